"""The engine's flags, declared once: ``EngineConfig`` holds the serving flags under vLLM's
names, as vLLM's ``EngineArgs`` does, and everything else that lists them reads this
declaration with :func:`dataclasses.fields`: the CLI copies its arguments through
:func:`cli_flag` / :func:`cli_dest` (engine/cli/flags.py), the recording schema types a
recording's flags from it (engine/events/validate.py ``RecordedFlags``), and
:meth:`EngineConfig.to_dict` writes them. A field's ``metadata`` says only where it differs
from the rule (a flag ``--field-name`` whose argument is ``field_name``, always recorded):
see :func:`meta`. What a model is (``ModelConfig``, the presets, reading config.json and
GGUF headers) lives in :mod:`engine.modelspec`, below this module."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.errors import UserError
from engine.modelspec.config import CANONICAL_DTYPE
from engine.modelspec.presets import BUNDLED_MODEL_NAME

# The metadata keys of an EngineConfig field (each optional; see meta()).
CLI, DEST, PARSE, WHEN_SET = "cli", "dest", "parse", "when_set"
_DERIVED: Any = object()  # meta()'s "no cli given": the field's own name, dashed


def meta(*, cli: str | None = _DERIVED, dest: str | None = None, parse: Callable[[Any], Any] | None = None,
         when_set: bool = False) -> dict[str, Any]:
    """The ``metadata`` of a field whose CLI or recording differs from the rule. ``cli``: its
    option string (None: no command exposes it); ``dest``: the argparse attribute when it is
    not the field's name; ``parse``: applied to the argument's value as it is copied;
    ``when_set``: written by :meth:`EngineConfig.to_dict` only when not None, so a recording
    of a run without the feature is what it was before the field existed."""
    out: dict[str, Any] = {}
    if cli is not _DERIVED:
        out[CLI] = cli
    if dest is not None:
        out[DEST] = dest
    if parse is not None:
        out[PARSE] = parse
    if when_set:
        out[WHEN_SET] = True
    return out


def cli_flag(f: dataclasses.Field[Any]) -> str | None:
    """The option string of ``f`` (``--max-model-len``), or None when no command has one."""
    return f.metadata.get(CLI, "--" + f.name.replace("_", "-"))


def cli_dest(f: dataclasses.Field[Any]) -> str | None:
    """The argparse attribute the CLI copies into ``f``, or None when no command has one."""
    return None if cli_flag(f) is None else f.metadata.get(DEST, f.name)


def written_when_set(f: dataclasses.Field[Any]) -> bool:
    return bool(f.metadata.get(WHEN_SET, False))


def _or_none(value: str | None) -> str | None:
    return value or None  # --served-model-name "": the model's own name, as no flag


def parse_dtype(value: str, flag: str = "--dtype") -> str:
    key = value.strip().lower()
    if key == "auto":
        return "auto"
    if key in CANONICAL_DTYPE:
        return CANONICAL_DTYPE[key]
    raise UserError(f"{flag} {value!r}: use one of auto, bfloat16, float16, float32")


@dataclass(slots=True)
class KVEventsConfig:
    """``--kv-events-config``: vLLM's ``KVEventsConfig`` (``vllm/config/kv_events.py``),
    same field names, same defaults (the comments are vLLM's meanings); parsed and checked
    by :mod:`engine.events.exporters.kv_events_config`, which publishes what it enables."""

    enable_kv_cache_events: bool = False  # record block stored/removed facts and publish them
    publisher: str | None = None  # "null" | "zmq"; None: "zmq" when events are enabled, else "null"
    endpoint: str = "tcp://*:5557"  # PUB address: bound when it holds "*" or "::" or is ipc/inproc, else connected
    replay_endpoint: str | None = None  # ROUTER address answering replay requests (None: no replay socket)
    buffer_steps: int = 10_000  # batches (one per step with changes) kept for replay
    hwm: int = 100_000  # ZMQ send high-water mark of the PUB socket: beyond it a slow subscriber loses messages
    max_queue_size: int = 100_000  # batches waiting for the publisher thread; beyond it they are dropped (counted)
    topic: str = ""  # first frame of every message; subscribers filter on it ({pod}, {model}: kv@{pod}@{model} is llm-d's)

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"

    @property
    def publishes(self) -> bool:
        """True when a ZMQ publisher must run."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ------------------------------------------------------------------ engine flags
@dataclass(slots=True)
class EngineConfig:
    """Serving flags, named as vLLM's (underscored). A new field is a new flag everywhere:
    recorded (and checked on read) as its type says, copied from ``--field-name`` by every
    command that defines it; :func:`meta` declares what differs."""

    # the CLI resolves --model, the positional MODEL and the bundled default together
    model: str = BUNDLED_MODEL_NAME
    served_model_name: str | None = field(default=None, metadata=meta(parse=_or_none))  # engine serve's
    dtype: str = field(default="auto", metadata=meta(parse=parse_dtype))
    kv_cache_dtype: str = "auto"
    load_format: str = "auto"  # auto | gguf | safetensors | dummy
    device: str = "auto"  # auto | cpu | cuda
    gpu_memory_utilization: float = 0.9
    # CPU: the budget's "total"
    device_memory_gib: float | None = field(default=None, metadata=meta(cli="--device-memory", dest="device_memory"))
    kv_cache_memory_bytes: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    # kvscope's --max-decode-step-tokens: the budget of a step in which a request decodes
    # (engine/core/scheduler.py); None = max_num_batched_tokens (vLLM). CPU default: derived.
    max_decode_step_tokens: int | None = field(default=None, metadata=meta(when_set=True))
    block_size: int = 16
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"  # fcfs | priority
    tensor_parallel_size: int = 1
    attention_backend: str = "auto"  # auto | torch | triton
    compile: bool = False
    enforce_eager: bool = False
    # no flag: vLLM's --cuda-graph-sizes is named as vLLM's only (engine/cli/vllm_flags.py)
    cuda_graph_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64, 128, 256],
                                        metadata=meta(cli=None))
    seed: int = 0
    stats_interval: float = 10.0
    log_prompts: bool = False
    events_path: str | None = field(default=None, metadata=meta(cli="--events"))
    num_threads: int | None = field(default=None, metadata=meta(cli="--threads"))
    quantization: str | None = "auto"  # auto (CPU: the GGUF's own blocks) | none/None | int8 | int4 (weight-only)
    # vLLM's KVEventsConfig; recorded as its fields (a dict), as every dataclass-valued flag
    kv_events_config: KVEventsConfig | None = field(default=None, metadata=meta(when_set=True))
    # vLLM's --disable-hybrid-kv-cache-manager: a model with sliding-window layers keeps every
    # layer on one full-attention table (the window masked in attention); None = off
    disable_hybrid_kv_cache_manager: bool | None = field(default=None, metadata=meta(when_set=True))
    # --data-parallel-size D: D engine cores behind one server (engine/serve/data_parallel.py);
    # data_parallel_rank is set in each core's own config, not on the command line. None = one core.
    data_parallel_size: int | None = field(default=None, metadata=meta(when_set=True))
    data_parallel_rank: int | None = field(default=None, metadata=meta(when_set=True, cli=None))
    # --pipeline-parallel-size P: contiguous layer stages on P ranks (engine/pipeline.py). None = one stage.
    pipeline_parallel_size: int | None = field(default=None, metadata=meta(when_set=True))
    # Stages across hosts (engine/pipeline.py): torch.distributed's rendezvous, as torchrun's
    # --nnodes/--node-rank/--master-addr/--master-port (or its environment). None = one host.
    nnodes: int | None = field(default=None, metadata=meta(when_set=True))
    node_rank: int | None = field(default=None, metadata=meta(when_set=True))
    master_addr: str | None = field(default=None, metadata=meta(when_set=True))
    master_port: int | None = field(default=None, metadata=meta(when_set=True))
    rendezvous_timeout_s: float | None = field(default=None,
                                               metadata=meta(when_set=True, cli="--rendezvous-timeout"))
    # kvscope's --stall-timeout S (engine serve): an engine core with work that finishes no step
    # for S seconds is stalled (engine/serve/stall.py); 0 = off; None = derived from this
    # machine's step times: max(30 s, 10 x the longest of phase D's worst-case step and the steps run)
    stall_timeout_s: float | None = field(default=None, metadata=meta(when_set=True, cli="--stall-timeout"))

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for f in dataclasses.fields(self):
            if written_when_set(f) and out[f.name] is None:
                del out[f.name]
        return out
