"""One replica seen from outside: the fold of its ``/metrics`` scrapes and KV-event batches.

A replica is a vLLM server or a kvscope one (both serve vLLM's families at
``/metrics``). :class:`ReplicaState` folds :class:`~engine.events.MetricsScrape`,
:class:`~engine.events.KvEventBatch` and the connection notes the poller publishes
(:class:`~engine.events.LogEvent` with ``data.source``) into what the fleet row and
the replica dashboard draw: the latest reading per engine (DP rank), rates between
scrapes, windowed latency quantiles and short series for sparklines. The fold is the
same live and in replay, so a recording shows what the live monitor showed.
"""

from __future__ import annotations

import copy
from collections import deque
from dataclasses import dataclass, field

from engine.events import Event, KvEventBatch, LogEvent, MetricsScrape
from engine.events.folds.frozen_counters import FrozenCounters
from engine.events.folds.parallel_window import RankReading, RankWindow, rank_window
from monitor.kv_events import PrefixCache
from monitor.prometheus import EngineMetrics, Histogram, parse_metrics

WINDOW_S = 60.0  # latency quantiles and rates cover the last minute of scrapes
SERIES_LEN = 120  # sparkline points kept per series
CONNECTING, LIVE, DISCONNECTED, REFUSED = "connecting", "live", "disconnected", "refused"
RATES = ("gen_tps", "prompt_tps", "preempt_per_min")
SERIES = ("running", "waiting", "kv_pct", "gen_tps", "prompt_tps", "ttft_p99", "hit_pct", "preempt_per_min")


def _series() -> dict[str, deque[float]]:
    return {name: deque(maxlen=SERIES_LEN) for name in SERIES}


@dataclass
class EngineState:
    """One engine (DP rank) of a replica: its latest reading, the readings of the
    last window and its series."""

    engine: str
    latest: EngineMetrics | None = None
    window: deque[tuple[float, EngineMetrics]] = field(default_factory=deque)
    series: dict[str, deque[float]] = field(default_factory=_series)
    gen_tps: float = 0.0
    prompt_tps: float = 0.0
    preempt_per_min: float = 0.0
    hit_rate: float | None = None  # prefix-cache hits / queries over the window

    def oldest(self) -> tuple[float, EngineMetrics] | None:
        return self.window[0] if len(self.window) > 1 else None

    def latency(self, name: str) -> Histogram | None:
        """Observations of histogram ``name`` made during the window (all of them when
        there is only one scrape)."""
        if self.latest is None or name not in self.latest.histograms:
            return None
        oldest = self.oldest()
        earlier = oldest[1].histograms.get(name) if oldest is not None else None
        return self.latest.histograms[name].minus(earlier)

    def quantile(self, name: str, q: float) -> float | None:
        hist = self.latency(name)
        return hist.quantile(q) if hist is not None else None


@dataclass
class ReplicaState:
    """Everything the monitor knows about one replica at source ``source``."""

    source: str
    kind: str = "?"  # vllm | kvscope, once detected
    status: str = CONNECTING
    reason: str = ""
    scrapes: int = 0
    last_scrape_t: float | None = None
    engines: dict[str, EngineState] = field(default_factory=dict)
    prefix: PrefixCache = field(default_factory=PrefixCache)
    kv_batches: int = 0
    kv_events: int = 0
    kv_rates: deque[tuple[float, int, int]] = field(default_factory=lambda: deque(maxlen=SERIES_LEN))
    kv_series: dict[str, deque[float]] = field(
        default_factory=lambda: {n: deque(maxlen=SERIES_LEN) for n in ("cached", "stored_per_s", "removed_per_s")})
    # requests running while the token counters stay frozen: a stall seen from /metrics
    frozen: FrozenCounters = field(default_factory=FrozenCounters)

    # ---------------------------------------------------------------- folding
    def apply(self, event: Event) -> None:
        if isinstance(event, MetricsScrape):
            self._scrape(event)
        elif isinstance(event, KvEventBatch):
            self.kv_batches += 1
            self.kv_events += len(event.events)
            self.prefix.apply(event.events, event.ts or event.t)
        elif isinstance(event, LogEvent) and event.data.get("source") == self.source:
            state = event.data.get("state")
            if state in (CONNECTING, LIVE, DISCONNECTED, REFUSED):
                self.status, self.reason = state, str(event.data.get("reason", ""))

    def _scrape(self, event: MetricsScrape) -> None:
        readings = parse_metrics(event.text)
        self.status, self.reason = LIVE, ""
        self.scrapes += 1
        t = event.t
        for label, reading in readings.items():
            state = self.engines.get(label)
            if state is None:
                state = self.engines[label] = EngineState(engine=label)
            self._engine_scrape(state, t, reading)
            self.frozen.observe(t, label, round(reading.running), reading.prompt_tokens + reading.generation_tokens)
        self._kv_sample(t)
        self.last_scrape_t = t

    @staticmethod
    def _engine_scrape(state: EngineState, t: float, reading: EngineMetrics) -> None:
        previous = state.latest
        state.latest = reading
        state.window.append((t, reading))
        while len(state.window) > 2 and t - state.window[1][0] >= WINDOW_S:
            state.window.popleft()
        oldest = state.oldest()
        if oldest is not None and t > oldest[0] and reading.generation_tokens >= oldest[1].generation_tokens:
            t0, then = oldest
            span = t - t0
            state.gen_tps = (reading.generation_tokens - then.generation_tokens) / span
            state.prompt_tps = (reading.prompt_tokens - then.prompt_tokens) / span
            state.preempt_per_min = max(0.0, reading.preemptions - then.preemptions) * 60.0 / span
            queries = reading.prefix_queries - then.prefix_queries
            state.hit_rate = (reading.prefix_hits - then.prefix_hits) / queries if queries > 0 else state.hit_rate
        elif previous is None and reading.prefix_queries > 0:
            state.hit_rate = reading.prefix_hits / reading.prefix_queries
        s = state.series
        s["running"].append(reading.running)
        s["waiting"].append(reading.waiting)
        s["kv_pct"].append(100.0 * reading.kv_usage)
        s["gen_tps"].append(state.gen_tps)
        s["prompt_tps"].append(state.prompt_tps)
        s["ttft_p99"].append(state.quantile("ttft", 0.99) or 0.0)
        s["hit_pct"].append(100.0 * (state.hit_rate or 0.0))
        s["preempt_per_min"].append(state.preempt_per_min)

    def _kv_sample(self, t: float) -> None:
        """Store/remove rates of the KV events, sampled at each scrape."""
        if not self.kv_batches:
            return
        self.kv_rates.append((t, self.prefix.stored_total, self.prefix.removed_total))
        if len(self.kv_rates) > 1:
            (t0, stored0, removed0), (t1, stored1, removed1) = self.kv_rates[-2], self.kv_rates[-1]
            span = max(t1 - t0, 1e-9)
            self.kv_series["stored_per_s"].append((stored1 - stored0) / span)
            self.kv_series["removed_per_s"].append((removed1 - removed0) / span)
        self.kv_series["cached"].append(len(self.prefix.blocks))

    # ---------------------------------------------------------------- reading
    @property
    def model_name(self) -> str:
        return next((e.latest.model_name for e in self.engines.values() if e.latest and e.latest.model_name), "")

    def total(self, name: str) -> float:
        """A gauge (``running``, ``waiting``) or a rate (``gen_tps``, ``prompt_tps``,
        ``preempt_per_min``) summed over engines."""
        out = 0.0
        for state in self.engines.values():
            if state.latest is not None:
                out += getattr(state, name) if name in RATES else getattr(state.latest, name)
        return out

    def kv_usage(self) -> float:
        readings = [s.latest.kv_usage for s in self.engines.values() if s.latest is not None]
        return sum(readings) / len(readings) if readings else 0.0

    def rank_windows(self) -> list[RankWindow]:
        """Each engine's (DP rank's) figures over the parallel panel's window, from the scrapes
        of the last minute, as kvscope's events give them (engine/events/folds/parallel_window.py)."""
        now = self.last_scrape_t or 0.0
        windows = []
        for label, engine in self.engines.items():
            readings: list[RankReading] = [(t, m.waiting, m.running, 100.0 * m.kv_usage, m.generation_tokens)
                                           for t, m in engine.window]
            window = rank_window(label, readings, now)
            if window is not None:
                windows.append(window)
        return windows

    def stall_text(self) -> str:
        """``⏸ STALLED engine 0: 3 running, no token counted for 75 s`` while an engine's counters
        are frozen with requests running for FrozenCounters.frozen_s; "" otherwise."""
        runs = self.frozen.stalled()
        return "".join(f"  ⏸ STALLED engine {e}: {run.running} running, no token counted for {run.seconds:,.0f} s"
                       for e, run in sorted(runs.items()))

    def hit_rate(self) -> float | None:
        rates = [s.hit_rate for s in self.engines.values() if s.hit_rate is not None]
        return sum(rates) / len(rates) if rates else None

    def quantile(self, name: str, q: float) -> float | None:
        """Quantile ``q`` of histogram ``name`` over the window, every engine's
        observations together (bucket counts add when the bounds agree)."""
        merged: Histogram | None = None
        for state in self.engines.values():
            hist = state.latency(name)
            if hist is None:
                continue
            if merged is None:
                merged = Histogram(list(hist.buckets), hist.total, hist.count)
            elif [le for le, _ in merged.buckets] == [le for le, _ in hist.buckets]:
                merged = Histogram([(le, a + b) for (le, a), (_, b) in zip(merged.buckets, hist.buckets, strict=True)],
                                   merged.total + hist.total, merged.count + hist.count)
        return merged.quantile(q) if merged is not None else None

    def series(self, name: str) -> list[float]:
        """Series ``name`` summed over engines (kv_pct and hit_pct averaged)."""
        columns = [list(s.series[name]) for s in self.engines.values()]
        if not columns:
            return []
        width = min(len(c) for c in columns)
        rows = [sum(c[len(c) - width + i] for c in columns) for i in range(width)]
        if name in ("kv_pct", "hit_pct"):
            rows = [v / len(columns) for v in rows]
        return rows

    def copy(self) -> ReplicaState:
        """An independent copy (replay checkpoints)."""
        clone = copy.copy(self)
        clone.engines = copy.deepcopy(self.engines)
        clone.prefix = self.prefix.copy()
        clone.kv_rates = copy.copy(self.kv_rates)
        clone.kv_series = copy.deepcopy(self.kv_series)
        clone.frozen = copy.deepcopy(self.frozen)
        return clone
