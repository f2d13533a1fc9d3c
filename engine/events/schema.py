"""Typed engine events, the event bus and the JSONL recording format.

Events are the single source of truth (docs/architecture.md): the monitor, the
Prometheus metrics, the periodic stats line, replay and the tests all read these
records and nothing else. An event is a small slotted dataclass; serialisation
happens only in sinks, so publishing with nobody listening costs almost nothing.

Every event carries ``type``, ``seq`` (monotonic integer) and ``t`` (seconds since
engine start on the bus clock). Producers build events without ``seq``/``t``; the
bus stamps both when it publishes, using the clock it was given (wall monotonic
for the real engine, simulated seconds for ``engine simulate``).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TextIO

import msgspec

from engine.logs import log_failure

SCHEMA_NAME = "kvscope.events"
SCHEMA_VERSION = 1


@dataclass(slots=True)
class Event:
    """Base of every event. ``type`` is a class constant, the wire name."""

    type: ClassVar[str] = "event"
    # Fields written only when non-empty: facts recorded only when a feature asks for
    # them (the KV cache events' block contents), so a recording made without it is
    # byte for byte what it was before the field existed.
    written_when_set: ClassVar[frozenset[str]] = frozenset()
    seq: int = field(default=0, kw_only=True)
    t: float = field(default=0.0, kw_only=True)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type}
        optional = self.written_when_set
        for name in _field_names(type(self)):
            value = getattr(self, name)
            if optional and not value and name in optional:
                continue
            out[name] = value
        return out


# ---------------------------------------------------------------- configuration
@dataclass(slots=True)
class EngineConfigEvent(Event):
    """Every flag and the model summary, emitted once before phase A."""

    type: ClassVar[str] = "engine.config"
    config: dict[str, Any] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)
    planned: bool = False


# ---------------------------------------------------------------------- startup
PHASES: dict[str, str] = {
    "A": "init",
    "B": "budget",
    "C": "load_weights",
    "D": "profile_run",
    "E": "kv_cache",
    "F": "graphs_compile",
    "G": "ready",
}


@dataclass(slots=True)
class StartupPhase(Event):
    """One startup phase boundary.

    status: ``begin`` | ``end`` | ``skipped`` | ``failed``. ``memory_before`` /
    ``memory_after`` hold device readings in bytes (total, free, allocated,
    reserved, peak, source). ``data`` holds the phase's own numbers (weights
    bytes, measured activation peak, KV pool bytes/blocks/tokens, concurrency...) in
    their JSON form; engine/events/phase_data.py declares them, one record per phase
    (``phase_record(event)``, ``read_phase(event, KvCacheData)``; producers publish
    ``record.to_dict()``). ``planned`` marks numbers from ``engine plan``;
    ``simulated`` from ``engine simulate``. ``rank``: the tensor-parallel rank whose
    phase it is (every rank runs A–G; rank 0 publishes the others' phases too), on every
    rank's events, rank 0's included; None (not written) when the replica has one rank,
    so a one-rank recording is what it always was. ``pp_rank`` / ``tp_rank``: under
    pipeline parallelism, the stage whose phase it is and the rank within the stage
    (every stage runs A–G for its own layers and KV pool, engine/pipeline.py); None (not
    written) otherwise. ``fixes``: a refused budget's fixes as data (engine/budget/fixes.py
    ``Fix.to_json``: flag, current, proposed, why), any one of which makes it fit; the
    ``reason`` sentence is rendered from them. Written only on a failure that has them, so
    other recordings are as they were; older recordings have the sentence alone.
    """

    type: ClassVar[str] = "startup.phase"
    written_when_set: ClassVar[frozenset[str]] = frozenset({"rank", "pp_rank", "tp_rank", "fixes"})
    phase: str = "A"
    name: str = "init"
    status: str = "begin"
    duration_s: float | None = None
    memory_before: dict[str, Any] | None = None
    memory_after: dict[str, Any] | None = None
    data: dict[str, Any] = field(default_factory=dict)
    reason: str | None = None
    fixes: list[dict[str, Any]] = field(default_factory=list)
    planned: bool = False
    simulated: bool = False
    rank: int | None = None
    pp_rank: int | None = None
    tp_rank: int | None = None

    def to_dict(self) -> dict[str, Any]:
        out = Event.to_dict(self)  # drops rank 0 with None (written_when_set): rank 0 goes back in
        for name in ("rank", "pp_rank", "tp_rank"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out


@dataclass(slots=True)
class StartupProgress(Event):
    """How far a long phase has got: ``done`` of ``total`` ``unit`` (total None when
    unknown) of ``what`` (``weights``, ``profile run``, ``kernels``, ``warm-up``), so
    the console, the dashboard and a recording show a phase that is moving."""

    type: ClassVar[str] = "startup.progress"
    phase: str = "C"
    what: str = ""
    done: float = 0.0
    total: float | None = None
    unit: str = ""

@dataclass(slots=True)
class StartupEta(Event):
    """The startup's prediction of itself (engine/startup_eta.py), published once before
    phase A: ``phases`` maps each phase letter to its predicted seconds, ``sources`` to where
    that came from (``history``: this machine's earlier starts of the same model and flags;
    ``read rate``: the model's bytes over phase C's measured read rate; ``machine``: other
    starts here; ``default``), ``starts`` counts the earlier starts read, ``key`` names the
    model and flags. The dashboard shows elapsed against predicted; ``/health`` the ETA."""

    type: ClassVar[str] = "startup.eta"
    phases: dict[str, float] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    starts: int = 0
    key: str = ""


# --------------------------------------------------------------------- requests
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


# ------------------------------------------------------------------------ steps
# Why a waiting request was not admitted in a step (a step event's ``waiting_reasons``:
# request id -> [code, details...]); what no fold of the other fields can tell.
WAIT_TOKEN_BUDGET = "token_budget"  # [code, the step's budget]: its token budget was spent (--max-num-batched-tokens, or --max-decode-step-tokens in a step with decodes)
WAIT_MAX_NUM_SEQS = "max_num_seqs"  # [code, max_num_seqs]: every sequence slot was taken
WAIT_BLOCKS = "blocks"  # [code, blocks needed, blocks free]: the pool is short for its next chunk now
WAIT_NEVER_FITS = "never_fits"  # [code, blocks needed, blocks in the pool]: it can never be admitted
WAIT_BEHIND = "behind"  # [code, head id]: an earlier request at the head of the queue could not be admitted
WAIT_PRIORITY = "priority"  # [code, head id]: a higher-priority request ahead could not be admitted
WAIT_ENCODER = "encoder_budget"  # [code, item tokens, encoder budget left]: its image/video does not fit
WAIT_PREEMPTING = "preempting"  # [code]: a running request was preempted this step, so nobody is admitted
WAIT_REASONS = (WAIT_TOKEN_BUDGET, WAIT_MAX_NUM_SEQS, WAIT_BLOCKS, WAIT_NEVER_FITS, WAIT_BEHIND, WAIT_PRIORITY,
                WAIT_ENCODER, WAIT_PREEMPTING)
WAITING_REASONS_CAP = 16  # requests explained per step, from the head of the queue; the rest are counted


def step_token_budget(max_num_batched_tokens: int, max_decode_step_tokens: int, decoding: int) -> int:
    """A step's token budget: ``max_num_batched_tokens``, or, with ``max_decode_step_tokens``
    set below it and ``decoding`` running requests decoding, that bound (at least one token per
    decoding request). The scheduler's rule (engine/core/scheduler.py) and the doctor's reading
    of a recorded step's budget (a ``token_budget`` wait names it): here, where both may import it."""
    if not decoding or not 0 < max_decode_step_tokens < max_num_batched_tokens:
        return max_num_batched_tokens
    return min(max_num_batched_tokens, max(max_decode_step_tokens, decoding))


# Where an admitted request's prefix-cache match stopped (a step event's ``prefix_lookups``:
# request id -> [hit tokens, cause, details...]).
PREFIX_SHORT_PROMPT = "short_prompt"  # the prompt is shorter than one block: nothing can be cached
PREFIX_LAST_TOKEN = "last_token"  # every block hit but the last, which holds the last prompt token (always recomputed)
PREFIX_COMPLETE = "complete"  # every full block hit; only the partial last block is computed
PREFIX_DIVERGED = "diverged"  # no cached chain continues at token k = hit tokens
PREFIX_EVICTED = "evicted"  # [hit, cause, step, block]: the next block was cached but evicted at that step
PREFIX_WINDOW = "sliding_window"  # [hit, cause, full-attention hit]: a sliding window lacked the blocks before it
PREFIX_CAUSES = (PREFIX_SHORT_PROMPT, PREFIX_LAST_TOKEN, PREFIX_COMPLETE, PREFIX_DIVERGED, PREFIX_EVICTED,
                 PREFIX_WINDOW)


@dataclass(slots=True)
class StepEvent(Event):
    """One scheduler step: decisions, block deltas and time split.

    ``scheduled`` maps request id -> [num_tokens, kind] with kind ``prefill`` or
    ``decode``. Block deltas, enough to rebuild the block table by folding:
    ``allocated`` request id -> block ids appended to its table this step (in
    order; includes prefix-cache hits on admission), ``freed`` request id -> block
    ids it released (finish, abort or preemption), ``cached`` block ids that became
    full and hashed this step, ``evicted`` block ids whose cached contents were
    dropped to be reused.

    With vLLM's ``enable_kv_cache_events`` (``--kv-events-config``) the step also says
    what the prefix cache gained and lost, the facts of vLLM's KV cache events:
    ``cached_runs`` the blocks of ``cached`` (same order) as runs of one request's
    consecutive blocks, ``{"block_ids", "hashes", "parent_hash", "token_ids"}``
    (``parent_hash``: the hash of the block before the run's first, null for a
    request's first block; ``token_ids``: block_size per block), and
    ``evicted_hashes`` the hash each block of ``evicted`` lost. Hashes are kvscope's
    (engine/core/kv_cache.py). Both are absent otherwise and in older recordings
    (read as empty).

    A KV cache of several groups, or with a sliding window
    (engine/core/kv_cache_coordinator.py), says which group each block change belongs to:
    ``allocated`` and ``freed`` list every group's blocks, group after group, and
    ``allocated_groups`` / ``freed_groups`` request id -> how many of them each group
    has; ``cached_groups`` / ``evicted_groups`` the group of each ``cached`` /
    ``evicted`` block. ``freed_by_window`` request id -> the blocks a sliding-window
    group released because they left the window while the request ran (never in
    ``freed``), ``freed_by_window_groups`` their counts per group. A ``cached_runs``
    entry carries its ``group_idx``. All absent for one full-attention group.

    What no fold can derive (issue 33), written when there is something to say:
    ``waiting_reasons`` request id -> [code, details...] (:data:`WAIT_REASONS`) for the
    first :data:`WAITING_REASONS_CAP` requests left waiting after the step's admissions, in
    queue order, and ``waiting_reasons_omitted`` how many more waited; ``prefix_lookups``
    request id -> [hit tokens, cause, details...] (:data:`PREFIX_CAUSES`) for each request
    admitted (new or resumed) with prefix caching on. Absent in older recordings.
    """

    type: ClassVar[str] = "step"
    written_when_set: ClassVar[frozenset[str]] = frozenset({"cached_runs", "evicted_hashes", "collective_s", "dp_rank",
                                                            "pipeline_bubble_s", "pipeline_bytes",
                                                            "collective_bytes", "collective_calls", "expert_counts",
                                                            "allocated_groups", "freed_groups", "cached_groups",
                                                            "evicted_groups", "freed_by_window",
                                                            "freed_by_window_groups", "waiting_reasons",
                                                            "waiting_reasons_omitted", "prefix_lookups",
                                                            "prompt_logprob_rows"})
    index: int = 0
    scheduled: dict[str, list[Any]] = field(default_factory=dict)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0  # after the step: finished requests' blocks already freed
    kv_blocks_cached_free: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used_forward: int = 0  # held during the forward pass (0 in recordings before it existed)
    kv_tokens_read: int = 0  # KV entries attention read: each scheduled context to its new tokens' end (0: older recording)
    allocated: dict[str, list[int]] = field(default_factory=dict)
    freed: dict[str, list[int]] = field(default_factory=dict)
    cached: list[int] = field(default_factory=list)
    evicted: list[int] = field(default_factory=list)
    cached_runs: list[dict[str, Any]] = field(default_factory=list)
    evicted_hashes: list[int] = field(default_factory=list)
    new: list[str] = field(default_factory=list)
    resumed: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    finished: dict[str, str] = field(default_factory=dict)
    prefix_queries_tokens: int = 0
    prefix_hits_tokens: int = 0
    duration_s: float = 0.0
    schedule_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    update_s: float = 0.0
    # Tensor parallelism (rank 0's view): seconds in the layers' all-reduces and the
    # logits gather, the bytes rank 0 contributed to them, and how many there were
    # (2 per layer + the embedding's + the gather). Absent with one rank.
    collective_s: float = 0.0
    collective_bytes: int = 0
    collective_calls: int = 0
    # Pipeline parallelism (engine/pipeline.py): per stage, the seconds it waited on the stage
    # before it (stage 0: on the last stage's results) and the activation bytes it sent. Absent with one stage.
    pipeline_bubble_s: list[float] = field(default_factory=list)
    pipeline_bytes: list[int] = field(default_factory=list)
    # A hybrid KV cache's groups (see the docstring); absent with one full-attention group.
    allocated_groups: dict[str, list[int]] = field(default_factory=dict)
    freed_groups: dict[str, list[int]] = field(default_factory=dict)
    cached_groups: list[int] = field(default_factory=list)
    evicted_groups: list[int] = field(default_factory=list)
    freed_by_window: dict[str, list[int]] = field(default_factory=dict)
    freed_by_window_groups: dict[str, list[int]] = field(default_factory=dict)
    # A mixture-of-experts model (engine/model/moe.py): per MoE layer, in the model's order, the
    # tokens the router sent to each expert in this step (a row sums to tokens x top-k;
    # folded by engine/events/folds/expert_load.py). Absent for a dense model.
    expert_counts: list[list[int]] = field(default_factory=list)
    dp_rank: int = 0  # the data-parallel rank whose engine core it is; written only when not 0
    # Why requests waited and where prefix matches stopped (see the docstring).
    waiting_reasons: dict[str, list[Any]] = field(default_factory=dict)
    waiting_reasons_omitted: int = 0
    prefix_lookups: dict[str, list[Any]] = field(default_factory=dict)
    # vLLM's prompt_logprobs: the prompt positions the LM head ran on for them this step, beyond
    # the one sampled row per sequence every step has. Absent (0) when no request asked.
    prompt_logprob_rows: int = 0


@dataclass(slots=True)
class EncoderStepEvent(Event):
    """A vision-language step's encoder work and encoder-cache occupancy, published
    just before the step's ``step`` event (``index`` is the same) and only by runs of a
    model with an encoder, so text recordings stay as they were. ``encoded``: [request
    id, item index, tokens] the encoder produced this step; ``freed``: [request id,
    item index] whose embeddings left the cache after it (consumed by the prefill,
    preempted or finished); ``cache_used_tokens`` of ``cache_capacity_tokens`` after
    the step (vLLM's encoder cache budget)."""

    type: ClassVar[str] = "encoder.step"
    index: int = 0
    encoded: list[list[Any]] = field(default_factory=list)
    freed: list[list[Any]] = field(default_factory=list)
    encoder_tokens: int = 0
    cache_used_tokens: int = 0
    cache_capacity_tokens: int = 0
    encode_s: float = 0.0


@dataclass(slots=True)
class StatsEvent(Event):
    """The periodic summary vLLM prints every --stats-interval seconds."""

    type: ClassVar[str] = "stats"
    interval_s: float = 0.0
    prompt_throughput: float = 0.0
    generation_throughput: float = 0.0
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_hit_rate: float = 0.0
    num_preemptions: int = 0


@dataclass(slots=True)
class SnapshotEvent(Event):
    """The whole visible state at once, sent first to a new live subscriber."""

    type: ClassVar[str] = "snapshot"
    state: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class LogEvent(Event):
    """A free-form engine message (warnings, refusals) for event consumers."""

    type: ClassVar[str] = "log"
    level: str = "info"
    message: str = ""
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class EngineStopped(Event):
    """The engine loop raised out of a step: its own state is unknown, so it stopped (the
    server answers /health 503 and exits 1). ``error`` is the exception in one line."""

    type: ClassVar[str] = "engine.stopped"
    error: str = ""


@dataclass(slots=True)
class EngineStalled(Event):
    """An engine core has work and finished no step within the stall limit (``--stall-timeout``;
    engine/serve/stall.py): ``rank`` (the data-parallel rank, 0 for one core) is alive or not,
    but makes no progress. ``phase`` is what its step was doing (engine/heartbeat.py's phases),
    ``stalled_s`` how long it had been at it, ``last_step`` the last step it finished (its
    ``index``, None before any), ``requests`` the ids it held, ``dump`` the file of its stacks,
    last step and requests (None when none could be written)."""

    type: ClassVar[str] = "engine.stalled"
    rank: int = 0
    phase: str = ""
    stalled_s: float = 0.0
    limit_s: float = 0.0
    last_step: int | None = None
    num_waiting: int = 0
    num_running: int = 0
    requests: list[str] = field(default_factory=list)
    dump: str | None = None


@dataclass(slots=True)
class EngineRecovered(Event):
    """A stalled engine core finished a step again (or its work left): ``stalled_s`` from the
    start of the stalled step (or the last sign of progress) until now."""

    type: ClassVar[str] = "engine.recovered"
    rank: int = 0
    stalled_s: float = 0.0
    last_step: int | None = None


@dataclass(slots=True)
class SinkFailed(Event):
    """A subscriber of the bus (the recording, an exporter, a metrics fold) raised: the
    bus stopped delivering to it and the engine went on. ``sink`` names it, ``error``
    is the exception in one line, ``at_event`` the type of the event it failed on."""

    type: ClassVar[str] = "sink.failed"
    sink: str = ""
    error: str = ""
    at_event: str = ""


# ------------------------------------------------------- other engines' streams
@dataclass(slots=True)
class MetricsScrape(Event):
    """One scrape of another server's Prometheus ``/metrics`` (a vLLM replica, or a
    kvscope one watched through its vLLM families): ``text`` is the exposition text
    as served, less comment and ``_created`` lines, so a recording replays through
    the same parser the live monitor uses."""

    type: ClassVar[str] = "metrics.scrape"
    source: str = ""
    text: str = ""


@dataclass(slots=True)
class KvEventBatch(Event):
    """One vLLM KV-cache ``EventBatch`` as received from its ZMQ publisher:
    ``batch_seq`` the publisher's sequence number, ``ts`` its timestamp, ``events``
    the BlockStored / BlockRemoved / AllBlocksCleared maps (each tagged ``type``)."""

    type: ClassVar[str] = "kv.events"
    source: str = ""
    batch_seq: int = 0
    ts: float = 0.0
    events: list[dict[str, Any]] = field(default_factory=list)
    data_parallel_rank: int | None = None


EVENT_TYPES: dict[str, type[Event]] = {
    cls.type: cls
    for cls in (
        EngineConfigEvent,
        StartupPhase,
        StartupProgress,
        StartupEta,
        RequestArrived,
        RequestScheduled,
        RequestFirstToken,
        RequestPreempted,
        RequestFinished,
        RequestRejected,
        StepEvent,
        EncoderStepEvent,
        StatsEvent,
        SnapshotEvent,
        LogEvent,
        EngineStopped,
        EngineStalled,
        EngineRecovered,
        SinkFailed,
        MetricsScrape,
        KvEventBatch,
    )
}

_FIELD_CACHE: dict[type, tuple[str, ...]] = {}


def _field_names(cls: type) -> tuple[str, ...]:
    names = _FIELD_CACHE.get(cls)
    if names is None:
        names = tuple(f.name for f in dataclasses.fields(cls))
        _FIELD_CACHE[cls] = names
    return names


def event_from_dict(data: dict[str, Any]) -> Event:
    """Rebuild a typed event from its JSON form, each field checked against its
    declared type (engine/events/validate.py); unknown keys are ignored so older
    readers survive newer writers. ValueError (a ``SchemaError`` naming the field)
    when a value is of the wrong type or the ``type`` is unknown."""
    from engine.events.validate import event_from_row  # it imports this module's classes

    return event_from_row(data)


# -------------------------------------------------------------------------- bus
Subscriber = Callable[[Event], None]


class EventBus:
    """Synchronous fan-out of events to subscribers.

    ``publish`` stamps ``seq`` and ``t`` and calls every subscriber in order.
    Thread-safe subscribe/unsubscribe; publishing happens on the engine thread.
    An event published by a subscriber while an event is being delivered (the
    stats reporter's ``stats`` event) is queued and delivered right after it, so
    every subscriber sees events in ``seq`` order.

    A subscriber that raises never stops the publisher: it is unsubscribed, the
    failure is logged once with its traceback, kept in ``failed_sinks`` and
    published as a :class:`SinkFailed` event to the subscribers left (the metrics
    count it, the view and ``/health`` show it), and delivery goes on.
    """

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        self._start = time.monotonic()
        self._clock = clock or (lambda: time.monotonic() - self._start)
        self._subscribers: tuple[Subscriber, ...] = ()
        self._lock = threading.Lock()
        self._seq = 0
        self._delivering = False
        self._queued: collections.deque[Event] = collections.deque()
        self._guard: threading.RLock | None = None  # see guard()
        self.failed_sinks: dict[str, str] = {}  # sink name -> the error that stopped it

    @property
    def has_subscribers(self) -> bool:
        return bool(self._subscribers)

    def now(self) -> float:
        return self._clock()

    def set_clock(self, clock: Callable[[], float]) -> None:
        self._clock = clock

    def subscribe(self, fn: Subscriber) -> Subscriber:
        with self._lock:
            self._subscribers = (*self._subscribers, fn)
        return fn

    def unsubscribe(self, fn: Subscriber) -> None:
        with self._lock:
            self._subscribers = tuple(s for s in self._subscribers if s is not fn)

    def guard(self) -> None:
        """From now on every publish holds a lock, so another thread may publish too: the
        stall detector's ``engine.stalled`` while the engine thread is stuck mid-step (the
        lock is free then; held, it is held for one event's delivery)."""
        if self._guard is None:
            self._guard = threading.RLock()

    def publish(self, event: Event) -> Event:
        guard = self._guard
        if guard is None:
            return self._publish(event)
        with guard:
            return self._publish(event)

    def _publish(self, event: Event) -> Event:
        self._seq += 1
        event.seq = self._seq
        event.t = self._clock()
        if self._delivering:
            self._queued.append(event)
            return event
        self._delivering = True
        try:
            self._deliver(event)
            queued = self._queued
            while queued:
                self._deliver(queued.popleft())
        finally:
            self._delivering = False
        return event

    def _deliver(self, event: Event) -> None:
        for fn in self._subscribers:
            try:
                fn(event)
            except Exception as exc:
                self._stop_failed(fn, event, exc)

    def _stop_failed(self, fn: Subscriber, event: Event, exc: Exception) -> None:
        """Unsubscribe a subscriber that raised; say so once (a log line with the traceback,
        a ``sink.failed`` event queued for the subscribers left)."""
        self.unsubscribe(fn)
        name = sink_name(fn)
        error = f"{type(exc).__name__}: {exc}"
        self.failed_sinks[name] = error
        log_failure("kvscope.events", f"event sink {name} failed on a {event.type} event and is stopped; "
                                      "the engine goes on without it")
        failed = SinkFailed(sink=name, error=error, at_event=event.type)
        self._seq += 1
        failed.seq, failed.t = self._seq, self._clock()
        self._queued.append(failed)


def sink_name(fn: Subscriber) -> str:
    """What the logs, ``/health`` and the metrics call a subscriber: its ``sink_name``
    attribute when it has one, else its class or function name."""
    named = getattr(fn, "sink_name", None)
    if isinstance(named, str):
        return named
    owner = getattr(fn, "__self__", None)  # a bound method: its object's name
    if owner is not None:
        return sink_name(owner)
    return getattr(fn, "__qualname__", None) or type(fn).__name__


# ------------------------------------------------------------------------ JSONL
def _json_default(obj: Any) -> Any:
    """What msgspec cannot encode by itself (it does dicts, lists, tuples, sets,
    dataclasses): paths as strings, numpy/torch scalars as numbers, the rest as text."""
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "item"):
        return obj.item()
    return str(obj)


# msgspec, not json: a step event with a full batch encodes ~5x faster, and every sink
# that writes events (the JSONL file, the server's /events history) pays it per event.
# Compact, UTF-8 as is, floats in shortest round-trip form; a NaN becomes null.
_ENCODER = msgspec.json.Encoder(enc_hook=_json_default)


def dumps(obj: Any) -> str:
    return _ENCODER.encode(obj).decode()


# the last event serialised by event_line, with the stamps it had then, and its line
_last_line: tuple[Event | None, int, float, str] = (None, 0, 0.0, "")


def event_line(event: Event) -> str:
    """``dumps(event.to_dict())``, made once however many sinks write the event (the recording
    and ``/events`` each did it again, one after the other on the publishing thread)."""
    global _last_line
    last = _last_line  # one read: another thread's assignment replaces the whole tuple
    if last[0] is event and last[1] == event.seq and last[2] == event.t:
        return last[3]
    line = dumps(event.to_dict())
    _last_line = (event, event.seq, event.t, line)
    return line


def header(config: dict[str, Any] | None = None, started_unix: float | None = None) -> dict[str, Any]:
    """The first line of a recording. ``started_unix``: the wall-clock time of the bus
    clock's zero (an event at ``t`` happened at ``started_unix + t``), written when
    known, so a replay can re-emit spans at their original times."""
    out: dict[str, Any] = {"schema": SCHEMA_NAME, "version": SCHEMA_VERSION, "config": config or {}}
    if started_unix is not None:
        out["started_unix"] = started_unix
    return out


class JsonlSink:
    """Writes one event per line after a header line.

    Each line is written whole with a single ``write`` and flushed per step,
    phase and request lifecycle event, so a reader of a file cut at any byte
    loses at most the last line. A write that fails (a full disk) cuts the file
    back to its last whole line, closes it and raises: the bus stops this sink and
    the engine goes on; the recording stays readable up to that line.
    """

    sink_name = "jsonl"

    def __init__(self, path: str | Path | TextIO, config: dict[str, Any] | None = None,
                 started_unix: float | None = None) -> None:
        if isinstance(path, str | Path):
            self._file: TextIO = open(path, "w", encoding="utf-8")  # noqa: SIM115
            self._owns = True
            self.sink_name = f"jsonl {path}"
        else:
            self._file = path
            self._owns = False
        self._lock = threading.Lock()
        first = dumps(header(config, started_unix))
        self._write_line(first)
        self._file.flush()
        self._whole_lines_end = len(first.encode("utf-8")) + 1  # bytes that are whole lines (an owned file)

    def _write_line(self, line: str) -> None:
        self._file.write(line + "\n")

    def __call__(self, event: Event) -> None:
        line = event_line(event)
        with self._lock:
            if self._file.closed:
                return
            try:
                self._write_line(line)
                self._file.flush()
            except OSError:
                self._cut_to_whole_lines()
                raise
            if self._owns:
                self._whole_lines_end += len(line.encode("utf-8", "surrogatepass")) + 1

    def _cut_to_whole_lines(self) -> None:
        """After a failed write: drop the part-written line (and whatever the buffer still
        holds, which a later flush would append mid-line), then close the file."""
        if not self._owns:
            return
        with contextlib.suppress(OSError, ValueError):
            os.ftruncate(self._file.fileno(), self._whole_lines_end)
        buffer = getattr(self._file, "buffer", None)
        with contextlib.suppress(OSError, ValueError):
            # closing the raw file directly: the text and byte buffers would retry the write
            raw = getattr(buffer, "raw", None)
            if raw is not None:
                raw.close()
        with contextlib.suppress(OSError, ValueError):
            self._file.close()

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.flush()
                if self._owns:
                    self._file.close()


@dataclass(slots=True)
class Recording:
    """A parsed event file: header, events, and whether the tail was cut."""

    header: dict[str, Any]
    events: list[Event]
    truncated: bool = False

    @property
    def config(self) -> dict[str, Any]:
        return self.header.get("config", {})


def iter_jsonl(source: str | Path | TextIO) -> Iterator[dict[str, Any] | None]:
    """Yield each JSON object of an event file; ``None`` for a line that does not
    parse (a line cut by a crash or a partial copy)."""
    for _, row in _numbered_rows(source):
        yield row


def _numbered_rows(source: str | Path | TextIO | bytes, name: str | None = None,
                   max_total_bytes: int | None = None) -> Iterator[tuple[int, dict[str, Any] | None]]:
    """(line number, JSON object or None) for each non-blank line, read through the bounded
    reader (engine/events/bounded.py: plain or gzipped, line-length, depth and size caps)."""
    from engine.events.bounded import MAX_LINE_BYTES, InputLimitError, check_json_depth, text_lines
    from engine.events.validate import decode_object

    name = name or (str(source) if isinstance(source, str | Path) else "<stream>")
    lines: Iterable[tuple[int, str]]
    if isinstance(source, str | Path | bytes):
        lines = text_lines(source, name, max_total_bytes)
    else:
        lines = enumerate(source, start=1)
    for number, line in lines:
        if len(line) > MAX_LINE_BYTES:
            raise InputLimitError(f"{name}: line {number}: longer than {MAX_LINE_BYTES >> 20} MiB: not a recording")
        line = line.strip()
        if line:
            check_json_depth(line, name, number)
            yield number, decode_object(line)


def read_events(source: str | Path | TextIO | bytes, name: str | None = None) -> Recording:
    """Read a JSONL recording, tolerating a truncated last line.

    Raises ``ValueError`` naming the file (``name``, else the path) and the line when
    the header is missing or of another schema, when a line that is not the last one
    does not parse (only a cut tail is expected), and when a field of the header or of
    an event is not of its declared type (engine/events/validate.py: the field is named).
    """
    from engine.events.bounded import max_recording_bytes
    from engine.events.validate import SchemaError, event_from_row

    name = name or (str(source) if isinstance(source, str | Path) else "<stream>")
    # streamed: the header is judged before the second line is read, a bad line before the next one
    rows = _numbered_rows(source, name, max_recording_bytes())
    first = next(rows, None)
    head = first[1] if first else None
    if first is None or head is None or head.get("schema") != SCHEMA_NAME:
        raise ValueError(f"{name}: not a kvscope event file (first line must be the {SCHEMA_NAME} header)")
    _check_head(head, name, first[0])
    events: list[Event] = []
    bad: tuple[int, str | None] | None = None  # a line that is not an event: a cut tail if nothing follows
    for number, row in rows:
        if bad is not None:
            raise ValueError(f"{name}: line {bad[0]} is not a valid event")
        kind = row.get("type") if row is not None else None
        if row is None or not isinstance(kind, str) or kind not in EVENT_TYPES:
            bad = (number, None)
            continue
        try:
            events.append(event_from_row(row))
        except SchemaError as exc:  # a whole line with a value of the wrong type: damage, not a cut
            raise ValueError(f"{name}: line {number}: {kind} event's {exc}") from None
    return Recording(header=head, events=events, truncated=bad is not None)


def _check_head(head: dict[str, Any], name: str, number: int) -> None:
    from engine.events.validate import SchemaError, check_header

    try:
        check_header(head)
    except SchemaError as exc:
        raise ValueError(f"{name}: line {number}: the header's {exc}") from None
    if head.get("version", 0) > SCHEMA_VERSION:
        raise ValueError(
            f"{name}: line {number} (the header): schema version {head.get('version')} is newer than this "
            f"kvscope reads ({SCHEMA_VERSION})"
        )


def open_sink(path: str | os.PathLike[str], config: dict[str, Any] | None = None) -> JsonlSink:
    return JsonlSink(Path(path), config)
