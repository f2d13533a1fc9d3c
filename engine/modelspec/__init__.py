"""What a model is, with no torch. Both the model wing (``engine.model``, which builds the
tensors) and the budget (``engine.budget``, which counts their bytes) sit above it; nothing here
imports either.

- ``config``: ``ModelConfig``: shapes, family fields, the exact parameter count
- ``families``: the registry keyed by architecture: family, config parsing, GGUF checks
- ``presets``: built-in model presets and their aliases
- ``readers``: a config from a preset, an HF folder's config.json or a GGUF header
- ``gguf_header``: a GGUF header read with ``struct``
- ``model_files``: models assembled from PyPI chunk packages
- ``kv_cache_dtypes``: the ``--kv-cache-dtype`` table
- ``hf_export``: what ``engine export-hf`` writes per family
"""
