"""What the phases start from: the device, the model's shapes, the resolved flags and the KV cache
groups (``prepare_startup``), and what the ``engine.config`` event says of them."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from engine.budget.memory import bytes_per_kv_token
from engine.budget.stages import stage_kv_cache_groups, stage_model
from engine.config import EngineConfig
from engine.core.kv_cache_groups import KVCacheGroup, config_groups, groups_to_config, kv_cache_groups
from engine.errors import UserError
from engine.model.cpu_caps import CpuCapabilities, detect
from engine.model.memory.device import resolve_device
from engine.modelspec.config import ModelConfig
from engine.modelspec.readers import load_model_config
from engine.startup.resolve import ResolvedConfig, resolve_config


@dataclass(frozen=True, slots=True)
class StartupInputs:
    """What the phases start from: the resolved flags, the model, the device and its CPU facts."""

    resolution: ResolvedConfig
    model: ModelConfig
    device: torch.device
    caps: CpuCapabilities | None
    bytes_per_token: int
    log: Any
    # The hybrid KV cache's groups (engine/core/kv_cache_groups.py) from the model's
    # layer_types and sliding_window; () for one full-attention table (every Llama).
    kv_cache_groups: tuple[KVCacheGroup, ...] = ()
    # A pipeline stage's layers [start, end) (engine/pipeline.py); None: every layer
    stage_layers: tuple[int, int] | None = None

    @property
    def budget_model(self) -> ModelConfig:
        """The shapes this rank's budget holds: a pipeline stage's layers only."""
        return self.model if self.stage_layers is None else stage_model(self.model, self.stage_layers)

    @property
    def budget_groups(self) -> tuple[KVCacheGroup, ...]:
        """The KV cache groups of this rank's pool: a stage's groups hold its own layers."""
        if self.stage_layers is None or not self.kv_cache_groups:
            return self.kv_cache_groups
        return stage_kv_cache_groups(self.kv_cache_groups, self.stage_layers)

    @property
    def config(self) -> EngineConfig:
        """The resolved flags: no ``auto`` left (a new object, not the caller's)."""
        return self.resolution.config

    @property
    def max_model_len(self) -> int:
        assert self.config.max_model_len is not None  # resolve_config fills it
        return self.config.max_model_len


def prepare_startup(config: EngineConfig, log: Any, stage: Any = None) -> StartupInputs:
    """Before phase A: the device (and ``--num-threads``), the model's shapes, the resolved
    flags and the KV cache groups. Raises UserError for flags no machine could run.
    ``stage``: a pipeline stage's StageLayout (engine/pipeline.py)."""
    device = resolve_device(config.device)
    if stage is not None and device.type != "cpu":
        raise UserError(f"--pipeline-parallel-size {stage.stages} on {device.type}: the stages exchange activations "
                        "over gloo, on CPU tensors only (NCCL is not wired yet); run with --device cpu or one stage")
    ranks_here = stage.ranks_on_host if stage is not None else config.tensor_parallel_size
    if device.type == "cpu" and config.num_threads:
        torch.set_num_threads(config.num_threads)
    elif device.type == "cpu" and ranks_here > 1:
        # The ranks share the host's cores: N ranks of all-core thread pools would spin against each other.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks_here))
    model = load_model_config(config.model)
    check_model_supported(model, config)
    caps = detect() if device.type == "cpu" else None
    resolution = resolve_config(config, model, device, caps)
    resolved = resolution.config
    per_token = bytes_per_kv_token(model, resolved.kv_cache_dtype, resolved.tensor_parallel_size, resolved.dtype)
    groups = () if config.disable_hybrid_kv_cache_manager else model_kv_cache_groups(model)
    layers = stage.layers(model.num_layers) if stage is not None else None
    return StartupInputs(resolution, model, device, caps, per_token, log, groups, layers)


def model_kv_cache_groups(model: ModelConfig) -> tuple[KVCacheGroup, ...]:
    """The model's KV cache groups as vLLM groups them (one block table per group over one
    pool); () when every layer attends fully, so a Llama model keeps its one table."""
    try:
        groups = kv_cache_groups(model.layer_types, model.sliding_window, model.num_layers)
    except ValueError as exc:
        raise UserError(f"{model.name}: {exc}") from None
    return config_groups(groups)


def resolved_config_dict(s: StartupInputs) -> dict[str, Any]:
    """``engine.config``'s flags: the resolved EngineConfig, plus ``kv_cache_groups`` for a
    hybrid KV cache (what ``engine replay`` and the KV events read; absent otherwise, so
    full-attention recordings are what they were)."""
    flags = s.config.to_dict()
    if s.kv_cache_groups:
        flags["kv_cache_groups"] = groups_to_config(s.kv_cache_groups)
    return flags


def check_model_supported(model: ModelConfig, config: EngineConfig) -> None:
    """Refuse a GGUF kvscope cannot run from its header alone (architecture, tokenizer type,
    every tensor's ggml type: milliseconds), and flags the model's family cannot serve,
    before phase A: never 20 s into phase C."""
    from pathlib import Path

    from engine.modelspec.families import check_config_supported, check_gguf_supported

    if model.source == "gguf" and model.path and config.load_format in ("auto", "gguf") and Path(model.path).is_file():
        check_gguf_supported(Path(model.path))
    check_config_supported(model, config.tensor_parallel_size)


def model_summary(model: ModelConfig, dtype: str, bytes_per_token: int) -> dict[str, Any]:
    summary = model.summary()
    summary["dtype"] = dtype
    summary["bytes_per_kv_token"] = bytes_per_token
    return summary
