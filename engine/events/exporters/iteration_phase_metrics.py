"""Phase-aware engine iteration histograms: vLLM PR#53550's shapes (open when this was written).

For every engine step that ran the model, two histograms under a ``phase`` label
(``prefill`` | ``decode``) observe how many requests the step scheduled in that phase and
how many tokens it scheduled for them; a step that mixes both phases records both, a step
of one phase records that phase only. A step that scheduled nothing (a non-model
iteration; a data-parallel rank's idle step) is not recorded, as the PR skips DP dummy
and non-model iterations. The source is the ``step`` event alone: its ``scheduled`` rows
(request id -> [tokens, kind]) give the requests of each phase, ``num_prefill_tokens`` /
``num_decode_tokens`` the tokens (the numbers ``vllm:iteration_tokens_total`` adds up).

Like vLLM's, the families are always on: the PR exports them whenever Prometheus
statistics are (off only under ``--disable-log-stats``), and kvscope's /metrics has no
such switch (it accepts ``--disable-log-stats`` and keeps its metrics).

The PR's ``vllm/v1/metrics/loggers.py`` could not be read; its tests name the logger's
histograms ``histogram_iteration_requests`` and ``histogram_iteration_tokens_by_phase``,
each keyed by phase (``ITERATION_PHASE_PREFILL`` / ``ITERATION_PHASE_DECODE``) and engine.
The family names here are those names after ``histogram_`` under ``vllm:``, the label is
``phase`` valued by the phases' names, and the help texts are kvscope's, modelled on
``vllm:iteration_tokens_total``'s. The buckets are not known either: both families take
``vllm:iteration_tokens_total``'s, passed in by the caller.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Histogram

from engine.events.exporters.deferred_series import DeferredHistogram, SeriesWriter
from engine.events.step_records import StepEvent

PHASE_LABEL = "phase"
ITERATION_PHASE_PREFILL = "prefill"
ITERATION_PHASE_DECODE = "decode"
ITERATION_PHASES = (ITERATION_PHASE_PREFILL, ITERATION_PHASE_DECODE)


class IterationPhaseHistograms:
    """``vllm:iteration_requests{phase}`` and ``vllm:iteration_tokens_by_phase{phase}``,
    observed from each step event by :meth:`observe`."""

    __slots__ = ("_requests", "_tokens")

    def __init__(self, registry: CollectorRegistry, label_names: tuple[str, ...], label_values: tuple[str, ...],
                 buckets: tuple[float, ...], writer: SeriesWriter | None = None) -> None:
        labels = (*label_names, PHASE_LABEL)
        requests = Histogram("vllm:iteration_requests",
                             "Histogram of number of requests per engine step in each phase (prefill, decode).",
                             labels, buckets=buckets, registry=registry)
        tokens = Histogram("vllm:iteration_tokens_by_phase",
                           "Histogram of number of scheduled tokens per engine step in each phase (prefill, decode).",
                           labels, buckets=buckets, registry=registry)
        # children resolved once: the step path only observes (with ``writer``, into their
        # deferred wrappers: engine/events/exporters/deferred_series.py)
        def child(family: Histogram, phase: str) -> Any:
            series = family.labels(*label_values, phase)
            return series if writer is None else writer.add(DeferredHistogram(series))

        self._requests: dict[str, Any] = {p: child(requests, p) for p in ITERATION_PHASES}
        self._tokens: dict[str, Any] = {p: child(tokens, p) for p in ITERATION_PHASES}

    def observe(self, event: StepEvent) -> None:
        """Record ``event``'s phases; nothing when it scheduled no request."""
        if not event.scheduled:
            return
        prefill_rows = sum(1 for row in event.scheduled.values() if row[1] == ITERATION_PHASE_PREFILL)
        decode_rows = len(event.scheduled) - prefill_rows
        if prefill_rows:
            self._requests[ITERATION_PHASE_PREFILL].observe(prefill_rows)
            self._tokens[ITERATION_PHASE_PREFILL].observe(event.num_prefill_tokens)
        if decode_rows:
            self._requests[ITERATION_PHASE_DECODE].observe(decode_rows)
            self._tokens[ITERATION_PHASE_DECODE].observe(event.num_decode_tokens)
