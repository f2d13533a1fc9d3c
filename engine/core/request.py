"""A request as the scheduler sees it: token ids, stop rules, status and timestamps.

Pure data: no torch, no clock. Every time stamp is a ``now`` value handed in by
the caller (wall seconds in the engine, simulated seconds in the simulator, the
step index in the driver), so the same request runs identically everywhere.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

from engine.core.encoder_cache import MultimodalInput
from engine.core.sampling_params import SamplingParams

# A request's block tables: one list of block ids per KV cache group (positions in order),
# in the groups' order; one list for a model whose layers all attend fully.
BlockTables = tuple[list[int], ...]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"  # this request's sampling or detokenising raised; the others go on

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset(
    {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED,
     RequestStatus.FINISHED_ERROR}
)

# The ``reason`` written in request.finished / step events.
FINISH_REASONS: dict[RequestStatus, str] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",  # vLLM V1's FinishReason.ERROR
}


class Request:
    """One generation request.

    Scheduler-owned state (read by everyone, written only by the scheduler and the
    KV cache manager): ``status``, ``num_computed_tokens`` (tokens whose KV is in
    the cache, advanced optimistically when a step is scheduled), ``block_tables``
    (:data:`BlockTables`: one table per KV cache group, positions in order, every
    group's covering the same positions; a sliding-window group's holds the null block
    where positions left the window; () while it holds no blocks), ``block_hashes``
    (chained hashes of its full blocks, filled lazily by the KV cache manager),
    ``num_cached_tokens`` (prefix-cache hit on first admission; -1 until then),
    ``num_preemptions``, ``queued_time`` (when :meth:`Scheduler.submit` took it; its
    ``arrival_time`` may be earlier: the time before is its preprocessing).

    ``sampling`` (:class:`~engine.core.sampling_params.SamplingParams`) is the model
    side's: temperature, top-p/top-k, seed and stop strings. The scheduler reads only
    ``max_tokens``, ``stop_token_ids``, ``eos_token_id`` and ``ignore_eos``.

    ``mm_inputs`` (vision-language requests): each image's or video's placeholder run
    in the prompt, in position order; the scheduler runs the encoder on one before a
    chunk covers it (engine/core/encoder_cache.py).
    """

    __slots__ = (
        "abort_cause",
        "arrival_order",
        "arrival_time",
        "block_hashes",
        "block_tables",
        "eos_token_id",
        "error",
        "finished_time",
        "first_scheduled_time",
        "first_token_time",
        "ignore_eos",
        "inter_token_latencies",
        "last_token_time",
        "max_tokens",
        "mm_inputs",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_hashed_blocks",
        "num_preemptions",
        "num_prompt_tokens",
        "output_text",
        "output_token_ids",
        "priority",
        "prompt_text",
        "prompt_token_ids",
        "queued_time",
        "request_id",
        "sampling",
        "status",
        "stop_token_ids",
        "token_ids",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        max_tokens: int = 16,
        *,
        stop_token_ids: Iterable[int] = (),
        eos_token_id: int | None = None,
        ignore_eos: bool = False,
        arrival_time: float = 0.0,
        priority: int = 0,
        sampling: SamplingParams | None = None,
        mm_inputs: tuple[MultimodalInput, ...] = (),
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.max_tokens = max_tokens
        self.stop_token_ids = frozenset(stop_token_ids)
        self.eos_token_id = eos_token_id
        self.ignore_eos = ignore_eos
        # arrival_time: when the request reached the engine's front door (the HTTP server's
        # receipt, vLLM's arrival_time); TTFT and e2e count from it. queued_time: when the
        # scheduler took it (set by Scheduler.submit); the queue time and the policy's
        # order count from it, so a replay orders requests as the run did.
        self.arrival_time = arrival_time
        self.queued_time = arrival_time
        self.arrival_order = 0  # set by the scheduler on arrival: breaks ties in queued_time
        self.priority = priority
        self.sampling = sampling
        self.mm_inputs = mm_inputs
        # Text is carried into events only with --log-prompts; otherwise both stay None.
        self.prompt_text: str | None = None
        self.output_text: str | None = None

        self.status = RequestStatus.WAITING
        # prompt + output, the sequence the KV cache holds; appended to, never rewritten.
        self.token_ids: list[int] = list(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.abort_cause = ""  # set by Scheduler.abort: why (engine/events/request_records.py ABORT_CAUSES)
        self.block_tables: BlockTables = ()  # made by the KV cache manager at the first allocation
        self.block_hashes: list[int] = []
        self.num_hashed_blocks = 0  # leading positions of the tables already registered in the prefix cache
        self.num_cached_tokens = -1
        self.num_preemptions = 0

        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finished_time: float | None = None
        self.error: str | None = None  # why it finished with reason "error"
        self.inter_token_latencies: list[float] = []

    # ---------------------------------------------------------------- derived
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_table_blocks(self) -> int:
        """Positions its tables cover, in blocks (every group's table covers the same)."""
        return len(self.block_tables[0]) if self.block_tables else 0

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    # ----------------------------------------------------------------- output
    def append_sampled(self, tokens: list[int], now: float, max_model_len: int) -> RequestStatus | None:
        """Append a step's sampled tokens (stamping the first token's and each gap's time) and
        apply the stop rules: the finished status the first stopping token gives (its later
        tokens are dropped), or None while it goes on."""
        for tok in tokens:
            self.token_ids.append(tok)
            self.output_token_ids.append(tok)
            last = self.last_token_time
            if last is None:
                self.first_token_time = now
            else:
                self.inter_token_latencies.append(now - last)
            self.last_token_time = now
            if tok in self.stop_token_ids or (not self.ignore_eos and tok == self.eos_token_id):
                return RequestStatus.FINISHED_STOPPED
            if len(self.output_token_ids) >= self.max_tokens or len(self.token_ids) >= max_model_len:
                return RequestStatus.FINISHED_LENGTH
        return None

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
            f"out={len(self.output_token_ids)}/{self.max_tokens}, computed={self.num_computed_tokens}, "
            f"blocks={self.num_table_blocks})"
        )
