"""One ``schedule`` call's plan: the step's token and encoder budgets, what it has scheduled so
far (undone for a request preempted after it was scheduled), and why the requests it left
waiting were not admitted (a step event's ``waiting_reasons``).

Pure like the scheduler that fills it: integers and requests, no torch, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.core.encoder_cache import EncoderCacheManager
from engine.core.policy import RequestQueue
from engine.core.request import Request
from engine.core.scheduler_config import SchedulerConfig
from engine.events.step_records import (
    WAIT_BEHIND,
    WAIT_ENCODER,
    WAIT_MAX_NUM_SEQS,
    WAIT_PREEMPTING,
    WAIT_PRIORITY,
    WAIT_TOKEN_BUDGET,
    WAITING_REASONS_CAP,
    step_token_budget,
)

if TYPE_CHECKING:
    from engine.core.scheduler import ScheduledRequest

# (request, item index, tokens): one image's or video's encoder run planned this step
EncoderInput = tuple[Request, int, int]


@dataclass(slots=True)
class StepPlan:
    """What one ``schedule`` call has decided so far."""

    budget: int
    limit: int  # the step's whole budget (``budget`` is what is left of it)
    long_prefill_token_threshold: int = 0  # a prompt chunk's cap (0: none)
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    tokens: dict[str, int] = field(default_factory=dict)
    preempted: list[str] = field(default_factory=list)
    new_ids: list[str] = field(default_factory=list)
    resumed_ids: list[str] = field(default_factory=list)
    num_prefill: int = 0
    num_decode: int = 0
    encoder_budget: int = 0
    encoder_inputs: list[EncoderInput] = field(default_factory=list)
    blocked: tuple[Request, list[Any]] | None = None  # the queue's head that stopped admission, and why
    prefix_lookups: dict[str, list[Any]] = field(default_factory=dict)

    @classmethod
    def for_step(cls, config: SchedulerConfig, running: list[Request]) -> StepPlan:
        """A new step's plan: its token budget (:func:`step_token_budget`), counting the running
        requests that decode only where a decode-step bound is set, and the encoder's."""
        decoding = (sum(1 for r in running if r.num_computed_tokens >= r.num_prompt_tokens)
                    if config.max_decode_step_tokens else 0)
        budget = step_token_budget(config.max_num_batched_tokens, config.max_decode_step_tokens, decoding)
        return cls(budget=budget, limit=budget, long_prefill_token_threshold=config.long_prefill_token_threshold,
                   encoder_budget=config.encoder_compute_budget)

    def chunk(self, remaining: int) -> int:
        """How many of ``remaining`` tokens fit this step (threshold, then budget)."""
        threshold = self.long_prefill_token_threshold
        if 0 < threshold < remaining:
            remaining = threshold
        return min(remaining, self.budget)

    def add(self, s: ScheduledRequest) -> None:
        self.scheduled.append(s)
        self.tokens[s.request.request_id] = s.num_tokens
        if s.is_prefill:
            self.num_prefill += s.num_tokens
        else:
            self.num_decode += s.num_tokens
        self.budget -= s.num_tokens

    def withdraw(self, req: Request) -> None:
        """Undo ``add`` for a request preempted after it was scheduled."""
        if not self.tokens.pop(req.request_id, 0):
            return
        for item in [e for e in self.encoder_inputs if e[0] is req]:
            self.encoder_inputs.remove(item)
            self.encoder_budget += item[2]
        for k, s in enumerate(self.scheduled):
            if s.request is req:
                del self.scheduled[k]
                self.budget += s.num_tokens
                if s.is_prefill:
                    self.num_prefill -= s.num_tokens
                else:
                    self.num_decode -= s.num_tokens
                return

    # ------------------------------------------------------------ the encoder
    def fit_encoder_inputs(self, req: Request, computed: int, num_new: int,
                           cache: EncoderCacheManager) -> tuple[int, list[EncoderInput]]:
        """vLLM's ``_try_schedule_encoder_inputs``: the items a chunk of ``num_new``
        tokens from ``computed`` reaches that are not cached yet, within the step's
        encoder compute budget and the cache's free room. The first that does not fit
        cuts the chunk before its placeholders (possibly to 0: not scheduled)."""
        items: list[EncoderInput] = []
        budget = self.encoder_budget
        room = cache.capacity - cache.used - sum(e[2] for e in self.encoder_inputs)
        for index, item in enumerate(req.mm_inputs):
            if item.offset >= computed + num_new:
                break  # beyond this chunk
            if item.end <= computed or cache.holds(req.request_id, index):
                continue  # consumed already, or its embeddings are parked
            if item.length > budget or item.length > room:
                return item.offset - computed, items
            budget -= item.length
            room -= item.length
            items.append((req, index, item.length))
        return num_new, items

    def take_encoder_inputs(self, encoded: list[EncoderInput]) -> None:
        """The items a scheduled chunk reaches run in this step's encoder, out of its budget."""
        self.encoder_inputs.extend(encoded)
        self.encoder_budget -= sum(e[2] for e in encoded)

    def encoder_reason(self, req: Request, computed: int) -> list[Any]:
        """The head's first image/video not yet encoded, against the encoder budget left."""
        item = next((m for m in req.mm_inputs if m.end > computed), req.mm_inputs[-1])
        return [WAIT_ENCODER, item.length, self.encoder_budget]

    # -------------------------------------------------------- waiting reasons
    def waiting_reasons(self, waiting: RequestQueue, num_running: int,
                        max_num_seqs: int) -> tuple[dict[str, list[Any]], int]:
        """Why each of the first ``WAITING_REASONS_CAP`` requests still waiting was not
        admitted this step, and how many more waited (a step event's ``waiting_reasons``)."""
        omitted = max(0, len(waiting) - WAITING_REASONS_CAP)
        if self.blocked is None:  # nobody was refused: admission never reached the queue
            common: list[Any]
            if self.preempted:
                common = [WAIT_PREEMPTING]
            elif num_running >= max_num_seqs:  # no slot: the budget left would not matter
                common = [WAIT_MAX_NUM_SEQS, max_num_seqs]
            else:
                common = [WAIT_TOKEN_BUDGET, self.limit]
            return {req.request_id: common for req in waiting.head(WAITING_REASONS_CAP)}, omitted
        blocked, why = self.blocked
        reasons: dict[str, list[Any]] = {}
        for req in waiting.head(WAITING_REASONS_CAP):
            if req is blocked:
                reasons[req.request_id] = why
            else:
                code = WAIT_PRIORITY if blocked.priority < req.priority else WAIT_BEHIND
                reasons[req.request_id] = [code, blocked.request_id]
        return reasons, omitted
