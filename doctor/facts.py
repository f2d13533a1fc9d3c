"""What a run did, folded from its events: the doctor's only input.

:class:`RunFacts` is a bus subscriber (a callable) and a fold: a recording's
events, a live ``/events`` stream or the in-process bus go through the same
``__call__``, so ``engine doctor`` and the monitor's Diagnosis panel judge the
same numbers. It keeps per step only what the rules read (a :class:`StepRow`),
per request the one record every reader of request events shares (``lives``, read
through :class:`RequestFacts`), and the startup phases as published; nothing is read
from the scheduler.

A recording of several data-parallel ranks (events with ``dp_rank``) folds each rank
> 0 into its own :class:`RunFacts` (``ranks``), so a step index always means one
scheduler's step; ``dp`` folds every rank's load for the imbalance rule.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

from engine.events import (
    EngineConfigEvent,
    Event,
    LogEvent,
    RequestArrived,
    RequestFinished,
    RequestFirstToken,
    RequestPreempted,
    RequestScheduled,
    SnapshotEvent,
    StartupPhase,
    StepEvent,
    event_from_dict,
)
from engine.events.engine_records import EngineRecovered, EngineStalled
from engine.events.folds.dp_balance import DataParallelLoad
from engine.events.folds.expert_load import ExpertLoad
from engine.events.folds.pipeline_idle import PipelineIdle
from engine.events.folds.request_record import RequestFold, RequestRecord
from engine.events.folds.sessions import SessionFold
from engine.events.phase_data import KvCacheData
from engine.events.step_records import WAIT_MAX_NUM_SEQS


@dataclass(slots=True)
class StepRow:
    """One step as the rules need it. ``prefills`` maps the requests that ran a
    prompt chunk in this step to the chunk's tokens."""

    index: int
    t: float
    duration_s: float
    num_prefill_tokens: int
    num_decode_tokens: int
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    prefills: dict[str, int]
    preempted: list[str]
    evicted: list[int]
    num_finished: int
    collective_s: float = 0.0  # tensor parallelism: all-reduce/gather time inside the step
    collective_bytes: int = 0
    admitted: int = 0  # requests admitted (new or resumed) in the step
    head: tuple[str, list[Any]] | None = None  # the first waiting request after the step, and why it waited
    deferred: list[str] = field(default_factory=list)  # running but given no token (kept when slots bind)
    scheduled: int = 0  # sequences the step ran
    # pipeline parallelism: per stage, seconds waiting on the stage before and activation bytes sent
    pipeline_bubble_s: list[float] = field(default_factory=list)
    pipeline_bytes: list[int] = field(default_factory=list)

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens


class RequestFacts:
    """The doctor's reading of one request's record (engine/events/folds/request_record.py):
    its figures as the request events gave them, and each fact the record places at a step
    read as the first step this fold saw at or after it (none when no step came after)."""

    __slots__ = ("_facts", "record")

    def __init__(self, record: RequestRecord, facts: RunFacts) -> None:
        self.record = record
        self._facts = facts

    @property
    def request_id(self) -> str:
        return self.record.request_id

    @property
    def prompt_tokens(self) -> int:
        return self.record.prompt_tokens

    @property
    def max_tokens(self) -> int:
        return self.record.max_tokens

    @property
    def arrival_t(self) -> float:
        arrival = self.record.arrival
        return arrival.t if arrival is not None else 0.0

    @property
    def arrival_step(self) -> int | None:
        """The first step after it arrived."""
        record = self.record
        return None if record.arrival is None or record.arrival_step is None else self._facts.step_from(
            record.arrival_step)

    @property
    def queue_time_s(self) -> float | None:
        """``request.scheduled``'s (None before its first admission)."""
        return self.record.queue_time_s if self.record.scheduled_t is not None else None

    @property
    def prefix_hit_tokens(self) -> int:
        return self.record.scheduled_hit_tokens

    @property
    def preempted_at(self) -> list[int]:
        steps = (self._facts.step_from(p.step) for p in self.record.preemptions)
        return [step for step in steps if step is not None]

    @property
    def tokens_lost(self) -> int:
        return sum(p.tokens_lost for p in self.record.preemptions)

    @property
    def ttft_s(self) -> float | None:
        return self.record.ttft_s

    @property
    def output_tokens(self) -> int | None:
        """``request.finished``'s (None before it finished)."""
        finished = self.record.finished
        return finished.output_tokens if finished is not None else None

    @property
    def finish_reason(self) -> str | None:
        finished = self.record.finished
        return finished.reason if finished is not None else None

    @property
    def total_tokens(self) -> int:
        """Prompt plus output: what the request holds in the KV pool at its end."""
        return self.prompt_tokens + (self.output_tokens if self.output_tokens is not None else self.max_tokens)


@dataclass(slots=True)
class StallFacts:
    """One ``engine.stalled`` and, if it came, its ``engine.recovered``."""

    rank: int
    t: float
    phase: str
    stalled_s: float
    limit_s: float
    last_step: int | None
    requests: list[str]
    dump: str | None
    recovered_after_s: float | None = None  # None: not recovered when the events end


@dataclass(slots=True)
class RunFacts:
    """Subscribe it to a bus or call it with each event; read the fields."""

    config: dict[str, Any] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)
    phases: dict[str, StartupPhase] = field(default_factory=dict)  # letter -> its latest end/failed/skipped
    failed_phase: StartupPhase | None = None
    steps: list[StepRow] = field(default_factory=list)
    requests: dict[str, RequestFacts] = field(default_factory=dict)
    errors: list[LogEvent] = field(default_factory=list)  # log events at warning level or above
    # block ids that served a prefix-cache hit (the first blocks of an admission that hit)
    prefix_blocks: set[int] = field(default_factory=set)
    events: int = 0
    # every request's life (waits with reasons, prefix lookups, preemptions): the request rules' input
    lives: RequestFold = field(default_factory=lambda: RequestFold(finished_kept=None))
    # sessions' turns: whether each found the previous turn's context still resident
    sessions: SessionFold = field(default_factory=SessionFold)
    _running: dict[str, None] = field(default_factory=dict)  # running after the last step, admission order
    # a MoE model's per-expert routed tokens over the whole run (the step events' expert_counts)
    experts: ExpertLoad = field(default_factory=lambda: ExpertLoad(window=None))
    # pipeline parallelism: each stage's bubble and bytes over this engine's steps
    pipeline: PipelineIdle = field(default_factory=PipelineIdle)
    # data parallelism: every rank's load (all events), and each rank > 0's own fold, so the
    # per-engine rules judge one scheduler's steps at a time (rank 0's are this fold's)
    dp: DataParallelLoad = field(default_factory=DataParallelLoad)
    ranks: dict[int, RunFacts] = field(default_factory=dict)
    own_rank: int = 0  # a rank's fold (in ``ranks``) takes its events as they are
    stalls: list[StallFacts] = field(default_factory=list)  # every core's, in order (engine.stalled)

    def __call__(self, event: Event) -> None:
        if self.own_rank == 0:
            self.dp(event)
            rank = getattr(event, "dp_rank", 0)
            if rank:
                self.rank(rank)(event)
                return
        self.events += 1
        self.lives(event)
        self.sessions(event)
        if isinstance(event, StepEvent):
            self._step(event)
        elif isinstance(event, RequestArrived | RequestScheduled | RequestPreempted | RequestFirstToken
                        | RequestFinished):
            self._request(event.request_id)
        elif isinstance(event, StartupPhase):
            if event.status != "begin":
                self.phases[event.phase] = event
            if event.status == "failed":
                self.failed_phase = event
        elif isinstance(event, EngineConfigEvent):
            self.config, self.model = dict(event.config), dict(event.model)
            self.dp.declared_size = int(self.config.get("data_parallel_size") or 0)
        elif isinstance(event, LogEvent):
            if event.level in ("warning", "error", "critical"):
                self.errors.append(event)
        elif isinstance(event, EngineStalled | EngineRecovered):
            self._stall(event)
        elif isinstance(event, SnapshotEvent):
            self._snapshot(event.state)

    def rank(self, rank: int) -> RunFacts:
        """Data-parallel rank ``rank``'s own fold (0: this one), with the run's flags and startup."""
        if rank == 0:
            return self
        facts = self.ranks.get(rank)
        if facts is None:
            facts = self.ranks[rank] = RunFacts(config=dict(self.config), model=dict(self.model),
                                                phases=dict(self.phases), failed_phase=self.failed_phase,
                                                own_rank=rank)
        return facts

    def _request(self, request_id: str) -> RequestFacts:
        """The doctor's reading of a request its events named (the record is the fold's)."""
        req = self.requests.get(request_id)
        if req is None:
            req = self.requests[request_id] = RequestFacts(self.lives.lives[request_id], self)
        return req

    def step_from(self, step: int) -> int | None:
        """The first step folded at or after ``step`` (a fold placed the fact there), None when none came."""
        k = bisect.bisect_left(self.steps, step, key=lambda row: row.index)
        return self.steps[k].index if k < len(self.steps) else None

    def _step(self, e: StepEvent) -> None:
        prefills = {rid: int(v[0]) for rid, v in e.scheduled.items() if len(v) > 1 and v[1] == "prefill"}
        self.steps.append(StepRow(
            index=e.index, t=e.t, duration_s=e.duration_s or e.forward_s,
            num_prefill_tokens=e.num_prefill_tokens, num_decode_tokens=e.num_decode_tokens,
            num_running=e.num_running, num_waiting=e.num_waiting,
            kv_blocks_used=e.kv_blocks_used_forward or e.kv_blocks_used, kv_blocks_total=e.kv_blocks_total,
            prefills=prefills, preempted=list(e.preempted), evicted=list(e.evicted), num_finished=len(e.finished),
            collective_s=e.collective_s, collective_bytes=e.collective_bytes,
            admitted=len(e.new) + len(e.resumed),
            head=next(iter(e.waiting_reasons.items()), None), scheduled=len(e.scheduled),
            pipeline_bubble_s=list(e.pipeline_bubble_s), pipeline_bytes=list(e.pipeline_bytes)))
        self.pipeline(e)
        running = self._running
        running.update(dict.fromkeys((*e.new, *e.resumed)))
        for rid in (*e.preempted, *e.finished):
            running.pop(rid, None)
        head = self.steps[-1].head
        if head is not None and head[1][:1] == [WAIT_MAX_NUM_SEQS]:
            self.steps[-1].deferred = [rid for rid in running if rid not in e.scheduled]
        if e.expert_counts:
            self.experts.add(e.expert_counts)
        for rid in e.new:
            hit_blocks = self._request(rid).prefix_hit_tokens // self.block_size
            self.prefix_blocks.update(e.allocated.get(rid, [])[:hit_blocks])
        for rid in e.preempted:
            self._request(rid)

    def _stall(self, event: EngineStalled | EngineRecovered) -> None:
        open_ = next((s for s in reversed(self.stalls) if s.rank == event.rank and s.recovered_after_s is None), None)
        if isinstance(event, EngineRecovered):
            if open_ is not None:
                open_.recovered_after_s = event.stalled_s
        elif open_ is None or open_.t != event.t:  # a snapshot's recent events may repeat one
            self.stalls.append(StallFacts(event.rank, event.t, event.phase, event.stalled_s, event.limit_s,
                                          event.last_step, list(event.requests), event.dump))

    def _snapshot(self, state: dict[str, Any]) -> None:
        """A live stream starts with the server's view: its flags, phases and the
        recent events it kept (older steps are gone; the rules say so by range)."""
        self.config = dict(state.get("config", {})) or self.config
        self.dp.declared_size = int(self.config.get("data_parallel_size") or 0)
        self.model = dict(state.get("model", {})) or self.model
        for letter, phase in (state.get("phases") or {}).items():
            if phase.get("status") in ("end", "failed", "skipped"):
                event = StartupPhase(phase=letter, name=phase.get("name", ""), status=phase["status"],
                                     duration_s=phase.get("duration_s"), data=dict(phase.get("data") or {}),
                                     reason=phase.get("reason"))
                self(event)
        for row in state.get("recent") or []:
            try:
                self(event_from_dict(row))
            except (ValueError, TypeError):
                continue  # a record this version does not know: the live events that follow still count
        for rank, stall in (state.get("stalled") or {}).items():  # stalled now, its event past the recent ones
            if not any(s.rank == int(rank) and s.recovered_after_s is None for s in self.stalls):
                self.stalls.append(StallFacts(int(rank), float(stall.get("t") or 0.0), str(stall.get("phase") or ""),
                                              float(stall.get("stalled_s") or 0.0), float(stall.get("limit_s") or 0.0),
                                              stall.get("last_step"), [], stall.get("dump")))

    # ---------------------------------------------------------------- readings
    @property
    def kv_cache(self) -> KvCacheData | None:
        """Phase E's pool, when the run reported it."""
        event = self.phases.get("E")
        return KvCacheData.from_dict(event.data) if event is not None and event.data else None

    def flag(self, name: str, default: Any = None) -> Any:
        """A flag under vLLM's underscored name, as the run's ``engine.config`` recorded it."""
        value = self.config.get(name)
        return default if value is None else value

    @property
    def block_size(self) -> int:
        kv = self.kv_cache
        return int(kv.block_size) if kv is not None and kv.block_size else int(self.flag("block_size", 16))

    @property
    def pool_tokens(self) -> int:
        """Tokens the KV pool holds: phase E's figure, else the steps' block total."""
        kv = self.kv_cache
        if kv is not None and kv.kv_cache_tokens:
            return int(kv.kv_cache_tokens)
        total = max((s.kv_blocks_total for s in self.steps), default=0)
        return total * self.block_size
