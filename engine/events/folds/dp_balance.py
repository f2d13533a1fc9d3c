"""Data-parallel balance folded from events (issue 37): each rank's queue, KV use,
requests and tokens, and after every step of any rank the load of all of them.

A rank's **load** is what vLLM's DP load balancer weighs, its waiting plus running
requests after its latest step; the **imbalance** at an instant is the busiest rank's
load over the mean across the ``size`` ranks (1.0 is even; a rank that never stepped
counts 0, so every request on one of two ranks reads 2.0). An instant counts as
imbalanced only while the busiest rank has requests *waiting*: a rank finishing its last
requests while the others are done (every run's tail) costs nobody anything. Each
rank's load is also averaged over time (``mean_load``). Step and request events carry
``dp_rank`` (0 when absent), so a recording of every rank (``engine simulate
--data-parallel-size``) folds here in one pass; the doctor's ``dp_imbalance`` rule, the
simulator's summary and ``make bench`` read the same fold.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.events.record import Event
from engine.events.request_records import RequestArrived, RequestFinished
from engine.events.step_records import StepEvent

WAITING_WEIGHT = 4  # vLLM's DP load balancer: a rank's score is 4 x waiting + running, the lowest gets the request
DP_IMBALANCE_BOUND = 1.5  # busiest rank's load over the mean beyond which a run is imbalanced
DP_MIN_MEAN_LOAD = 1.0  # below one request per rank on average, max / mean is noise


@dataclass(slots=True)
class RankLoad:
    """One rank: what was routed to it, what it finished, and its queue after its latest step."""

    rank: int
    steps: int = 0
    requests: int = 0  # request.arrived on this rank: what the balancer routed to it
    prompt_tokens: int = 0
    finished: int = 0
    output_tokens: int = 0  # of its finished requests
    waiting: int = 0
    running: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    peak_load: int = 0
    peak_kv_usage: float = 0.0
    load_seconds: float = 0.0  # its load integrated over the run's time
    reported_kv_usage: float | None = None  # KV usage as a share, where a reading gives no block counts (vLLM)

    @property
    def load(self) -> int:
        return self.waiting + self.running

    @property
    def kv_usage(self) -> float:
        if self.reported_kv_usage is not None:
            return self.reported_kv_usage
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


@dataclass(frozen=True, slots=True)
class LoadSample:
    """Every rank's load and KV usage right after one rank's step (``rank``, ``step``)."""

    t: float
    rank: int
    step: int
    loads: tuple[int, ...]  # by rank, ranks 0 .. the highest seen so far
    waiting: tuple[int, ...]
    kv_usage: tuple[float, ...]

    def padded(self, size: int) -> tuple[int, ...]:
        return self.loads + (0,) * max(0, size - len(self.loads))

    def mean(self, size: int) -> float:
        return sum(self.loads) / max(size, len(self.loads), 1)

    def imbalance(self, size: int) -> float:
        """Busiest load over the mean (0.0 when nothing is in flight)."""
        mean = self.mean(size)
        return max(self.loads) / mean if mean > 0 else 0.0

    def busiest(self) -> int:
        return max(range(len(self.loads)), key=lambda r: (self.loads[r], -r))

    def queued_imbalance(self, size: int, bound: float, min_mean: float) -> bool:
        """Beyond ``bound`` with ``min_mean`` requests per rank in flight and the busiest rank queueing."""
        return (self.mean(size) >= min_mean and self.imbalance(size) > bound
                and self.waiting[self.busiest()] > 0)


@dataclass(slots=True)
class DataParallelLoad:
    """Subscribe it to a bus or call it with each event; ``size`` is ``--data-parallel-size``
    (ranks seen beyond it widen it)."""

    declared_size: int = 0
    ranks: dict[int, RankLoad] = field(default_factory=dict)
    samples: list[LoadSample] = field(default_factory=list)
    first_t: float | None = None
    last_t: float = 0.0

    def __call__(self, event: Event) -> None:
        if isinstance(event, StepEvent):
            self._step(event)
        elif isinstance(event, RequestArrived):
            rank = self.rank(event.dp_rank)
            rank.requests += 1
            rank.prompt_tokens += event.prompt_tokens
        elif isinstance(event, RequestFinished):
            rank = self.rank(event.dp_rank)
            rank.finished += 1
            rank.output_tokens += event.output_tokens

    def rank(self, index: int) -> RankLoad:
        load = self.ranks.get(index)
        if load is None:
            load = self.ranks[index] = RankLoad(index)
        return load

    @property
    def size(self) -> int:
        return max(self.declared_size, max(self.ranks, default=-1) + 1)

    @property
    def stepped_ranks(self) -> list[int]:
        return sorted(r for r, load in self.ranks.items() if load.steps)

    @property
    def span_s(self) -> float:
        return self.last_t - self.first_t if self.first_t is not None else 0.0

    def mean_load(self, rank: int) -> float:
        """Its waiting + running averaged over the run's time."""
        span = self.span_s
        return self.rank(rank).load_seconds / span if span > 0 else float(self.rank(rank).load)

    def _step(self, e: StepEvent) -> None:
        self._advance(e.t)
        rank = self._read(e.dp_rank, e.num_waiting, e.num_running)
        rank.kv_blocks_used = e.kv_blocks_used_forward or e.kv_blocks_used
        rank.kv_blocks_total = e.kv_blocks_total
        rank.peak_kv_usage = max(rank.peak_kv_usage, rank.kv_usage)
        self._sample(e.t, e.dp_rank, e.index)

    def observe(self, t: float, readings: dict[int, tuple[int, int, float]], index: int = 0) -> None:
        """Ranks' queues read outside kvscope's events, ``{rank: (waiting, running, KV usage
        as a share)}`` at ``t`` seconds: one round of a vLLM log's per-engine stats lines or
        one scrape of its ``/metrics`` (doctor/vllm_dp.py). One sample after the round, as
        after a step; a rank not in ``readings`` keeps its last reading (vLLM prints an idle
        engine's line at DEBUG). ``index`` numbers the round (a sample's ``step``)."""
        if not readings:
            return
        self._advance(t)
        for index_of_rank, (waiting, running, kv_usage) in sorted(readings.items()):
            rank = self._read(index_of_rank, waiting, running)
            rank.reported_kv_usage = kv_usage
            rank.peak_kv_usage = max(rank.peak_kv_usage, kv_usage)
        self._sample(t, min(readings), index)

    def _advance(self, t: float) -> None:
        if self.first_t is None:
            self.first_t = t
        elif t > self.last_t:  # the load each rank held since the last sample
            for load in self.ranks.values():
                load.load_seconds += load.load * (t - self.last_t)
        self.last_t = max(self.last_t, t)

    def _read(self, index: int, waiting: int, running: int) -> RankLoad:
        rank = self.rank(index)
        rank.steps += 1
        rank.waiting, rank.running = waiting, running
        rank.peak_load = max(rank.peak_load, rank.load)
        return rank

    def _sample(self, t: float, rank: int, step: int) -> None:
        top = max(self.ranks) + 1
        loads = tuple(self.ranks[r].load if r in self.ranks else 0 for r in range(top))
        waiting = tuple(self.ranks[r].waiting if r in self.ranks else 0 for r in range(top))
        usage = tuple(self.ranks[r].kv_usage if r in self.ranks else 0.0 for r in range(top))
        self.samples.append(LoadSample(t, rank, step, loads, waiting, usage))

    def imbalanced_runs(self, bound: float = DP_IMBALANCE_BOUND, min_mean: float = DP_MIN_MEAN_LOAD,
                        min_samples: int = 1) -> list[list[LoadSample]]:
        """Maximal runs of consecutive samples imbalanced beyond ``bound`` with at least
        ``min_mean`` requests per rank in flight and the busiest rank queueing,
        ``min_samples`` long or more."""
        size = self.size
        runs: list[list[LoadSample]] = []
        current: list[LoadSample] = []
        for sample in self.samples:
            if sample.queued_imbalance(size, bound, min_mean):
                current.append(sample)
                continue
            if len(current) >= min_samples:
                runs.append(current)
            current = []
        if len(current) >= min_samples:
            runs.append(current)
        return runs

    def queued_share(self, bound: float = DP_IMBALANCE_BOUND, min_mean: float = DP_MIN_MEAN_LOAD) -> float:
        """The share of samples imbalanced beyond ``bound`` with the busiest rank queueing."""
        size = self.size
        bad = sum(1 for s in self.samples if s.queued_imbalance(size, bound, min_mean))
        return bad / len(self.samples) if self.samples else 0.0

    def spread(self, values: Sequence[float]) -> float:
        """The largest of ``values`` (one per rank) over their mean: 1.0 is even."""
        mean = sum(values) / len(values) if values else 0.0
        return max(values) / mean if mean > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        """Per rank: requests, tokens, steps, mean and peak load, peak KV; the spreads (max / mean)
        of requests routed, output tokens and mean load, and the share of steps imbalanced."""
        ranks = [self.rank(r) for r in range(self.size)]
        return {"size": self.size,
                "requests_spread": self.spread([r.requests for r in ranks]),
                "output_tokens_spread": self.spread([r.output_tokens for r in ranks]),
                "load_spread": self.spread([self.mean_load(r.rank) for r in ranks]),
                "imbalanced_share": self.queued_share(),
                "ranks": [{"rank": r.rank, "requests": r.requests, "prompt_tokens": r.prompt_tokens,
                           "finished": r.finished, "output_tokens": r.output_tokens, "steps": r.steps,
                           "mean_load": self.mean_load(r.rank), "peak_load": r.peak_load,
                           "peak_kv_usage": r.peak_kv_usage} for r in ranks]}
