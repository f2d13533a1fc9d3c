"""The numbers each startup phase reports, as one frozen record per phase.

``StartupPhase.data`` is the JSON form (what recordings hold and every sink
writes); the classes here are its declared contract. Producers build a record
and publish ``record.to_dict()`` (engine/startup/ for a real start,
``MemoryPlan`` for ``engine plan``); consumers read a record back with
:func:`phase_record`, :func:`read_phase` or ``<Record>.from_dict(event.data)`` and use its attributes
instead of string keys.

A phase reports only what it knows: ``engine plan`` has no load time, a CPU
start no CUDA graphs, a failed phase what it had before it failed. So every
field is optional, and a record remembers which fields were *reported*:

* a field given to the constructor is reported, even as ``None`` (a real start
  writes ``"triton": null`` when triton is not installed, ``"quantization":
  null`` for float weights);
* a field left out is not reported and reads as ``None``;
* ``dataclasses.replace(record, name=value)`` adds ``name`` to the reported
  fields when ``value`` is not None;
* ``to_dict()`` writes exactly the reported fields, in declaration order (the
  order startup has always written them), then any keys the record did not
  know (kept in ``extra`` by ``from_dict``), so ``from_dict(d).to_dict() == d``
  for every recording.

Lists are tuples in a record and lists again in ``to_dict()``. No torch here:
the monitor reads these on machines without it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

if TYPE_CHECKING:
    from engine.events.startup_records import StartupPhase


class _NotReported:
    """The default of every phase field: the producer did not give it."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "NOT_REPORTED"


# Typed Any so that ``name: int | None = NOT_REPORTED`` type-checks; __post_init__
# replaces it with None, so no consumer ever sees it.
NOT_REPORTED: Any = _NotReported()
_BASE_FIELDS = ("extra", "reported")

P = TypeVar("P", bound="PhaseData")


@dataclass(frozen=True, slots=True)
class PhaseData:
    """Base of the per-phase records: ``phase`` is the letter (A–G) the record belongs to."""

    phase: ClassVar[str] = ""
    extra: Mapping[str, Any] = field(default_factory=dict, kw_only=True, repr=False)
    reported: frozenset[str] = field(default=NOT_REPORTED, kw_only=True, repr=False)

    def __post_init__(self) -> None:
        given = None if self.reported is NOT_REPORTED else self.reported
        names: list[str] = []
        for f in _data_fields(type(self)):
            value = getattr(self, f.name)
            if value is NOT_REPORTED:
                object.__setattr__(self, f.name, None)
            elif given is None or value is not None or f.name in given:
                names.append(f.name)  # given (None included), or set through dataclasses.replace
        object.__setattr__(self, "reported", frozenset(names))

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: the reported fields in declaration order, then ``extra``."""
        out = {f.name: _plain(getattr(self, f.name)) for f in _data_fields(type(self)) if f.name in self.reported}
        out.update(self.extra)
        return out

    @classmethod
    def from_dict(cls: type[P], data: Mapping[str, Any]) -> P:
        """Read a recorded ``data`` object: known keys become fields (lists become
        tuples, values are not coerced), the rest is kept in ``extra``; a missing key
        is simply not reported."""
        names = {f.name for f in _data_fields(cls)}
        known = {k: _frozen(v) for k, v in data.items() if k in names}
        extra = {k: v for k, v in data.items() if k not in names}
        return cls(**known, extra=extra, reported=frozenset(known))


@dataclass(frozen=True, slots=True)
class InitData(PhaseData):
    """Phase A: versions, the device's memory as first read, and the dtype chosen.
    ``engine simulate`` reports only ``device``, ``gpu`` and ``simulated``."""

    phase: ClassVar[str] = "A"
    torch: str | None = NOT_REPORTED
    device: str | None = NOT_REPORTED  # "cpu", "cuda", "cuda:1"
    gpu: str | None = NOT_REPORTED  # engine simulate: the GPU preset simulated
    simulated: bool | None = NOT_REPORTED  # engine simulate
    threads: int | None = NOT_REPORTED  # torch's intra-op threads
    triton: str | None = NOT_REPORTED  # its installed version; null when not installed
    cuda: str | None = NOT_REPORTED  # CUDA only: torch's CUDA version
    gpu_name: str | None = NOT_REPORTED  # CUDA only
    driver: str | None = NOT_REPORTED  # CUDA only: the NVIDIA driver, null when NVML is unavailable
    cpu_count: int | None = NOT_REPORTED  # not on CUDA
    memory_source: str | None = NOT_REPORTED  # where the memory reading came from
    total_bytes: int | None = NOT_REPORTED
    free_bytes: int | None = NOT_REPORTED
    dtype: str | None = NOT_REPORTED  # the resolved --dtype
    dtype_reason: str | None = NOT_REPORTED
    cpu: Mapping[str, Any] | None = NOT_REPORTED  # CPU only: CpuCapabilities.summary()
    allocator: str | None = NOT_REPORTED  # CPU only: how the host allocator was set for step tensors


@dataclass(frozen=True, slots=True)
class BudgetData(PhaseData):
    """Phase B: requested = total × utilization. ``engine plan`` reports the first three."""

    phase: ClassVar[str] = "B"
    total_bytes: int | None = NOT_REPORTED
    gpu_memory_utilization: float | None = NOT_REPORTED
    requested_bytes: int | None = NOT_REPORTED
    free_bytes: int | None = NOT_REPORTED
    memory_source: str | None = NOT_REPORTED


@dataclass(frozen=True, slots=True)
class LoadWeightsData(PhaseData):
    """Phase C: the weights' bytes (all ``engine plan`` knows) and how they were loaded."""

    phase: ClassVar[str] = "C"
    weights_bytes: int | None = NOT_REPORTED
    load_seconds: float | None = NOT_REPORTED
    load_format: str | None = NOT_REPORTED
    source: str | None = NOT_REPORTED  # the file or folder read; null for dummy weights
    num_tensors: int | None = NOT_REPORTED
    weights_cache: str | None = NOT_REPORTED  # GGUF: "hit", "miss" or "off"; else "none"
    quantization: str | None = NOT_REPORTED  # the resolved --quantization; null for float weights
    quantization_reason: str | None = NOT_REPORTED
    vision_weights_bytes: int | None = NOT_REPORTED  # VL models: the part of weights_bytes the vision tower holds
    # CPU: the copies the kernel plan's choices keep (bf16, int8), part of weights_bytes (engine/model/plan/candidates.py)
    kernel_plan_bytes: int | None = NOT_REPORTED
    # CPU: the float weights the kernel plan never multiplies by (the GGUF blocks or a copy at every
    # step size), not kept and not in weights_bytes (engine/model/layers/kernel_routing.py KernelRouting.drop_unused_float_weights)
    kernel_plan_dropped_bytes: int | None = NOT_REPORTED
    # CPU, a GGUF read as blocks (engine/model/loading/gguf_blocks.py): the file's tensor bytes, and the bytes of
    # its blocks the weights hold (views of the mapped file, or copies where rows moved)
    file_tensor_bytes: int | None = NOT_REPORTED
    block_bytes: int | None = NOT_REPORTED


@dataclass(frozen=True, slots=True)
class ProfileRunData(PhaseData):
    """Phase D: the worst-case step's activation peak and the memory outside torch.
    ``engine plan`` reports the two estimates and ``estimated``; ``cached`` says a
    stored measurement (of ``measured_at``, unix time) was reused."""

    phase: ClassVar[str] = "D"
    activation_peak_bytes: int | None = NOT_REPORTED
    non_torch_bytes: int | None = NOT_REPORTED
    method: str | None = NOT_REPORTED  # how the peak was measured
    max_num_batched_tokens: int | None = NOT_REPORTED
    max_num_seqs: int | None = NOT_REPORTED
    estimated: tuple[str, ...] | None = NOT_REPORTED  # which inputs were estimated, not measured
    forward_s: float | None = NOT_REPORTED
    sample_s: float | None = NOT_REPORTED
    cached: bool | None = NOT_REPORTED
    measured_at: float | None = NOT_REPORTED
    # the step sizes the forward ran at: the budget, or two points of a line evaluated at it (CPU, in parts)
    profiled_tokens: tuple[int, ...] | None = NOT_REPORTED
    # VL models (engine/budget/vision.py): what the encoder adds to the profile
    encoder_activation_peak_bytes: int | None = NOT_REPORTED  # the tower's run on the profiled items
    encoder_cache_tokens: int | None = NOT_REPORTED  # the encoder cache budget: min(compute budget, cache size)
    encoder_cache_bytes: int | None = NOT_REPORTED
    mm_items_profiled: int | None = NOT_REPORTED
    mm_modality: str | None = NOT_REPORTED  # the modality profiled (the most tokens per item)
    skip_mm_profiling: bool | None = NOT_REPORTED


@dataclass(frozen=True, slots=True)
class KvCacheData(PhaseData):
    """Phase E: the KV pool and what it holds (``MemoryPlan.kv_cache_data()``), and
    whether the CPU default cap (4 GiB) sized it."""

    phase: ClassVar[str] = "E"
    kv_pool_bytes: int | None = NOT_REPORTED
    bytes_per_token: int | None = NOT_REPORTED
    block_size: int | None = NOT_REPORTED
    num_blocks: int | None = NOT_REPORTED
    kv_cache_tokens: int | None = NOT_REPORTED
    max_model_len: int | None = NOT_REPORTED
    max_concurrency: float | None = NOT_REPORTED
    kv_pool_overridden: bool | None = NOT_REPORTED
    cpu_default_cap: bool | None = NOT_REPORTED  # real starts only
    # A model with sliding-window layers (engine/budget/memory.py's hybrid formula); absent
    # for a model whose layers all attend fully, so those records are what they were.
    kv_cache_layout: str | None = NOT_REPORTED  # the layout the numbers above describe: hybrid | full_attention
    page_size_bytes: int | None = NOT_REPORTED  # hybrid: one layer's block
    layers_per_group: int | None = NOT_REPORTED  # hybrid: G, padding layers included
    blocks_per_request: int | None = NOT_REPORTED  # hybrid: one max_model_len request's blocks, all groups
    kv_cache_groups: tuple[Mapping[str, Any], ...] | None = NOT_REPORTED  # hybrid: KvGroupBudget.to_json() each
    other_layout: Mapping[str, Any] | None = NOT_REPORTED  # the same pool under the layout not used
    # CPU: the step token budget the scheduler runs and why (derived from the kernel plan's prefill speed)
    max_num_batched_tokens: int | None = NOT_REPORTED
    max_num_batched_tokens_reason: str | None = NOT_REPORTED
    # kvscope's budget of a step in which a request decodes (the scheduler's), and why; unset: off
    max_decode_step_tokens: int | None = NOT_REPORTED
    max_decode_step_tokens_reason: str | None = NOT_REPORTED


@dataclass(frozen=True, slots=True)
class GraphsCompileData(PhaseData):
    """Phase F: on CUDA the captured decode graphs; on CPU the kernels built, the
    decode paths enabled (each "enabled…" or why not), ``--compile`` and warm-up."""

    phase: ClassVar[str] = "F"
    cuda_graph_bytes: int | None = NOT_REPORTED
    batch_sizes: tuple[int, ...] | None = NOT_REPORTED
    capture_seconds: float | None = NOT_REPORTED
    cpu_decode_kernel: str | None = NOT_REPORTED
    kernel_seconds: float | None = NOT_REPORTED  # phase F's wait for the builds started in phase A
    kernels: tuple[Mapping[str, Any], ...] | None = NOT_REPORTED  # BuildReport.to_dict() each
    cpu_decode_layers: str | None = NOT_REPORTED
    compile_seconds: float | None = NOT_REPORTED  # only with --compile
    warmup_seconds: float | None = NOT_REPORTED
    # CPU: the kernel plan (engine/model/plan/kernel_plan.py KernelPlan.to_json(): each candidate's µs per
    # projection group and step size, the choice and why, the fused layer, where it came from)
    kernel_plan: Mapping[str, Any] | None = NOT_REPORTED
    # CPU: each part of a step (activations, rms_norm, projections, prefill/decode attention, lm_head,
    # fused_decode_layer) and the dtype it runs in: which run in bf16 (engine/model/layers/kernel_routing.py precision_report)
    precision: Mapping[str, str] | None = NOT_REPORTED


@dataclass(frozen=True, slots=True)
class ReadyData(PhaseData):
    """Phase G: the sum of the phases' durations and the serving process."""

    phase: ClassVar[str] = "G"
    startup_seconds: float | None = NOT_REPORTED
    pid: int | None = NOT_REPORTED


PHASE_DATA: dict[str, type[PhaseData]] = {
    cls.phase: cls
    for cls in (InitData, BudgetData, LoadWeightsData, ProfileRunData, KvCacheData, GraphsCompileData, ReadyData)
}


def phase_record(event: StartupPhase) -> PhaseData:
    """The event's data as its phase's record (a bare ``PhaseData``, everything in
    ``extra``, for a letter outside A–G)."""
    return PHASE_DATA.get(event.phase, PhaseData).from_dict(event.data)


def read_phase(event: StartupPhase, kind: type[P]) -> P | None:
    """The event's data as ``kind`` when the event is of ``kind``'s phase, else None:
    ``read_phase(ev, KvCacheData)``."""
    return kind.from_dict(event.data) if event.phase == kind.phase else None


_FIELDS: dict[type, tuple[dataclasses.Field[Any], ...]] = {}


def _data_fields(cls: type) -> tuple[dataclasses.Field[Any], ...]:
    fields = _FIELDS.get(cls)
    if fields is None:
        fields = _FIELDS[cls] = tuple(f for f in dataclasses.fields(cls) if f.name not in _BASE_FIELDS)
    return fields


def _plain(value: Any) -> Any:
    """A record's value in JSON form: tuples as lists, mappings as dicts."""
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return dict(value)
    return value


def _frozen(value: Any) -> Any:
    """A JSON value in record form: lists as tuples."""
    if isinstance(value, list):
        return tuple(value)
    return value
