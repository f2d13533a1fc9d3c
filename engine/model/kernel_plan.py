"""The kernel plan: which implementation multiplies each projection group at each step size,
chosen by timing every candidate on this CPU with the model's own weights.

Constants tuned on one CPU pick the wrong path on another (issue 34: an AMX Xeon ran its
500-token prefills through the int8-activation GEMV that wins on AVX2, at 40 % of vLLM's
speed, while its bf16 GEMM was 4x faster). So at the first start for a (weights, weight
formats, dtype, ISA, torch, kernel sources, threads) the engine times, for each group
(QKV, O, gate/up, down on one layer, and the LM head; each on at most its first
``WEIGHT_ROWS_TIMED`` output rows, time being linear in them, and scaled to the whole weight) and each step-size class the scheduler makes (``STEP_CLASSES``:
1, 2-8, 9-16, 17-32, 33-64, 65+, one representative row count each), the candidates this machine has:

* ``gemv``: kvscope's GEMV over the GGUF blocks (q4_1x8: int8 activations; q4_1 and q8_0:
  float activations), engine/model/kernels/cpu_gemv.py;
* ``q8_0x16``: a Q8_0 weight's blocks regrouped 16 rows at a time at load (lossless), multiplied
  with int8 activations, 16 outputs per vpdpbusd (engine/model/kernels/cpu_quant.py; offered where
  the AVX-512 VNNI build runs): the many-row GEMM for a Q8_0 LM head;
* ``torch``: ``F.linear`` over the model's float weights (fp32 GEMM for an fp32 model);
* ``fp32pack``: oneDNN's linear over a float32 copy packed once (float32 sums: the LM head too);
* ``bf16``: oneDNN's linear over a bf16 copy packed once (AMX or AVX512-BF16), only where bf16 is
  native, never for the LM head (its output would be rounded to bf16 before the fp32
  logits: greedy decoding would pick among bf16 ties);
* ``int8pack``: torch's ``_weight_int8pack_mm`` over per-channel int8 weights, where torch has it;
* ``fused``: the whole decode layer as one C++ call over the GGUF blocks (its GEMV at every size;
  engine/model/kernels/cpu_layer.py), timed against the op-by-op layer on the chosen
  projections at every class, for pure-decode steps up to where it stops winning;
* ``attn`` (prefill attention, ``ATTENTION``): one causal chunk over the paged cache at the
  multi-row classes: torch SDPA over the gathered context in float32, or on q, K and V rounded
  to bf16 (where bf16 is native and ``--dtype auto``), or kvscope's paged prefill kernel.

The LM head's candidates take float32 rows and return float32 sums in every dtype mode (a bf16
weight is widened slice by slice: engine/model/families/llama.py ``fp32_linear``). A float weight that
no chosen candidate multiplies by is dropped once the plan is installed (llama.py
``_drop_unused_float_weights``; phase C counts what is held).

Each candidate's output is checked against the fp32 reference ``x @ W.T`` on the same
inputs (relative RMS error at most ``ACCURACY_BOUND``; the GEMV against its own blocks'
values in fp32, which are ``W`` for a GGUF's blocks and the weights ``--quantization`` chose
for packed ones); the fastest that passes is chosen.
A candidate more than ``PRUNE_FACTOR`` x slower than the best at one class is not timed at
the bigger ones. Measuring stops at ``MEASURE_BOUND_S``: cells not reached keep the fallback
constants' choice, say so, and are measured at the next start (the stored plan is resumed). The plan is stored beside phase D's profile
(``kernel_plans/<key>.json`` under engine/model/memory/profile_cache.py's folder) so a warm start reuses it, and ``KVSCOPE_KERNEL_PLAN``
pins one (a path or the JSON itself), ``measure`` measures again, ``off`` runs the fallback
constants (``GEMV_MAX_ROWS`` in engine/model/families/llama.py and the ISA's dtype rule).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.model import plan_stability

if TYPE_CHECKING:  # torch is imported where it runs: ``engine plan`` reads the switch and stored plans without it
    import torch

PLAN_ENV = "KVSCOPE_KERNEL_PLAN"
PLAN_FORMAT_VERSION = 2  # 2: the 9-64 class split into 9-16, 17-32, 33-64
PLANS_FOLDER = "kernel_plans"  # under the profiles folder (engine/model/memory/profile_cache.py)
GROUPS = ("qkv", "o", "gate_up", "down", "head")
# The model attribute each group's weight and quantized copy are named by.
GROUP_ATTRS = {"qkv": "qkv_proj", "o": "o_proj", "gate_up": "gate_up_proj", "down": "down_proj", "head": "head"}
LAYER_GROUPS = GROUPS[:4]
# Prefill attention of one chunk over its paged causal context, at the multi-row classes: torch's
# SDPA over the gathered context in float32, or on q, K, V rounded to bf16 (torch's flash kernel in
# bf16; AVX512-BF16 or AMX; where bf16 is native and --dtype auto), or "paged", kvscope's C++ kernel
# reading the cache in place (engine/model/attention/cpu_decode.py paged_prefill; where it is built
# for the head dim), or "paged_bf16", its vdpbf16ps twin (over a bf16 cache on AVX512-BF16, where
# bf16 is allowed). Decode rows run the paged-decode kernel.
ATTENTION = "attn"
ATTENTION_CANDIDATES = ("torch", "bf16", "paged", "paged_bf16")
# The copies a plan's candidates keep, registered as ``<projection>_<suffix>`` buffers: bf16 (dense,
# only where this torch has no oneDNN linear), the oneDNN-packed bf16 copy, the float32 weight packed
# likewise, the int8 weights and their scales.
PLAN_COPY_SUFFIXES = ("bf16", "bf16_packed", "fp32_packed", "int8pack", "int8pack_scale", "q8_0x16")


@dataclass(frozen=True, slots=True)
class StepClass:
    """Steps of ``lo``..``hi`` token rows (``hi`` None: up to the token budget), timed at ``rows``."""

    lo: int
    hi: int | None
    rows: int

    @property
    def name(self) -> str:
        return str(self.lo) if self.hi == self.lo else f"{self.lo}-{self.hi}" if self.hi else f"{self.lo}+"


# Decode batches of 9-64 are split in three: a GEMM's fixed cost makes it win at 64 rows and lose
# at 12 to the GEMV (time linear in rows), and one class timed at 64 ran a 12-sequence decode
# step through bf16 GEMMs op by op in 60 ms instead of the fused layer's ~25 (Zen 4, AVX-512).
STEP_CLASSES = (StepClass(1, 1, 1), StepClass(2, 8, 8), StepClass(9, 16, 16), StepClass(17, 32, 32),
                StepClass(33, 64, 64), StepClass(65, None, 256))
CANDIDATES = ("gemv", "q8_0x16", "dequant", "torch", "fp32pack", "bf16", "int8pack")
# Candidates that multiply the GGUF's blocks (or a lossless regrouping of them), never the float
# weight: their reference is the blocks' own values, and they need no float copy held.
BLOCK_CANDIDATES = frozenset({"gemv", "q8_0x16"})
# Candidates whose time grows with rows like a GEMV's (a weight row re-read per few activation
# rows): one more than PRUNE_FACTOR x behind at a smaller class cannot catch up at a bigger one,
# so it is not timed there (int8pack took 0.65 s for one 256-row QKV on Zen 4). GEMMs are always timed.
ROW_LINEAR = frozenset({"gemv", "int8pack"})
# torch's int8pack is a weight-only GEMV: timed at decode sizes only.
MAX_ROWS_TIMED = {"int8pack": 8}
# dequant widens the whole weight on every call: only a prefill-sized step can pay that back.
MIN_ROWS_TIMED = {"dequant": 64}
ACCURACY_BOUND = 1e-2  # relative RMS error against the fp32 reference (int8 activations: ~5e-3 on N(0,1) inputs)
# Total measuring time of one start. Measured once per (model, formats, ISA, torch, threads,
# kernel sources) and stored, so only a first start pays it: ~0.8-1.7 s on a quiet 2-core
# Zen 4 (AVX-512) for SmolLM2; cells a loaded machine does not reach keep the fallback's
# choice and are measured at the next start (``KernelPlan.unmeasured``).
MEASURE_BOUND_S = 2.0
PRUNE_FACTOR = 3.0
TIMED_REPS = 3  # interleaved rounds at least after one untimed call (which gives the output checked); the median counts
MAX_ROUNDS = 5  # rounds while a cell is within CELL_BUDGET_S (cheap cells: a steadier median)
CELL_BUDGET_S = 0.02  # past this, a cell adds no rounds beyond TIMED_REPS
WEIGHT_ROWS_TIMED = 1024  # a multiple of 8 (q4_1x8 interleaves 8 rows)
FUSED_CONTEXT = 32  # tokens each sequence of the fused-layer timing attends over
# The CPU default token budget where the plan's measured speed fits more than vLLM-CPU's 2,048
# tokens (engine/startup.py CPU_PROMPT_STEP_TOKENS, the floor) in about this many seconds of
# projections (attention, norms and sampling add ~15-25 %), so the budget scales with a fast CPU.
# Tighter step targets (0.1 s; one second on the steps with decodes alone) were measured and
# dropped: CPU_PROMPT_STEP_TOKENS' comment has the figures.
STEP_TARGET_S = 1.0
BUDGET_MIN, BUDGET_MAX, BUDGET_QUANTUM = 128, 8192, 64


def plan_setting() -> str:
    """``KVSCOPE_KERNEL_PLAN``: ``""`` (stored or measured), ``off``, ``measure``, or a pinned plan."""
    return os.environ.get(PLAN_ENV, "").strip()


def plan_enabled() -> bool:
    return plan_setting().lower() not in ("off", "0", "false", "no")


# ``--dtype auto`` on CPU with the plan on (engine/startup.py resolve_dtype, ``engine plan``).
AUTO_DTYPE = "float32"
AUTO_DTYPE_REASON = ("the kernel plan runs float32 activations and picks each projection's implementation by "
                     "measurement (bf16 GEMM over bf16 weights and bf16 prefill attention where bf16 is native and "
                     "measured fastest; the fused fp32 decode layer where it wins; float32 logits always); "
                     f"{PLAN_ENV}=off runs the ISA rule")


# ---------------------------------------------------------------------- implementations
@dataclass(slots=True)
class Implementation:
    """One candidate for one weight: the call, and the tensors it keeps (bf16 or int8 copies)."""

    call: Callable[[torch.Tensor], torch.Tensor]
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    # A candidate that computes in another dtype (bf16): the call without its cast back, and that
    # dtype, so the next op can take the output as it is (engine/model/families/llama.py mlp_block).
    native: Callable[[torch.Tensor], torch.Tensor] | None = None
    computes_in: torch.dtype | None = None


def candidates_for(weight: torch.Tensor, quantized: Any, gemv_kernel: Any, native_bf16: bool,
                   group: str, approximate: bool = True) -> list[str]:
    """The candidates this weight can run here (``quantized``: its QuantizedLinear or None).
    ``approximate`` (``--dtype auto``) adds those that round the weights further (bf16, int8);
    a dtype given by flag keeps to its own precision: the GEMV over the file's blocks and torch."""
    import torch

    out = []
    if quantized is not None and quantized.gemv is not None:
        out.append("gemv")
        if quantized.formats == ("q8_0",) and q8_0x16_fast():
            out.append("q8_0x16")
        if weight.dtype == torch.float32 and group != "head":
            out.append("dequant")  # no float copy held: the blocks widened each call, then one GEMM
    out.append("torch")
    if weight.dtype == torch.float32 and mkldnn_linear_available():
        out.append("fp32pack")
    if approximate and weight.dtype == torch.float32 and native_bf16 and group != "head":
        out.append("bf16")
    if approximate and weight.dtype == torch.float32 and hasattr(torch, "_weight_int8pack_mm"):
        out.append("int8pack")
    return out


def implementation(candidate: str, weight: torch.Tensor, quantized: Any, gemv_kernel: Any,
                   group: str = "") -> Implementation:
    """``candidate`` for ``weight`` (``[out, in]``), copies made now. The LM head's (``group``
    "head") take float32 rows and sum and return float32 in every dtype mode: its ``torch``
    widens a bf16 weight slice by slice (engine/model/families/llama.py fp32_linear), never rounding logits to bf16."""
    import torch
    import torch.nn.functional as F

    if candidate == "gemv":
        return Implementation(quantized.matmul)
    if candidate == "q8_0x16":
        return _q8_0x16_implementation(quantized)
    if candidate == "dequant":
        return Implementation(lambda x: F.linear(x, quantized.dequantize().to(x.dtype)))
    if candidate == "torch":
        if group == "head":
            from engine.model.families.llama import fp32_linear

            return Implementation(lambda x: fp32_linear(x, weight))
        return Implementation(lambda x: F.linear(x, weight))
    if candidate == "fp32pack":
        packed32 = pack_for_mkldnn(weight.float().contiguous())
        assert packed32 is not None, "fp32pack is a candidate only where oneDNN's linear is available"
        return Implementation(_packed_linear(packed32, torch.float32), {"fp32_packed": packed32})
    if candidate == "bf16":
        w16 = weight.to(torch.bfloat16).contiguous()
        packed = pack_for_mkldnn(w16)
        if packed is None:
            def dense(x: torch.Tensor) -> torch.Tensor:
                return F.linear(x.to(torch.bfloat16), w16)

            return Implementation(lambda x: dense(x).to(x.dtype), {"bf16": w16}, dense, torch.bfloat16)
        native = _packed_linear(packed, torch.bfloat16, cast_back=False)
        return Implementation(_packed_linear(packed, torch.bfloat16), {"bf16_packed": packed}, native, torch.bfloat16)
    if candidate == "int8pack":
        scale = (weight.float().abs().amax(dim=1) / 127.0).clamp_min(1e-12)
        q = torch.round(weight.float() / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        dtype = weight.dtype
        return Implementation(lambda x: torch._weight_int8pack_mm(x.to(dtype), q, scale.to(dtype)),
                              {"int8pack": q, "int8pack_scale": scale.to(dtype)})
    raise ValueError(f"kernel plan: unknown candidate {candidate!r} (known: {', '.join(CANDIDATES)})")


def q8_0x16_fast() -> bool:
    """Whether the block-type kernel is built here with its vpdpbusd q8_0x16 path."""
    from engine.model.kernels import cpu_quant

    kernel = cpu_quant.load_kernel()
    return kernel is not None and bool(kernel.q8_0x16_native())


def _q8_0x16_implementation(quantized: Any) -> Implementation:
    from engine.model.kernels import cpu_quant

    kernel = cpu_quant.load_kernel()
    assert kernel is not None, "q8_0x16 is a candidate only where the block-type kernel is built"
    packed, rows, matmul = kernel.pack_q8_0x16(quantized.blocks), quantized.out_features, kernel.q8_0x16_matmul
    return Implementation(lambda x: matmul(x, packed, rows), {"q8_0x16": packed})


def pack_for_mkldnn(weight: torch.Tensor) -> torch.Tensor | None:
    """A bf16 or float32 ``weight`` reordered once into oneDNN's blocked layout for its linear, or
    None where this torch has no oneDNN linear. ``F.linear`` reorders (or MKL packs) the weight on
    every call: prepacked, a bf16 projection ran 15-30 % faster at 8-256 rows (SmolLM2's 3072x576
    and 576x1536), and the float32 LM head (49152x576) 3.5x faster at 16 rows (7 against 25 ms),
    on 2 Zen 4 cores (AVX512-BF16); a bf16 copy gives the same output bits as F.linear."""
    import torch

    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, 256)  # type: ignore[no-any-return]
    except (AttributeError, RuntimeError):
        return None


def _packed_linear(packed: torch.Tensor, dtype: torch.dtype,
                   cast_back: bool = True) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x @ W.T`` over a :func:`pack_for_mkldnn` weight of ``dtype``, rows cast to it (and the
    output back to the rows' dtype unless ``cast_back`` is False)."""
    import torch

    linear = torch.ops.mkldnn._linear_pointwise
    if not cast_back:
        return lambda x: linear(x.to(dtype), packed, None, "none", [], "")
    return lambda x: linear(x.to(dtype), packed, None, "none", [], "").to(x.dtype)


@functools.cache
def mkldnn_linear_available() -> bool:
    """Whether this torch packs and runs oneDNN's linear (the CPU wheels do)."""
    import torch

    probe = pack_for_mkldnn(torch.ones(8, 8))
    if probe is None:
        return False
    try:
        torch.ops.mkldnn._linear_pointwise(torch.ones(1, 8), probe, None, "none", [], "")
    except RuntimeError:
        return False
    return True


def mkldnn_bf16_pack_available() -> bool:
    """Whether oneDNN packs a bf16 weight here: it needs AVX512-BW/VL/DQ or AVX-NE-CONVERT, so on
    AVX2 the bf16 candidate keeps a dense bf16 copy (``bf16``) instead of a packed one."""
    import torch

    return pack_for_mkldnn(torch.ones(8, 8, dtype=torch.bfloat16)) is not None


class Route:
    """One projection's implementation by step size: the first whose row limit holds."""

    __slots__ = ("impls", "limits")

    def __init__(self, limits: Sequence[int], impls: Sequence[Implementation]) -> None:
        self.limits = tuple(limits)
        self.impls = tuple(impls)

    def _for(self, rows: int) -> Implementation:
        for limit, impl in zip(self.limits, self.impls, strict=True):
            if rows <= limit:
                return impl
        return self.impls[-1]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._for(x.shape[0]).call(x)

    def native(self, x: torch.Tensor) -> torch.Tensor:
        """The output in the dtype the implementation computes in (no cast back)."""
        impl = self._for(x.shape[0])
        return (impl.native or impl.call)(x)

    def computes_in(self, rows: int) -> torch.dtype | None:
        """The dtype a step of ``rows`` rows is cast to (None: the rows' own)."""
        return self._for(rows).computes_in


def build_route(choices: Sequence[tuple[int, str]], weight: torch.Tensor, quantized: Any,
                gemv_kernel: Any, group: str = "") -> tuple[Route, dict[str, torch.Tensor]]:
    """The route for ``choices`` (``(row limit, candidate)`` per class, in order; the last
    class unbounded) and the copies it keeps."""
    limits: list[int] = []
    impls: list[Implementation] = []
    made: dict[str, Implementation] = {}
    last = None
    for limit, candidate in choices:
        if candidate not in made:
            made[candidate] = implementation(candidate, weight, quantized, gemv_kernel, group)
        if candidate == last:
            limits[-1] = limit  # same candidate as the class below: one range
            continue
        limits.append(limit)
        impls.append(made[candidate])
        last = candidate
    limits[-1] = 1 << 62
    extra = {name: t for impl in made.values() for name, t in impl.extra.items()}
    return Route(limits, impls), extra


# ---------------------------------------------------------------------- the plan
@dataclass(slots=True)
class Cell:
    """One group at one step-size class: each candidate's µs and error, what was chosen and why."""

    group: str
    step: str  # StepClass.name
    rows: int
    shape: str  # "out x in" of the whole weight
    weight_rows_timed: int = 0  # the output rows timed; ``us`` is scaled to the whole weight
    us: dict[str, float] = field(default_factory=dict)
    error: dict[str, float] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)
    chosen: str = ""
    why: str = ""
    measured: bool = True  # False: the bound was reached first; ``chosen`` is the fallback's

    @property
    def key(self) -> tuple[str, str]:
        return self.group, self.step


@dataclass(slots=True)
class KernelPlan:
    cells: list[Cell]
    fused_max_rows: int = 0  # pure-decode steps of at most this many rows run the fused layer (0: never)
    source: str = "measured"  # measured | stored | pinned | fallback
    measured_at: float = 0.0
    measure_seconds: float = 0.0
    bound_s: float = MEASURE_BOUND_S
    accuracy_bound: float = ACCURACY_BOUND
    isa: str = ""
    key: str = ""
    load_average: float = 0.0  # the 1-minute load average when measured (other processes' load skews it)
    cpus: int = 0
    model: str = ""  # the model's name, for ``engine plan``
    threads: int = 0
    notes: list[str] = field(default_factory=list)
    fused_timed: bool = True  # False: the bound was reached before the fused layer was timed

    @property
    def unmeasured(self) -> int:
        """Cells (and the fused layer) a bound left on the fallback: a later start measures them."""
        return sum(not c.measured for c in self.cells) + (not self.fused_timed)

    def cell(self, group: str, step: str) -> Cell | None:
        return next((c for c in self.cells if c.group == group and c.step == step), None)

    def choices(self, group: str) -> list[tuple[int, str]]:
        """``(row limit, candidate)`` per step class for ``group`` (the layer's groups or "head")."""
        out = []
        for sc in STEP_CLASSES:
            c = self.cell(group, sc.name)
            out.append((sc.hi or (1 << 62), c.chosen if c is not None and c.chosen else "torch"))
        return out

    def gemv_limit(self, group: str) -> int:
        """Rows up to which ``group`` runs the GEMV from one row up (the fused layer's limit)."""
        limit = 0
        for hi, candidate in self.choices(group):
            if candidate != "gemv":
                break
            limit = hi
        return limit

    def uses(self, candidate: str) -> bool:
        return any(c.chosen == candidate for c in self.cells)

    def prefill_us_per_token(self, num_layers: int) -> float | None:
        """µs of projections per prompt token at the biggest class (layers x the four groups)."""
        big = STEP_CLASSES[-1]
        cells = [self.cell(g, big.name) for g in LAYER_GROUPS]
        if any(c is None or c.chosen not in c.us for c in cells):
            return None
        return num_layers * sum(c.us[c.chosen] / c.rows for c in cells if c is not None)

    def summary(self) -> str:
        """One line: each group's choice per class, and the fused layer."""
        parts = []
        for group in (*LAYER_GROUPS, "head", ATTENTION):
            picks = [f"{c.step}:{c.chosen}" for sc in STEP_CLASSES if (c := self.cell(group, sc.name)) is not None]
            if picks:
                parts.append(f"{group} " + " ".join(picks))
        fused = f"fused decode layer <= {self.fused_max_rows} rows" if self.fused_max_rows else "fused decode layer off"
        pending = f"; {self.unmeasured} cells on the fallback until the next start" if self.unmeasured else ""
        return f"kernel plan ({self.source}): " + "; ".join(parts) + f"; {fused}{pending}"

    def table_lines(self) -> list[str]:
        """The table: group, shape, step class, each candidate's µs (rejected ones marked), chosen."""
        lines = [f"kernel plan ({self.source}; ISA {self.isa or '?'}; accuracy bound {self.accuracy_bound:g} "
                 f"relative RMS vs fp32; measured in {self.measure_seconds * 1000:.0f} ms of a "
                 f"{self.bound_s * 1000:.0f} ms bound at load average {self.load_average:g} on {self.cpus} CPUs; "
                 f"{PLAN_ENV}=measure measures again)"]
        for c in self.cells:
            times = []
            for name, us in c.us.items():
                mark = "" if name not in c.rejected else " REJECTED"
                times.append(f"{name} {us:,.1f}{mark}")
            times += [f"{name} ({why})" for name, why in c.rejected.items() if name not in c.us]
            lines.append(f"  {c.group:<8} {c.shape:<11} rows {c.step:<5} (timed {c.rows:>3}): "
                         f"{'; '.join(times) or 'not timed'} µs -> {c.chosen} ({c.why})")
        lines.append(f"  fused decode layer: {f'pure-decode steps <= {self.fused_max_rows} rows' if self.fused_max_rows else 'off'}")
        lines.extend(f"  note: {n}" for n in self.notes)
        return lines

    def to_json(self) -> dict[str, Any]:
        return {"format": PLAN_FORMAT_VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> KernelPlan:
        """A plan from :meth:`to_json` (a stored or pinned one); ValueError if malformed."""
        if data.get("format") != PLAN_FORMAT_VERSION:
            raise ValueError(f"kernel plan format {data.get('format')!r}, this engine reads {PLAN_FORMAT_VERSION}")
        try:
            cells = [Cell(**c) for c in data["cells"]]
            fields_ = {k: v for k, v in data.items() if k not in ("format", "cells")}
            plan = cls(cells=cells, **fields_)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"kernel plan: {exc}") from None
        known = {sc.name for sc in STEP_CLASSES}
        for c in plan.cells:
            allowed = ATTENTION_CANDIDATES if c.group == ATTENTION else CANDIDATES
            if c.group not in (*GROUPS, ATTENTION) or c.step not in known or c.chosen not in allowed:
                raise ValueError(f"kernel plan cell {c.group!r} {c.step!r} -> {c.chosen!r}: groups are "
                                 f"{', '.join((*GROUPS, ATTENTION))}, steps {', '.join(sorted(known))}, candidates "
                                 f"{', '.join(CANDIDATES)}")
        return plan


# ---------------------------------------------------------------------- choosing
def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:

    ref = reference.float()
    return float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def choose(cell: Cell, bound: float = ACCURACY_BOUND, incumbent: str = "",
           margin: float = plan_stability.MARGIN) -> Cell:
    """Fill ``chosen``/``why``/``rejected`` from ``us`` and ``error``: the fastest candidate whose
    error is within ``bound`` (a candidate failing the bound is rejected whatever its speed), unless
    ``incumbent`` (the previous plan's or the fallback's choice) passed and the fastest is not
    ``margin`` faster: then the incumbent stays (engine/model/plan_stability.py)."""
    for name, err in cell.error.items():
        if not math.isfinite(err) or err > bound:
            cell.rejected[name] = f"error {err:.2e} > {bound:g}"
    passing = {n: us for n, us in cell.us.items() if n not in cell.rejected}
    if not passing:
        cell.chosen, cell.why = "torch", "no candidate passed: torch's float GEMM"
        return cell
    best = min(passing, key=passing.__getitem__)
    if plan_stability.keep_incumbent(cell, passing, best, incumbent, margin):
        return cell
    others = sorted((us, n) for n, us in passing.items() if n != best)
    cell.chosen = best
    cell.why = (f"fastest within the bound ({passing[best]:,.1f} µs; next {others[0][1]} {others[0][0]:,.1f} µs)"
                if others else "the only candidate within the bound")
    if incumbent in passing and incumbent != best:
        cell.why += f"; over the {margin:.0%} margin against the incumbent {incumbent}"
    return cell


def _timed_round_robin(calls: Mapping[str, Callable[[], Any]], reps: int = TIMED_REPS,
                       clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """µs of each call: the median of its interleaved rounds, each round calling every candidate
    once (so a burst of load from other processes slows one round of all rather than one
    candidate): ``reps`` rounds, up to ``MAX_ROUNDS`` while the cell is within ``CELL_BUDGET_S``.
    The median, not the fastest: :func:`choose`'s margin compares typical times, and one lucky
    round decided plans that flipped between quiet starts (engine/model/plan_stability.py)."""
    rounds: dict[str, list[float]] = {name: [] for name in calls}
    cell_start = clock()
    for done in range(MAX_ROUNDS):
        if done >= reps and clock() - cell_start > CELL_BUDGET_S:
            break
        for name, call in calls.items():
            call_start = clock()
            call()
            rounds[name].append(clock() - call_start)
    return {name: statistics.median(times) * 1e6 for name, times in rounds.items()}


@dataclass(slots=True)
class _Target:
    group: str
    weight: torch.Tensor  # the rows timed
    quantized: Any
    candidates: list[str]
    full_rows: int  # the whole weight's
    blocks_weight: torch.Tensor | None = None  # the quantized copy's own values (the GEMV's reference)


def _targets(model: Any, gemv_kernel: Any, native_bf16: bool, approximate: bool) -> list[_Target]:
    """Each group's weight (layer 0's, and the LM head) cut to its first ``WEIGHT_ROWS_TIMED``
    rows, with its quantized copy cut alike."""
    from engine.model.loading.weight_blocks import holds_nothing

    out = []
    for group in GROUPS:
        module = model if group == "head" else model.layers[0]
        attr = GROUP_ATTRS[group]
        whole = model.head_weight if group == "head" else getattr(module, attr)
        if whole.shape[0] == 0:
            continue  # a sparse (MoE) layer's empty dense MLP: its cells stay torch, never run
        rows = min(WEIGHT_ROWS_TIMED, whole.shape[0])
        q = module.quantized.get(attr)
        q_rows = None if q is None else q.first_rows(rows)
        if q_rows is not None and q is not None:
            q_rows.bind_like(q)
        candidates = candidates_for(whole, q, gemv_kernel, native_bf16, group, approximate)
        blocks_weight = None
        if q_rows is not None and q_rows.source != "gguf":  # a GGUF's float weights are its blocks' values
            blocks_weight = q_rows.dequantize()
        weight = whole[:rows]
        if holds_nothing(whole):  # read as blocks, no float copy held: the slice's values made for the timing
            assert q_rows is not None
            weight = q_rows.dequantize().to(whole.dtype)
        out.append(_Target(group, weight, q_rows, candidates, whole.shape[0], blocks_weight))
    return out


def measure(model: Any, gemv_kernel: Any, native_bf16: bool, isa: str, fallback: Callable[[str, int], str],
            bound_s: float | None = None, fused: FusedTiming | None = None,
            approximate: bool = True, resume: KernelPlan | None = None,
            incumbent: KernelPlan | None = None) -> KernelPlan:
    """Time every candidate of every group at every step class on ``model``'s weights (layer 0,
    the LM head's first rows) and choose. ``fallback(group, rows)``: the constants' candidate
    for cells the time bound leaves unmeasured. ``fused``: times the fused decode layer.
    The biggest class (prefill, which also sets the token budget) is measured first, then
    single rows (decode), then the rest. ``resume``: an earlier start's partial plan, whose
    measured cells (and fused timing) are kept and only the rest measured. Each measured choice
    must beat its incumbent by ``plan_stability.MARGIN``: ``incumbent``'s (a quiet earlier
    plan), else the fallback's."""
    import torch

    bound_s = MEASURE_BOUND_S if bound_s is None else bound_s
    start = time.perf_counter()
    deadline = start + bound_s
    generator = torch.Generator().manual_seed(0)
    cells: list[Cell] = []
    ratios: dict[tuple[str, str, int], float] = {}  # (group, candidate, rows) -> its µs over the best's
    impls: dict[tuple[str, str], Implementation] = {}
    done = {c.key: c for c in resume.cells if c.measured} if resume is not None else {}
    for c in done.values():
        _note_ratios(c, ratios)
    with torch.inference_mode():
        targets = _targets(model, gemv_kernel, native_bf16, approximate)
        for sc in sorted(STEP_CLASSES, key=lambda c: (c.hi is not None, c.rows)):
            for target in targets:
                if (target.group, sc.name) in done:
                    cells.append(done[(target.group, sc.name)])
                    continue
                weight = target.weight
                cell = Cell(target.group, sc.name, sc.rows, f"{target.full_rows}x{weight.shape[1]}",
                            weight_rows_timed=weight.shape[0])
                cells.append(cell)
                if time.perf_counter() > deadline:
                    cell.chosen, cell.measured = fallback(target.group, sc.rows), False
                    cell.why = (f"not measured: the {bound_s * 1000:.0f} ms bound was reached (fallback constants; "
                                "the next start measures it)")
                    continue
                _measure_cell(cell, target, impls, generator, ratios, gemv_kernel)
        attention = attention_candidates(model, approximate and native_bf16)
        if len(attention) > 1:
            cells.extend(_attention_cells(model, attention, generator, deadline, done))
    _hold_incumbents([c for c in cells if c.key not in done and c.measured], incumbent, fallback)
    order = {(sc.name, g): i for i, (sc, g) in enumerate((sc, g) for sc in STEP_CLASSES
                                                          for g in (*GROUPS, ATTENTION))}
    cells.sort(key=lambda c: order[(c.step, c.group)])
    plan = KernelPlan(cells=cells, isa=isa, bound_s=bound_s, measured_at=time.time(),
                      load_average=round(plan_stability.current_load(), 2), cpus=os.cpu_count() or 0)
    notes = _fused_part(plan, fused, deadline, resume, incumbent)
    kept = plan_stability.kept_note(c for c in cells if c.key not in done)
    if kept is not None:
        notes.append(kept)
    notes.append(f"each weight timed on at most its first {WEIGHT_ROWS_TIMED:,} output rows, µs scaled to the "
                 "whole weight (time is linear in rows)")
    if resume is not None:
        notes.append(f"resumed an earlier start's plan: {len(done)} cells kept, {len(cells) - len(done)} measured now")
    plan.notes = notes
    plan.measure_seconds = time.perf_counter() - start + (resume.measure_seconds if resume is not None else 0.0)
    return plan


def _hold_incumbents(cells: Sequence[Cell], incumbent: KernelPlan | None, fallback: Callable[[str, int], str]) -> None:
    """Choose each measured cell again against its incumbent: ``incumbent``'s choice (a quiet
    earlier plan's), else the fallback constants' (float32 SDPA for attention)."""
    for cell in cells:
        default = "torch" if cell.group == ATTENTION else fallback(cell.group, cell.rows)
        choose(cell, incumbent=plan_stability.incumbent_for(incumbent, cell.group, cell.step, default))


def _fused_part(plan: KernelPlan, fused: FusedTiming | None, deadline: float, resume: KernelPlan | None,
                incumbent: KernelPlan | None) -> list[str]:
    """Set ``plan``'s fused-layer rows: ``resume``'s timing, the fallback's (on) past the bound, or
    timed now against the incumbent rows (``incumbent``'s, else the fallback's); its notes."""
    if fused is None:
        return []
    from engine.model.kernels.cpu_layer import MAX_ROWS

    if resume is not None and resume.fused_timed:
        plan.fused_max_rows = resume.fused_max_rows
        return [n for n in resume.notes if n.startswith("fused decode layer")]
    if time.perf_counter() > deadline:
        plan.fused_max_rows = MAX_ROWS  # the fallback: every pure-decode step the fused layer takes
        plan.fused_timed = False
        return ["fused decode layer not timed: the bound was reached (fallback: on; the next start times it)"]
    plan.fused_max_rows = plan_stability.incumbent_fused_rows(incumbent, MAX_ROWS)  # what the timing must beat
    plan.fused_max_rows, notes = fused(plan, deadline)
    return notes


def _measure_cell(cell: Cell, target: _Target, impls: dict[tuple[str, str], Implementation],
                  generator: torch.Generator, ratios: dict[tuple[str, str, int], float], gemv_kernel: Any) -> None:
    """Check and time each candidate of ``target`` at ``cell.rows`` rows, then choose. A
    ``ROW_LINEAR`` candidate over ``PRUNE_FACTOR`` x the best at a smaller class timed before
    (``ratios``) is not timed at this one."""
    import torch
    import torch.nn.functional as F

    weight = target.weight
    # the LM head's candidates take float32 rows whatever the model's dtype (implementation())
    x = torch.randn(cell.rows, weight.shape[1], generator=generator).to(
        torch.float32 if target.group == "head" else weight.dtype)
    reference = F.linear(x.float(), weight.float())
    # The GEMV multiplies the quantized copy the user chose (--quantization): it is checked against
    # those weights in fp32 (for a GGUF's own blocks the same as the float weights).
    blocks_reference = None if target.blocks_weight is None else F.linear(x.float(), target.blocks_weight)
    calls: dict[str, Callable[[], Any]] = {}
    for name in target.candidates:
        behind = max((r for (g, n, rows), r in ratios.items() if g == target.group and n == name and rows < cell.rows),
                     default=0.0)
        if name in ROW_LINEAR and behind > PRUNE_FACTOR:
            cell.rejected[name] = f"not timed: over {PRUNE_FACTOR:g}x the best at a smaller step (time linear in rows)"
            continue
        if cell.rows > MAX_ROWS_TIMED.get(name, cell.rows):
            cell.rejected[name] = f"not timed above {MAX_ROWS_TIMED[name]} rows (a GEMV: time linear in rows)"
            continue
        if cell.rows < MIN_ROWS_TIMED.get(name, 0):
            cell.rejected[name] = f"not timed below {MIN_ROWS_TIMED[name]} rows (widens the whole weight each call)"
            continue
        impl = impls.get((target.group, name))
        if impl is None:
            impl = impls[(target.group, name)] = implementation(name, weight, target.quantized, gemv_kernel,
                                                                target.group)
        try:
            out = impl.call(x)
        except RuntimeError as exc:  # an op this torch build lacks for these dtypes
            cell.rejected[name] = f"failed: {str(exc).splitlines()[0][:120]}"
            continue
        cell.error[name] = relative_error(out, blocks_reference if name in BLOCK_CANDIDATES and blocks_reference is not None
                                          else reference)
        calls[name] = functools.partial(impl.call, x)
    scale = target.full_rows / weight.shape[0]
    cell.us.update({name: us * scale for name, us in _timed_round_robin(calls).items()})
    choose(cell)
    _note_ratios(cell, ratios)


def _note_ratios(cell: Cell, ratios: dict[tuple[str, str, int], float]) -> None:
    """Each candidate's µs over the chosen one's at this cell (pruning at the bigger classes)."""
    best = cell.us.get(cell.chosen)
    if best:
        for name, us in cell.us.items():
            ratios[(cell.group, name, cell.rows)] = us / best


def attention_candidates(model: Any, bf16: bool) -> tuple[str, ...]:
    """The prefill-attention candidates ``model``'s backend has: float32 SDPA always; bf16 SDPA
    when ``bf16`` (native, ``--dtype auto``); the paged kernels the backend has (the bf16 one
    only when ``bf16``)."""
    out = ["torch"]
    if bf16:
        out.append("bf16")
    kernels = getattr(model.backend, "prefill_kernels", {})
    out.extend(name for name in ("paged", "paged_bf16") if name in kernels and (bf16 or name == "paged"))
    return tuple(out)


def _attention_cells(model: Any, candidates: Sequence[str], generator: torch.Generator, deadline: float,
                     done: Mapping[tuple[str, str], Cell] | None = None) -> list[Cell]:
    """Prefill attention of one ``rows``-token causal chunk (layer 0's heads) per multi-row class,
    each candidate as the backend runs it over a paged cache of 16-token blocks: torch's SDPA over
    the gathered context (float32, or q, K, V rounded to bf16) and the paged kernels reading it in
    place (over the cache dtype the engine stores, where they read it); checked against float32
    SDPA over the same K and V."""
    import torch
    import torch.nn.functional as F

    layer = model.layers[0]
    heads, kv_heads, head_dim = layer.num_heads, layer.num_kv_heads, layer.head_dim
    scale, gqa = 1.0 / math.sqrt(head_dim), heads != kv_heads
    block = 16

    def sdpa(q: torch.Tensor, cache: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
        kv = cache[torch.arange(cache.shape[0])]  # the backend's gather through the block table
        k = kv[:, 0].reshape(-1, kv_heads, head_dim)[:rows].transpose(0, 1)[None].to(dtype)
        v = kv[:, 1].reshape(-1, kv_heads, head_dim)[:rows].transpose(0, 1)[None].to(dtype)
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None].to(dtype), k, v, is_causal=True, scale=scale,
                                             enable_gqa=gqa)
        return out[0].transpose(0, 1).float()

    cells = []
    for sc in STEP_CLASSES:
        if sc.lo == 1:
            continue  # decode rows: the paged-decode kernel
        if done and (ATTENTION, sc.name) in done and set(done[(ATTENTION, sc.name)].us) >= set(candidates):
            cells.append(done[(ATTENTION, sc.name)])
            continue
        cell = Cell(ATTENTION, sc.name, sc.rows, f"{heads}q/{kv_heads}kv x {head_dim}")
        cells.append(cell)
        if time.perf_counter() > deadline:
            cell.chosen, cell.measured = "torch", False
            cell.why = "not measured: the bound was reached (float32 SDPA; the next start measures it)"
            continue
        rows = sc.rows
        q = torch.randn(rows, heads, head_dim, generator=generator)
        blocks = -(-rows // block)
        cache = torch.randn(blocks, 2, block, kv_heads, head_dim, generator=generator)
        stored = getattr(model.backend, "kv_cache_dtype", None)
        if stored in (torch.bfloat16, torch.float16):  # the engine's K and V, and the reference's, as stored
            cache = cache.to(stored)
        calls = {"torch": functools.partial(sdpa, q, cache, rows, torch.float32)}
        if "bf16" in candidates:
            calls["bf16"] = functools.partial(sdpa, q, cache, rows, torch.bfloat16)
        table = torch.arange(blocks, dtype=torch.int32)[None]
        for name in ("paged", "paged_bf16"):
            if name in candidates:
                calls[name] = functools.partial(model.backend.prefill_kernels[name], q, cache, table,
                                                torch.tensor([rows], dtype=torch.int32), torch.tensor([0, rows]), scale)
        reference = calls["torch"]()
        cell.error = {name: relative_error(call(), reference) for name, call in calls.items()}
        cell.us.update(_timed_round_robin(calls))
        choose(cell)
    return cells


# A callable (plan so far, deadline) -> (fused max rows, notes) that times the fused layer.
FusedTiming = Callable[[KernelPlan, float], tuple[int, list[str]]]


def fused_rows_from(timings: Sequence[tuple[StepClass, float, float, float]], max_rows: int,
                    bound: float = ACCURACY_BOUND, incumbent_rows: int | None = None) -> tuple[int, list[str]]:
    """From ``(class, fused µs, op-by-op µs, fused error)`` in class order: the rows up to which
    the fused layer wins from one row up (through the last class timed: ``max_rows``), and a
    note per class. ``incumbent_rows``: the rows the previous plan (or the fallback) ran fused;
    a class changes sides only on ``plan_stability.MARGIN`` (None: the faster wins)."""
    rows, notes, winning = 0, [], True
    for sc, fused_us, layer_us, err in timings:
        held = None if incumbent_rows is None else min(sc.hi or max_rows, max_rows) <= incumbent_rows
        ok = err <= bound and plan_stability.fused_wins(fused_us, layer_us, held)
        kept = " (kept as incumbent: within the margin)" if err <= bound and ok != (fused_us < layer_us) else ""
        notes.append(f"fused decode layer at {sc.rows} rows: {fused_us:,.1f} µs vs op-by-op {layer_us:,.1f} µs"
                     + (f" (error {err:.2e} > {bound:g}: rejected)" if err > bound else "")
                     + (" -> fused" if ok and winning else " -> op by op") + kept)
        if winning and ok:
            rows = min(sc.hi or max_rows, max_rows)
        else:
            winning = False
    if winning and timings:
        rows = max_rows
        notes.append(f"fused decode layer won at every size timed: it serves pure-decode steps up to {max_rows} rows")
    return rows, notes


# ---------------------------------------------------------------------- storing, pinning
def plan_key(parts: Mapping[str, Any]) -> str:
    """The stored plan's key: ``parts`` (weights, formats, dtype, ISA, torch, threads) plus
    this module's and the kernels' sources."""
    from engine.model.attention import cpu_decode
    from engine.model.kernels import cpu_gemv, cpu_layer

    digest = hashlib.sha256(Path(__file__).read_bytes())
    kernels = [cpu_gemv.SPEC.module_name(), cpu_layer.SPEC.module_name(), cpu_decode.SPEC.module_name()]
    text = json.dumps({"format": PLAN_FORMAT_VERSION, "plan_source": digest.hexdigest()[:16],
                       "kernels": kernels, **parts},
                      sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def _entry(key: str) -> Path | None:
    from engine.model.memory.profile_cache import profile_root

    root = profile_root()
    return None if root is None else root / PLANS_FOLDER / f"{key}.json"


def load_stored(key: str) -> KernelPlan | None:
    path = _entry(key)
    if path is None or not path.is_file():
        return None
    try:
        plan = KernelPlan.from_json(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None
    plan.source, plan.key = "stored", key
    return plan


def store(plan: KernelPlan) -> None:
    """Write the plan beside the profiles (best effort: a read-only cache still starts)."""
    from engine.model.loading.startup_cache import atomic_write

    path = _entry(plan.key)
    if path is None:
        return
    text = json.dumps({**plan.to_json(), "source": "measured"})
    with contextlib.suppress(OSError):
        atomic_write(path, lambda tmp: Path(tmp).write_text(text))


def measured_overloaded(plan: KernelPlan, load: float | None = None) -> bool:
    """True when ``plan`` was measured with more runnable threads than CPUs and the machine is
    quieter now (``load``: the 1-minute load average, read when None): parallel kernels then wait
    for descheduled threads (a 20 µs GEMV took 20 ms at load 8 on 2 cores), so such a plan is
    measured again once the load allows."""
    cpus = plan_stability.cpu_count(plan)
    load = plan_stability.current_load() if load is None else load
    return plan_stability.plan_loaded(plan) and not plan_stability.is_loaded(load, cpus)


def stored_for_model(name: str) -> list[KernelPlan]:
    """The stored plans measured for model ``name`` (any flags), newest first: ``engine plan``."""
    path = _entry("x")
    if path is None or not path.parent.is_dir():
        return []
    plans = []
    for entry in path.parent.glob("*.json"):
        try:
            plan = KernelPlan.from_json(json.loads(entry.read_text()))
        except (OSError, ValueError):
            continue
        if plan.model == name:
            plans.append(plan)
    return sorted(plans, key=lambda p: p.measured_at, reverse=True)


def pinned() -> KernelPlan | None:
    """The plan ``KVSCOPE_KERNEL_PLAN`` names (a path or the JSON itself), or None."""
    from engine.errors import UserError

    value = plan_setting()
    if value.lower() in ("", "measure", "off", "0", "false", "no", "auto"):
        return None
    try:
        text = value if value.startswith("{") else Path(value).expanduser().read_text()
        plan = KernelPlan.from_json(json.loads(text))
    except (OSError, ValueError) as exc:
        raise UserError(f"{PLAN_ENV}={value[:80]!r}: {exc}; give a plan JSON (from a phase F event's "
                        "kernel_plan or a stored plan file), its path, 'measure' or 'off'") from None
    plan.source = "pinned"
    return plan


def derived_batch_budget(plan: KernelPlan, num_layers: int) -> tuple[int, str] | None:
    """The CPU default ``--max-num-batched-tokens`` from the plan's prefill speed: one step's
    projections near ``STEP_TARGET_S``; None when the plan has no biggest-class timings."""
    per_token = plan.prefill_us_per_token(num_layers)
    if per_token is None or per_token <= 0:
        return None
    raw = STEP_TARGET_S * 1e6 / per_token
    tokens = int(min(BUDGET_MAX, max(BUDGET_MIN, raw // BUDGET_QUANTUM * BUDGET_QUANTUM)))
    return tokens, (f"derived from the kernel plan's prefill speed ({1e6 / per_token:,.0f} tok/s of projections, "
                    f"{per_token:,.1f} µs a token over {num_layers} layers): {tokens:,} tokens keep one step's "
                    f"projections near {STEP_TARGET_S * 1000:.0f} ms (attention and sampling add ~15-25 %)")


# ---------------------------------------------------------------------- the fused decode layer
def fused_timing(model: Any) -> FusedTiming | None:
    """The timing of the fused decode layer on ``model``'s layer 0 against the op-by-op layer
    (the plan's projections, the paged-decode kernel), or None where it cannot run."""
    import torch

    from engine.model.kernels import cpu_layer

    if getattr(model.backend, "decode_kernel", None) is None or cpu_layer.load_kernel() is None:
        return None
    kernel = cpu_layer.load_kernel()

    def run(plan: KernelPlan, deadline: float) -> tuple[int, list[str]]:
        incumbent_rows = plan.fused_max_rows  # what measure() set: the previous plan's rows, or the fallback's
        model.install_kernel_plan(replace(plan, fused_max_rows=cpu_layer.MAX_ROWS))
        if not model._fused_layers:
            return 0, ["fused decode layer does not apply to this model's layers or weights"]
        layer, args = model.layers[0], model._fused_layers[0]
        timings, notes = [], []
        generator = torch.Generator().manual_seed(1)
        for sc in STEP_CLASSES:  # every class: past 64 rows a packed bf16 GEMM can beat its GEMV
            if time.perf_counter() > deadline:
                notes.append(f"fused decode layer not timed at {sc.rows} rows: the bound was reached (op by op)")
                break
            timings.append((sc, *_fused_against_layer(model, layer, kernel, args, min(sc.rows, cpu_layer.MAX_ROWS),
                                                      generator)))
        if not timings:  # the bound came first (installing the plan's copies took it): as past the bound
            plan.fused_timed = False  # else "off" was stored as if measured, and no later start timed it
            return cpu_layer.MAX_ROWS, ["fused decode layer not timed: the bound was reached (fallback: on; "
                                        "the next start times it)"]
        rows, fused_notes = fused_rows_from(timings, cpu_layer.MAX_ROWS, incumbent_rows=incumbent_rows)
        return rows, fused_notes + notes

    return run


def _fused_against_layer(model: Any, layer: Any, kernel: Any, args: tuple[tuple[object, ...], tuple[object, ...]],
                         rows: int, generator: torch.Generator) -> tuple[float, float, float]:
    """``(fused µs, op-by-op µs, relative difference)`` of one pure-decode step of ``rows``
    sequences, each attending over ``FUSED_CONTEXT`` tokens, through layer ``layer``."""
    import torch

    from engine.model.attention.base import AttentionMetadata

    block, (before, after) = 16, args
    per_seq = FUSED_CONTEXT // block + 1
    cache = torch.randn(rows * per_seq, 2, block, layer.num_kv_heads, layer.head_dim, generator=generator)
    tables = torch.arange(rows * per_seq, dtype=torch.int32).view(rows, per_seq)
    lens = torch.full((rows,), FUSED_CONTEXT + 1, dtype=torch.int32)
    slots = tables[:, FUSED_CONTEXT // block].to(torch.int64) * block + FUSED_CONTEXT % block
    meta = AttentionMetadata(slot_mapping=slots, query_start_loc=torch.arange(rows + 1, dtype=torch.int32),
                             seq_lens=lens, block_tables=tables, max_query_len=1, max_seq_len=FUSED_CONTEXT + 1,
                             query_lens_cpu=[1] * rows, seq_lens_cpu=[FUSED_CONTEXT + 1] * rows)
    rotary = model.rotary_local if getattr(layer, "is_sliding", False) else model.rotary  # Gemma 3's two bases
    cos, sin = rotary.cos_sin(torch.full((rows,), FUSED_CONTEXT), model.dtype)
    hidden = torch.randn(rows, layer.input_layernorm.shape[0], generator=generator)
    entry = getattr(kernel, getattr(layer, "fused_entry", "decode_layer"))  # Gemma 3: decode_layer_gemma3

    def fused_call() -> torch.Tensor:
        return entry(hidden, *before, cos.view(rows, -1), sin.view(rows, -1), cache, slots, tables, lens, *after)

    def layer_call() -> torch.Tensor:
        return layer(hidden, cos, sin, cache, meta, model.backend)

    with torch.inference_mode():
        err = relative_error(fused_call(), layer_call())
        us = _timed_round_robin({"fused": fused_call, "layer": layer_call})
        return us["fused"], us["layer"], err


# ---------------------------------------------------------------------- at startup
def resolve(model: Any, key: str, native_bf16: bool, isa: str, log: Any = None,
            approximate: bool = True) -> KernelPlan | None:
    """The plan for this start, installed on ``model``: pinned by ``KVSCOPE_KERNEL_PLAN``, the
    stored one for ``key``, or measured now (and stored); None when the variable is ``off``
    (the fallback constants run). ``approximate``: see :func:`candidates_for`."""
    import torch

    from engine.model.kernels import cpu_gemv

    if not plan_enabled() or getattr(model, "expert_counter", None) is not None:
        return None  # a MoE model's experts run grouped (engine/model/layers/moe.py); the plan times dense layers
    load = plan_stability.current_load()
    plan, previous = _start_plan(key, model.config.name, isa, load, log)
    remeasure = plan is not None and plan.source == "stored" and measured_overloaded(plan, load)
    if remeasure and log is not None:
        log.info(f"the stored kernel plan was measured at load average {plan.load_average:g} on {plan.cpus} CPUs "  # type: ignore[union-attr]
                 f"(other processes' threads skew its timings); the load is {load:.2f} now: measuring again")
    resume = plan if plan is not None and plan.source == "stored" and not remeasure and plan.unmeasured else None
    if resume is not None and plan_stability.defer_resume(resume, load):
        resume = None
        if log is not None:
            log.info(f"the stored kernel plan left {plan.unmeasured} cells on the fallback constants; the load is "  # type: ignore[union-attr]
                     f"{load:.2f} on {plan_stability.cpu_count(plan)} CPUs: a quieter start measures them")
    if resume is not None and log is not None:
        log.info(f"the stored kernel plan left {resume.unmeasured} cells on the fallback constants (its bound was "
                 "reached): measuring them now")
    if plan is None or remeasure or resume is not None:
        incumbent = resume or _incumbent_plan(previous, model.config.name, isa)
        if model._gemv_pending:
            model.resolve_gemv()  # each quantized weight bound to its kernel (the GEMV candidate)
        gemv_kernel = cpu_gemv.load_kernel() if model.quantized_linears() else None
        plan = measure(model, gemv_kernel, native_bf16, isa, model.fallback_candidate, fused=fused_timing(model),
                       approximate=approximate, resume=resume,
                       incumbent=incumbent)
        plan.key, plan.model, plan.threads = key, model.config.name, torch.get_num_threads()
        plan = _settle_measured(plan, previous, log)
    model.install_kernel_plan(plan)
    if log is not None:
        log.info(plan.summary())
    return plan


def _stored_like(name: str, isa: str) -> list[KernelPlan]:
    """The stored plans of model ``name`` on this ISA at this thread count (any other flags or sources)."""
    import torch

    threads = torch.get_num_threads()
    return [p for p in stored_for_model(name) if p.isa == isa and p.threads == threads]


def _start_plan(key: str, name: str, isa: str, load: float, log: Any) -> tuple[KernelPlan | None, KernelPlan | None]:
    """``(the plan to start from, the plan stored under key)``: the pinned plan; the stored one (on a
    loaded machine the last quiet plan instead of a loaded one, plan_stability.settle_stored); or
    None to measure (nothing stored, or ``KVSCOPE_KERNEL_PLAN=measure``)."""
    plan = pinned()
    if plan is not None:
        return plan, None
    previous = load_stored(key)
    if previous is None or plan_setting().lower() == "measure":
        return None, previous
    settled = plan_stability.settle_stored(previous, load, _stored_like(name, isa))
    if settled.message and log is not None:
        log.warning(settled.message)
    return settled.plan, previous


def _incumbent_plan(previous: KernelPlan | None, name: str, isa: str) -> KernelPlan | None:
    """The plan whose choices a new measurement must beat by the margin: the stored plan of this key
    if it was measured quiet, else the newest quiet plan of the model here (its choices this start
    cannot run are no incumbents: choose() keeps only one that passed), else None (the fallback's)."""
    if previous is not None and not plan_stability.plan_loaded(previous):
        return previous
    quiet = [p for p in _stored_like(name, isa) if not plan_stability.plan_loaded(p)]
    return max(quiet, key=lambda p: p.measured_at, default=None)


def _settle_measured(plan: KernelPlan, previous: KernelPlan | None, log: Any) -> KernelPlan:
    """Store ``plan`` unless it was measured loaded over a quiet plan; what this start runs (a loaded
    measurement gives way to the last quiet plan it can run: plan_stability.settle_measured)."""
    settled = plan_stability.settle_measured(plan, previous, _stored_like(plan.model, plan.isa))
    if settled.store:
        store(plan)
    if settled.message and log is not None:
        log.warning(settled.message)
    return settled.plan


def stored_for_start(key: str, name: str, isa: str, load: float | None = None) -> KernelPlan | None:
    """The plan a start with ``key`` would run before measuring (engine/startup.py derives the
    token budget from it): pinned, or stored (the last quiet plan in place of a loaded one on a
    loaded machine); None when nothing is stored."""
    plan = pinned()
    if plan is not None:
        return plan
    stored = load_stored(key)
    if stored is None:
        return None
    load = plan_stability.current_load() if load is None else load
    return plan_stability.settle_stored(stored, load, _stored_like(name, isa)).plan
