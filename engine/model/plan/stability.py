"""Kernel plans that hold still (engine/model/plan/): a choice changes only on a measured
margin, and a start on a loaded machine neither stores nor runs its own skewed timings where a
plan measured on a quiet machine exists.

Two starts of the same model a minute apart on a quiet 2-core Zen 4 chose different plans where
candidates were within 1-5 % of each other (decode 6.7 against 15.1 tok/s), and a start at load
17 switched the fused decode layer off and stored that plan for every later start. So:

* a challenger replaces the incumbent (the previous quiet plan's choice; for a first plan the
  fallback constants') only when the median of its interleaved rounds is ``MARGIN`` faster
  (incumbent µs >= (1 + ``MARGIN``) x challenger µs); within the margin the incumbent is kept and
  the cell's ``why`` (and a plan note) says so;
* a plan is *loaded* when it was measured at a 1-minute load average above the CPU count (other
  processes' threads deschedule the parallel kernels'): a loaded measurement is never stored
  over a quiet plan, and a loaded start runs the last quiet plan of the same key, or of the same
  model, ISA and threads whose choices this start can run, saying so in the log and the notes.

Everything here takes the load average and the plans as arguments: tests inject both.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.model.plan.kernel_plan import Cell, KernelPlan

# A challenger must be this much faster than the incumbent (the median of rounds) to replace it:
# above the 1-5 % two quiet starts differ by, below the gaps that decide a plan (GEMV against
# GEMM at 12 rows: 60 against 26 ms).
MARGIN = 0.10
KEPT = "kept as incumbent"  # how a kept cell's ``why`` starts


def current_load() -> float:
    """The 1-minute load average now (a function, so tests can replace it)."""
    return os.getloadavg()[0]


def cpu_count(plan: KernelPlan | None = None) -> int:
    return (plan.cpus if plan is not None and plan.cpus else 0) or os.cpu_count() or 1


def is_loaded(load: float, cpus: int) -> bool:
    """More runnable threads than CPUs: a timing then measures the wait for a CPU too."""
    return load > cpus


def plan_loaded(plan: KernelPlan) -> bool:
    return is_loaded(plan.load_average, cpu_count(plan))


def beats(challenger_us: float, incumbent_us: float, margin: float = MARGIN) -> bool:
    """Whether the challenger is ``margin`` faster: the incumbent takes (1 + margin)x its time or more."""
    return challenger_us <= 0 or incumbent_us / challenger_us >= 1.0 + margin


def keep_incumbent(cell: Cell, passing: Mapping[str, float], best: str, incumbent: str,
                   margin: float = MARGIN) -> bool:
    """Set ``cell`` to ``incumbent`` when it passed and ``best`` does not beat it by ``margin``;
    False (nothing set) when the fastest should be chosen."""
    if not incumbent or incumbent == best or incumbent not in passing:
        return False
    if beats(passing[best], passing[incumbent], margin):
        return False
    gain = passing[incumbent] / passing[best] - 1.0
    cell.chosen = incumbent
    cell.why = (f"{KEPT}: {best} {passing[best]:,.1f} µs against its {passing[incumbent]:,.1f} µs (medians of "
                f"interleaved rounds) is {gain:.1%} faster, within the {margin:.0%} margin")
    return True


def incumbent_for(previous: KernelPlan | None, group: str, step: str, fallback: str) -> str:
    """The choice a measurement must beat at one cell: the previous plan's (a quiet one only), else
    ``fallback`` (the constants'). An unmeasured cell of the previous plan holds the fallback's too."""
    if previous is not None and not plan_loaded(previous):
        cell = previous.cell(group, step)
        if cell is not None and cell.chosen:
            return cell.chosen
    return fallback


def incumbent_fused_rows(previous: KernelPlan | None, fallback_rows: int) -> int:
    """The fused layer's rows a measurement must beat: the previous quiet plan's (timed), else the
    fallback's (every pure-decode step it takes)."""
    if previous is not None and not plan_loaded(previous) and previous.fused_timed:
        return previous.fused_max_rows
    return fallback_rows


def fused_wins(fused_us: float, layer_us: float, incumbent_fused: bool | None, margin: float = MARGIN) -> bool:
    """Whether the fused layer serves a class: faster than op by op, by ``margin`` where op by op is
    the incumbent, and not ``margin`` slower where the fused layer is (``None``: no incumbent)."""
    if incumbent_fused is None:
        return fused_us < layer_us
    if incumbent_fused:
        return not beats(layer_us, fused_us, margin)
    return beats(fused_us, layer_us, margin)


def kept_note(cells: Iterable[Cell], margin: float = MARGIN) -> str | None:
    """The plan note naming the cells kept as incumbent, or None."""
    kept = [f"{c.group} {c.step} {c.chosen}" for c in cells if c.why.startswith(KEPT)]
    if not kept:
        return None
    return (f"{len(kept)} cells {KEPT} (a challenger within the {margin:.0%} margin of the previous plan's "
            f"or the fallback constants' choice does not replace it): {', '.join(kept)}")


# ---------------------------------------------------------------------- loaded starts
def compatible(quiet: KernelPlan, like: KernelPlan) -> bool:
    """Whether ``quiet`` was measured for this start's configuration and its choices run here,
    judged by ``like`` (a plan of this start's key): the same ISA, threads and cells, the same
    candidates at each cell both measured, and each of ``quiet``'s choices ``like``'s or one that
    passed its bound there."""
    if (quiet.isa, quiet.threads) != (like.isa, like.threads):
        return False
    if {c.key for c in quiet.cells} != {c.key for c in like.cells}:
        return False
    for cell in quiet.cells:
        mine = like.cell(cell.group, cell.step)
        assert mine is not None
        if cell.us and mine.us and _considered(cell) != _considered(mine):
            return False  # another --dtype or --quantization: other candidates
        passed = set(mine.us) - set(mine.rejected)
        if cell.chosen != mine.chosen and cell.chosen not in passed:
            return False
    return True


def _considered(cell: Cell) -> set[str]:
    """The candidates a measured cell had: timed, or not timed for a reason (pruned, failed)."""
    return set(cell.us) | set(cell.rejected)


def last_quiet(like: KernelPlan, stored: Iterable[KernelPlan]) -> KernelPlan | None:
    """The newest quiet plan among ``stored`` (any key) that this start can run (:func:`compatible`)."""
    found = [p for p in stored if not plan_loaded(p) and (p.key == like.key or compatible(p, like))]
    return max(found, key=lambda p: p.measured_at, default=None)


def fall_back(quiet: KernelPlan, why: str) -> KernelPlan:
    """``quiet`` to run instead of a loaded plan, with the reason in its notes."""
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(quiet.measured_at))
    note = (f"{why}: this start runs the last quiet plan (measured {when} at load average {quiet.load_average:g} "
            f"on {cpu_count(quiet)} CPUs) instead")
    return replace(quiet, notes=[*quiet.notes, note], source="stored")


@dataclass(slots=True)
class Settled:
    """What a start runs, whether its measurement is stored, and the log line saying why (or "")."""

    plan: KernelPlan
    store: bool
    message: str = ""


def settle_measured(measured: KernelPlan, previous: KernelPlan | None,
                    stored: Iterable[KernelPlan]) -> Settled:
    """After measuring: a quiet measurement runs and is stored. A loaded one is never stored over a
    quiet ``previous`` (the plan stored under the same key), and runs the last quiet plan this start
    can run where one exists (``previous`` first, then ``stored``: the model's other plans)."""
    if not plan_loaded(measured):
        return Settled(measured, True)
    quiet_previous = previous is not None and not plan_loaded(previous)
    candidates = [previous] if quiet_previous and previous is not None else list(stored)
    quiet = last_quiet(measured, candidates)
    if quiet is None:
        return Settled(measured, not quiet_previous)
    why = (f"measured at load average {measured.load_average:g} on {cpu_count(measured)} CPUs (loaded: its "
           "timings are skewed by other processes' threads)")
    chosen = fall_back(quiet, why)
    return Settled(chosen, not quiet_previous, f"kernel plan {why}; not stored over a quiet plan: running the last "
                                                f"quiet plan (load average {quiet.load_average:g}) instead")


def settle_stored(stored_plan: KernelPlan, load: float, others: Iterable[KernelPlan]) -> Settled:
    """Before measuring, on a start at ``load``: a loaded stored plan on a still loaded machine gives
    way to the last quiet plan of the model this start can run (``others``), where one exists."""
    cpus = cpu_count(stored_plan)
    if not is_loaded(load, cpus) or not plan_loaded(stored_plan):
        return Settled(stored_plan, False)
    quiet = last_quiet(stored_plan, others)
    if quiet is None:
        return Settled(stored_plan, False)
    why = (f"the stored plan was measured at load average {stored_plan.load_average:g} on {cpus} CPUs and the "
           f"load is {load:.2f} now (too loaded to measure again)")
    return Settled(fall_back(quiet, why), False, f"kernel plan: {why}: running the last quiet plan instead")


def defer_resume(stored_plan: KernelPlan, load: float) -> bool:
    """Whether a quiet partial plan waits for a quieter start to measure its remaining cells (this
    start is loaded: its timings would join a quiet plan's)."""
    return stored_plan.unmeasured > 0 and not plan_loaded(stored_plan) and is_loaded(load, cpu_count(stored_plan))


def measured_overloaded(plan: KernelPlan, load: float | None = None) -> bool:
    """True when ``plan`` was measured with more runnable threads than CPUs and the machine is
    quieter now (``load``: the 1-minute load average, read when None): parallel kernels then wait
    for descheduled threads (a 20 µs GEMV took 20 ms at load 8 on 2 cores), so such a plan is
    measured again once the load allows."""
    cpus = cpu_count(plan)
    load = current_load() if load is None else load
    return plan_loaded(plan) and not is_loaded(load, cpus)
