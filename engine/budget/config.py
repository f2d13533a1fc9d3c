"""The engine's flags as a config: ``EngineConfig`` holds the serving flags under vLLM's
names. What a model is (``ModelConfig``, the presets, reading config.json and GGUF headers)
lives in :mod:`engine.modelspec`, below both the model wing and the budget."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from engine.errors import UserError
from engine.modelspec.config import CANONICAL_DTYPE
from engine.modelspec.presets import BUNDLED_MODEL_NAME

if TYPE_CHECKING:
    from engine.events.kv_events_config import KVEventsConfig


# ------------------------------------------------------------------ engine flags
@dataclass(slots=True)
class EngineConfig:
    """Serving flags, named as vLLM's (underscored)."""

    model: str = BUNDLED_MODEL_NAME
    served_model_name: str | None = None
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    load_format: str = "auto"  # auto | gguf | safetensors | dummy
    device: str = "auto"  # auto | cpu | cuda
    gpu_memory_utilization: float = 0.9
    device_memory_gib: float | None = None  # CPU: the budget's "total"
    kv_cache_memory_bytes: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    # kvscope's --max-decode-step-tokens: the budget of a step in which a request decodes
    # (engine/core/scheduler.py); None = max_num_batched_tokens (vLLM). CPU default: derived.
    max_decode_step_tokens: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"  # fcfs | priority
    tensor_parallel_size: int = 1
    attention_backend: str = "auto"  # auto | torch | triton
    compile: bool = False
    enforce_eager: bool = False
    cuda_graph_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64, 128, 256])
    seed: int = 0
    stats_interval: float = 10.0
    log_prompts: bool = False
    events_path: str | None = None
    num_threads: int | None = None
    quantization: str | None = "auto"  # auto (CPU: the GGUF's own blocks) | none/None | int8 | int4 (weight-only)
    kv_events_config: KVEventsConfig | None = None  # --kv-events-config (vLLM's KVEventsConfig)
    # vLLM's --disable-hybrid-kv-cache-manager: a model with sliding-window layers keeps every
    # layer on one full-attention table (the window masked in attention); None = off
    disable_hybrid_kv_cache_manager: bool | None = None
    # --data-parallel-size D: D engine cores behind one server (engine/serve/data_parallel.py);
    # data_parallel_rank is set in each core's own config. None = one core.
    data_parallel_size: int | None = None
    data_parallel_rank: int | None = None
    # --pipeline-parallel-size P: contiguous layer stages on P ranks (engine/pipeline.py). None = one stage.
    pipeline_parallel_size: int | None = None
    # Stages across hosts (engine/pipeline.py): torch.distributed's rendezvous, as torchrun's
    # --nnodes/--node-rank/--master-addr/--master-port (or its environment). None = one host.
    nnodes: int | None = None
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    rendezvous_timeout_s: float | None = None

    # Optional features' settings, written by to_dict only when given, so the config of a
    # run without them (a recording's header) is what it was before they existed.
    WRITTEN_WHEN_SET: ClassVar[tuple[str, ...]] = ("kv_events_config", "disable_hybrid_kv_cache_manager",
                                                 "max_decode_step_tokens",
                                                 "data_parallel_size", "data_parallel_rank",
                                                 "pipeline_parallel_size", "nnodes", "node_rank", "master_addr",
                                                 "master_port", "rendezvous_timeout_s")

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for name in self.WRITTEN_WHEN_SET:
            if out[name] is None:
                del out[name]
        return out


def parse_dtype(value: str, flag: str = "--dtype") -> str:
    key = value.strip().lower()
    if key == "auto":
        return "auto"
    if key in CANONICAL_DTYPE:
        return CANONICAL_DTYPE[key]
    raise UserError(f"{flag} {value!r}: use one of auto, bfloat16, float16, float32")
