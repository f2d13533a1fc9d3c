"""A real vLLM's data-parallel balance: the doctor's ``dp_imbalance`` judgement on what a
vLLM server shows of its engines (issue 37; vllm#36748, #40279, #48808).

vLLM has no kvscope events, but each engine core (DP rank) reports its queue: the
periodic stats line ``Engine 001: ... Running: 31 reqs, Waiting: 108 reqs, GPU KV cache
usage: 98.6%, ...`` (doctor/vllm_log.py reads them) and the ``engine``-labelled gauges of
``/metrics`` (doctor/inputs.py samples them). Either becomes a list of
:class:`EngineRound`, one per stats round or scrape, and each round is one
``DataParallelLoad.observe`` of engine/events/folds/dp_balance.py: the same fold, bound
(``DP_IMBALANCE_BOUND`` x the mean waiting + running while the busiest engine queues,
at least ``DP_MIN_MEAN_LOAD`` per engine) and runs as the events rule, held for
``SUSTAINED_ROUNDS`` rounds in a row (30 s of vLLM's 10 s log interval). The wording is
vLLM's: its engines by their printed index, the clock it printed, and its own levers
(the balancer, ``--api-server-count``, external load balancing, ``--data-parallel-size``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from doctor.rules.finding import WARNING, Finding
from doctor.rules.kv_pool import KV_FULL, KV_LOW
from engine.budget.fixes import Fix
from engine.events.folds.dp_balance import (
    DP_IMBALANCE_BOUND,
    DP_MIN_MEAN_LOAD,
    WAITING_WEIGHT,
    DataParallelLoad,
    LoadSample,
)

SUSTAINED_ROUNDS = 3  # rounds in a row: 20-30 s of vLLM's stats lines, a burst between two lines is not a run
LOG_INTERVAL_S = 10.0  # VLLM_LOG_STATS_INTERVAL's default: the clock of a log whose lines carry no time
COORDINATOR_INTERVAL_MS = 100  # vLLM's DP coordinator publishes the engines' queue counts this often


@dataclass(slots=True)
class EngineRound:
    """Every engine's reading at one instant: one round of stats lines, or one scrape.
    ``readings`` are ``{engine: (waiting, running, KV usage share)}``; ``ordinal`` is its
    place in the source (the round's first line, the scrape's number) and ``clock`` the
    time vLLM printed, if any."""

    t: float
    readings: dict[int, tuple[int, int, float]]
    ordinal: int
    clock: str | None = None
    generation_tps: dict[int, float] = field(default_factory=dict)  # what the engine generated, tokens/s
    tokens: dict[int, float] = field(default_factory=dict)  # prompt + generation tokens counted so far (/metrics)


@dataclass(slots=True)
class VllmFleet:
    """A vLLM server's engines as read from ``source`` ("log" or "metrics"); ``size`` is
    its --data-parallel-size where printed (0: the engines seen)."""

    source: str
    rounds: list[EngineRound]
    size: int = 0
    api_server_count: int | None = None
    max_num_seqs: int | None = None  # what one engine runs at once, where printed

    @property
    def unit(self) -> str:
        return "stats round" if self.source == "log" else "scrape"

    def where(self, round_: EngineRound) -> str:
        return f"{'line' if self.source == 'log' else 'scrape'} {round_.ordinal}"

    def at(self, round_: EngineRound) -> str:
        return f"{round_.clock} ({self.where(round_)})" if round_.clock else self.where(round_)

    def fold(self) -> DataParallelLoad:
        dp = DataParallelLoad(declared_size=self.size)
        for index, round_ in enumerate(self.rounds):
            dp.observe(round_.t, round_.readings, index)
        return dp


def engine_name(index: int) -> str:
    """As vLLM prints it: ``Engine 001``."""
    return f"Engine {index:03d}"


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def _queued(sample: LoadSample, size: int) -> tuple[int, ...]:
    """Waiting by engine, every engine (the sample lists only those that reported)."""
    return sample.waiting + (0,) * (size - len(sample.waiting))


@dataclass(slots=True)
class ImbalancedRun:
    """A fleet's longest imbalanced run, read once for the evidence, cause and fixes: the
    busiest engine, the round quoted (its longest queue) and each engine's averages."""

    fleet: VllmFleet
    dp: DataParallelLoad
    size: int
    held: int  # rounds imbalanced, over every run
    longest: list[LoadSample]
    busiest: int
    worst: float  # the highest max/mean of the longest run
    peak: LoadSample
    kv_at_peak: tuple[float, ...]
    waiting: list[float]  # mean waiting by engine over the longest run
    running: list[float]

    @property
    def name(self) -> str:
        return engine_name(self.busiest)

    @property
    def first(self) -> EngineRound:
        return self.fleet.rounds[self.longest[0].step]

    @property
    def last(self) -> EngineRound:
        return self.fleet.rounds[self.longest[-1].step]

    @property
    def at_peak(self) -> str:
        return self.fleet.at(self.fleet.rounds[self.peak.step])

    @property
    def loads(self) -> tuple[int, ...]:
        return self.peak.padded(self.size)

    @property
    def waiting_at_peak(self) -> tuple[int, ...]:
        return _queued(self.peak, self.size)

    @property
    def span_s(self) -> float:
        return self.longest[-1].t - self.longest[0].t

    @property
    def others_kv(self) -> float:
        """The other engines' mean KV cache usage at the peak."""
        return _mean([u for r, u in enumerate(self.kv_at_peak) if r != self.busiest])

    @property
    def kv_bound(self) -> bool:
        """The busiest engine's KV cache is full while the others have room: it is sent tokens it cannot admit."""
        return self.kv_at_peak[self.busiest] >= KV_FULL and self.others_kv < KV_LOW


def imbalanced_run(fleet: VllmFleet) -> ImbalancedRun | None:
    """The fleet's longest run beyond the bound, or None (one engine, or balanced)."""
    dp = fleet.fold()
    size = dp.size
    if size < 2:
        return None
    runs = dp.imbalanced_runs(DP_IMBALANCE_BOUND, DP_MIN_MEAN_LOAD, SUSTAINED_ROUNDS)
    if not runs:
        return None
    longest = max(runs, key=len)
    busiest = statistics.mode(s.busiest() for s in longest)
    # The round quoted: the busiest engine's longest queue of the run (the most imbalanced is often its drain).
    peak = max(longest, key=lambda s: (_queued(s, size)[busiest], s.imbalance(size)))
    return ImbalancedRun(
        fleet, dp, size, sum(len(r) for r in runs), longest, busiest, max(s.imbalance(size) for s in longest), peak,
        peak.kv_usage + (0.0,) * (size - len(peak.kv_usage)),
        [_mean([_queued(s, size)[r] for s in longest]) for r in range(size)],
        [_mean([s.padded(size)[r] - _queued(s, size)[r] for s in longest]) for r in range(size)])


def _evidence(run: ImbalancedRun) -> list[str]:
    fleet, size, unit, longest = run.fleet, run.size, run.fleet.unit, run.longest
    loads, waiting_at_peak, name = run.loads, run.waiting_at_peak, run.name
    evidence = [
        f"{run.held} of {len(run.dp.samples)} {unit}s with {name} queueing while its waiting + running was over "
        f"{DP_IMBALANCE_BOUND:g}x the mean of {size} engines; the longest run {fleet.at(run.first)} to "
        f"{fleet.at(run.last)}: {len(longest)} {unit}s, {run.span_s:,.0f} s",
        f"at {run.at_peak}, by engine: " + ", ".join(
            f"{r:03d}: {loads[r] - waiting_at_peak[r]} running + {waiting_at_peak[r]} waiting" for r in range(size))
        + f" (max/mean {run.peak.imbalance(size):.2f}); KV cache usage " + ", ".join(f"{u:.0%}" for u in run.kv_at_peak),
        f"over that run, on average: {name} {run.waiting[run.busiest]:,.1f} waiting and "
        f"{run.running[run.busiest]:,.1f} running; the mean engine {_mean(run.waiting):,.1f} waiting and "
        f"{_mean(run.running):,.1f} running"]
    run_rounds = [fleet.rounds[s.step] for s in longest]
    tps = {r: [x.generation_tps[r] for x in run_rounds if r in x.generation_tps] for r in range(size)}
    if all(tps.values()):
        evidence.append("generation throughput over that run: " + ", ".join(
            f"{r:03d}: {_mean(v):,.1f} tokens/s" for r, v in tps.items()))
    return evidence


def _cause(run: ImbalancedRun) -> str:
    name = run.name
    if run.kv_bound:
        return (f"{name}'s KV cache is {run.kv_at_peak[run.busiest]:.0%} full while the other engines average "
                f"{run.others_kv:.0%}: its requests hold more tokens (longer prompts or outputs) and vLLM's "
                f"balancer weighs requests ({WAITING_WEIGHT} x waiting + running), not tokens, so it keeps being sent "
                "a share it cannot admit (vllm#48808)")
    return (f"{name} was sent more than its share ({run.loads[run.busiest]} in flight against an even "
            f"{run.peak.mean(run.size):,.1f}). vLLM's balancer "
            f"sends each request to the engine with the lowest {WAITING_WEIGHT} x waiting + running, from counts "
            f"its DP coordinator publishes about every {COORDINATOR_INTERVAL_MS} ms; a queue this uneven for this "
            "long means those counts were stale or missing (vllm#48808: not published for DP without expert "
            "parallelism, fixed by vllm#49204) or the requests were pinned to a rank (an X-data-parallel-rank "
            "header, an external router)")


def _engine_count_fix(run: ImbalancedRun) -> Fix:
    """More engines where an even spread would still queue, else keep the count: the routing is the cause."""
    size, at_peak = run.size, run.at_peak
    # What one engine runs at once: its --max-num-seqs where printed, else the most any engine ran.
    capacity = max(run.fleet.max_num_seqs or 0,
                   max(max(s.padded(size)[r] - _queued(s, size)[r] for r in range(size)) for s in run.dp.samples))
    total = sum(run.loads)
    if capacity and total > size * capacity:
        needed = math.ceil(total / capacity)
        return Fix("--data-parallel-size", size, needed,
                   f"even spread, {size} engines would still queue: {total} requests in flight at "
                   f"{at_peak} and one engine runs {capacity} at once; {needed} engines run them all",
                   numbers={"in_flight": total, "per_engine": capacity})
    return Fix("", None, None,
               f"keep --data-parallel-size {size}: its engines held {total} requests at {at_peak}, "
               f"{total / size:,.1f} each, within the {capacity} one engine runs at once; the queue is the "
               "routing's, not a lack of engines", numbers={"in_flight": total, "per_engine": capacity})


def _fixes(run: ImbalancedRun) -> list[Fix]:
    size, loads, name, mean = run.size, run.loads, run.name, run.peak.mean(run.size)
    fixes = [Fix(f"route to the least loaded engine (vLLM's DP balancer: {WAITING_WEIGHT} x waiting + running)",
                 None, None, f"an even spread holds {mean:,.1f} requests on each of the {size} engines at "
                 f"{run.at_peak} instead of {loads[run.busiest]} on {name} ({run.waiting_at_peak[run.busiest]} of "
                 "them waiting)", numbers={"even_load": mean, "busiest_load": loads[run.busiest]}),
             _engine_count_fix(run)]
    n = run.fleet.api_server_count
    if n and n > 1:
        fixes.append(Fix("--api-server-count", n, 1,
                         f"each of {n} front-ends routes on its own estimate between the coordinator's "
                         f"{COORDINATOR_INTERVAL_MS} ms updates (it counts every request it sends as {n} waiting); one "
                         "front-end routes on one view: if the imbalance goes, the estimates were the cause (raise it "
                         "again once the front-end, not the engines, is what binds)"))
    fixes.append(Fix("--data-parallel-external-lb", None, None,
                     f"or balance outside vLLM: each of the {size} ranks its own endpoint (--data-parallel-external-lb "
                     "--data-parallel-rank R, or --data-parallel-hybrid-lb per node) behind a router that reads each "
                     "engine's vllm:num_requests_waiting and vllm:num_requests_running"
                     + (" and routes long prompts by vllm:kv_cache_usage_perc" if run.kv_bound else "")
                     + " and sends each request to the least loaded"))
    return fixes


def dp_imbalance_finding(fleet: VllmFleet) -> Finding | None:
    """``dp_imbalance`` over a vLLM server's engines, or None (one engine, or balanced)."""
    run = imbalanced_run(fleet)
    if run is None:
        return None
    return Finding("dp_imbalance", WARNING, f"data-parallel imbalance: {run.name} queues at up to "
                   f"{run.worst:.2f}x the mean load of {run.size} engines", _evidence(run), _cause(run), _fixes(run),
                   numbers={"size": run.size, "busiest_engine": run.busiest, "imbalanced_rounds": run.held,
                            "longest_run_rounds": len(run.longest), "longest_run_s": run.span_s,
                            "peak_imbalance": run.worst, "loads_at_peak": list(run.loads),
                            "waiting_at_peak": list(run.waiting_at_peak), "kv_usage_at_peak": list(run.kv_at_peak),
                            "mean_waiting": run.waiting, "mean_running": run.running, "bound": DP_IMBALANCE_BOUND,
                            "source": fleet.source},
                   place=f"{'lines' if fleet.source == 'log' else 'scrapes'} {run.first.ordinal}–{run.last.ordinal}")
