"""The model families: each a decoder class built on Llama's layers, paged KV cache and
attention backends, registered by architecture in :mod:`engine.modelspec.families`.

- ``llama``: the Llama-family decoder over one flattened batch
- ``qwen3``, ``gemma3``: their own layers on Llama's machinery
- ``qwen3_moe``, ``qwen2_moe``, ``mixtral``: the mixture-of-experts families
- ``parallel_llama``: one rank's slice of a Llama
"""
