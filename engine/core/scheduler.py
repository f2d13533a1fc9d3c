"""The continuous-batching scheduler, in vLLM V1's order.

One token-budget loop covers every case; there are no prefill and decode phases,
only requests whose ``num_computed_tokens`` catch up with their ``token_ids``:

1. Running requests first, in admission order: each gets its next prompt chunk or
   its one decode token. When the pool cannot supply a block, the most recently
   admitted running request (with the priority policy: the worst priority, latest
   arrival) is preempted — blocks freed, progress reset, put at the front of the
   waiting queue — and the allocation retried. A request with nothing to compute
   is skipped (``continue``, not ``break``), as in vLLM.
   A step's budget is ``max_num_batched_tokens``; with ``max_decode_step_tokens`` set
   (kvscope's, on CPU by default), a step in which some running request decodes gets
   at most that many (at least one per decoding request), so a long prompt stalls the
   decodes beside it for one bounded step, while a step with no decode to stall (only
   prompts) may still take the whole budget.
2. Waiting requests, only if nothing was preempted this step, while budget,
   ``max_num_seqs`` and blocks allow: prefix lookup, then as much of the prompt as
   the budget (and ``long_prefill_token_threshold``) leaves: chunked prefill. The
   first that does not fit stops admission (head-of-line).
3. ``num_computed_tokens`` advances optimistically for everything scheduled; the
   model runs; ``update_from_output`` appends the sampled tokens, applies stop
   rules, finishes and frees.

No torch, no clock, no I/O: time enters as ``now`` arguments (wall seconds in the
engine, simulated seconds in the simulator, step indices in the driver) and
lifecycle events go to an optional :class:`~engine.events.EventBus`. Nothing is
built for events when the bus has no subscribers.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.core.block_pool import BlockDeltas
from engine.core.encoder_cache import EncoderCacheManager
from engine.core.kv_cache import KVCacheManager
from engine.core.policy import create_request_queue
from engine.core.request import FINISH_REASONS, BlockTables, Request, RequestStatus
from engine.core.scheduler_config import SchedulerConfig
from engine.core.step_plan import StepPlan
from engine.events import (
    EventBus,
    RequestArrived,
    RequestFinished,
    RequestFirstToken,
    RequestPreempted,
    RequestRejected,
    RequestScheduled,
)
from engine.events.request_records import ABORT_CLIENT_DISCONNECT


class ScheduledRequest:
    """What the model runner needs for one request in one step.

    ``token_ids`` are the tokens to compute (positions ``start_position`` ..
    ``start_position + num_tokens - 1``); ``block_tables`` are the request's whole
    tables, one per KV cache group in the config's group order (live lists: valid until
    the next ``schedule``; the null block where a sliding window freed a position), and
    ``block_ids`` the first of them (every group's table covers the same positions);
    ``samples`` is
    True when this step reaches the end of the known tokens, so the runner must
    sample one token for it (a prompt's last chunk or a decode step).
    """

    __slots__ = ("is_prefill", "num_tokens", "request", "samples", "start_position")

    def __init__(
        self, request: Request, start_position: int, num_tokens: int, is_prefill: bool, samples: bool
    ) -> None:
        self.request = request
        self.start_position = start_position
        self.num_tokens = num_tokens
        self.is_prefill = is_prefill
        self.samples = samples

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def block_tables(self) -> BlockTables:
        """One block table per KV cache group (live lists, valid until the next ``schedule``)."""
        return self.request.block_tables

    @property
    def block_ids(self) -> list[int]:
        """The first group's table (its length is every group's)."""
        return self.request.block_tables[0]

    @property
    def token_ids(self) -> list[int]:
        start = self.start_position
        return self.request.token_ids[start : start + self.num_tokens]

    @property
    def kind(self) -> str:
        return "prefill" if self.is_prefill else "decode"


@dataclass(slots=True)
class SchedulerOutput:
    """One step's decisions.

    ``scheduled`` in batch order (running requests first, then admissions).
    ``finished_req_ids`` are requests that finished or were aborted since the
    previous step's output, so the runner can drop their state. ``deltas`` holds
    this step's block changes; it keeps filling during ``update_from_output``
    (finished requests free their blocks there) and is complete once that returns.
    ``finished`` (request id -> reason) and the post-step counts (``num_running``,
    ``num_waiting``, ``num_blocks_used``, ``num_blocks_cached_free``) are filled by
    ``update_from_output``.
    """

    step_index: int
    scheduled: list[ScheduledRequest]
    num_prefill_tokens: int
    num_decode_tokens: int
    new_req_ids: list[str]
    resumed_req_ids: list[str]
    preempted_req_ids: list[str]
    finished_req_ids: list[str]
    deltas: BlockDeltas
    num_blocks_total: int
    num_blocks_used_scheduled: int = 0  # blocks held during the forward pass
    finished: dict[str, str] = field(default_factory=dict)
    num_running: int = 0
    num_waiting: int = 0
    num_blocks_used: int = 0
    num_blocks_cached_free: int = 0
    # vision-language models: (request id, item index, tokens) encoded this step, the items
    # freed after it (consumed, preempted or finished), and the cache after the step
    encoder_inputs: list[tuple[str, int, int]] = field(default_factory=list)
    encoder_freed: list[tuple[str, int]] = field(default_factory=list)
    encoder_cache_used: int = 0
    encoder_cache_capacity: int = 0
    # filled only while events are published (issue 33): why the requests left waiting were
    # not admitted, and where each admission's prefix match stopped (see StepEvent)
    waiting_reasons: dict[str, list[Any]] = field(default_factory=dict)
    waiting_reasons_omitted: int = 0
    prefix_lookups: dict[str, list[Any]] = field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        return {s.request.request_id: s.num_tokens for s in self.scheduled}

    @property
    def kv_tokens_read(self) -> int:
        """KV entries the step's attention reads: each scheduled request's context up
        to the end of its new tokens (what the cost model's memory traffic counts)."""
        total = 0
        for s in self.scheduled:
            total += s.start_position + s.num_tokens
        return total

    @property
    def allocated(self) -> dict[str, list[int]]:
        return self.deltas.all_allocated()

    @property
    def freed(self) -> dict[str, list[int]]:
        return self.deltas.all_freed()

    @property
    def cached(self) -> list[int]:
        return list(self.deltas.cached)

    @property
    def evicted(self) -> list[int]:
        return self.deltas.evicted

    @property
    def prefix_query_tokens(self) -> int:
        return self.deltas.prefix_query_tokens

    @property
    def prefix_hit_tokens(self) -> int:
        return self.deltas.prefix_hit_tokens


class Scheduler:
    """Continuous batching over a :class:`KVCacheManager`; see the module docstring."""

    def __init__(self, config: SchedulerConfig, bus: EventBus | None = None) -> None:
        self.config = config
        self.bus = bus
        self.kv = KVCacheManager(
            config.num_blocks, config.block_size, config.enable_prefix_caching,
            record_block_contents=config.enable_kv_cache_events, kv_cache_groups=config.kv_cache_groups,
            max_num_batched_tokens=config.max_num_batched_tokens)
        self.encoder_cache = EncoderCacheManager(config.encoder_cache_size)
        self.requests: dict[str, Request] = {}  # unfinished requests
        self.waiting = create_request_queue(config.policy)
        self.running: list[Request] = []
        self.step_index = 0
        self.num_preemptions_total = 0
        self._finished_since_schedule: list[str] = []
        self._arrivals = itertools.count()

    # ------------------------------------------------------------ properties
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def _publishing(self) -> bool:
        return self.bus is not None and self.bus.has_subscribers

    # --------------------------------------------------------------- arrival
    def rejection_reason(self, req: Request) -> str | None:
        """Why the request can never run here, or None if it can."""
        cfg = self.config
        total = req.num_prompt_tokens + req.max_tokens
        if req.num_prompt_tokens == 0:
            return "empty prompt"
        if req.max_tokens < 1:
            return f"max_tokens must be at least 1, got {req.max_tokens}"
        if total > cfg.max_model_len:
            return (
                f"prompt ({req.num_prompt_tokens}) + max_tokens ({req.max_tokens}) = {total} tokens "
                f"exceeds --max-model-len {cfg.max_model_len}"
            )
        if not self.kv.can_ever_fit(total):
            return (
                f"{total} tokens need {self.kv.blocks_needed(total)} blocks but the KV pool has only "
                f"{self.kv.pool.num_usable}"
            )
        if req.request_id in self.requests:
            return f"request id {req.request_id!r} is already in use"
        encoder_limit = min(cfg.encoder_compute_budget, cfg.encoder_cache_size)
        for item in req.mm_inputs:
            if item.length > encoder_limit:
                return (f"a {item.modality} of {item.length} tokens exceeds the encoder budget ({encoder_limit} tokens)"
                        if encoder_limit else f"a {item.modality} input, but this model has no encoder")
        return None

    def add_request(self, req: Request, now: float) -> bool:
        """Queue a request; False (and a ``request.rejected`` event) if it can never fit."""
        return self.submit(req, now) is None

    def submit(self, req: Request, now: float) -> str | None:
        """Queue a request and return None, or return why it can never run here
        (and publish ``request.rejected``): the one admission check, so a caller
        that needs the message does not ask twice."""
        reason = self.rejection_reason(req)
        publishing = self._publishing()
        if reason is not None:
            req.status = RequestStatus.FINISHED_ABORTED
            req.finished_time = now
            if publishing:
                assert self.bus is not None
                self.bus.publish(
                    RequestRejected(
                        request_id=req.request_id,
                        reason=reason,
                        prompt_tokens=req.num_prompt_tokens,
                        max_tokens=req.max_tokens,
                    )
                )
            return reason
        req.status = RequestStatus.WAITING
        req.queued_time = now
        req.arrival_order = next(self._arrivals)
        self.requests[req.request_id] = req
        self.waiting.append(req)
        if publishing:
            assert self.bus is not None
            self.bus.publish(
                RequestArrived(
                    request_id=req.request_id,
                    prompt_tokens=req.num_prompt_tokens,
                    max_tokens=req.max_tokens,
                    priority=req.priority,
                    prompt=req.prompt_text,
                    preprocess_s=max(now - req.arrival_time, 0.0),
                    sampling=({"temperature": req.sampling.temperature, "top_p": req.sampling.top_p}
                              if req.sampling is not None else None),
                    session=(req.sampling.session or "") if req.sampling is not None else "",
                )
            )
        return None

    # -------------------------------------------------------------- schedule
    def schedule(self, now: float) -> SchedulerOutput:
        plan = StepPlan.for_step(self.config, self.running)
        publishing = self._publishing()
        self.kv.pool.step = self.step_index  # an eviction remembers its step (prefix misses say when)
        self._schedule_running(plan, now, publishing)
        if not plan.preempted:  # admission waits while the pool is short
            self._admit_waiting(plan, now, publishing)
        for req, index, tokens in plan.encoder_inputs:  # the encoder runs before the forward that reads it
            self.encoder_cache.allocate(req.request_id, index, tokens)
        # optimistic advance: the KV of everything scheduled is written this step
        for s in plan.scheduled:
            s.request.num_computed_tokens += s.num_tokens
        return self._output(plan)

    def _schedule_running(self, plan: StepPlan, now: float, publishing: bool) -> None:
        """Step 1: each running request, in admission order, gets its next chunk
        or decode token, preempting others when the pool is short."""
        running = self.running
        allocate_slots = self.kv.allocate_slots  # locals: this loop runs per request per step
        chunk = plan.chunk
        add = plan.add
        i = 0
        while i < len(running) and plan.budget > 0:
            req = running[i]
            computed = req.num_computed_tokens
            total = len(req.token_ids)
            num_new = chunk(total - computed)
            encoded: list[tuple[Request, int, int]] = []
            if req.mm_inputs and num_new > 0:
                num_new, encoded = plan.fit_encoder_inputs(req, computed, num_new, self.encoder_cache)
            if num_new <= 0:
                i += 1
                continue
            if allocate_slots(req, num_new) is None:
                still_running, i = self._preempt_until_fits(req, num_new, i, plan, now, publishing)
                if not still_running:
                    continue  # req itself was preempted; the element now at i is the next one
            plan.take_encoder_inputs(encoded)
            is_prefill = not (num_new == 1 and computed == total - 1 and computed >= req.num_prompt_tokens)
            add(ScheduledRequest(req, computed, num_new, is_prefill, computed + num_new >= total))
            i += 1

    def _preempt_until_fits(
        self, req: Request, num_new: int, index: int, plan: StepPlan, now: float, publishing: bool
    ) -> tuple[bool, int]:
        """``req``'s slots did not fit: preempt the policy's victims until they do.

        Returns whether ``req`` is still running and its index in ``running``
        after the victims ahead of it were removed."""
        running = self.running
        while True:
            victim = self.waiting.pick_victim(running)
            victim_index = running.index(victim) if victim is not running[-1] else len(running) - 1
            del running[victim_index]
            if victim_index < index:
                index -= 1
            plan.withdraw(victim)  # priority policy: the victim may be scheduled already
            self._preempt(victim, now, publishing, self.waiting.preemption_reason(victim, req), req.request_id)
            plan.preempted.append(victim.request_id)
            if victim is req:
                return False, index
            if self.kv.allocate_slots(req, num_new) is not None:
                return True, index

    def _admit_waiting(self, plan: StepPlan, now: float, publishing: bool) -> None:
        """Step 2: waiting requests while budget, ``max_num_seqs`` and blocks
        allow; the first that does not fit stops admission (head-of-line)."""
        kv = self.kv
        waiting = self.waiting
        running = self.running
        max_seqs = self.config.max_num_seqs
        while waiting and plan.budget > 0 and len(running) < max_seqs:
            req = waiting.peek()
            reads_cache = reads_prefix_cache(req)
            hit_blocks, hit_tokens = kv.get_computed_blocks(req) if reads_cache else (None, 0)
            # explained before the allocation caches the request's own blocks
            lookup = kv.explain_hit(req, hit_tokens) if publishing and kv.enable_caching and reads_cache else None
            total = len(req.token_ids)
            num_new = plan.chunk(total - hit_tokens)
            encoded: list[tuple[Request, int, int]] = []
            if req.mm_inputs:
                num_new, encoded = plan.fit_encoder_inputs(req, hit_tokens, num_new, self.encoder_cache)
                if num_new <= 0:
                    if publishing:
                        plan.blocked = (req, plan.encoder_reason(req, hit_tokens))
                    break  # its first item does not fit the encoder's budget this step
            if kv.allocate_slots(req, num_new, hit_blocks, hit_tokens) is None:
                if publishing:
                    plan.blocked = (req, kv.explain_refusal(req))
                break
            plan.take_encoder_inputs(encoded)
            waiting.pop()
            running.append(req)
            if reads_cache:  # vLLM counts no lookup for a request that skips the cache
                kv.record_lookup(total, hit_tokens)
            if lookup is not None:
                plan.prefix_lookups[req.request_id] = lookup
            self._start_running(req, hit_tokens, plan, now, publishing)
            plan.add(ScheduledRequest(req, hit_tokens, num_new, True, hit_tokens + num_new >= total))

    def _start_running(self, req: Request, hit_tokens: int, plan: StepPlan, now: float, publishing: bool) -> None:
        """A request leaves the waiting queue: new or resumed, first schedule time."""
        req.num_computed_tokens = hit_tokens
        if req.status is RequestStatus.PREEMPTED:
            plan.resumed_ids.append(req.request_id)
        else:
            plan.new_ids.append(req.request_id)
        req.status = RequestStatus.RUNNING
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = hit_tokens
        if req.first_scheduled_time is None:
            req.first_scheduled_time = now
            if publishing:
                assert self.bus is not None
                self.bus.publish(
                    RequestScheduled(
                        request_id=req.request_id,
                        queue_time_s=now - req.queued_time,
                        prefix_hit_tokens=hit_tokens,
                    )
                )

    def _output(self, plan: StepPlan) -> SchedulerOutput:
        """Step 3's record: what runs this step, for the executor and the step event."""
        cfg = self.config
        assert plan.num_prefill + plan.num_decode <= cfg.max_num_batched_tokens, "token budget exceeded"
        assert len(self.running) <= cfg.max_num_seqs, "max_num_seqs exceeded"
        finished_ids = self._finished_since_schedule
        self._finished_since_schedule = []
        pool = self.kv.pool
        out = SchedulerOutput(
            step_index=self.step_index,
            scheduled=plan.scheduled,
            num_prefill_tokens=plan.num_prefill,
            num_decode_tokens=plan.num_decode,
            new_req_ids=plan.new_ids,
            resumed_req_ids=plan.resumed_ids,
            preempted_req_ids=plan.preempted,
            finished_req_ids=finished_ids,
            deltas=pool.deltas,  # keeps filling until update_from_output returns
            num_blocks_total=cfg.num_blocks,
            num_blocks_used_scheduled=pool.num_used,
            encoder_inputs=[(r.request_id, index, tokens) for r, index, tokens in plan.encoder_inputs],
            encoder_cache_capacity=cfg.encoder_cache_size,
            prefix_lookups=plan.prefix_lookups,
        )
        if self.waiting and self._publishing():
            out.waiting_reasons, out.waiting_reasons_omitted = plan.waiting_reasons(self.waiting, len(self.running),
                                                                                 cfg.max_num_seqs)
        self.step_index += 1
        return out

    def _preempt(self, req: Request, now: float, publishing: bool, reason: str, for_request: str) -> None:
        lost = req.num_computed_tokens
        freed = self.kv.free(req)
        self.encoder_cache.free_request(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.prepend(req)
        if publishing:
            assert self.bus is not None
            self.bus.publish(
                RequestPreempted(
                    request_id=req.request_id,
                    computed_tokens_lost=lost,
                    blocks_freed=len(freed),
                    num_preemptions=req.num_preemptions,
                    reason=reason,
                    for_request=for_request,
                )
            )

    # ---------------------------------------------------------------- update
    def update_from_output(
        self,
        output: SchedulerOutput,
        sampled: dict[str, list[int]],
        now: float,
        stopped: set[str] | frozenset[str] = frozenset(),
        failed: Mapping[str, str] | None = None,
    ) -> list[Request]:
        """Apply a step's sampled tokens; finish and free requests that stop.

        ``sampled`` maps request id -> token ids for every scheduled request whose
        ``samples`` flag is set (mid-prefill chunks get none). ``stopped`` names
        requests whose text matched a stop string (only the caller, who owns the
        detokenizer, can tell): they finish with reason ``stop`` after their
        tokens are appended. ``failed`` maps the requests whose sampling or
        detokenising raised to why: they finish with reason ``error`` (no token of
        theirs is appended) and free their blocks; the rest of the batch goes on.
        Requests aborted since ``schedule`` are skipped.
        Returns the requests finished in this call and completes ``output``
        (``finished``, post-step counts, block deltas).
        """
        publishing = self._publishing()
        finished: list[Request] = []
        for s in output.scheduled:
            req = s.request
            if not s.samples or req.status is not RequestStatus.RUNNING:
                continue  # a mid-prefill chunk; or aborted or preempted after the step was scheduled
            if failed and req.request_id in failed:
                req.error = failed[req.request_id]
                req.status = RequestStatus.FINISHED_ERROR
                finished.append(req)
                continue
            tokens = sampled.get(req.request_id)
            if not tokens:
                raise KeyError(f"no sampled token for request {req.request_id!r}, which completed its prompt")
            first = req.last_token_time is None
            status = req.append_sampled(tokens, now, self.config.max_model_len)
            if first and publishing:
                assert self.bus is not None
                self.bus.publish(RequestFirstToken(request_id=req.request_id, ttft_s=now - req.arrival_time))
            if status is None and req.request_id in stopped:
                status = RequestStatus.FINISHED_STOPPED
            if status is not None:
                req.status = status
                finished.append(req)
        if finished:
            self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]
            for req in finished:
                self._finish(req, now, publishing)
                output.finished[req.request_id] = FINISH_REASONS[req.status]
        if self.config.encoder_cache_size:
            cache = self.encoder_cache
            cache.free_consumed(s.request for s in output.scheduled
                                if s.request.mm_inputs and not s.request.is_finished)
            output.encoder_freed, output.encoder_cache_used = cache.take_freed(), cache.used
        output.num_running, output.num_waiting = len(self.running), len(self.waiting)
        output.num_blocks_used, output.num_blocks_cached_free = self.kv.pool.num_used, self.kv.pool.num_cached_free
        # later frees (aborts between steps) belong to the next step
        self.kv.take_deltas()
        return finished

    def _finish(self, req: Request, now: float, publishing: bool) -> None:
        self.kv.free(req)
        self.encoder_cache.free_request(req.request_id)
        req.finished_time = now
        del self.requests[req.request_id]
        self._finished_since_schedule.append(req.request_id)
        if publishing:
            assert self.bus is not None
            self.bus.publish(finished_event(req))

    # ----------------------------------------------------------------- abort
    def abort(self, request_id: str, now: float, cause: str = ABORT_CLIENT_DISCONNECT) -> bool:
        """Stop a request now and free everything it holds; False if unknown or done.
        ``cause``: why (one of engine/events/request_records.py's ABORT_CAUSES), on its finish event."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        req.abort_cause = cause
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED_ABORTED
        self._finish(req, now, self._publishing())
        return True

    # ----------------------------------------------------------- inspection
    def block_table(self) -> dict[str, list[int]]:
        """Request id -> block ids for every request holding blocks: every group's real
        blocks, group order. For tests/snapshots."""
        null = self.kv.pool.null_block
        out: dict[str, list[int]] = {}
        for rid, r in self.requests.items():
            blocks = [b for table in r.block_tables for b in table if b != null]
            if blocks:
                out[rid] = blocks
        return out

    def check_integrity(self) -> None:
        """Assert pool, table and queue invariants (O(pool); for tests)."""
        self.kv.pool.check_integrity(table for r in self.requests.values() for table in r.block_tables)
        running_ids = {r.request_id for r in self.running}
        waiting_ids = {r.request_id for r in self.waiting}
        assert len(running_ids) == len(self.running), "a request is running twice"
        assert not running_ids & waiting_ids, "a request is both running and waiting"
        assert running_ids | waiting_ids == set(self.requests), "running + waiting != unfinished requests"
        assert len(self.running) <= self.config.max_num_seqs, "more running requests than max_num_seqs"
        for r in self.running:
            assert r.status is RequestStatus.RUNNING, f"{r.request_id} in running with status {r.status}"
            for table in r.block_tables:
                assert len(table) * self.config.block_size >= r.num_computed_tokens, "computed tokens without slots"
        for r in self.waiting:
            assert not any(r.block_tables), f"waiting request {r.request_id} holds blocks"
            assert r.num_computed_tokens == 0, f"waiting request {r.request_id} has computed tokens"


def reads_prefix_cache(req: Request) -> bool:
    """False for a request still owed its prompt logprobs (vLLM's ``skip_reading_prefix_cache``):
    they need every prompt position's logits, so nothing of the prompt may come from the cache.
    Once it has output tokens (a resume after preemption) the logprobs were sent: it reads hits."""
    return req.sampling is None or req.sampling.prompt_logprobs is None or bool(req.output_token_ids)


def finished_event(req: Request) -> RequestFinished:
    """The ``request.finished`` event with every latency of a finished request."""
    end = req.finished_time if req.finished_time is not None else 0.0
    arrival, queued = req.arrival_time, req.queued_time
    start = req.first_scheduled_time
    first = req.first_token_time
    last = req.last_token_time
    return RequestFinished(
        request_id=req.request_id,
        reason=FINISH_REASONS.get(req.status, "abort"),
        prompt_tokens=req.num_prompt_tokens,
        output_tokens=len(req.output_token_ids),
        prefix_hit_tokens=max(req.num_cached_tokens, 0),
        num_preemptions=req.num_preemptions,
        queue_time_s=(start - queued) if start is not None else end - queued,
        ttft_s=(first - arrival) if first is not None else None,
        e2e_s=end - arrival,
        prefill_time_s=(first - start) if first is not None and start is not None else 0.0,
        decode_time_s=(last - first) if last is not None and first is not None else 0.0,
        inference_time_s=(last - start) if last is not None and start is not None else 0.0,
        inter_token_latencies_s=list(req.inter_token_latencies),
        output_text=req.output_text,
        error=req.error,
        abort_cause=req.abort_cause if req.status is RequestStatus.FINISHED_ABORTED else "",
        # a prefill cut short: the prompt KV computed and thrown away (no token counter has it)
        computed_prompt_tokens=min(req.num_computed_tokens, req.num_prompt_tokens) if first is None else 0,
    )
