"""Phase C: the runner built and its weights loaded (the CPU kernel plan resolved over them), and
the tokenizer."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from engine.budget.memory import GiB
from engine.events.phase_data import LoadWeightsData
from engine.model.cpu_caps import detect
from engine.model.loading.loader import LoadInfo
from engine.model.loading.tokenizer import Tokenizer
from engine.model.parallel import TensorParallel
from engine.model.plan.setting import plan_enabled
from engine.model.runner import ModelRunner
from engine.modelspec.config import ModelConfig
from engine.modelspec.readers import load_model_config
from engine.startup.inputs import StartupInputs
from engine.startup.recorder import PhaseHandle
from engine.startup.resolve import kernel_plan_key, multi_rank


def phase_load_weights(c: PhaseHandle, s: StartupInputs, progress: Callable[[int, int], None] | None,
                       parallel: TensorParallel | None = None) -> tuple[ModelRunner, Tokenizer, LoadInfo]:
    """Phase C: build the runner (this rank's slice under tensor parallelism), load the weights and the tokenizer."""
    config, model, log = s.config, s.model, s.log
    runner = ModelRunner(model, dtype=config.dtype, block_size=config.block_size, device=str(s.device),
                         attention_backend=config.attention_backend, load_format=config.load_format,
                         seed=config.seed, quantization=config.quantization,
                         kv_cache_dtype=config.kv_cache_dtype, parallel=parallel,
                         kv_cache_groups=s.kv_cache_groups)
    info = runner.load_weights(progress)
    if s.stage_layers is not None:  # a pipeline stage keeps its layers (engine/pipeline.py)
        from engine.pipeline import carve_stage

        carve_stage(runner, s.stage_layers)
        info.weights_bytes = runner.model.weights_bytes()
    plan_bytes, dropped = None, 0
    if s.device.type == "cpu" and parallel is None and not multi_rank(config) and plan_enabled():
        # measured (or read back) here, not in phase F: phase D profiles, and phase E sizes, what it runs
        before = runner.model.weights_bytes()
        # placeholders from the load (a GGUF read as blocks never held them) are not the plan's to count
        unheld = runner.model.routing.dropped_float_bytes()
        key = kernel_plan_key(config, model, config.quantization, config.dtype, s.caps, s.resolution.dtype_auto,
                              config.kv_cache_dtype)
        runner.resolve_kernel_plan(key, s.caps or detect(), log, approximate=s.resolution.dtype_auto)
        info.weights_bytes = runner.model.weights_bytes()
        # float weights no step multiplies by under the plan are not kept (engine/model/layers/kernel_routing.py),
        # net of the floats a plan restored (a copy it runs by, counted in plan_bytes through weights_bytes)
        dropped = max(0, runner.model.routing.dropped_float_bytes() - unheld)
        plan_bytes = info.weights_bytes - before + dropped
    tokenizer = _tokenizer_for(model) if config.load_format != "dummy" else _dummy_tokenizer(model)
    quantization_reason = s.resolution.quantization_reason
    c.record = LoadWeightsData(weights_bytes=info.weights_bytes, load_seconds=info.load_seconds,
                               load_format=info.load_format, source=info.source, num_tensors=info.num_tensors,
                               weights_cache=info.cache, quantization=config.quantization,
                               quantization_reason=quantization_reason, file_tensor_bytes=info.file_tensor_bytes,
                               block_bytes=info.block_bytes)
    if plan_bytes is not None:
        c.record = dataclasses.replace(c.record, kernel_plan_bytes=plan_bytes, kernel_plan_dropped_bytes=dropped)
        if dropped:
            log.info(f"kernel plan: {dropped / GiB:.4f} GiB of float weights dropped (every step size runs their "
                     "GGUF blocks or a bf16/int8 copy)")
    log.info(f"Model loading took {info.weights_bytes / GiB:.4f} GiB and {info.load_seconds:.2f} seconds"
             + (f" (weights cache {info.cache})" if info.cache not in ("none", "mapped") else ""))
    if info.file_tensor_bytes:
        log.info(f"weights read as the GGUF's blocks, mapped: {(info.block_bytes or 0) / GiB:.4f} GiB of blocks for "
                 f"{info.file_tensor_bytes / GiB:.4f} GiB of tensors in the file"
                 + (f"; the kernel plan's copies (x16 layouts, float packs) {plan_bytes / GiB:.4f} GiB"
                    if plan_bytes else ""))
    log.info(f"quantization {config.quantization or 'none'} ({quantization_reason})")
    return runner, tokenizer, info


def _tokenizer_for(model: ModelConfig) -> Tokenizer:
    """A GGUF file's tokenizer comes from the startup cache (building its BPE takes seconds)."""
    from pathlib import Path

    from engine.model.loading.startup_cache import cached_tokenizer
    from engine.modelspec.readers import resolve_model_file

    location = Path(model.path) if model.path else resolve_model_file(model.name)
    if location is not None and location.is_file():
        return cached_tokenizer(location)
    return Tokenizer.for_model(model)


def _dummy_tokenizer(model: ModelConfig) -> Tokenizer:
    """Dummy weights of a preset have no tokenizer file: use the bundled one
    when the vocabulary fits, so text in/out still works for benchmarks."""
    from engine.modelspec.presets import BUNDLED_MODEL_NAME

    bundled = load_model_config(BUNDLED_MODEL_NAME)
    return _tokenizer_for(bundled)
