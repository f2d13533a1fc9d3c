"""``engine capacity``: the highest request rate a deployment serves a trace at within an SLO.

The trace's arrival pattern (engine/sim/traces.py) is replayed scaled in rate, its arrival times
divided by a factor, through :class:`~engine.sim.simulate.Simulation` (the real scheduler and KV
pool; D ranks through :class:`~engine.sim.data_parallel.DataParallelSimulation`), on the
deployment's cost: this machine's fitted step cost (engine/sim/step_fit.py) or a GPU preset's
roofline (engine/sim/capacity_setup.py builds both). Every run's events are folded into its
latencies (:class:`RunFold`), and the factor is searched (:func:`find_capacity`): doubled or
halved until the SLO breaks on one side and holds on the other, then bisected geometrically to
``tolerance``. It assumes a higher rate never serves the same trace faster, which holds for a
scheduler that admits in arrival order up to the lines a tail crosses.

What held the rate is read from the first rate that broke the SLO (:func:`binding_constraint`):
its violated objectives, how much of the slow requests' time they spent queued, and, for each
step that left requests waiting, why the head of the queue waited (the step event's
``waiting_reasons``).
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.errors import UserError
from engine.events import Event, EventBus, RequestFinished, RequestRejected, StepEvent
from engine.events.step_records import (
    WAIT_BLOCKS,
    WAIT_MAX_NUM_SEQS,
    WAIT_NEVER_FITS,
    WAIT_PREEMPTING,
    WAIT_TOKEN_BUDGET,
)
from engine.sim.data_parallel import DataParallelSimulation
from engine.sim.simulate import SimResult, SimSetup, Simulation
from engine.sim.workload import WorkloadRequest

METRICS = {"ttft": "TTFT", "itl": "ITL", "tpot": "TPOT", "e2e": "e2e"}
METRIC_ALIASES = {"e2el": "e2e", "latency": "e2e"}
UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6}
DEFAULT_TOLERANCE = 0.02
MAX_FACTOR = float(2**20)  # the search gives up past ~10^6 x or 10^-6 of the trace's rate

KV_BLOCKS = "kv-blocks"
COMPUTE = "compute"
MAX_NUM_SEQS = "max-num-seqs"
QUEUE = "queue"
NONE = "none"
# why the head of the queue waited -> the constraint it stands for
WAIT_TO_CONSTRAINT = {WAIT_BLOCKS: KV_BLOCKS, WAIT_NEVER_FITS: KV_BLOCKS, WAIT_PREEMPTING: KV_BLOCKS,
                      WAIT_MAX_NUM_SEQS: MAX_NUM_SEQS, WAIT_TOKEN_BUDGET: QUEUE}


# ------------------------------------------------------------------------ the SLO
@dataclass(frozen=True, slots=True)
class Objective:
    """One term of an SLO: ``metric``'s ``stat`` (``p99``, ``p50``, ``mean``) at most ``limit_s``."""

    metric: str
    stat: str
    limit_s: float

    @property
    def key(self) -> str:
        return f"{self.metric}_{self.stat}"

    def label(self) -> str:
        return f"{METRICS[self.metric]} {self.stat}"

    def measure(self, values: Sequence[float]) -> float:
        if not values:
            return 0.0
        if self.stat == "mean":
            return float(np.mean(values))
        return float(np.percentile(np.asarray(values, dtype=float), float(self.stat[1:])))


_TERM = re.compile(r"^(?P<metric>[a-z0-9]+)_(?P<stat>p\d+(?:\.\d+)?|mean|median)=(?P<value>[\d.]+)(?P<unit>s|ms|us|µs)$")


def parse_slo(text: str) -> tuple[Objective, ...]:
    """``"ttft_p99=2s,itl_p99=200ms"`` -> objectives (metrics ttft, itl, tpot, e2e; stats pNN,
    mean, median; units s, ms, us)."""
    out = []
    for term in (t.strip().lower() for t in text.split(",") if t.strip()):
        m = _TERM.match(term)
        metric = METRIC_ALIASES.get(m["metric"], m["metric"]) if m else ""
        if m is None or metric not in METRICS:
            raise UserError(f"--slo {text!r}: each term is METRIC_STAT=VALUE with a unit, METRIC one of "
                            f"{', '.join(METRICS)}, STAT p50..p99.9, mean or median: ttft_p99=2s,itl_p99=200ms")
        stat = "p50" if m["stat"] == "median" else m["stat"]
        if stat != "mean" and not 0 < float(stat[1:]) <= 100:
            raise UserError(f"--slo {term}: a percentile is in (0, 100]")
        limit = float(m["value"]) * UNITS[m["unit"]]
        if limit <= 0:
            raise UserError(f"--slo {term}: give a positive limit")
        out.append(Objective(metric, stat, limit))
    if not out:
        raise UserError("--slo: give at least one objective, e.g. ttft_p99=2s,itl_p99=200ms")
    return tuple(out)


def describe_slo(slo: Sequence[Objective]) -> str:
    return ", ".join(f"{o.label()} ≤ {seconds(o.limit_s)}" for o in slo)


def seconds(value: float) -> str:
    return f"{value:.3g} s" if value >= 1 else f"{value * 1e3:.3g} ms"


# ------------------------------------------------------------------ one run's fold
@dataclass(slots=True)
class RunFold:
    """A simulated run's latencies and waits, folded from its events."""

    ttft: dict[str, float] = field(default_factory=dict)
    queue: dict[str, float] = field(default_factory=dict)
    e2e: dict[str, float] = field(default_factory=dict)
    itl: list[float] = field(default_factory=list)
    itl_owner: list[str] = field(default_factory=list)  # the request of each gap in ``itl``
    tpot: list[float] = field(default_factory=list)
    rejected: int = 0
    preempted: set[str] = field(default_factory=set)
    steps: int = 0
    waiting_steps: int = 0
    head_waits: Counter[str] = field(default_factory=Counter)
    peak_blocks: int = 0
    num_blocks: int = 0
    peak_running: int = 0

    def __call__(self, event: Event) -> None:
        if isinstance(event, StepEvent):
            self._step(event)
        elif isinstance(event, RequestFinished):
            rid = event.request_id
            if event.ttft_s is not None:
                self.ttft[rid] = event.ttft_s
            self.queue[rid] = event.queue_time_s
            self.e2e[rid] = event.e2e_s
            self.itl.extend(event.inter_token_latencies_s)
            self.itl_owner.extend([rid] * len(event.inter_token_latencies_s))
            if event.output_tokens > 1 and event.ttft_s is not None:
                self.tpot.append((event.e2e_s - event.ttft_s) / (event.output_tokens - 1))
        elif isinstance(event, RequestRejected):
            self.rejected += 1

    def _step(self, e: StepEvent) -> None:
        self.steps += 1
        self.preempted.update(e.preempted)
        self.peak_blocks = max(self.peak_blocks, e.kv_blocks_used_forward or e.kv_blocks_used)
        self.num_blocks = max(self.num_blocks, e.kv_blocks_total)
        self.peak_running = max(self.peak_running, e.num_running)
        if e.num_waiting > 0:
            self.waiting_steps += 1
            head = next(iter(e.waiting_reasons.values()), None)
            self.head_waits[str(head[0]) if head else "unexplained"] += 1

    def values(self, metric: str) -> list[float]:
        if metric == "ttft":
            return list(self.ttft.values())
        if metric == "e2e":
            return list(self.e2e.values())
        return self.itl if metric == "itl" else self.tpot


@dataclass(slots=True)
class Point:
    """One simulated rate: the trace's arrivals divided by ``scale``."""

    scale: float
    rate: float
    values: dict[str, float]
    ok: bool
    fold: RunFold
    simulated_s: float


def scaled(requests: Sequence[WorkloadRequest], scale: float) -> list[WorkloadRequest]:
    return [dataclasses.replace(r, arrival_time=r.arrival_time / scale) for r in requests]


def run_point(setup: SimSetup, requests: Sequence[WorkloadRequest], scale: float, base_rate: float,
              slo: Sequence[Objective]) -> Point:
    """Simulate the trace at ``scale`` x its rate and judge the SLO (a rejected request breaks it)."""
    fold = RunFold()
    bus = EventBus()
    bus.subscribe(fold)
    workload = scaled(requests, scale)
    result: SimResult
    if setup.data_parallel_size > 1:
        result = DataParallelSimulation(setup, bus).run(workload, startup=False)
    else:
        result = Simulation(setup, bus).run(workload, startup=False)
    values = {o.key: o.measure(fold.values(o.metric)) for o in slo}
    ok = all(values[o.key] <= o.limit_s for o in slo) and not fold.rejected and result.completed
    return Point(scale, base_rate * scale, values, ok, fold, result.sim_seconds)


# ------------------------------------------------------------------------ the search
@dataclass(slots=True)
class Search:
    """Every point run, in order; ``best`` the highest rate that met the SLO, ``broke`` the lowest
    above it that did not (None: the SLO held up to the search's end / broke down to its end)."""

    points: list[Point]
    best: Point | None
    broke: Point | None
    wall_s: float

    @property
    def runs(self) -> int:
        return len(self.points)

    @property
    def max_rate(self) -> float:
        return self.best.rate if self.best is not None else 0.0


def find_capacity(run: Callable[[float], Point], start: float = 1.0, tolerance: float = DEFAULT_TOLERANCE,
                  max_factor: float = MAX_FACTOR) -> Search:
    """Bracket then bisect the scale factor (see the module doc)."""
    if tolerance <= 0:
        raise UserError(f"--tolerance {tolerance}: give a positive fraction, e.g. 0.02")
    began = time.perf_counter()
    points = [run(start)]
    lo = points[0] if points[0].ok else None
    hi = None if points[0].ok else points[0]
    factor = start
    while (hi is None and factor < start * max_factor) or (lo is None and factor > start / max_factor):
        factor = factor * 2 if hi is None else factor / 2
        p = run(factor)
        points.append(p)
        if p.ok:
            lo = p
        else:
            hi = p
        if lo is not None and hi is not None:
            break
    while lo is not None and hi is not None and hi.scale / lo.scale > 1 + tolerance:
        p = run(math.sqrt(lo.scale * hi.scale))
        points.append(p)
        if p.ok:
            lo = p
        else:
            hi = p
    return Search(points, lo, hi, time.perf_counter() - began)


def search_capacity(setup: SimSetup, requests: Sequence[WorkloadRequest], base_rate: float,
                    slo: Sequence[Objective], *, start: float = 1.0,
                    tolerance: float = DEFAULT_TOLERANCE) -> Search:
    """:func:`find_capacity` over simulations of ``requests`` (arriving at ``base_rate`` per second)."""
    if base_rate <= 0:
        raise UserError("the trace's requests all arrive at once: there is no rate to scale; give a trace whose "
                        "arrivals are spread in time")
    return find_capacity(lambda s: run_point(setup, requests, s, base_rate, slo), start, tolerance)


# ------------------------------------------------------------ the binding constraint
@dataclass(frozen=True, slots=True)
class Binding:
    """What held the rate: ``name`` one of kv-blocks, compute, max-num-seqs, queue (none: the SLO
    never broke), ``detail`` the evidence in one line."""

    name: str
    detail: str
    violated: tuple[str, ...] = ()
    queued_share: float = 0.0
    head_waits: dict[str, int] = field(default_factory=dict)


def _tail(times: dict[str, float], limit: float) -> list[str]:
    """The requests over ``limit``, or the slowest tenth when none is."""
    over = [rid for rid, t in times.items() if t > limit]
    if over:
        return over
    ranked = sorted(times, key=times.__getitem__, reverse=True)
    return ranked[: max(1, len(ranked) // 10)]


def _waits_constraint(fold: RunFold) -> str:
    counts: Counter[str] = Counter()
    for reason, n in fold.head_waits.items():
        counts[WAIT_TO_CONSTRAINT.get(reason, QUEUE)] += n
    return counts.most_common(1)[0][0] if counts else QUEUE


def _gaps_of_preempted(fold: RunFold, slo: Sequence[Objective], point: Point) -> float:
    """The share of the gaps over a broken ITL limit that preempted requests saw (0: ITL held)."""
    broken = [o for o in slo if o.metric == "itl" and point.values[o.key] > o.limit_s]
    if not broken:
        return 0.0
    limit = broken[0].limit_s
    owners = [rid for rid, gap in zip(fold.itl_owner, fold.itl, strict=True) if gap > limit]
    return sum(rid in fold.preempted for rid in owners) / len(owners) if owners else 0.0


def binding_constraint(search: Search, slo: Sequence[Objective]) -> Binding:
    point = search.broke
    if point is None:
        return Binding(NONE, f"the SLO held up to {MAX_FACTOR:.3g}x the trace's rate: nothing bound")
    fold = point.fold
    violated = tuple(o.label() for o in slo if point.values[o.key] > o.limit_s)
    waits = dict(fold.head_waits.most_common())
    latency = [o for o in slo if o.metric in ("ttft", "e2e") and point.values[o.key] > o.limit_s]
    share = 0.0
    if latency:
        times = fold.ttft if latency[0].metric == "ttft" else fold.e2e
        tail = _tail(times, latency[0].limit_s)
        total = sum(times[r] for r in tail)
        share = sum(fold.queue.get(r, 0.0) for r in tail) / total if total > 0 else 0.0
    if latency and share >= 0.5 and fold.waiting_steps:
        name = _waits_constraint(fold)
    elif _gaps_of_preempted(fold, slo, point) >= 0.5:
        name = KV_BLOCKS  # the long gaps are preempted requests recomputing: the pool is short
    else:
        name = COMPUTE
    detail = (f"at {point.rate:.3g} req/s {', '.join(violated) or 'the run'} broke; "
              + (f"the slowest requests spent {share * 100:.0f} % of their time queued; " if latency else "")
              + f"{fold.waiting_steps:,} of {fold.steps:,} steps left requests waiting"
              + (f" (the head on: {', '.join(f'{k} {v:,}' for k, v in waits.items())})" if waits else "")
              + f"; peak {fold.peak_blocks:,} of {fold.num_blocks:,} KV blocks, {fold.peak_running} running, "
              f"{len(fold.preempted):,} requests preempted")
    return Binding(name, detail, violated, share, waits)


SETTLE_E2E = 10  # a trace shorter than this many requests' lifetimes at the rate found has no steady queue


def short_trace_note(search: Search, requests: Sequence[WorkloadRequest]) -> str | None:
    """A warning when the trace, at the rate found, lasts too few request lifetimes for its queue to
    settle: a burst that ends before the queue builds flatters the rate."""
    best = search.best
    if best is None or not best.fold.e2e or len(requests) < 2:
        return None
    span = (requests[-1].arrival_time - requests[0].arrival_time) / best.scale
    e2e = float(np.median(list(best.fold.e2e.values())))
    if span >= SETTLE_E2E * e2e:
        return None
    return (f"at that rate the trace's arrivals last {span:.3g} s, {span / e2e:.1f}x a request's median e2e "
            f"({e2e:.3g} s): too short for the queue to settle, so the rate may flatter a sustained load; "
            "--repeat N plays the trace N times back to back")


def points_table(search: Search, slo: Sequence[Objective]) -> list[dict[str, Any]]:
    """One row per simulated rate, in rate order (the plot's and --json's data)."""
    rows = []
    for p in sorted(search.points, key=lambda p: p.rate):
        rows.append({"rate": p.rate, "scale": p.scale, "ok": p.ok, **{o.key + "_s": p.values[o.key] for o in slo},
                     "preempted": len(p.fold.preempted), "waiting_steps": p.fold.waiting_steps,
                     "steps": p.fold.steps, "peak_blocks": p.fold.peak_blocks})
    return rows
