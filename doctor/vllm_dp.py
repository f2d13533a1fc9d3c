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


def dp_imbalance_finding(fleet: VllmFleet) -> Finding | None:
    """``dp_imbalance`` over a vLLM server's engines, or None (one engine, or balanced)."""
    dp = fleet.fold()
    size = dp.size
    if size < 2:
        return None
    runs = dp.imbalanced_runs(DP_IMBALANCE_BOUND, DP_MIN_MEAN_LOAD, SUSTAINED_ROUNDS)
    if not runs:
        return None

    def run_mean(values: list[float]) -> float:
        return sum(values) / len(values)

    def queued(s: LoadSample) -> tuple[int, ...]:  # waiting by engine, every engine
        return s.waiting + (0,) * (size - len(s.waiting))

    rounds, unit = fleet.rounds, fleet.unit
    longest = max(runs, key=len)
    held = sum(len(r) for r in runs)
    busiest = statistics.mode(s.busiest() for s in longest)
    worst = max(s.imbalance(size) for s in longest)
    # The round quoted: the busiest engine's longest queue of the run (the most imbalanced is often its drain).
    peak = max(longest, key=lambda s: (queued(s)[busiest], s.imbalance(size)))
    first, last, at_peak = rounds[longest[0].step], rounds[longest[-1].step], rounds[peak.step]
    loads, mean = peak.padded(size), peak.mean(size)
    waiting_at_peak = queued(peak)
    kv_at_peak = peak.kv_usage + (0.0,) * (size - len(peak.kv_usage))
    span_s = longest[-1].t - longest[0].t

    waiting = [run_mean([queued(s)[r] for s in longest]) for r in range(size)]
    running = [run_mean([s.padded(size)[r] - queued(s)[r] for s in longest]) for r in range(size)]
    name = engine_name(busiest)
    evidence = [
        f"{held} of {len(dp.samples)} {unit}s with {name} queueing while its waiting + running was over "
        f"{DP_IMBALANCE_BOUND:g}x the mean of {size} engines; the longest run {fleet.at(first)} to {fleet.at(last)}: "
        f"{len(longest)} {unit}s, {span_s:,.0f} s",
        f"at {fleet.at(at_peak)}, by engine: " + ", ".join(
            f"{r:03d}: {loads[r] - waiting_at_peak[r]} running + {waiting_at_peak[r]} waiting" for r in range(size))
        + f" (max/mean {peak.imbalance(size):.2f}); KV cache usage " + ", ".join(f"{u:.0%}" for u in kv_at_peak),
        f"over that run, on average: {name} {waiting[busiest]:,.1f} waiting and {running[busiest]:,.1f} running; "
        f"the mean engine {run_mean(waiting):,.1f} waiting and {run_mean(running):,.1f} running"]
    run_rounds = [rounds[s.step] for s in longest]
    tps = {r: [x.generation_tps[r] for x in run_rounds if r in x.generation_tps] for r in range(size)}
    if all(tps.values()):
        evidence.append("generation throughput over that run: " + ", ".join(
            f"{r:03d}: {run_mean(v):,.1f} tokens/s" for r, v in tps.items()))

    others_kv = [u for r, u in enumerate(kv_at_peak) if r != busiest]
    kv_bound = kv_at_peak[busiest] >= KV_FULL and run_mean(others_kv) < KV_LOW
    if kv_bound:
        cause = (f"{name}'s KV cache is {kv_at_peak[busiest]:.0%} full while the other engines average "
                 f"{run_mean(others_kv):.0%}: its requests hold more tokens (longer prompts or outputs) and vLLM's "
                 f"balancer weighs requests ({WAITING_WEIGHT} x waiting + running), not tokens, so it keeps being sent "
                 "a share it cannot admit (vllm#48808)")
    else:
        cause = (f"{name} was sent more than its share ({loads[busiest]} in flight against an even {mean:,.1f}). "
                 "vLLM's balancer "
                 f"sends each request to the engine with the lowest {WAITING_WEIGHT} x waiting + running, from counts "
                 f"its DP coordinator publishes about every {COORDINATOR_INTERVAL_MS} ms; a queue this uneven for this "
                 "long means those counts were stale or missing (vllm#48808: not published for DP without expert "
                 "parallelism, fixed by vllm#49204) or the requests were pinned to a rank (an X-data-parallel-rank "
                 "header, an external router)")
    # What one engine runs at once: its --max-num-seqs where printed, else the most any engine ran.
    capacity = max(fleet.max_num_seqs or 0,
                   max(max(s.padded(size)[r] - queued(s)[r] for r in range(size)) for s in dp.samples))
    total = sum(loads)
    fixes = [Fix(f"route to the least loaded engine (vLLM's DP balancer: {WAITING_WEIGHT} x waiting + running)",
                 None, None, f"an even spread holds {mean:,.1f} requests on each of the {size} engines at "
                 f"{fleet.at(at_peak)} instead of {loads[busiest]} on {name} ({waiting_at_peak[busiest]} of them waiting)",
                 numbers={"even_load": mean, "busiest_load": loads[busiest]})]
    if capacity and total > size * capacity:
        needed = math.ceil(total / capacity)
        fixes.append(Fix("--data-parallel-size", size, needed,
                         f"even spread, {size} engines would still queue: {total} requests in flight at "
                         f"{fleet.at(at_peak)} and one engine runs {capacity} at once; {needed} engines run them all",
                         numbers={"in_flight": total, "per_engine": capacity}))
    else:
        fixes.append(Fix("", None, None,
                         f"keep --data-parallel-size {size}: its engines held {total} requests at {fleet.at(at_peak)}, "
                         f"{total / size:,.1f} each, within the {capacity} one engine runs at once; the queue is the "
                         "routing's, not a lack of engines", numbers={"in_flight": total, "per_engine": capacity}))
    if fleet.api_server_count and fleet.api_server_count > 1:
        n = fleet.api_server_count
        fixes.append(Fix("--api-server-count", n, 1,
                         f"each of {n} front-ends routes on its own estimate between the coordinator's "
                         f"{COORDINATOR_INTERVAL_MS} ms updates (it counts every request it sends as {n} waiting); one "
                         "front-end routes on one view: if the imbalance goes, the estimates were the cause (raise it "
                         "again once the front-end, not the engines, is what binds)"))
    fixes.append(Fix("--data-parallel-external-lb", None, None,
                     f"or balance outside vLLM: each of the {size} ranks its own endpoint (--data-parallel-external-lb "
                     "--data-parallel-rank R, or --data-parallel-hybrid-lb per node) behind a router that reads each "
                     "engine's vllm:num_requests_waiting and vllm:num_requests_running"
                     + (" and routes long prompts by vllm:kv_cache_usage_perc" if kv_bound else "")
                     + " and sends each request to the least loaded"))
    return Finding("dp_imbalance", WARNING, f"data-parallel imbalance: {name} queues at up to "
                   f"{worst:.2f}x the mean load of {size} engines", evidence, cause, fixes,
                   numbers={"size": size, "busiest_engine": busiest, "imbalanced_rounds": held,
                            "longest_run_rounds": len(longest), "longest_run_s": span_s,
                            "peak_imbalance": worst, "loads_at_peak": list(loads),
                            "waiting_at_peak": list(waiting_at_peak), "kv_usage_at_peak": list(kv_at_peak),
                            "mean_waiting": waiting, "mean_running": running, "bound": DP_IMBALANCE_BOUND,
                            "source": fleet.source},
                   place=f"{'lines' if fleet.source == 'log' else 'scrapes'} {first.ordinal}–{last.ordinal}")
