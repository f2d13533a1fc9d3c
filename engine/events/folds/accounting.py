"""Every request and every token accounted for, folded from the lifecycle events.

Each request that reached the engine (``request.arrived``) leaves it through exactly one
``request.finished``, whose reason is typed: ``stop``, ``length``, ``error``, or ``abort``
with its cause (engine/events/request_records.py ``ABORT_CAUSES``: the client left, a deadline, the
server's shutdown). :class:`RequestLedger` checks that promise over a run (live, on a
recording, under data parallelism where request ids are per rank), and
:class:`AbortMetrics` exports what vLLM's families cannot say: aborts by cause and the
prompt tokens a prefill computed for a request that ended before its first token (work
done, in no token counter). The token counters and the per-request histograms are in
engine/events/exporters/metrics.py, counted by one tally so their sums agree exactly.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from engine.events.record import Event
from engine.events.request_records import ABORT_CAUSES, RequestArrived, RequestFinished, RequestRejected

UNKNOWN_CAUSE = "unknown"  # an abort in a recording made before causes were written


class AbortMetrics:
    """``kvscope:request_abort_total{cause}`` and ``kvscope:prompt_tokens_discarded_total``,
    under the same ``model_name`` / ``engine`` labels as vLLM's families."""

    def __init__(self, registry: CollectorRegistry, label_names: tuple[str, ...],
                 label_values: tuple[str, ...]) -> None:
        self._values = label_values
        self._aborts = Counter("kvscope:request_abort", "Aborted requests by cause (client_disconnect, timeout, "
                               "shutdown); they sum to request_success_total{finished_reason=\"abort\"}.",
                               (*label_names, "cause"), registry=registry)
        self._by_cause = {cause: self._aborts.labels(*label_values, cause) for cause in ABORT_CAUSES}
        self.discarded = Counter("kvscope:prompt_tokens_discarded",
                                 "Prompt tokens computed for requests that ended before their first token (an abort "
                                 "or error mid-prefill): work done that vllm:prompt_tokens_total does not count.",
                                 label_names, registry=registry).labels(*label_values)

    def finished(self, event: RequestFinished) -> None:
        if event.reason == "abort":
            cause = event.abort_cause or UNKNOWN_CAUSE
            counter = self._by_cause.get(cause)
            if counter is None:
                counter = self._by_cause[cause] = self._aborts.labels(*self._values, cause)
            counter.inc()
        if event.computed_prompt_tokens:
            self.discarded.inc(event.computed_prompt_tokens)


def finish_kind(event: RequestFinished) -> str:
    """A finish's typed reason in one word: ``stop``, ``length``, ``error`` or ``abort:<cause>``."""
    if event.reason != "abort":
        return event.reason
    return f"abort:{event.abort_cause or UNKNOWN_CAUSE}"


@dataclass(slots=True)
class RequestLedger:
    """Arrivals against finishes, per data-parallel rank (a request id is one rank's).

    ``open`` holds the requests in the engine now; ``twice`` those finished more than
    once and ``unknown`` those finished with no arrival seen (both breaches of the
    promise, kept to be reported); ``by_kind`` counts finishes by :func:`finish_kind`;
    ``prompt_tokens`` / ``output_tokens`` sum the finished requests' own counts
    (prompts whose prefill completed, every output token), which equal
    ``vllm:prompt_tokens_total`` / ``vllm:generation_tokens_total`` once ``open`` is empty.
    """

    open: dict[tuple[int, str], float] = field(default_factory=dict)  # (rank, id) -> arrival t
    finished: set[tuple[int, str]] = field(default_factory=set)
    twice: list[tuple[int, str]] = field(default_factory=list)
    unknown: list[tuple[int, str]] = field(default_factory=list)
    by_kind: collections.Counter[str] = field(default_factory=collections.Counter)
    arrived: int = 0
    rejected: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    discarded_prompt_tokens: int = 0

    def __call__(self, event: Event) -> None:
        if isinstance(event, RequestArrived):
            self.arrived += 1
            self.open[(event.dp_rank, event.request_id)] = event.t
        elif isinstance(event, RequestRejected):
            self.rejected += 1
        elif isinstance(event, RequestFinished):
            self._finished(event)

    def _finished(self, event: RequestFinished) -> None:
        key = (event.dp_rank, event.request_id)
        if key in self.finished:
            self.twice.append(key)
            return
        self.finished.add(key)
        if self.open.pop(key, None) is None:
            self.unknown.append(key)
        self.by_kind[finish_kind(event)] += 1
        if event.ttft_s is not None:
            self.prompt_tokens += event.prompt_tokens
        self.output_tokens += event.output_tokens
        self.discarded_prompt_tokens += event.computed_prompt_tokens

    @property
    def balanced(self) -> bool:
        """Every arrival finished exactly once, and nothing else finished."""
        return not self.open and not self.twice and not self.unknown

    def summary(self) -> dict[str, Any]:
        return {"arrived": self.arrived, "finished": len(self.finished), "in_engine": len(self.open),
                "finished_twice": len(self.twice), "finished_unknown": len(self.unknown),
                "by_reason": dict(sorted(self.by_kind.items())), "prompt_tokens": self.prompt_tokens,
                "output_tokens": self.output_tokens, "discarded_prompt_tokens": self.discarded_prompt_tokens}
