"""The periodic stats line and ``stats`` event, folded from the event stream.

vLLM V1 prints one line every ``VLLM_LOG_STATS_INTERVAL`` seconds (kvscope:
``--stats-interval``)::

    Engine 000: Avg prompt throughput: 120.5 tokens/s, Avg generation throughput: 33.0 tokens/s,
    Running: 4 reqs, Waiting: 0 reqs, GPU KV cache usage: 12.5%, Prefix cache hit rate: 40.0%

(one line; 0.30+ puts the device word before "KV cache usage", so kvscope on CPU
prints "CPU KV cache usage"). :func:`format_stats_line` is the only place that
format lives. The numbers follow vLLM 0.11.1+: a prompt counts whole (cached
tokens included) when its first token comes out; generation tokens count as they
are sampled; KV usage is the last step's used / total blocks; the prefix hit
rate is hit tokens / queried tokens over the most recent 1000 requests;
"Preemptions: N" (preemptions in the interval) appears only when N > 0.

Everything here reads events only (DESIGN principle 1). Time is the event time
axis (``event.t``), so a replayed or simulated run reports the same lines.
:class:`TokenTally` is shared with the Prometheus sink (engine.events.exporters.metrics) so both
count prompt and generation tokens the same way.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from engine.errors import UserError
from engine.events import (
    EngineConfigEvent,
    Event,
    EventBus,
    RequestArrived,
    RequestFinished,
    RequestFirstToken,
    StartupPhase,
    StatsEvent,
    StepEvent,
)
from engine.events.phase_data import InitData
from engine.logs import get_logger

# vLLM's CachingMetrics window (max_recent_requests)
PREFIX_HIT_WINDOW_REQUESTS = 1000


def format_stats_line(stats: StatsEvent, device_word: str = "GPU", engine_index: int = 0) -> str:
    """vLLM V1's periodic line for ``stats`` (0.30+ wording, device word first)."""
    parts = [
        f"Avg prompt throughput: {stats.prompt_throughput:.1f} tokens/s",
        f"Avg generation throughput: {stats.generation_throughput:.1f} tokens/s",
        f"Running: {stats.num_running:d} reqs",
        f"Waiting: {stats.num_waiting:d} reqs",
    ]
    if stats.num_preemptions > 0:
        parts.append(f"Preemptions: {stats.num_preemptions:d}")
    parts.append(f"{device_word} KV cache usage: {stats.kv_cache_usage * 100:.1f}%")
    parts.append(f"Prefix cache hit rate: {stats.prefix_cache_hit_rate * 100:.1f}%")
    return f"Engine {engine_index:03d}: " + ", ".join(parts)


def kv_cache_usage(step: StepEvent) -> float:
    """Fraction of KV blocks in use after ``step`` (cached-but-free blocks count as
    free, as vLLM's kv_cache_usage_perc; kvscope has no reserved null block)."""
    total = step.kv_blocks_total
    return step.kv_blocks_used / total if total > 0 else 0.0


def device_word_from_config(config: dict[str, Any]) -> str | None:
    """The device word (CPU or GPU) when a config's ``device`` says which, else None."""
    return device_word_of(config.get("device"))


def device_word_of(device_name: object) -> str | None:
    """The device word (CPU or GPU) of a device name ("cpu", "cuda:0", "gpu"), else None."""
    device = str(device_name or "").lower()
    if device.startswith("cpu"):
        return "CPU"
    if device.startswith("cuda") or device.startswith("gpu"):
        return "GPU"
    return None


class TokenTally:
    """Prompt and generation tokens as vLLM counts them, folded from events.

    A prompt counts once, whole, at its request's first token. A generated token
    counts when it is sampled: the first token at ``request.first_token``, each
    later one from its ``decode`` entry in a ``step`` event. Tokens no event shows
    as they happen (the one sampled at the end of a recompute after preemption)
    are added at ``request.finished`` from its exact ``output_tokens``, so totals
    are exact for every finished request.

    The scheduler publishes a step's finish events before the step event, so a
    decode entry of a request that already finished is skipped: the finish
    already counted its last token.
    """

    __slots__ = ("_live",)

    def __init__(self) -> None:
        # request id -> [prompt tokens, generated tokens counted, prompt counted (0/1)]
        self._live: dict[str, list[int]] = {}

    @property
    def num_live(self) -> int:
        return len(self._live)

    def arrived(self, event: RequestArrived) -> None:
        self._live[event.request_id] = [event.prompt_tokens, 0, 0]

    def first_token(self, event: RequestFirstToken) -> int:
        """Count the first token; returns the prompt tokens to count now (1 generated
        token is implied)."""
        entry = self._live.get(event.request_id)
        if entry is None:  # arrived before we subscribed: its prompt counts at finish
            self._live[event.request_id] = [0, 1, 0]
            return 0
        entry[1] += 1
        if entry[2]:
            return 0
        entry[2] = 1
        return entry[0]

    def step(self, event: StepEvent) -> int:
        """Generated tokens sampled by the step's decode entries."""
        if not event.num_decode_tokens:
            return 0
        live = self._live
        generated = 0
        for request_id, (num_tokens, kind) in event.scheduled.items():
            if kind == "decode":
                entry = live.get(request_id)
                if entry is not None:
                    entry[1] += num_tokens
                    generated += num_tokens
        return generated

    def finished(self, event: RequestFinished) -> tuple[int, int]:
        """(prompt, generated) tokens not counted yet for a finished request."""
        prompt, generated, _, _ = self.settle(event)
        return prompt, generated

    def settle(self, event: RequestFinished) -> tuple[int, int, int, int]:
        """A finished request's (prompt, generated) tokens not counted yet, then its whole
        (prompt, generated) count: what the per-request histograms observe, so their sums
        are the counters' totals exactly, aborted requests included (a prompt counts only
        once its prefill completed; an abort before that counts 0 prompt tokens)."""
        entry = self._live.pop(event.request_id, None)
        if entry is None:
            prompt = event.prompt_tokens if event.ttft_s is not None else 0
            return prompt, event.output_tokens, prompt, event.output_tokens
        prompt = event.prompt_tokens if (not entry[2] and event.ttft_s is not None) else 0
        generated = max(0, event.output_tokens - entry[1])
        return prompt, generated, prompt + (entry[0] if entry[2] else 0), entry[1] + generated


class PrefixHitWindow:
    """Prefix-cache hit rate over the most recent requests, as vLLM's
    CachingMetrics: per-step (requests, queried tokens, hit tokens), oldest steps
    dropped while more than ``max_requests`` requests remain in the window."""

    __slots__ = ("_hits", "_max_requests", "_queries", "_requests", "_window")

    def __init__(self, max_requests: int = PREFIX_HIT_WINDOW_REQUESTS) -> None:
        self._max_requests = max_requests
        self._window: deque[tuple[int, int, int]] = deque()
        self._requests = 0
        self._queries = 0
        self._hits = 0

    def observe(self, requests: int, queries: int, hits: int) -> None:
        if requests <= 0 and queries <= 0:
            return
        self._window.append((requests, queries, hits))
        self._requests += requests
        self._queries += queries
        self._hits += hits
        while len(self._window) > 1 and self._requests > self._max_requests:
            old_requests, old_queries, old_hits = self._window.popleft()
            self._requests -= old_requests
            self._queries -= old_queries
            self._hits -= old_hits

    @property
    def hit_rate(self) -> float:
        return self._hits / self._queries if self._queries > 0 else 0.0


class StatsAccumulator:
    """Pure fold of events into the numbers of one stats interval.

    ``observe`` every event; ``snapshot(now)`` returns the :class:`StatsEvent` for
    the interval since the previous snapshot (or the first event) and starts the
    next one.
    """

    def __init__(self) -> None:
        self.tokens = TokenTally()
        self.prefix = PrefixHitWindow()
        self._interval_start: float | None = None
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._preemptions = 0
        self._last_step: StepEvent | None = None

    @property
    def interval_start(self) -> float | None:
        return self._interval_start

    def observe(self, event: Event) -> None:
        if self._interval_start is None:
            self._interval_start = event.t
        if isinstance(event, StepEvent):
            self._generation_tokens += self.tokens.step(event)
            self._preemptions += len(event.preempted)
            self.prefix.observe(
                len(event.new) + len(event.resumed), event.prefix_queries_tokens, event.prefix_hits_tokens
            )
            self._last_step = event
        elif isinstance(event, RequestFirstToken):
            self._prompt_tokens += self.tokens.first_token(event)
            self._generation_tokens += 1
        elif isinstance(event, RequestArrived):
            self.tokens.arrived(event)
        elif isinstance(event, RequestFinished):
            prompt, generated = self.tokens.finished(event)
            self._prompt_tokens += prompt
            self._generation_tokens += generated

    def snapshot(self, now: float) -> StatsEvent:
        start = self._interval_start if self._interval_start is not None else now
        elapsed = now - start
        step = self._last_step
        stats = StatsEvent(
            interval_s=elapsed,
            prompt_throughput=self._prompt_tokens / elapsed if elapsed > 0 else 0.0,
            generation_throughput=self._generation_tokens / elapsed if elapsed > 0 else 0.0,
            num_running=step.num_running if step is not None else 0,
            num_waiting=step.num_waiting if step is not None else 0,
            kv_cache_usage=kv_cache_usage(step) if step is not None else 0.0,
            prefix_cache_hit_rate=self.prefix.hit_rate,
            num_preemptions=self._preemptions,
        )
        self._interval_start = now
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._preemptions = 0
        return stats


StatsLineSink = Callable[[str, bool], None]


def _log_with_structlog(line: str, idle: bool) -> None:
    logger = get_logger("kvscope.stats")
    # vLLM drops the line to DEBUG while idle
    (logger.debug if idle else logger.info)(line)


class StatsReporter:
    """Bus subscriber: folds events and, each time ``interval_s`` has passed on the
    event time axis, publishes a ``stats`` event and logs vLLM's line.

    ``interval_s`` 0 turns the periodic report off (``report`` still works).
    ``device_word`` ("GPU"/"CPU") defaults to what the engine.config event's
    ``device`` says, else "GPU". ``log(line, idle)`` receives each line; by
    default structlog at INFO, DEBUG when both throughputs are zero now and at
    the previous report (as vLLM). There is no clock of its own: intervals are
    measured on ``event.t``, so replay and simulation report like the live run.
    """

    def __init__(
        self,
        bus: EventBus | None,
        interval_s: float,
        *,
        device_word: str | None = None,
        engine_index: int = 0,
        log: StatsLineSink | None = _log_with_structlog,
    ) -> None:
        if not interval_s >= 0:
            raise UserError(f"--stats-interval {interval_s}: give seconds >= 0 (0 turns the stats line off)")
        self.bus = bus
        self.interval_s = float(interval_s)
        self.engine_index = engine_index
        self._device_word = device_word
        self._log = log
        self._acc = StatsAccumulator()
        self._was_idle = True
        self.last_line: str | None = None
        self.last_stats: StatsEvent | None = None

    @property
    def device_word(self) -> str:
        return self._device_word or "GPU"

    def __call__(self, event: Event) -> None:
        if isinstance(event, StatsEvent):
            return
        if isinstance(event, EngineConfigEvent) and self._device_word is None:
            self._device_word = device_word_from_config(event.config)
        elif isinstance(event, StartupPhase) and self._device_word is None and event.phase == InitData.phase:
            self._device_word = device_word_of(InitData.from_dict(event.data).device)
        acc = self._acc
        acc.observe(event)
        start = acc.interval_start
        if self.interval_s > 0 and start is not None and event.t - start >= self.interval_s:
            self.report(event.t)

    def report(self, now: float) -> tuple[StatsEvent, str]:
        """Close the interval at ``now`` (event time): publish the stats event on
        the bus (if any), log the line and return both."""
        stats = self._acc.snapshot(now)
        line = format_stats_line(stats, self.device_word, self.engine_index)
        idle = stats.prompt_throughput == 0 and stats.generation_throughput == 0
        if self._log is not None:
            self._log(line, idle and self._was_idle)
        self._was_idle = idle
        self.last_line = line
        self.last_stats = stats
        if self.bus is not None:
            self.bus.publish(stats)
        return stats, line
