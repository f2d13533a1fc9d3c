"""A request's life as records: arrived, scheduled, first token, preempted (and why),
finished (and, for an abort, its cause), rejected."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from engine.events.record import Event


@dataclass(slots=True)
class RequestArrived(Event):
    """A request entered the waiting queue. ``sampling``: its temperature and top_p
    when it has sampling settings (the real engine; the simulator's have none, and
    then the key is not written). ``preprocess_s``: how long before this event the
    server received it (parsing, tokenising, the queue to the engine thread; vLLM's
    arrival_time is the receipt): its TTFT and e2e count from ``t - preprocess_s``,
    its queue time from ``t``. Written only when not 0. ``session``: the conversation it
    continues (an ``X-Session-Id`` header, else its ``cache_salt``, else its ``user``;
    engine/events/folds/sessions.py folds turns by it); written only when set."""

    type: ClassVar[str] = "request.arrived"
    written_when_set: ClassVar[frozenset[str]] = frozenset({"dp_rank", "sampling", "preprocess_s", "session"})
    request_id: str = ""
    prompt_tokens: int = 0
    max_tokens: int = 0
    priority: int = 0
    prompt: str | None = None  # only with --log-prompts
    sampling: dict[str, float] | None = None
    preprocess_s: float = 0.0
    dp_rank: int = 0  # the data-parallel rank whose engine core it is; written only when not 0
    session: str = ""


@dataclass(slots=True)
class RequestScheduled(Event):
    """First admission of a request (not resumptions after preemption)."""

    type: ClassVar[str] = "request.scheduled"
    written_when_set: ClassVar[frozenset[str]] = frozenset({"dp_rank"})
    request_id: str = ""
    queue_time_s: float = 0.0
    prefix_hit_tokens: int = 0
    dp_rank: int = 0  # the data-parallel rank whose engine core it is; written only when not 0


@dataclass(slots=True)
class RequestFirstToken(Event):
    type: ClassVar[str] = "request.first_token"
    written_when_set: ClassVar[frozenset[str]] = frozenset({"dp_rank"})
    request_id: str = ""
    ttft_s: float = 0.0
    dp_rank: int = 0  # the data-parallel rank whose engine core it is; written only when not 0


# Why a running request was preempted (vLLM's num_preemptions_by_reason label values).
PREEMPTION_KV_FULL = "kv_full"  # no free KV block for a running request
PREEMPTION_PRIORITY = "priority"  # --scheduling-policy priority: a lower priority made room for a higher one
PREEMPTION_REASONS = (PREEMPTION_KV_FULL, PREEMPTION_PRIORITY)


@dataclass(slots=True)
class RequestPreempted(Event):
    """A running request lost its blocks (recompute later). ``reason`` is one of
    :data:`PREEMPTION_REASONS`; recordings made before it existed read as ``kv_full``,
    the only reason there was. What it held: ``blocks_freed`` blocks and
    ``computed_tokens_lost`` computed tokens, all to recompute when it resumes (less any
    prefix-cache hit then). ``for_request``: the running request whose next tokens found
    no free block and for which it made room (its own id when it was the last one left
    to give way); absent in recordings before it existed."""

    type: ClassVar[str] = "request.preempted"
    written_when_set: ClassVar[frozenset[str]] = frozenset({"dp_rank", "for_request"})
    request_id: str = ""
    computed_tokens_lost: int = 0
    blocks_freed: int = 0
    num_preemptions: int = 0
    reason: str = PREEMPTION_KV_FULL
    for_request: str = ""
    dp_rank: int = 0  # the data-parallel rank whose engine core it is; written only when not 0


# Why an aborted request was aborted (a ``request.finished`` event's ``abort_cause``).
ABORT_CLIENT_DISCONNECT = "client_disconnect"  # the client left or cancelled before the last token
ABORT_TIMEOUT = "timeout"  # a deadline the caller set ran out
ABORT_SHUTDOWN = "shutdown"  # the server stopped (--shutdown-timeout ran out, or it was stopped at once)
ABORT_CAUSES = (ABORT_CLIENT_DISCONNECT, ABORT_TIMEOUT, ABORT_SHUTDOWN)


@dataclass(slots=True)
class RequestFinished(Event):
    """A request left the engine. reason: ``stop`` | ``length`` | ``abort`` | ``error``
    (its own sampling or detokenising raised; ``error`` says what). Every request that
    reached the engine (``request.arrived``) gets exactly one.

    ``abort_cause`` (reason ``abort``): one of :data:`ABORT_CAUSES`; absent in recordings
    before it existed. ``computed_prompt_tokens``: for a request that ended before its
    first token, the prompt tokens whose KV it had computed (its prefill's work, which no
    token counter bills); absent (0) otherwise."""

    type: ClassVar[str] = "request.finished"
    written_when_set: ClassVar[frozenset[str]] = frozenset({"dp_rank", "error", "abort_cause",
                                                            "computed_prompt_tokens"})
    request_id: str = ""
    reason: str = "stop"
    prompt_tokens: int = 0
    output_tokens: int = 0
    prefix_hit_tokens: int = 0
    num_preemptions: int = 0
    queue_time_s: float = 0.0
    ttft_s: float | None = None
    e2e_s: float = 0.0
    prefill_time_s: float = 0.0
    decode_time_s: float = 0.0
    inference_time_s: float = 0.0
    inter_token_latencies_s: list[float] = field(default_factory=list)
    output_text: str | None = None  # only with --log-prompts
    error: str | None = None  # reason "error": the exception, in one line
    dp_rank: int = 0  # the data-parallel rank whose engine core it is; written only when not 0
    abort_cause: str = ""
    computed_prompt_tokens: int = 0


@dataclass(slots=True)
class RequestRejected(Event):
    type: ClassVar[str] = "request.rejected"
    written_when_set: ClassVar[frozenset[str]] = frozenset({"dp_rank"})
    request_id: str = ""
    reason: str = ""
    prompt_tokens: int = 0
    max_tokens: int = 0
    dp_rank: int = 0  # the data-parallel rank whose engine core it is; written only when not 0
