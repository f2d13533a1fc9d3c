"""Load across data-parallel ranks and pipeline stages over the last seconds, and whether
the ranks are balanced.

Two sources give the same readings and share the arithmetic and the verdict here:

* kvscope's events, folded by :class:`ParallelLoad` (held by the EngineView): each DP
  rank's ``step`` events (``dp_rank``; 0 when absent) give its waiting and running
  counts, its KV blocks used and the tokens it generated (decode tokens, plus one per
  ``request.first_token`` of that rank since its previous step); DP rank 0's steps give
  each pipeline stage's ``pipeline_bubble_s`` and ``pipeline_bytes``.
* a vLLM server's ``/metrics`` (``monitor vllm URL``), whose every series carries
  ``engine`` = the DP rank: monitor/replica.py hands each engine's scrapes to
  :func:`rank_load` as the same readings.

A gauge's window figure is its time-weighted mean over the last ``WINDOW_S`` seconds of
the source's clock (each reading holds until the next, the last one until now), so an
idle rank that stopped stepping keeps its last counts rather than an old average; a
counter's is its growth over the window per second. The imbalance verdict
(:func:`imbalance_verdict`) takes, for the queue (waiting), the running batch and the KV
usage, the busiest rank's window mean over the ranks' mean (``max / mean``: 1.0 even, D
when one rank of D holds everything) and names the worst above ``IMBALANCE_BOUND``; a
figure whose busiest rank stays under its floor (``FLOORS``: one request, 10 % KV) is too
small to judge. A stage's utilisation is ``1 - bubble / forward`` over the window's steps
(the bubble: seconds it sat in ``recv`` for the stage before it, engine/pipeline.py); the
busiest stage is the one the others wait on.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.events.schema import Event, RequestFirstToken, StepEvent

WINDOW_S = 10.0
IMBALANCE_BOUND = 1.5  # max / mean above this is an imbalance (two ranks: one holds 3x the other's)
STAGE_SPREAD = 0.10  # stages whose utilisations differ by less than this are called even
# (figure, its words, the busiest rank's window mean below which it is not judged)
FIGURES = (("waiting", "queue", 1.0), ("running", "running batch", 1.0), ("kv_pct", "KV usage", 10.0))
MAX_READINGS = 2048  # per rank and for the stages: a faster stepper's window is its last readings

# One rank's reading: (t, waiting, running, KV usage %, generated tokens so far).
RankReading = tuple[float, float, float, float, float]
# One step's stage figures: (t, forward seconds, bubble seconds per stage, bytes sent so far per stage).
StageReading = tuple[float, float, tuple[float, ...], tuple[float, ...]]


def window_mean(samples: Sequence[tuple[float, float]], now: float, window_s: float = WINDOW_S) -> float | None:
    """Time-weighted mean of a gauge over ``[now - window_s, now]``: each reading holds
    until the next, the last until ``now``; from the first reading on when it came
    inside the window. None without readings."""
    if not samples:
        return None
    start = now - window_s
    total = span = 0.0
    for i, (t, value) in enumerate(samples):
        lo = max(t, start)
        hi = min(samples[i + 1][0] if i + 1 < len(samples) else now, now)
        if hi > lo:
            total += value * (hi - lo)
            span += hi - lo
    return total / span if span > 0 else samples[-1][1]


def window_rate(samples: Sequence[tuple[float, float]], now: float, window_s: float = WINDOW_S) -> float | None:
    """Per-second growth of a cumulative counter over ``[now - window_s, now]``: from the
    last reading at or before the window's start (else the first) to the last reading,
    over the time from there to ``now``. None when no time has passed; a counter that went
    back (a restarted server) counts from zero."""
    if not samples:
        return None
    start = now - window_s
    base_t, base = samples[0]
    for t, value in samples:
        if t > start:
            break
        base_t, base = t, value
    span = now - max(base_t, start)
    if span <= 0:
        return None
    last = samples[-1][1]
    return (last - base if last >= base else last) / span


@dataclass(frozen=True, slots=True)
class RankLoad:
    """One DP rank: its latest counts and their window means, and its generation rate."""

    rank: str
    waiting: float
    running: float
    kv_pct: float
    mean_waiting: float
    mean_running: float
    mean_kv_pct: float
    gen_tps: float | None  # None until two readings span some time

    def mean(self, figure: str) -> float:
        return float(getattr(self, f"mean_{figure}"))


def rank_load(rank: str, readings: Sequence[RankReading], now: float, window_s: float = WINDOW_S) -> RankLoad | None:
    """A rank's load from its readings (oldest first), None without any."""
    if not readings:
        return None
    _, waiting, running, kv_pct, _ = readings[-1]

    def mean(column: int) -> float:
        return window_mean([(r[0], r[column]) for r in readings], now, window_s) or 0.0

    return RankLoad(rank, waiting, running, kv_pct, mean(1), mean(2), mean(3),
                    gen_tps=window_rate([(r[0], r[4]) for r in readings], now, window_s))


@dataclass(frozen=True, slots=True)
class Imbalance:
    """The verdict: ``figure`` is None when balanced (or not judged); else the rank
    holding ``ratio`` times the ranks' mean of ``figure``."""

    text: str
    figure: str | None = None
    rank: str | None = None
    ratio: float = 1.0


def imbalance_verdict(loads: Sequence[RankLoad], window_s: float = WINDOW_S,
                      bound: float = IMBALANCE_BOUND) -> Imbalance:
    """The worst ``max / mean`` over the ranks among the queue, the running batch and the
    KV usage (window means), named when above ``bound`` (module docstring)."""
    if len(loads) < 2:
        return Imbalance("one rank: nothing to balance")
    worst: tuple[float, str, str, float, float] | None = None  # ratio, figure, rank, its mean, the ranks' mean
    judged = []
    for figure, words, floor in FIGURES:
        means = [load.mean(figure) for load in loads]
        top = max(means)
        if top < floor:
            continue
        judged.append(words)
        mean = statistics.fmean(means)
        ratio = top / mean
        if worst is None or ratio > worst[0]:
            worst = (ratio, figure, loads[means.index(top)].rank, top, mean)
    window = f"last {window_s:g} s"
    if worst is None:
        return Imbalance(f"too little load to judge: under 1 request waiting or running and 10% KV on every "
                         f"rank ({window})")
    ratio, figure, rank, top, mean = worst
    words = dict((f, w) for f, w, _ in FIGURES)[figure]
    if ratio > bound:
        unit = "%" if figure == "kv_pct" else ""
        return Imbalance(f"rank {rank} holds {ratio:.1f}x the mean {words} ({top:.1f}{unit} vs mean {mean:.1f}{unit}, "
                         f"{window}; bound {bound:g}x)", figure, rank, ratio)
    return Imbalance(f"balanced: every rank within {bound:g}x the mean {', '.join(judged)} "
                     f"(worst {ratio:.2f}x, {window})", ratio=ratio)


@dataclass(frozen=True, slots=True)
class StageLoad:
    """One pipeline stage over the window's steps."""

    stage: int
    utilisation: float  # 1 - bubble / forward, in [0, 1]
    bubble_s: float  # per step, the mean over the window's steps
    bytes_per_s: float | None


def stage_loads(readings: Sequence[StageReading], now: float, window_s: float = WINDOW_S) -> list[StageLoad]:
    """Each stage's utilisation over the steps inside the window (the last step alone when
    none is: an idle pipeline shows how its last step went) and its bytes sent per second."""
    if not readings:
        return []
    inside = [r for r in readings if r[0] > now - window_s] or [readings[-1]]
    forward = sum(r[1] for r in inside)
    num_stages = len(readings[-1][2])
    out = []
    for stage in range(num_stages):
        bubble = sum(r[2][stage] for r in inside if stage < len(r[2]))
        busy = 1.0 - bubble / forward if forward > 0 else 0.0
        sent = [(r[0], r[3][stage]) for r in readings if stage < len(r[3])]
        out.append(StageLoad(stage, min(1.0, max(0.0, busy)), bubble / len(inside), window_rate(sent, now, window_s)))
    return out


def stage_verdict(stages: Sequence[StageLoad], spread: float = STAGE_SPREAD) -> str:
    """Which stage the others wait on (the busiest), or that they are even."""
    if len(stages) < 2:
        return ""
    busiest = max(stages, key=lambda s: s.utilisation)
    idlest = min(stages, key=lambda s: s.utilisation)
    if busiest.utilisation - idlest.utilisation < spread:
        return f"stages even: utilisations within {100 * spread:.0f} points"
    return (f"stage {busiest.stage} is the bottleneck ({100 * busiest.utilisation:.0f}% busy); stage "
            f"{idlest.stage} waits {100 * (1 - idlest.utilisation):.0f}% of its forward time")


class ParallelLoad:
    """The fold of step and first-token events into per-rank and per-stage readings."""

    def __init__(self, window_s: float = WINDOW_S, max_readings: int = MAX_READINGS) -> None:
        self.window_s = window_s
        self.max_readings = max_readings
        self.now = 0.0
        self.ranks: dict[int, deque[RankReading]] = {}
        self.stages: deque[StageReading] = deque(maxlen=max_readings)
        self._generated: dict[int, float] = {}  # per rank: tokens generated so far
        self._first_tokens: dict[int, int] = {}  # per rank: first tokens since its last step

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    @property
    def num_stages(self) -> int:
        return len(self.stages[-1][2]) if self.stages else 0

    @property
    def parallel(self) -> bool:
        """More than one DP rank or pipeline stage seen: what the monitor's panel waits for."""
        return self.num_ranks > 1 or self.num_stages > 1

    def apply(self, event: Event) -> None:
        self.now = max(self.now, event.t)
        if isinstance(event, RequestFirstToken):
            self._first_tokens[event.dp_rank] = self._first_tokens.get(event.dp_rank, 0) + 1
        elif isinstance(event, StepEvent):
            rank = event.dp_rank
            generated = self._generated.get(rank, 0.0) + event.num_decode_tokens + self._first_tokens.pop(rank, 0)
            self._generated[rank] = generated
            kv_pct = 100.0 * event.kv_blocks_used / event.kv_blocks_total if event.kv_blocks_total else 0.0
            self._add(rank, (event.t, float(event.num_waiting), float(event.num_running), kv_pct, generated))
            if event.pipeline_bubble_s and rank == 0:
                sent = self.stages[-1][3] if self.stages else ()
                total = tuple(float(b) + (sent[i] if i < len(sent) else 0.0)
                              for i, b in enumerate(event.pipeline_bytes))
                self.stages.append((event.t, event.forward_s or event.duration_s,
                                    tuple(map(float, event.pipeline_bubble_s)), total))
                self._prune(self.stages)

    def _add(self, rank: int, reading: RankReading) -> None:
        readings = self.ranks.get(rank)
        if readings is None:
            readings = self.ranks[rank] = deque(maxlen=self.max_readings)
        readings.append(reading)
        self._prune(readings)

    def _prune(self, readings: deque[Any]) -> None:
        """Drop readings older than the window but one: the last at or before its start
        holds into it (a gauge) or is the counter's base."""
        newest = readings[-1][0]
        while len(readings) > 2 and readings[1][0] <= newest - self.window_s:
            readings.popleft()

    def rank_loads(self) -> list[RankLoad]:
        loads = (rank_load(str(rank), self.ranks[rank], self.now, self.window_s) for rank in sorted(self.ranks))
        return [load for load in loads if load is not None]

    def stage_loads(self) -> list[StageLoad]:
        return stage_loads(self.stages, self.now, self.window_s)

    def seed_ranks(self, balance: dict[str, Any], t: float) -> None:
        """Each rank's counts from a data-parallel server's snapshot (its ``data_parallel``:
        engine/serve/data_parallel.py's ``balance_state``), so a monitor that joins sees
        every rank at once; the ranks' later steps follow."""
        for entry in balance.get("ranks") or []:
            rank = int(entry.get("rank", 0))
            total = int(entry.get("kv_blocks_total") or 0)
            kv_pct = 100.0 * int(entry.get("kv_blocks_used") or 0) / total if total else 0.0
            self._add(rank, (t, float(entry.get("waiting") or 0), float(entry.get("running") or 0), kv_pct,
                             self._generated.get(rank, 0.0)))
        self.now = max(self.now, t)

    def to_dict(self) -> dict[str, Any]:
        return {"window_s": self.window_s, "now": self.now,
                "ranks": {str(r): [list(x) for x in readings] for r, readings in self.ranks.items()},
                "stages": [[t, f, list(b), list(s)] for t, f, b, s in self.stages],
                "first_tokens": {str(r): n for r, n in self._first_tokens.items()}}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ParallelLoad:
        load = cls(window_s=float(data.get("window_s", WINDOW_S)))
        load.now = float(data.get("now", 0.0))
        for rank, readings in (data.get("ranks") or {}).items():
            rows = [(float(t), float(w), float(r), float(k), float(g)) for t, w, r, k, g in readings]
            load.ranks[int(rank)] = deque(rows, maxlen=load.max_readings)
            if rows:
                load._generated[int(rank)] = rows[-1][4]
        load.stages.extend((float(t), float(f), tuple(map(float, b)), tuple(map(float, s)))
                           for t, f, b, s in data.get("stages") or [])
        load._first_tokens = {int(r): int(n) for r, n in (data.get("first_tokens") or {}).items()}
        return load
