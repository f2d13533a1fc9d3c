"""The kernel plan as stored: the groups and step-size classes it covers, each cell's timings and
choice (``Cell``), and ``KernelPlan`` with its summary, its table and its JSON (the stored-plan
file and phase F's event). The package's ``__init__`` tells how a plan is measured."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from engine.model.plan.setting import PLAN_ENV

PLAN_FORMAT_VERSION = 2  # 2: the 9-64 class split into 9-16, 17-32, 33-64
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
CANDIDATES = ("gemv", "x16", "dequant", "torch", "fp32pack", "bf16", "int8pack")
ACCURACY_BOUND = 1e-2  # relative RMS error against the fp32 reference (int8 activations: ~5e-3 on N(0,1) inputs)
# Total measuring time of one start. Measured once per (model, formats, ISA, torch, threads,
# kernel sources) and stored, so only a first start pays it: ~0.8-1.7 s on a quiet 2-core
# Zen 4 (AVX-512) for SmolLM2; cells a loaded machine does not reach keep the fallback's
# choice and are measured at the next start (``KernelPlan.unmeasured``).
MEASURE_BOUND_S = 2.0
# The bound of a model's first plan here, with no quiet plan to run the unmeasured cells by: the
# fallback constants' per-sequence SDPA and row-by-row kernels made Gemma 3 270M's first profile
# step take minutes, while its whole plan measures in ~3-4 s on a quiet 2-core Zen 4.
FIRST_MEASURE_BOUND_S = 10.0


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

