"""What a model is, with no torch: its shapes (:mod:`~engine.modelspec.config`'s
``ModelConfig``), the built-in presets and the files they stand for
(:mod:`~engine.modelspec.presets`, :mod:`~engine.modelspec.model_files`), reading a config
from a preset name, an HF folder's config.json or a GGUF header
(:mod:`~engine.modelspec.readers`, :mod:`~engine.modelspec.gguf_header`), and the family
registry keyed by architecture (:mod:`~engine.modelspec.families`). Both the model wing
(engine/model/, which builds the tensors) and the budget (engine/budget/, which counts
their bytes) sit above it; nothing here imports either."""
