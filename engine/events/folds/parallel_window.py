"""The last seconds of data-parallel balance and pipeline idle time, for the live monitor.

``engine/events/folds/dp_balance.py`` and ``engine/events/folds/pipeline_idle.py`` fold a whole run
(the doctor, the simulator's summary, the bench); a dashboard needs the same figures over
a moving window, and a verdict now. This module keeps their definitions, bound and floor,
over the last ``WINDOW_S`` seconds of the source's clock:

* a DP rank's **load** is its waiting plus running requests (dp_balance's), its KV usage
  its blocks used over its pool; the **imbalance** is the busiest rank's window mean over
  the ranks' mean (``max / mean``: 1.0 even, D when one rank of D holds everything),
  called beyond ``DP_IMBALANCE_BOUND`` when the ranks average at least
  ``DP_MIN_MEAN_LOAD`` requests and the busiest one has requests waiting (a rank finishing
  its last requests costs nobody anything), as the doctor's ``dp_imbalance`` rule calls an
  instant; KV usage is judged by the same bound once the busiest rank uses ``KV_FLOOR_PCT``;
* a PP stage's **utilisation** is 1 - its bubble fraction (pipeline_idle's: bubble seconds
  over the steps' seconds) over the window's steps; the busiest stage is the one the
  others wait on.

A gauge's window figure is its time-weighted mean (each reading holds until the next, the
last until now), so a rank that stopped stepping keeps its last counts rather than an old
average; a counter's is its growth over the window per second.

Two sources give the same readings: kvscope's events, folded by :class:`ParallelWindow`
(the EngineView holds one: each DP rank's ``step`` events with their ``dp_rank``, the tokens
each rank generated as its decode tokens plus one per ``request.first_token``, and each DP
rank's ``pipeline_bubble_s`` / ``pipeline_bytes``: with DP x PP every rank has its own stages), and a vLLM server's ``/metrics`` whose every
series carries ``engine`` = the DP rank (monitor/replica.py hands each engine's scrapes to
:func:`rank_window`).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.events.folds.dp_balance import DP_IMBALANCE_BOUND, DP_MIN_MEAN_LOAD
from engine.events.folds.pipeline_idle import PipelineIdle
from engine.events.record import Event
from engine.events.request_records import RequestFirstToken
from engine.events.step_records import StepEvent

WINDOW_S = 10.0
KV_FLOOR_PCT = 10.0  # KV usage is judged once the busiest rank uses this much of its pool
STAGE_SPREAD = 0.10  # stages whose utilisations differ by less than this are called even
MAX_READINGS = 2048  # per rank and for the stages: a faster stepper's window is its last readings

# One rank's reading: (t, waiting, running, KV usage %, generated tokens so far).
RankReading = tuple[float, float, float, float, float]
# One step's stage figures: (t, step seconds, bubble seconds per stage, bytes sent so far per stage).
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
class RankWindow:
    """One DP rank: its latest counts, their window means and its generation rate."""

    rank: str
    waiting: float
    running: float
    kv_pct: float
    mean_waiting: float
    mean_running: float
    mean_kv_pct: float
    gen_tps: float | None  # None until two readings span some time

    @property
    def mean_load(self) -> float:
        return self.mean_waiting + self.mean_running


def rank_window(rank: str, readings: Sequence[RankReading], now: float,
                window_s: float = WINDOW_S) -> RankWindow | None:
    """A rank's window from its readings (oldest first), None without any."""
    if not readings:
        return None
    _, waiting, running, kv_pct, _ = readings[-1]

    def mean(column: int) -> float:
        return window_mean([(r[0], r[column]) for r in readings], now, window_s) or 0.0

    return RankWindow(rank, waiting, running, kv_pct, mean(1), mean(2), mean(3),
                      gen_tps=window_rate([(r[0], r[4]) for r in readings], now, window_s))


@dataclass(frozen=True, slots=True)
class Imbalance:
    """The verdict: ``figure`` (``load`` or ``kv``) is None when balanced or not judged;
    else the rank holding ``ratio`` times the ranks' mean of it."""

    text: str
    figure: str | None = None
    rank: str | None = None
    ratio: float = 1.0


def imbalance_verdict(ranks: Sequence[RankWindow], window_s: float = WINDOW_S,
                      bound: float = DP_IMBALANCE_BOUND) -> Imbalance:
    """The ranks' load and KV usage spreads over the window, the worse one named when
    beyond ``bound`` (module docstring)."""
    if len(ranks) < 2:
        return Imbalance("one rank: nothing to balance")
    window = f"last {window_s:g} s"
    judged: list[tuple[float, str, RankWindow, float, float]] = []  # ratio, figure, busiest, its mean, the mean
    loads = [r.mean_load for r in ranks]
    busiest = ranks[loads.index(max(loads))]
    if statistics.fmean(loads) >= DP_MIN_MEAN_LOAD and busiest.mean_waiting > 0:
        judged.append((busiest.mean_load / statistics.fmean(loads), "load", busiest, busiest.mean_load,
                       statistics.fmean(loads)))
    kv = [r.mean_kv_pct for r in ranks]
    if max(kv) >= KV_FLOOR_PCT:
        fullest = ranks[kv.index(max(kv))]
        judged.append((fullest.mean_kv_pct / statistics.fmean(kv), "kv", fullest, fullest.mean_kv_pct,
                       statistics.fmean(kv)))
    if not judged:
        return Imbalance(f"too little load to judge ({window}): under {DP_MIN_MEAN_LOAD:g} request per rank or "
                         f"none waiting on the busiest, and under {KV_FLOOR_PCT:g}% KV")
    ratio, figure, rank, top, mean = max(judged, key=lambda j: j[0])
    if ratio <= bound:
        return Imbalance(f"balanced: every rank within {bound:g}x the mean load and KV usage "
                         f"(worst {ratio:.2f}x, {window})", ratio=ratio)
    what = (f"load ({top:.1f} waiting + running vs mean {mean:.1f}" if figure == "load"
            else f"KV usage ({top:.0f}% vs mean {mean:.0f}%")
    return Imbalance(f"rank {rank.rank} holds {ratio:.2f}x the mean {what}, {window}; bound {bound:g}x)",
                     figure, rank.rank, ratio)


@dataclass(frozen=True, slots=True)
class StageWindow:
    """One pipeline stage over the window's steps."""

    stage: int
    utilisation: float  # 1 - its bubble fraction
    bubble_s: float  # per step, the mean over the window's steps
    bytes_per_s: float | None


def stage_windows(readings: Sequence[StageReading], now: float, window_s: float = WINDOW_S) -> list[StageWindow]:
    """Each stage over the steps inside the window (the last step alone when none is: an
    idle pipeline shows how its last step went) and its bytes sent per second."""
    if not readings:
        return []
    inside = [r for r in readings if r[0] > now - window_s] or [readings[-1]]
    idle = PipelineIdle()
    for _, step_s, bubbles, _ in inside:
        idle.add(list(bubbles), [], step_s)
    out = []
    for stage, fraction in enumerate(idle.fractions):
        sent = [(r[0], r[3][stage]) for r in readings if stage < len(r[3])]
        out.append(StageWindow(stage, min(1.0, max(0.0, 1.0 - fraction)), idle.bubble_s[stage] / idle.steps,
                               window_rate(sent, now, window_s)))
    return out


def stage_verdict(stages: Sequence[StageWindow], spread: float = STAGE_SPREAD) -> str:
    """Which stage the others wait on (the busiest), or that they are even."""
    if len(stages) < 2:
        return ""
    busiest = max(stages, key=lambda s: s.utilisation)
    idlest = min(stages, key=lambda s: s.utilisation)
    if busiest.utilisation - idlest.utilisation < spread:
        return f"stages even: utilisations within {100 * spread:.0f} points"
    return (f"stage {busiest.stage} is the bottleneck ({100 * busiest.utilisation:.0f}% busy); stage "
            f"{idlest.stage} idles {100 * (1 - idlest.utilisation):.0f}% of the step time")


class ParallelWindow:
    """The fold of step and first-token events into per-rank and per-stage readings."""

    def __init__(self, window_s: float = WINDOW_S, max_readings: int = MAX_READINGS) -> None:
        self.window_s = window_s
        self.max_readings = max_readings
        self.now = 0.0
        self.ranks: dict[int, deque[RankReading]] = {}
        self.stages: dict[int, deque[StageReading]] = {}  # per DP rank: its pipeline's steps
        self._generated: dict[int, float] = {}  # per rank: tokens generated so far
        self._first_tokens: dict[int, int] = {}  # per rank: first tokens since its last step

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    @property
    def num_stages(self) -> int:
        return max((len(readings[-1][2]) for readings in self.stages.values() if readings), default=0)

    @property
    def stage_ranks(self) -> list[int]:
        """The DP ranks whose steps carried pipeline stages, in order."""
        return sorted(rank for rank, readings in self.stages.items() if readings)

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
            if event.pipeline_bubble_s:
                stages = self.stages.get(rank)
                if stages is None:
                    stages = self.stages[rank] = deque(maxlen=self.max_readings)
                sent = stages[-1][3] if stages else ()
                total = tuple(float(b) + (sent[i] if i < len(sent) else 0.0)
                              for i, b in enumerate(event.pipeline_bytes))
                # the step's seconds as pipeline_idle takes them
                stages.append((event.t, event.duration_s or event.forward_s,
                               tuple(map(float, event.pipeline_bubble_s)), total))
                self._prune(stages)

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

    def rank_windows(self) -> list[RankWindow]:
        windows = (rank_window(str(rank), self.ranks[rank], self.now, self.window_s) for rank in sorted(self.ranks))
        return [w for w in windows if w is not None]

    def stage_windows(self, rank: int | None = None) -> list[StageWindow]:
        """DP rank ``rank``'s stages (default: the lowest rank with stages; [] without)."""
        ranks = self.stage_ranks
        if rank is None:
            rank = ranks[0] if ranks else 0
        return stage_windows(self.stages.get(rank, ()), self.now, self.window_s)

    def rank_stage_windows(self) -> dict[int, list[StageWindow]]:
        """Every DP rank's stages, by rank."""
        return {rank: self.stage_windows(rank) for rank in self.stage_ranks}

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
                "stages": {str(rank): [[t, s, list(b), list(sent)] for t, s, b, sent in readings]
                           for rank, readings in self.stages.items()},
                "first_tokens": {str(r): n for r, n in self._first_tokens.items()}}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ParallelWindow:
        fold = cls(window_s=float(data.get("window_s", WINDOW_S)))
        fold.now = float(data.get("now", 0.0))
        for rank, readings in (data.get("ranks") or {}).items():
            rows = [(float(t), float(w), float(r), float(k), float(g)) for t, w, r, k, g in readings]
            fold.ranks[int(rank)] = deque(rows, maxlen=fold.max_readings)
            if rows:
                fold._generated[int(rank)] = rows[-1][4]
        stages = data.get("stages") or {}
        if isinstance(stages, list):  # written before every rank had its stages: rank 0's
            stages = {"0": stages}
        for rank, readings in stages.items():
            fold.stages[int(rank)] = deque(((float(t), float(s), tuple(map(float, b)), tuple(map(float, sent)))
                                            for t, s, b, sent in readings), maxlen=fold.max_readings)
        fold._first_tokens = {int(r): int(n) for r, n in (data.get("first_tokens") or {}).items()}
        return fold
