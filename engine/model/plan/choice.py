"""One cell's choice: each candidate's error against the fp32 reference, its time (the median of
interleaved rounds), and the fastest within the accuracy bound unless the incumbent holds within
the margin (engine/model/plan/stability.py)."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from engine.model.plan import stability
from engine.model.plan.kernel_plan import ACCURACY_BOUND, Cell

if TYPE_CHECKING:
    import torch

TIMED_REPS = 3  # interleaved rounds at least after one untimed call (which gives the output checked); the median counts
MAX_ROUNDS = 5  # rounds while a cell is within CELL_BUDGET_S (cheap cells: a steadier median)
CELL_BUDGET_S = 0.02  # past this, a cell adds no rounds beyond TIMED_REPS


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:

    ref = reference.float()
    return float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def choose(cell: Cell, bound: float = ACCURACY_BOUND, incumbent: str = "",
           margin: float = stability.MARGIN) -> Cell:
    """Fill ``chosen``/``why``/``rejected`` from ``us`` and ``error``: the fastest candidate whose
    error is within ``bound`` (a candidate failing the bound is rejected whatever its speed), unless
    ``incumbent`` (the previous plan's or the fallback's choice) passed and the fastest is not
    ``margin`` faster: then the incumbent stays (engine/model/plan/stability.py)."""
    for name, err in cell.error.items():
        if not math.isfinite(err) or err > bound:
            cell.rejected[name] = f"error {err:.2e} > {bound:g}"
    passing = {n: us for n, us in cell.us.items() if n not in cell.rejected}
    if not passing:
        cell.chosen, cell.why = "torch", "no candidate passed: torch's float GEMM"
        return cell
    best = min(passing, key=passing.__getitem__)
    if stability.keep_incumbent(cell, passing, best, incumbent, margin):
        return cell
    others = sorted((us, n) for n, us in passing.items() if n != best)
    cell.chosen = best
    cell.why = (f"fastest within the bound ({passing[best]:,.1f} µs; next {others[0][1]} {others[0][0]:,.1f} µs)"
                if others else "the only candidate within the bound")
    if incumbent in passing and incumbent != best:
        cell.why += f"; over the {margin:.0%} margin against the incumbent {incumbent}"
    return cell


def timed_round_robin(calls: Mapping[str, Callable[[], Any]], reps: int = TIMED_REPS,
                      clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """µs of each call: the median of its interleaved rounds, each round calling every candidate
    once (so a burst of load from other processes slows one round of all rather than one
    candidate): ``reps`` rounds, up to ``MAX_ROUNDS`` while the cell is within ``CELL_BUDGET_S``.
    The median, not the fastest: :func:`choose`'s margin compares typical times, and one lucky
    round decided plans that flipped between quiet starts (engine/model/plan/stability.py)."""
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

