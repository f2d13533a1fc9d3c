"""A stall seen from outside: an engine that reports requests running while its token
counters stay frozen.

A vLLM server tells nothing of its steps, but its ``/metrics`` do:
``vllm:num_requests_running`` (a gauge) and ``vllm:prompt_tokens_total`` +
``vllm:generation_tokens_total`` (counters that move with every step that completes a
prompt or samples a token). Running > 0 while both stay where they were for ``frozen_s``
seconds is a stall: the engine is alive enough to answer ``/metrics`` and ``/health``
(vllm#41725: 70 minutes silent, every counter frozen, ``/health`` 200), but makes no
progress. vLLM counts a prompt's tokens when its prefill completes, so one long chunked
prefill alone moves neither counter for as long as it takes: hence the generous default.

One fold for ``monitor vllm`` (monitor/replica.py, live and replayed) and ``engine doctor
http://...`` (doctor/vllm_stall.py), fed one reading per scrape per engine (DP rank).
"""

from __future__ import annotations

from dataclasses import dataclass, field

FROZEN_S = 60.0  # running > 0 and no token counted for this long: stalled


@dataclass(slots=True)
class FrozenRun:
    """One engine's counters frozen with requests running: from ``start`` (the last scrape at
    which they moved, or at which requests started running) to ``end`` (the last scrape seen
    frozen, or the one at which they moved again: ``recovered``)."""

    engine: str
    start: float
    end: float
    running: int  # requests running at the last frozen scrape
    tokens: float  # the counters' sum, frozen at
    recovered: bool = False
    listed: bool = False  # in FrozenCounters.runs (it lasted frozen_s)

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass(slots=True)
class FrozenCounters:
    """Feed :meth:`observe` each scrape's reading per engine; read :meth:`stalled` (now) and
    :attr:`runs` (every frozen stretch at least ``frozen_s`` long, closed or open)."""

    frozen_s: float = FROZEN_S
    runs: list[FrozenRun] = field(default_factory=list)
    _open: dict[str, FrozenRun] = field(default_factory=dict)

    def observe(self, t: float, engine: str, running: int, tokens: float) -> None:
        """``tokens``: the engine's prompt + generation token counters at ``t``."""
        run = self._open.get(engine)
        if run is not None and running > 0 and tokens == run.tokens:
            run.end, run.running = t, running
            if run.seconds >= self.frozen_s and not run.listed:
                run.listed = True
                self.runs.append(run)
            return
        if run is not None and run.listed:
            run.end, run.recovered = t, True
        self._open.pop(engine, None)
        if running > 0:  # from now on, frozen until the counters move
            self._open[engine] = FrozenRun(engine, t, t, running, tokens)

    def stalled(self) -> dict[str, FrozenRun]:
        """The engines frozen for at least ``frozen_s`` as of their last reading."""
        return {e: run for e, run in self._open.items() if run.seconds >= self.frozen_s}

    def frozen_for(self, engine: str) -> float:
        """Seconds ``engine``'s counters have been frozen with requests running (0: moving or idle)."""
        run = self._open.get(engine)
        return run.seconds if run is not None else 0.0
