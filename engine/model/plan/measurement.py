"""Measuring a plan: every candidate of every group at every step-size class, timed on the
model's own weights (layer 0's and the LM head's first ``WEIGHT_ROWS_TIMED`` rows), checked and
chosen (engine/model/plan/choice.py); then prefill attention (attention_cells.py) and the fused
decode layer (fused_layer.py), all within ``MEASURE_BOUND_S`` (``FIRST_MEASURE_BOUND_S`` for a model's
first plan here)."""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.model.plan import stability
from engine.model.plan.attention_cells import attention_candidates, attention_cells
from engine.model.plan.candidates import BLOCK_CANDIDATES, Implementation, candidates_for, implementation
from engine.model.plan.choice import choose, relative_error, timed_round_robin
from engine.model.plan.kernel_plan import (
    ATTENTION,
    FIRST_MEASURE_BOUND_S,
    GROUP_ATTRS,
    GROUPS,
    MEASURE_BOUND_S,
    STEP_CLASSES,
    Cell,
    KernelPlan,
)

if TYPE_CHECKING:
    import torch

    from engine.model.plan.fused_layer import FusedTiming

# Candidates whose time grows with rows like a GEMV's (a weight row re-read per few activation
# rows): one more than PRUNE_FACTOR x behind at a smaller class cannot catch up at a bigger one,
# so it is not timed there (int8pack took 0.65 s for one 256-row QKV on Zen 4). GEMMs are always timed.
ROW_LINEAR = frozenset({"gemv", "int8pack"})
# torch's int8pack is a weight-only GEMV: timed at decode sizes only.
MAX_ROWS_TIMED = {"int8pack": 8}
# dequant widens the whole weight on every call: only a prefill-sized step can pay that back.
MIN_ROWS_TIMED = {"dequant": 64}
PRUNE_FACTOR = 3.0
WEIGHT_ROWS_TIMED = 1024  # a multiple of 8 (q4_1x8 interleaves 8 rows)


@dataclass(slots=True)
class _Target:
    group: str
    weight: torch.Tensor  # the rows timed
    quantized: Any
    candidates: list[str]
    full_rows: int  # the whole weight's
    blocks_weight: torch.Tensor | None = None  # the quantized copy's own values (the GEMV's reference)
    blocks_only: bool = False  # read as blocks, no float copy held: torch's candidates would make one


def fallback_choice(target: _Target, rows: int, fallback: Callable[[str, int], str]) -> str:
    """The constants' choice for ``target`` at ``rows``, except that a weight held only as blocks
    never runs the row-by-row GEMV over more than one row where x16 (or, at prefill sizes, the
    blocks widened per call) runs it: the plain GEMV re-reads the weight every few rows, and a
    2,048-token profile step of Gemma 3 270M took 73-98 s on it (Zen 4) against ~4 s on x16."""
    choice = fallback(target.group, rows)
    if choice != "gemv" or rows <= 1 or not target.blocks_only:
        return choice
    if "x16" in target.candidates:
        return "x16"
    if "dequant" in target.candidates and rows >= MIN_ROWS_TIMED["dequant"]:
        return "dequant"
    return choice


def unmeasured_choice(target: _Target, step: str, rows: int, incumbent: KernelPlan | None,
                      fallback: Callable[[str, int], str]) -> str:
    """What a cell the bound left unmeasured runs until a later start measures it: the incumbent
    quiet plan's choice where this start can run it (it was measured; the constants were not),
    else :func:`fallback_choice`."""
    held = stability.incumbent_for(incumbent, target.group, step, "")
    return held if held in target.candidates else fallback_choice(target, rows, fallback)


def _targets(model: Any, gemv_kernel: Any, native_bf16: bool, approximate: bool) -> list[_Target]:
    """Each group's weight (layer 0's, and the LM head) cut to its first ``WEIGHT_ROWS_TIMED``
    rows, with its quantized copy cut alike."""
    out = []
    for group in GROUPS:
        module = model if group == "head" else model.layers[0]
        projection = module.projections[GROUP_ATTRS[group]]
        whole = projection.weight
        if whole.shape[0] == 0:
            continue  # a sparse (MoE) layer's empty dense MLP: its cells stay torch, never run
        rows = min(WEIGHT_ROWS_TIMED, whole.shape[0])
        q = projection.blocks
        q_rows = None if q is None else q.first_rows(rows)
        if q_rows is not None and q is not None:
            q_rows.bind_like(q)
        candidates = candidates_for(whole, q, gemv_kernel, native_bf16, group, approximate)
        blocks_weight = None
        if q_rows is not None and q_rows.source != "gguf":  # a GGUF's float weights are its blocks' values
            blocks_weight = q_rows.dequantize()
        weight = whole[:rows]
        blocks_only = not projection.holds_float()
        if blocks_only:  # read as blocks, no float copy held: the slice's values made for the timing
            assert q_rows is not None
            weight = q_rows.dequantize().to(whole.dtype)
        out.append(_Target(group, weight, q_rows, candidates, whole.shape[0], blocks_weight, blocks_only))
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
    must beat its incumbent by ``stability.MARGIN``: ``incumbent``'s (a quiet earlier
    plan), else the fallback's. A cell left unmeasured runs :func:`unmeasured_choice`."""
    import torch

    if bound_s is None:  # a first plan has no quiet plan to run its unmeasured cells by: a longer bound
        bound_s = FIRST_MEASURE_BOUND_S if incumbent is None and resume is None else MEASURE_BOUND_S
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
                    cell.chosen, cell.measured = unmeasured_choice(target, sc.name, sc.rows, incumbent, fallback), False
                    source = ("the incumbent plan's choice" if cell.chosen == stability.incumbent_for(
                        incumbent, target.group, sc.name, "") else "fallback constants")
                    cell.why = (f"not measured: the {bound_s * 1000:.0f} ms bound was reached ({source}; "
                                "the next start measures it)")
                    continue
                _measure_cell(cell, target, impls, generator, ratios, gemv_kernel)
        attention = attention_candidates(model, approximate and native_bf16)
        if len(attention) > 1:
            cells.extend(attention_cells(model, attention, generator, deadline, done, incumbent))
    by_group = {t.group: t for t in targets}
    _hold_incumbents([c for c in cells if c.key not in done and c.measured], incumbent,
                     lambda group, rows: fallback_choice(by_group[group], rows, fallback) if group in by_group
                     else fallback(group, rows))
    order = {(sc.name, g): i for i, (sc, g) in enumerate((sc, g) for sc in STEP_CLASSES
                                                          for g in (*GROUPS, ATTENTION))}
    cells.sort(key=lambda c: order[(c.step, c.group)])
    plan = KernelPlan(cells=cells, isa=isa, bound_s=bound_s, measured_at=time.time(),
                      load_average=round(stability.current_load(), 2), cpus=os.cpu_count() or 0)
    plan.notes = _fused_part(plan, fused, deadline, resume, incumbent) + _notes(cells, done, resume)
    plan.measure_seconds = time.perf_counter() - start + (resume.measure_seconds if resume is not None else 0.0)
    return plan


def _notes(cells: Sequence[Cell], done: Mapping[tuple[str, str], Cell], resume: KernelPlan | None) -> list[str]:
    """The plan's notes on its cells: those kept as incumbents, the rows timed, what was resumed."""
    notes = []
    kept = stability.kept_note(c for c in cells if c.key not in done)
    if kept is not None:
        notes.append(kept)
    notes.append(f"each weight timed on at most its first {WEIGHT_ROWS_TIMED:,} output rows, µs scaled to the "
                 "whole weight (time is linear in rows)")
    if resume is not None:
        notes.append(f"resumed an earlier start's plan: {len(done)} cells kept, {len(cells) - len(done)} measured now")
    return notes


def _hold_incumbents(cells: Sequence[Cell], incumbent: KernelPlan | None, fallback: Callable[[str, int], str]) -> None:
    """Choose each measured cell again against its incumbent: ``incumbent``'s choice (a quiet
    earlier plan's), else the fallback constants' (float32 SDPA for attention)."""
    for cell in cells:
        default = "torch" if cell.group == ATTENTION else fallback(cell.group, cell.rows)
        choose(cell, incumbent=stability.incumbent_for(incumbent, cell.group, cell.step, default))


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
    plan.fused_max_rows = stability.incumbent_fused_rows(incumbent, MAX_ROWS)  # what the timing must beat
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
    cell.us.update({name: us * scale for name, us in timed_round_robin(calls).items()})
    choose(cell)
    _note_ratios(cell, ratios)


def _note_ratios(cell: Cell, ratios: dict[tuple[str, str, int], float]) -> None:
    """Each candidate's µs over the chosen one's at this cell (pruning at the bigger classes)."""
    best = cell.us.get(cell.chosen)
    if best:
        for name, us in cell.us.items():
            ratios[(cell.group, name, cell.rows)] = us / best

