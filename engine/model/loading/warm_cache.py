"""``python -m engine.model.loading.warm_cache``: build each assembled model's tokenizer and float32
weights into the startup cache (Gemma 3 270M's: ~40 s and ~25 s cold on 2 cores), so the
first test run or start does not pay them; a warm cache makes it a few seconds of mapping.
The Makefile's setup target runs it after engine/modelspec/model_files.py assembled the files
(kept apart from that module, which engine/modelspec/presets.py imports and must stay torch-free).
"""

from __future__ import annotations

import sys
import time

from engine.modelspec.model_files import CHUNKED_MODELS, ChunkedModel


def warm_startup_cache(model: ChunkedModel) -> None:
    from engine.model.loading.startup_cache import cached_tokenizer
    from engine.model.runner import ModelRunner
    from engine.modelspec.readers import load_model_config

    start = time.perf_counter()
    cached_tokenizer(model.target())
    info = ModelRunner(load_model_config(model.preset), dtype="float32").load_weights()
    print(f"model {model.preset}: tokenizer and float32 weights in the startup cache (weights cache {info.cache}, "
          f"{time.perf_counter() - start:.1f} s)")


def main() -> int:
    for model in CHUNKED_MODELS:
        if model.installed_path() is not None:
            warm_startup_cache(model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
