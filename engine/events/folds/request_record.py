"""One request's record, folded once from its events: the one per-request fold every reader
of request events shares (issue 33). When it arrived, each step it waited and why, each
prefill chunk, where its prefix-cache match stopped and why, each preemption (for whom,
what it held, what it must recompute), its resumes, its decode steps and their gaps, the
blocks it held over time, and how it finished.

:class:`RequestFold` is a bus subscriber like every other fold: the server keeps one for
``GET /debug/requests``, ``engine replay --request`` folds a recording, the monitor's
request panel folds what it has seen, the doctor's facts read it, and the exporters
(OTLP, Perfetto, ``vllm bench`` outputs, forward-pass metrics) and the engine view read
their requests from it, each keeping beside the record only what is its own. Nothing here
reads the engine: the step event's ``waiting_reasons`` and ``prefix_lookups`` carry what
no fold could derive; everything else follows from the other fields.

Request events of a step (``request.preempted`` while scheduling, ``request.first_token``
and ``request.finished`` while updating) are published before that step's ``step`` event,
and an arrival between two steps belongs to the next one, so each is placed at the step
after the last step folded.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from engine.events.record import Event
from engine.events.request_records import (
    RequestArrived,
    RequestFinished,
    RequestFirstToken,
    RequestPreempted,
    RequestRejected,
    RequestScheduled,
)
from engine.events.startup_records import EngineConfigEvent, StartupPhase
from engine.events.step_records import (
    PREFIX_COMPLETE,
    PREFIX_DIVERGED,
    PREFIX_EVICTED,
    PREFIX_LAST_TOKEN,
    PREFIX_SHORT_PROMPT,
    PREFIX_WINDOW,
    WAIT_BEHIND,
    WAIT_BLOCKS,
    WAIT_ENCODER,
    WAIT_MAX_NUM_SEQS,
    WAIT_NEVER_FITS,
    WAIT_PREEMPTING,
    WAIT_PRIORITY,
    WAIT_TOKEN_BUDGET,
    WAITING_REASONS_CAP,
    StepEvent,
)

WAITING = "waiting"
RUNNING = "running"
FINISHED = "finished"
REJECTED = "rejected"
STATES = (WAITING, RUNNING, FINISHED, REJECTED)
# the fold's own wait codes, for steps whose event names no reason for the request
WAIT_UNLISTED = "unlisted"  # beyond the WAITING_REASONS_CAP requests the step explained
WAIT_UNRECORDED = "unrecorded"  # a recording made before steps carried waiting reasons
FINISHED_KEPT = 2048  # finished lives a long-running fold keeps (oldest dropped first)
UNWRITTEN_FIELDS = ("arrival", "scheduled_t", "finished", "num_preemptions")  # left out of to_dict, the /debug/requests answer


# each code's words; ``{0}``, ``{1}``: the entry's details after the code
WAIT_TEXT = {
    WAIT_TOKEN_BUDGET: "the step's token budget ({0} tokens) was spent",
    WAIT_MAX_NUM_SEQS: "--max-num-seqs reached: all {0} sequence slots taken",
    WAIT_BLOCKS: "blocks short: needs {0}, {1} free",
    WAIT_NEVER_FITS: "can never fit: needs {0} blocks, the pool has {1} in total",
    WAIT_BEHIND: "behind {0}, the head of the queue, which could not be admitted",
    WAIT_PRIORITY: "a higher-priority request ahead ({0}) could not be admitted",
    WAIT_ENCODER: "encoder budget: its {0}-token input does not fit the {1} tokens left this step",
    WAIT_PREEMPTING: "a running request was preempted this step: nobody is admitted while the pool is short",
    WAIT_UNLISTED: f"queued beyond the first {WAITING_REASONS_CAP} the step explained",
    WAIT_UNRECORDED: "queued (the recording predates waiting reasons)",
}
# each cause's words after the "tokens reused" head; ``{hit}``: the tokens reused, ``{args}``: the details
PREFIX_TEXT = {
    PREFIX_SHORT_PROMPT: "the prompt is shorter than one block, so nothing of it can be cached",
    PREFIX_LAST_TOKEN: "the match stopped before the last block: the last prompt token is always recomputed",
    PREFIX_COMPLETE: "every full block hit; only the partial last block is computed",
    PREFIX_DIVERGED: "diverged from the longest cached chain at token {hit:,}",
    PREFIX_EVICTED: "stopped at token {hit:,}: the next block was evicted at step {args[0]} (block {args[1]})",
    PREFIX_WINDOW: ("stopped at token {hit:,} by the sliding window (full attention alone would reuse "
                    "{args[0]:,}): the window lacked the blocks just before it"),
}


def wait_reason_text(reason: list[Any]) -> str:
    """A step event's ``waiting_reasons`` entry in words."""
    code, args = (reason[0], reason[1:]) if reason else ("", [])
    template = WAIT_TEXT.get(code) if isinstance(code, str) else None  # a damaged row's code may not hash
    return f"{code} {args}" if template is None else template.format(*args)


def prefix_text(lookup: list[Any], prompt_tokens: int | None = None) -> str:
    """A step event's ``prefix_lookups`` entry in words: what was reused and where the match
    stopped. ``prompt_tokens``: the sequence looked up (prompt, or prompt + output when
    resumed), for the 'of N' part."""
    hit, cause, args = int(lookup[0]), lookup[1], lookup[2:]
    of = f" of {prompt_tokens:,}" if prompt_tokens else ""
    head = f"prefix cache: {hit:,}{of} tokens reused; "
    template = PREFIX_TEXT.get(cause) if isinstance(cause, str) else None
    return head + (str(cause) if template is None else template.format(hit=hit, args=args))


@dataclass(slots=True)
class WaitRun:
    """Consecutive steps the request waited for one reason."""

    first_step: int
    last_step: int
    reason: list[Any]


@dataclass(slots=True)
class Chunk:
    step: int
    tokens: int
    computed: int  # tokens computed after the chunk (prefix-cache hits included)


@dataclass(slots=True)
class Lookup:
    step: int
    hit_tokens: int
    cause: str
    details: list[Any]
    resumed: bool
    evicted_by: str | None = None  # the request the evicted block went to, from that step's allocations


@dataclass(slots=True)
class Preemption:
    step: int
    t: float
    reason: str
    for_request: str
    blocks_freed: int
    tokens_lost: int  # computed tokens dropped: recomputed on resume, less any prefix hit then


@dataclass(slots=True)
class DecodeRun:
    """Consecutive steps that each decoded one of the request's tokens."""

    first_step: int
    last_step: int
    tokens: int
    first_t: float
    last_t: float
    max_gap_s: float = 0.0  # the longest time between two of its steps


@dataclass(slots=True)
class RequestRecord:
    """Everything the events say about one request; steps are ``StepEvent.index`` values."""

    request_id: str
    prompt_tokens: int = 0
    max_tokens: int = 0
    priority: int = 0
    state: str = WAITING
    arrived_t: float | None = None
    arrival_step: int | None = None
    waits: list[WaitRun] = field(default_factory=list)
    chunks: list[Chunk] = field(default_factory=list)
    lookups: list[Lookup] = field(default_factory=list)
    preemptions: list[Preemption] = field(default_factory=list)
    resumes: list[int] = field(default_factory=list)
    decode_runs: list[DecodeRun] = field(default_factory=list)
    blocks: list[tuple[int, int]] = field(default_factory=list)  # (step, blocks held after it), on change
    peak_blocks: int = 0
    computed_tokens: int = 0
    output_tokens: int = 0
    first_scheduled_step: int | None = None
    queue_time_s: float | None = None
    first_token_step: int | None = None
    ttft_s: float | None = None
    finish_step: int | None = None
    finish_reason: str | None = None
    finished_t: float | None = None
    e2e_s: float | None = None
    inter_token_latencies_s: list[float] = field(default_factory=list)
    error: str | None = None  # finish reason error / a rejection: why
    scheduled_hit_tokens: int = 0  # request.scheduled's prefix hit (the first admission)
    # The events themselves, for the readers that need what only they say (not in to_dict):
    arrival: RequestArrived | None = None  # its request.arrived: sampling, preprocess_s (when it was received)
    scheduled_t: float | None = None  # request.scheduled's time: the first admission
    finished: RequestFinished | None = None  # its request.finished: the engine's own figures and time split
    num_preemptions: int = 0  # the latest request.preempted's count (the engine's, from before a fold began too)

    @property
    def held_blocks(self) -> int:
        return self.blocks[-1][1] if self.blocks else 0

    @property
    def wait_reason(self) -> list[Any] | None:
        """Why it waits now (the latest step's reason), while it waits."""
        return self.waits[-1].reason if self.state == WAITING and self.waits else None

    @property
    def prefix_hit_tokens(self) -> int:
        """The first admission's reuse (vLLM's ``num_cached_tokens``)."""
        return self.lookups[0].hit_tokens if self.lookups else self.scheduled_hit_tokens

    def to_dict(self) -> dict[str, Any]:
        out = {key: value for key, value in asdict(self).items() if key not in UNWRITTEN_FIELDS}
        out["blocks"] = [list(pair) for pair in self.blocks]
        return out

    # ---------------------------------------------------------------- words
    def timeline(self) -> list[tuple[int | None, str]]:
        """(step, what happened) in step order: the text ``engine replay --request`` prints."""
        rows: list[tuple[float, int, int | None, str]] = []  # (sort key, tie order, step, text)

        def add(step: int | None, order: int, text: str) -> None:
            rows.append((step if step is not None else -1, order, step, text))

        when = f" at t={self.arrived_t:.3f} s" if self.arrived_t is not None else ""
        add(self.arrival_step, 0, f"arrived{when}: prompt {self.prompt_tokens:,} tokens, max_tokens "
                                  f"{self.max_tokens:,}" + (f", priority {self.priority}" if self.priority else ""))
        for wait in self.waits:
            steps = wait.last_step - wait.first_step + 1
            add(wait.first_step, 1, f"waited {steps} step{'s' if steps > 1 else ''}"
                                    f"{f' (to step {wait.last_step})' if steps > 1 else ''}: "
                                    f"{wait_reason_text(wait.reason)}")
        for lookup in self.lookups:
            verb = "resumed" if lookup.resumed else "admitted"
            text = prefix_text([lookup.hit_tokens, lookup.cause, *lookup.details])
            if lookup.evicted_by:
                text += f" for {lookup.evicted_by}"
            add(lookup.step, 2, f"{verb}; {text}")
        for step in self.resumes:
            if not any(lk.step == step for lk in self.lookups):
                add(step, 2, "resumed")
        if self.first_scheduled_step is not None and not self.lookups:
            add(self.first_scheduled_step, 2, "admitted" + (f" after {self.queue_time_s:.3f} s in the queue"
                                                             if self.queue_time_s is not None else ""))
        for chunk in self.chunks:
            add(chunk.step, 3, f"prefill chunk of {chunk.tokens:,} tokens ({chunk.computed:,} computed)")
        if self.first_token_step is not None:
            ttft = f" (TTFT {self.ttft_s:.3f} s)" if self.ttft_s is not None else ""
            add(self.first_token_step, 4, f"first token{ttft}")
        for run in self.decode_runs:
            span = (f"steps {run.first_step}-{run.last_step}" if run.last_step > run.first_step
                    else f"step {run.first_step}")
            add(run.first_step, 5, f"decoded {run.tokens:,} token{'s' if run.tokens > 1 else ''} over {span}"
                                   f" (longest gap {run.max_gap_s * 1e3:,.1f} ms)")
        previous: DecodeRun | None = None
        for run in self.decode_runs:
            if previous is not None and run.first_step > previous.last_step + 1:
                add(previous.last_step + 1, 5, f"no token for {run.first_step - previous.last_step - 1} steps "
                                               f"({(run.first_t - previous.last_t) * 1e3:,.1f} ms)")
            previous = run
        for p in self.preemptions:
            whom = ("for its own next tokens (it was the one to give way)" if p.for_request == self.request_id
                    else f"to make room for {p.for_request}" if p.for_request else "")
            add(p.step, 6, f"preempted ({p.reason}) {whom}: held {p.blocks_freed} blocks and "
                           f"{p.tokens_lost:,} computed tokens, all to recompute")
        if self.blocks:
            changes = " → ".join(f"{n} (step {s})" for s, n in self.blocks[:12])
            more = f" … {len(self.blocks) - 12} more changes" if len(self.blocks) > 12 else ""
            add(self.blocks[0][0], 7, f"blocks held: {changes}{more}; peak {self.peak_blocks}")
        if self.finish_reason is not None:
            e2e = f", e2e {self.e2e_s:.3f} s" if self.e2e_s is not None else ""
            why = f": {self.error}" if self.error else ""
            add(self.finish_step, 8, f"finished: {self.finish_reason}{why} ({self.output_tokens:,} tokens out{e2e})")
        elif self.state == REJECTED:
            add(self.arrival_step, 8, f"rejected: {self.error}")
        rows.sort(key=lambda row: (row[0], row[1]))
        return [(step, text) for _, _, step, text in rows]

    def render(self) -> str:
        lines = [f"request {self.request_id}: {self.state}"]
        for step, text in self.timeline():
            lines.append(f"  {'step ' + str(step) if step is not None else 'before any step':>11}  {text}")
        return "\n".join(lines)

    def summary(self, now: float) -> dict[str, Any]:
        """One row of ``GET /debug/requests``: id, state, age, tokens and why."""
        reason = self.wait_reason
        if self.state == WAITING:
            why = wait_reason_text(reason) if reason else "arrived; not yet in a step"
        elif self.state == RUNNING:
            why = ("prefill" if self.computed_tokens < self.prompt_tokens else "decoding") + \
                  f": {self.computed_tokens:,} tokens computed, {self.held_blocks} blocks held"
        elif self.state == FINISHED:
            why = f"finished: {self.finish_reason}"
        else:
            why = f"rejected: {self.error}"
        return {"id": self.request_id, "state": self.state,
                "age_s": round(max(0.0, now - self.arrived_t), 3) if self.arrived_t is not None else None,
                "prompt_tokens": self.prompt_tokens, "computed_tokens": self.computed_tokens,
                "output_tokens": self.output_tokens, "blocks": self.held_blocks,
                "num_preemptions": len(self.preemptions), "why": why,
                "reason": list(reason) if reason else None}


class RequestFold:
    """Bus subscriber: every request's :class:`RequestRecord`. ``lives`` holds the requests in
    the engine (and, up to ``finished_kept``, finished ones, oldest dropped first; None
    keeps all, as a replay does)."""

    sink_name = "request lifecycle"

    def __init__(self, finished_kept: int | None = FINISHED_KEPT) -> None:
        self.lives: OrderedDict[str, RequestRecord] = OrderedDict()
        self.finished_kept = finished_kept
        self._waiting: dict[str, None] = {}  # requests waiting now, arrival order
        self._finished: list[str] = []  # finished lives, oldest first (for the bound)
        # lives dropped since the last step: a fold that keeps none finished (finished_kept=0) still
        # sees a request's last step after its request.finished, and must not begin it again
        self._dropped: set[str] = set()
        self._next_step = 0
        self._last_t = 0.0
        self._block_size = 0
        self._group_kinds: list[Any] = []  # the KV cache groups' kinds, config order ([]: one full-attention group)
        # block -> (step, request) that last took it while it held an evicted hash: who evicted it
        self._evicted_to: dict[tuple[int, int], str] = {}

    def __call__(self, event: Event) -> None:
        if isinstance(event, StepEvent):
            self._step(event)
        elif isinstance(event, RequestArrived):
            life = self.record(event.request_id)
            life.prompt_tokens, life.max_tokens, life.priority = event.prompt_tokens, event.max_tokens, event.priority
            life.arrived_t, life.arrival_step, life.state = event.t, self._next_step, WAITING
            life.arrival = event
            self._waiting[event.request_id] = None
        elif isinstance(event, RequestScheduled):
            life = self.record(event.request_id)
            life.queue_time_s, life.scheduled_hit_tokens = event.queue_time_s, event.prefix_hit_tokens
            life.scheduled_t = event.t
            life.computed_tokens = event.prefix_hit_tokens  # admitted: its cached tokens count as computed
        elif isinstance(event, RequestPreempted):
            life = self.record(event.request_id)
            life.preemptions.append(Preemption(self._next_step, event.t, event.reason, event.for_request,
                                               event.blocks_freed, event.computed_tokens_lost))
            life.num_preemptions = event.num_preemptions
        elif isinstance(event, RequestFirstToken):
            life = self.record(event.request_id)
            life.first_token_step, life.ttft_s = self._next_step, event.ttft_s
        elif isinstance(event, RequestFinished):
            self._finished_event(event)
        elif isinstance(event, RequestRejected):
            life = self.record(event.request_id)
            life.prompt_tokens, life.max_tokens = event.prompt_tokens, event.max_tokens
            life.state, life.error, life.arrival_step = REJECTED, event.reason, self._next_step
            if life.arrived_t is None:
                life.arrived_t = event.t
            self._waiting.pop(event.request_id, None)
            self._retire(event.request_id)
        elif isinstance(event, EngineConfigEvent):
            self.set_kv_layout(int(event.config.get("block_size") or self._block_size), event.config)
        elif isinstance(event, StartupPhase) and event.phase == "E" and event.data.get("block_size"):
            self._block_size = int(event.data["block_size"])

    def set_kv_layout(self, block_size: int, config: dict[str, Any]) -> None:
        """The block size and the KV cache groups' kinds (``engine.config``'s ``kv_cache_groups``,
        none for one full-attention group): a resumed request's prefix hit follows from them when
        its step names none."""
        self._block_size = block_size
        groups = config.get("kv_cache_groups")
        self._group_kinds = [g.get("kind") for g in groups if isinstance(g, dict)] if isinstance(groups, list) else []

    def add(self, record: RequestRecord) -> None:
        """A record read from elsewhere (a snapshot's request), folded on from here."""
        self.lives[record.request_id] = record
        if record.state == WAITING:
            self._waiting[record.request_id] = None

    def record(self, request_id: str) -> RequestRecord:
        """The request's record, begun when it has none."""
        life = self.lives.get(request_id)
        if life is None:
            life = self.lives[request_id] = RequestRecord(request_id)
        return life

    def _finished_event(self, event: RequestFinished) -> None:
        life = self.record(event.request_id)
        life.state, life.finish_reason, life.finish_step = FINISHED, event.reason, self._next_step
        life.finished = event
        life.finished_t, life.e2e_s, life.output_tokens = event.t, event.e2e_s, event.output_tokens
        life.prompt_tokens = life.prompt_tokens or event.prompt_tokens
        life.inter_token_latencies_s = list(event.inter_token_latencies_s)
        if life.ttft_s is None:
            life.ttft_s = event.ttft_s
        if life.queue_time_s is None:
            life.queue_time_s = event.queue_time_s
        life.error = event.error
        self._waiting.pop(event.request_id, None)
        self._retire(event.request_id)

    def _retire(self, request_id: str) -> None:
        self._finished.append(request_id)
        kept = self.finished_kept
        if kept is not None and len(self._finished) > kept:
            dropped = self._finished.pop(0)
            self.lives.pop(dropped, None)
            self._dropped.add(dropped)

    def _step(self, ev: StepEvent) -> None:
        step = ev.index
        self._note_evictions(ev)
        for rid in ev.preempted:
            life = self.record(rid)
            life.state, life.computed_tokens = WAITING, 0
            self._waiting[rid] = None
        self._admit(ev)
        self._run(ev)
        self._hold_blocks(ev)
        self._waits(ev)
        for rid, reason in ev.finished.items():
            done = self.lives.get(rid)
            if done is not None and done.finish_reason is None:  # a finish without its event
                done.state, done.finish_reason, done.finish_step = FINISHED, reason, step
                self._waiting.pop(rid, None)
                self._retire(rid)
        self._next_step = step + 1
        self._last_t = ev.t
        self._dropped.clear()

    def _note_evictions(self, ev: StepEvent) -> None:
        """Who took each block evicted this step: a later prefix miss on it names them."""
        if ev.evicted:
            takers = {b: rid for rid, blocks in ev.allocated.items() for b in blocks}
            for b in ev.evicted:
                taker = takers.get(b)
                if taker is not None:
                    self._evicted_to[(ev.index, b)] = taker

    def _admit(self, ev: StepEvent) -> None:
        """The requests admitted (new or resumed) in the step: where their prefix match stopped."""
        step, lookups = ev.index, ev.prefix_lookups
        for rid in (*ev.new, *ev.resumed):
            life = self.record(rid)
            life.state = RUNNING
            self._waiting.pop(rid, None)
            resumed = rid in ev.resumed and life.first_scheduled_step is not None
            if resumed:
                life.resumes.append(step)
            elif life.first_scheduled_step is None:
                life.first_scheduled_step = step
            entry = lookups.get(rid)
            if entry is not None:
                lookup = Lookup(step, int(entry[0]), str(entry[1]), list(entry[2:]), resumed)
                if lookup.cause == PREFIX_EVICTED and len(entry) >= 4:
                    lookup.evicted_by = self._evicted_to.get((int(entry[2]), int(entry[3])))
                life.lookups.append(lookup)
                life.computed_tokens = lookup.hit_tokens
            elif rid in ev.resumed:  # caching off, or a recording before prefix_lookups: its blocks say
                life.computed_tokens = self._resumed_hit(ev, rid)
            else:  # request.scheduled's hit
                life.computed_tokens = life.scheduled_hit_tokens

    def _resumed_hit(self, ev: StepEvent, rid: str) -> int:
        """Prefix-cache hit tokens of a request resumed after preemption in a step that names
        none (a resumption publishes no request.scheduled). A hit is whole blocks and the step's
        tokens fill the blocks after it, so ``hit + num_new`` lies in the table's last block:
        ``hit`` is the one multiple of the block size in
        ``((num_allocated - 1) * bs - num_new, num_allocated * bs - num_new]``.

        Every group's table is allocated: ``num_allocated`` is one full-attention group's
        count (a sliding window's table has the null block, not listed, wherever the hit lies
        wholly before its window). With no full-attention group the largest count is exact for
        a hit shorter than the window; a request resumed alone takes the step's hits less the
        new requests' instead."""
        counts = ev.allocated_groups.get(rid)
        kinds = self._group_kinds
        if counts is None:  # the step names no groups: one full-attention table's
            counts, kinds = [len(ev.allocated.get(rid, ()))], ["full_attention"]
        full = [i for i, kind in enumerate(kinds) if kind == "full_attention" and i < len(counts)]
        if full:
            num_allocated = counts[full[0]]
        elif kinds and len(ev.resumed) == 1:
            new_hits = sum(self.lives[r].scheduled_hit_tokens for r in ev.new if r in self.lives)
            return max(0, ev.prefix_hits_tokens - new_hits)
        else:
            num_allocated = max(counts, default=0)
        bs = self._block_size
        if bs <= 0 or num_allocated <= 0:
            return 0
        num_new = int(ev.scheduled[rid][0]) if rid in ev.scheduled else 0
        return max(0, (num_allocated * bs - num_new) // bs * bs)

    def _run(self, ev: StepEvent) -> None:
        """The step's scheduled tokens: prefill chunks, decode runs and the tokens sampled."""
        step, t, lives = ev.index, ev.t, self.lives
        previous = step - 1
        for rid, (num_tokens, kind) in ev.scheduled.items():  # per request per step: kept lean
            found = lives.get(rid)
            if found is None and rid in self._dropped:
                continue
            life = found if found is not None else self.record(rid)
            life.computed_tokens += num_tokens
            counted = life.finish_reason is not None  # request.finished (before its last step) gave the count
            if kind == "decode":
                if not counted:
                    life.output_tokens += 1
                runs = life.decode_runs
                last = runs[-1] if runs else None
                if last is not None and last.last_step == previous:
                    gap = t - last.last_t
                    if gap > last.max_gap_s:
                        last.max_gap_s = gap
                    last.last_step = step
                    last.last_t = t
                    last.tokens += 1
                else:
                    runs.append(DecodeRun(step, step, 1, t, t))
                    life.state = FINISHED if counted else RUNNING
                continue
            life.chunks.append(Chunk(step, int(num_tokens), life.computed_tokens))
            if not counted and life.computed_tokens >= life.prompt_tokens + life.output_tokens:
                life.output_tokens += 1  # the chunk that completes the context samples a token
            life.state = FINISHED if counted else RUNNING

    def _hold_blocks(self, ev: StepEvent) -> None:
        """The blocks each request holds after the step, on change."""
        for rid in (*ev.allocated, *ev.freed, *ev.freed_by_window):
            if rid in self._dropped:
                continue
            life = self.record(rid)
            held = life.held_blocks + len(ev.allocated.get(rid, ())) - len(ev.freed.get(rid, ())) \
                - len(ev.freed_by_window.get(rid, ()))
            life.blocks.append((ev.index, held))
            if held > life.peak_blocks:
                life.peak_blocks = held

    def _waits(self, ev: StepEvent) -> None:
        """Why each request still waiting after the step waited."""
        step, reasons, lives = ev.index, ev.waiting_reasons, self.lives
        if self._waiting:
            unlisted = [WAIT_UNLISTED] if ev.waiting_reasons_omitted else [WAIT_UNRECORDED]
            for rid in self._waiting:
                waiting = lives.get(rid)
                if waiting is None or waiting.arrival_step is None or waiting.arrival_step > step:
                    continue
                self._wait(waiting, step, reasons.get(rid) or unlisted)
        for rid in reasons:
            if rid not in self._waiting:  # a live fold that missed its arrival
                self._waiting[rid] = None
                self._wait(self.record(rid), step, reasons[rid])

    @staticmethod
    def _wait(life: RequestRecord, step: int, reason: list[Any]) -> None:
        runs = life.waits
        last = runs[-1] if runs else None
        if last is not None and last.last_step == step - 1 and last.reason == reason:
            last.last_step = step
        else:
            runs.append(WaitRun(step, step, list(reason)))

    # ------------------------------------------------------------ readings
    def get(self, request_id: str) -> RequestRecord | None:
        return self.lives.get(request_id)

    def waiting_now(self) -> list[RequestRecord]:
        """The requests waiting now (never run yet, or preempted back to the queue), arrival
        order: read per step, so it walks the queue, not every life the fold keeps."""
        lives = self.lives
        return [life for rid in self._waiting if (life := lives.get(rid)) is not None]

    def in_state(self, state: str | None = None) -> list[RequestRecord]:
        """The lives in ``state`` (all when None), arrival order."""
        return [life for life in self.lives.values() if state is None or life.state == state]


class SharedRequests(Protocol):
    """A request fold another subscriber of the same bus keeps (the server's ``/debug/requests``,
    behind its lock) and the exporters read too: called with each event, it folds the event once
    however many of its readers call it; ``fold`` is the fold, read on the thread that folds."""

    fold: RequestFold

    def __call__(self, event: Event) -> None: ...


def request_fold_for(shared: SharedRequests | None) -> tuple[RequestFold, Callable[[Event], None]]:
    """``(the fold an exporter reads, what it feeds each event)``: ``shared``'s (one fold of each
    event for every reader), else a private fold of its own."""
    if shared is None:
        fold = RequestFold()
        return fold, fold
    return shared.fold, shared


def request_metrics(life: RequestRecord) -> dict[str, Any]:
    """A finished request's timings under vLLM's per-request metric names (PR#46768:
    ``time_to_first_token_ms``, ``generation_time_ms`` arrival to the last token,
    ``queue_time_ms``, ``mean_itl_ms``, ``tokens_per_second`` output tokens over the
    generation time), plus kvscope's own under ``kvscope``: preemptions, prefix tokens
    reused, peak blocks. Every figure is the events' (request.finished and the steps)."""
    itls = life.inter_token_latencies_s
    e2e = life.e2e_s
    return {
        "time_to_first_token_ms": life.ttft_s * 1e3 if life.ttft_s is not None else None,
        "generation_time_ms": e2e * 1e3 if e2e is not None else None,
        "queue_time_ms": life.queue_time_s * 1e3 if life.queue_time_s is not None else None,
        "mean_itl_ms": sum(itls) / len(itls) * 1e3 if itls else None,
        "tokens_per_second": life.output_tokens / e2e if e2e else None,
        "kvscope": {"preemptions": len(life.preemptions), "prefix_tokens_reused": life.prefix_hit_tokens,
                    "peak_blocks": life.peak_blocks},
    }


def lifecycle_of(events: list[Event] | Any) -> RequestFold:
    """Fold ``events`` (a recording's) into every request's life."""
    fold = RequestFold(finished_kept=None)
    for event in events:
        fold(event)
    return fold
