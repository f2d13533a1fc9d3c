"""``engine replay``: re-run the scheduler from a recording and compare decisions.

A recording (JSONL events, from the real engine or ``engine simulate``) holds the
flags (the ``engine.config`` event's, resolved; the header's as given), phase E's
``num_blocks``, every arrival, abort and
finish, and every step's decisions. Replay rebuilds a fresh
:class:`~engine.core.scheduler.Scheduler` with those limits, feeds it the recorded
arrivals and aborts at the recorded steps, and compares each step it takes with
the recorded one: tokens per request, preemptions, block ids allocated, freed,
cached and evicted, finishes, queue lengths and pool use.

Events carry token counts, never token ids, so replay supplies the ids:

- Sampled tokens: a filler id, except at a request's recorded finish step with
  reason ``stop``, where it samples a stop id. ``length`` finishes are left to
  the scheduler (max_tokens / max-model-len), so they are verified.
- Prompt ids only matter to prefix caching. A request's first admission records
  its hit length (``request.scheduled``) and the hit block ids (first entries of
  its ``allocated``); those blocks were written by an earlier request, so the
  replayed prompt starts with that request's first ``hit`` tokens and continues
  with ids nobody else has. Limitation: hits of a resumed (preempted) request on
  another request's blocks are not reconstructed. The KV cache groups come from
  ``engine.config``'s ``kv_cache_groups`` (none named: one full-attention group); hits
  are read in the first full-attention group's table (a model of sliding windows only
  has its hits not reconstructed).
- Sharing longer than the hit: in a hybrid pool a sliding window can cut a request's
  first hit short of what the full-attention groups held (its admission's
  ``prefix_lookups`` entry ``[hit, "sliding_window", full-attention hit]``; the hit
  may be 0). Its prompt still shares that longer prefix, and it shows: in the window
  groups' blocks it writes or finds held already, and in what its lookups while it
  waited made it need. The events do not say whose prefix it shares, so
  :class:`_WindowShares` finds out: at each step that looks the request up while it
  fares otherwise than recorded, it tries, on copies of the scheduler, the prompt
  prefix of each request whose block at the shared length's end the replayed
  full-attention cache holds, rules out those that fare otherwise too, and keeps the
  first that fares as recorded. Limitation: a sharing that only a lookup stopped by an
  eviction shows (``[hit, "evicted", step, block]``) is not reconstructed.

A recording cut at any byte replays up to its last whole step and says so.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.budget.memory import GiB
from engine.core.kv_cache import extend_block_hashes
from engine.core.kv_cache_groups import resolve_groups
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from engine.core.step_loop import ExecutedStep, run_step
from engine.errors import UserError
from engine.events import (
    EngineConfigEvent,
    Event,
    EventBus,
    Recording,
    RequestArrived,
    RequestFinished,
    RequestRejected,
    RequestScheduled,
    StartupPhase,
    StepEvent,
    read_events,
)
from engine.events.ledger import LEDGER
from engine.events.phase_data import KvCacheData
from engine.events.step_records import PREFIX_WINDOW
from engine.sim.driver import SAMPLED_TOKEN_ID

STOP_TOKEN_ID = -1  # never a prompt id: the replay's "model" says stop with it
FILLER_TOKEN_ID = SAMPLED_TOKEN_ID
MAX_WINDOW_SHARE_TRIALS = 16  # distinct cached prefixes tried at one step for one request

# Fields of a step event that are decisions (compared), in the order shown.
COMPARED_FIELDS = (
    "index",
    "scheduled",
    "preempted",
    "new",
    "resumed",
    "allocated",
    "allocated_groups",
    "freed",
    "freed_groups",
    "freed_by_window",
    "cached",
    "evicted",
    "finished",
    "num_prefill_tokens",
    "num_decode_tokens",
    "num_running",
    "num_waiting",
    "kv_blocks_used",
    "kv_blocks_total",
)
_REQUEST_KEYED = ("scheduled", "allocated", "allocated_groups", "freed", "freed_groups", "freed_by_window", "finished")
_REQUEST_LISTS = ("preempted", "new", "resumed")


def load_recording(path: str | Path) -> Recording:
    """Read an event file for replay; a one-line :class:`UserError` when it is not one."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{path}: no such recording (give a JSONL event file from --events or engine simulate)")
    try:
        return read_events(p)
    except ValueError as exc:
        raise UserError(str(exc)) from None


def _phase_data(events: Iterable[Event]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for ev in events:
        if isinstance(ev, StartupPhase) and ev.data and not ev.rank:  # rank 0's: the replica's
            out.setdefault(ev.phase, {}).update(ev.data)
    return out


def recorded_flags(rec: Recording) -> dict[str, Any]:
    """The flags the recorded run used. The header's config holds the flags as given
    (the sink writes it before startup resolves them); the ``engine.config`` event holds
    them resolved, every ``auto`` and device default filled in (on CPU
    ``max_num_batched_tokens`` 512, not the flag's 8,192), so its values win. Recordings
    without that event (scripted scheduler runs) keep the header's."""
    flags = dict(rec.config)
    resolved = next((ev for ev in rec.events if isinstance(ev, EngineConfigEvent)), None)
    if resolved is not None:
        flags.update(resolved.config)
    return flags


def scheduler_config_from_recording(rec: Recording) -> SchedulerConfig:
    """The scheduler limits a recording ran with: the resolved flags
    (:func:`recorded_flags`), pool size and block size from phase E (or the first
    step event)."""
    if any(ev.type == "encoder.step" for ev in rec.events):
        raise UserError("the recording is of a vision-language model (it has encoder.step events): engine replay "
                        "does not rebuild its requests' images yet; simulate it again with engine simulate instead")
    cfg = recorded_flags(rec)
    kv = KvCacheData.from_dict(_phase_data(rec.events).get("E", {}))
    first_step = next((ev for ev in rec.events if isinstance(ev, StepEvent)), None)
    num_blocks = kv.num_blocks or (cfg.get("simulation") or {}).get("num_blocks") or (
        first_step.kv_blocks_total if first_step else 0
    )
    if not num_blocks:
        raise UserError("the recording has no KV pool size (no phase E event and no step): nothing to replay")
    try:
        return SchedulerConfig.from_flags(cfg, num_blocks=int(num_blocks), block_size=kv.block_size,
                                          max_model_len=kv.max_model_len)
    except (TypeError, ValueError) as exc:
        raise UserError(f"the recording's config cannot drive a scheduler: {exc}") from None


@dataclass(slots=True)
class RecordedStep:
    """One recorded step and the inputs that reached the scheduler before it."""

    event: StepEvent
    inputs: list[Event]


@dataclass(slots=True)
class Divergence:
    """The first step where replay and recording disagree."""

    position: int  # how many steps matched before this one
    recorded: StepEvent
    replayed: StepEvent
    fields: list[str]
    request_ids: list[str]


@dataclass(slots=True)
class ReplayReport:
    steps_recorded: int
    steps_replayed: int = 0
    divergence: Divergence | None = None
    line_cut: bool = False  # the file's last line was cut mid-way
    tail_events: int = 0  # whole events after the last whole step (a step cut short)

    @property
    def ok(self) -> bool:
        return self.divergence is None


def split_steps(events: list[Event]) -> tuple[list[RecordedStep], int]:
    """Group events into steps: the arrivals, aborts and out-of-band finishes
    before each step event, which the replay feeds in before scheduling it.
    Returns the steps and the number of events after the last step event."""
    steps: list[RecordedStep] = []
    pending: list[Event] = []
    for ev in events:
        if isinstance(ev, StepEvent):
            step_finished = ev.finished
            inputs = [
                e for e in pending
                if isinstance(e, RequestArrived | RequestRejected)
                or (isinstance(e, RequestFinished) and (e.reason == "abort" or e.request_id not in step_finished))
            ]
            steps.append(RecordedStep(ev, inputs))
            pending = []
        elif isinstance(ev, RequestArrived | RequestRejected | RequestFinished):
            pending.append(ev)
    return steps, len(pending)


class _PromptBuilder:
    """Prompt ids that reproduce the recorded prefix-cache hits (see module doc)."""

    def __init__(self, steps: list[RecordedStep], block_size: int, events: list[Event],
                 hit_group: int | None = 0) -> None:
        self.block_size = block_size
        self.prompt_tokens: dict[str, int] = {}
        self.source: dict[str, tuple[str, int]] = {}  # request -> (request whose prefix it shares, tokens)
        self._built: dict[str, list[int]] = {}
        self._next_unique = 1_000_000
        first_hit: dict[str, int] = {}
        for ev in events:
            if isinstance(ev, RequestArrived):
                self.prompt_tokens[ev.request_id] = ev.prompt_tokens
            elif isinstance(ev, RequestScheduled) and ev.prefix_hit_tokens > 0:
                first_hit.setdefault(ev.request_id, ev.prefix_hit_tokens)
        block_source: dict[int, tuple[str, int]] = {}  # block -> (request that wrote it, table position)
        table_len: dict[str, int] = {}
        admitted: set[str] = set()
        if hit_group is None:  # windows only: no table holds a hit from position 0
            return
        for step in steps:
            ev = step.event
            for rid, blocks in ev.allocated.items():
                # every group's blocks, group after group (no counts: one group's)
                counts = ev.allocated_groups.get(rid) or [len(blocks)]
                g = hit_group if hit_group < len(counts) else 0
                blocks = blocks[sum(counts[:g]) : sum(counts[: g + 1])]
                start = table_len.get(rid, 0)
                num_hit = 0
                if rid not in admitted and rid in first_hit and start == 0:
                    num_hit = min(first_hit[rid] // block_size, len(blocks))
                    if num_hit:
                        src = block_source.get(blocks[num_hit - 1])
                        if src is not None and src[1] == num_hit - 1 and src[0] != rid:
                            self.source[rid] = (src[0], num_hit * block_size)
                admitted.add(rid)
                for j in range(num_hit, len(blocks)):
                    block_source[blocks[j]] = (rid, start + j)
                table_len[rid] = start + len(blocks)
            for rid in ev.freed:
                table_len[rid] = 0

    def prompt(self, request_id: str, num_tokens: int) -> list[int]:
        built = self._built.get(request_id)
        if built is not None:
            return built
        prefix: list[int] = []
        src = self.source.get(request_id)
        if src is not None:
            other, hit = src
            base = self.prompt(other, self.prompt_tokens.get(other, hit))
            prefix = base[:hit]
            if len(prefix) < hit:  # the shared prefix ran into the other request's output
                prefix += [FILLER_TOKEN_ID] * (hit - len(prefix))
            prefix = prefix[: max(num_tokens - 1, 0)]
        start = self._next_unique
        self._next_unique += num_tokens - len(prefix)
        built = prefix + list(range(start, start + num_tokens - len(prefix)))
        self._built[request_id] = built
        return built

    def built(self, request_id: str) -> list[int] | None:
        """The prompt built for ``request_id`` so far (None before its arrival)."""
        return self._built.get(request_id)

    def share(self, request_id: str, prefix: list[int]) -> list[str]:
        """Start ``request_id``'s built prompt with ``prefix`` (a longer sharing than its
        first hit showed), and the built prompts that copied its start; returns every
        request whose prompt changed, ``request_id`` first."""
        built = self._built[request_id]
        self._built[request_id] = prefix + built[len(prefix):]
        changed = [request_id]
        for other, (src, hit) in self.source.items():
            copied = self._built.get(other)
            if src == request_id and copied is not None:
                n = min(hit, len(copied) - 1, len(self._built[request_id]))
                changed += self.share(other, self._built[request_id][:n])
        return changed


def window_cut_shares(steps: list[RecordedStep]) -> dict[int, list[tuple[str, int]]]:
    """Step index -> (request, tokens) for each first admission whose sliding window cut its
    hit short of the full-attention groups' (``prefix_lookups``; see the module docstring),
    in admission order."""
    out: dict[int, list[tuple[str, int]]] = {}
    for step in steps:
        ev = step.event
        new = set(ev.new)
        for rid, lookup in ev.prefix_lookups.items():
            if rid in new and len(lookup) > 2 and lookup[1] == PREFIX_WINDOW and lookup[2] > lookup[0]:
                out.setdefault(ev.index, []).append((rid, int(lookup[2])))
    return out


# A request's own parts of a step: what a trial of its prompt is judged on.
_REQUEST_OWN_FIELDS = ("scheduled", "allocated", "allocated_groups", "waiting_reasons", "prefix_lookups")


def _same_for_request(recorded: StepEvent, replayed: StepEvent, request_id: str) -> bool:
    """``request_id`` fared the same in both steps: scheduled, allocated and waited alike, its
    lookup stopped alike, and the same of its blocks were cached."""
    if any(getattr(recorded, name).get(request_id) != getattr(replayed, name).get(request_id)
           for name in _REQUEST_OWN_FIELDS):
        return False
    rec_cached, rep_cached = set(recorded.cached), set(replayed.cached)
    return all((b in rec_cached) == (b in rep_cached) for b in recorded.allocated.get(request_id, ()))


def _set_prompt(req: Request, prompt: list[int]) -> None:
    """Give a request that has computed nothing yet its rebuilt prompt."""
    req.prompt_token_ids = list(prompt)
    req.token_ids = list(prompt)
    req.block_hashes = []


def _listened(scheduler: Scheduler) -> Scheduler:
    """``scheduler`` with a bus that listens, so its steps say why requests waited and where
    their lookups stopped (a trial is judged on them)."""
    bus = EventBus()
    bus.subscribe(lambda _event: None)
    scheduler.bus = bus
    return scheduler


class _WindowShares:
    """The longer sharing of window-cut admissions (see the module docstring). A waiting
    request's prompt matters only at the steps that look it up, so it may change until
    its admission; ``undecided`` holds each such request and the tokens it shares."""

    def __init__(self, prompts: _PromptBuilder, steps: list[RecordedStep], block_size: int,
                 full_group: int | None) -> None:
        self.prompts = prompts
        self.block_size = block_size
        self.full_group = full_group
        self.undecided: dict[str, int] = {}  # request -> shared tokens
        if full_group is not None:
            for shares in window_cut_shares(steps).values():
                self.undecided.update(shares)
        self._owner: dict[int, tuple[str, int]] = {}  # block hash -> (request, position) of a prompt's full block
        self._ruled_out: dict[str, list[list[int]]] = {}  # request -> prefixes a trial step ruled out

    def note_prompt(self, request_id: str, prompt: list[int]) -> None:
        """Remember the hash of each full block of a prompt (the replay's requests carry no salt)."""
        probe = Request(request_id, prompt)
        for j, h in enumerate(extend_block_hashes(probe, len(prompt) // self.block_size, self.block_size)):
            self._owner.setdefault(h, (request_id, j))

    def candidates(self, scheduler: Scheduler, request_id: str, num_blocks: int) -> list[list[int]]:
        """Distinct prompt prefixes of ``num_blocks`` blocks that end at a block the full-attention
        cache holds now, the most recently cached first."""
        assert self.full_group is not None
        size = num_blocks * self.block_size
        out: list[list[int]] = []
        for h in reversed(scheduler.kv.pool.cached_block_maps[self.full_group]):
            owner = self._owner.get(h)
            if owner is None or owner[1] != num_blocks - 1 or owner[0] == request_id:
                continue
            prompt = self.prompts.built(owner[0])
            prefix = prompt[:size] if prompt is not None else []
            if len(prefix) == size and prefix not in out:
                out.append(prefix)
        return out[:MAX_WINDOW_SHARE_TRIALS]

    def step(self, scheduler: Scheduler, recorded: StepEvent, run: Callable[[Scheduler], StepEvent]) -> StepEvent:
        """Run ``recorded``'s step on ``scheduler``, first on a copy when it may look up a
        waiting request whose prefix is undecided: if that request fares otherwise than
        recorded, it takes the first candidate prefix that fares as recorded."""
        # a step admits at most max_num_seqs - running requests (the ones it preempts go back
        # ahead of the queue), so only those first in the queue can be looked up
        reachable = scheduler.waiting.head(max(scheduler.config.max_num_seqs - len(scheduler.running), 0))
        pending = [req.request_id for req in reachable if req.request_id in self.undecided
                   and req.status is RequestStatus.WAITING and not req.num_computed_tokens]
        if pending:
            probe = _listened(copy.deepcopy(scheduler))
            event = run(probe)
            for rid in pending:
                if probe.requests[rid].block_hashes and not _same_for_request(recorded, event, rid):
                    self._switch(scheduler, recorded, rid, run)
        return run(scheduler)

    def _switch(self, scheduler: Scheduler, recorded: StepEvent, request_id: str,
                run: Callable[[Scheduler], StepEvent]) -> None:
        """Try each candidate prefix not yet ruled out for one step, rule out those that fare
        otherwise than recorded, and give the request (and the prompts that copied its
        start) the first that fares as recorded."""
        ruled_out = self._ruled_out.setdefault(request_id, [])
        for prefix in self.candidates(scheduler, request_id, self.undecided[request_id] // self.block_size):
            if prefix in ruled_out:
                continue
            if not _same_for_request(recorded, run(self._trial(scheduler, request_id, prefix)), request_id):
                ruled_out.append(prefix)
                continue
            for rid in self.prompts.share(request_id, prefix):
                prompt = self.prompts.built(rid)
                assert prompt is not None
                self.note_prompt(rid, prompt)
                req = scheduler.requests.get(rid)
                if req is not None and req.status is RequestStatus.WAITING and not req.num_computed_tokens:
                    _set_prompt(req, prompt)
            return

    def _trial(self, scheduler: Scheduler, request_id: str, prefix: list[int]) -> Scheduler:
        trial = _listened(copy.deepcopy(scheduler))
        built = self.prompts.built(request_id)
        assert built is not None
        _set_prompt(trial.requests[request_id], prefix + built[len(prefix):])
        return trial


def _diff_fields(recorded: StepEvent, replayed: StepEvent) -> list[str]:
    out = []
    for name in COMPARED_FIELDS:
        a, b = getattr(recorded, name), getattr(replayed, name)
        if name in ("cached", "evicted"):
            a, b = sorted(a), sorted(b)
        if a != b:
            out.append(name)
    return out


def _involved(recorded: StepEvent, replayed: StepEvent, fields: list[str]) -> list[str]:
    ids: dict[str, None] = {}
    for name in fields:
        a, b = getattr(recorded, name), getattr(replayed, name)
        if name in _REQUEST_KEYED:
            for rid in set(a) | set(b):
                if a.get(rid) != b.get(rid):
                    ids[rid] = None
        elif name in _REQUEST_LISTS:
            for rid in set(a) ^ set(b):
                ids[rid] = None
    return sorted(ids)


class Replayer:
    """Step-by-step replay of a recording; see the module docstring."""

    def __init__(self, recording: Recording) -> None:
        self.recording = recording
        self.config = scheduler_config_from_recording(recording)
        self.steps, self.tail_events = split_steps(recording.events)
        self.phases = _phase_data(recording.events)
        self.scheduler = Scheduler(self.config)
        # hits are reconstructed from the first full-attention group (positions from 0, no null
        # block); with windows only they are not (see the module docstring)
        groups = resolve_groups(self.config.kv_cache_groups)
        hit_group = next((i for i, g in enumerate(groups) if not g.spec.is_sliding), None)
        self._prompts = _PromptBuilder(self.steps, self.config.block_size, recording.events, hit_group)
        self._window_shares = _WindowShares(self._prompts, self.steps, self.config.block_size, hit_group)
        self._stop_at: dict[int, set[str]] = {}
        self._fail_at: dict[int, set[str]] = {}  # requests whose own sampling/detokenising raised
        for step in self.steps:
            for rid, reason in step.event.finished.items():
                if reason in ("stop", "error"):
                    (self._stop_at if reason == "stop" else self._fail_at).setdefault(step.event.index, set()).add(rid)
        self.position = 0  # recorded steps replayed so far
        self.last_replayed: StepEvent | None = None

    def _feed(self, inputs: list[Event]) -> None:
        sched = self.scheduler
        for ev in inputs:
            if isinstance(ev, RequestArrived | RequestRejected):
                prompt = self._prompts.prompt(ev.request_id, ev.prompt_tokens)
                self._window_shares.note_prompt(ev.request_id, prompt)
                sched.add_request(
                    Request(ev.request_id, prompt, ev.max_tokens, stop_token_ids=(STOP_TOKEN_ID,),
                            arrival_time=ev.t - getattr(ev, "preprocess_s", 0.0),
                            priority=getattr(ev, "priority", 0)),
                    ev.t,
                )
            elif isinstance(ev, RequestFinished):
                if ev.abort_cause:  # the recorded cause; older recordings: the scheduler's default
                    sched.abort(ev.request_id, ev.t, ev.abort_cause)
                else:
                    sched.abort(ev.request_id, ev.t)

    def execute(self, output: SchedulerOutput, now: float) -> ExecutedStep:
        """The replay's executor: each sampling request answers the filler token, or
        the stop token at the step where the recording stopped it, or fails where the
        recording's request failed (finish reason ``error``)."""
        stops = self._stop_at.get(output.step_index, ())
        fails = self._fail_at.get(output.step_index, ())
        return ExecutedStep({s.request.request_id: [STOP_TOKEN_ID if s.request.request_id in stops else FILLER_TOKEN_ID]
                             for s in output.scheduled if s.samples},
                            now, failed={rid: "recorded" for rid in fails})

    def step(self) -> tuple[StepEvent, StepEvent]:
        """Replay the next recorded step: (recorded, replayed)."""
        recorded = self.steps[self.position]
        self._feed(recorded.inputs)
        now = recorded.event.t
        replayed = self._window_shares.step(self.scheduler, recorded.event, lambda sched: self._run_step(sched, now))
        self.position += 1
        self.last_replayed = replayed
        return recorded.event, replayed

    def _run_step(self, scheduler: Scheduler, now: float) -> StepEvent:
        event = run_step(scheduler, self, None, now, build_event=True).event
        assert event is not None
        return event

    def run(self, until_step: int | None = None, verify: bool = True) -> ReplayReport:
        """Replay every recorded step (or through recorded index ``until_step``),
        stopping at the first divergence when ``verify``."""
        report = ReplayReport(steps_recorded=len(self.steps), line_cut=self.recording.truncated,
                              tail_events=self.tail_events)
        while self.position < len(self.steps):
            if until_step is not None and self.steps[self.position].event.index > until_step:
                break
            before = self.position
            recorded, replayed = self.step()
            report.steps_replayed = self.position
            if verify:
                fields = _diff_fields(recorded, replayed)
                if fields:
                    report.divergence = Divergence(before, recorded, replayed, fields,
                                                   _involved(recorded, replayed, fields))
                    break
        return report

    # ------------------------------------------------------------- rendering
    def describe_request(self, request_id: str) -> str:
        req = self.scheduler.requests.get(request_id)
        if req is None:
            return f"  {request_id}: not in the replayed scheduler (finished, rejected or never arrived)"
        return (
            f"  {request_id}: {req.status.value}, prompt {req.num_prompt_tokens}, output "
            f"{req.num_output_tokens}/{req.max_tokens}, computed {req.num_computed_tokens}, "
            f"{req.num_table_blocks} blocks, {req.num_preemptions} preemptions"
        )

    def render_divergence(self, div: Divergence, width: int = 60) -> str:
        rec, rep = div.recorded, div.replayed
        lines = [
            f"MISMATCH at step {rep.index} (recorded step index {rec.index}; {div.position} steps matched before it)",
            f"  {'field':<20} {'recorded':<{width}} replayed",
        ]
        for name in div.fields:
            a, b = getattr(rec, name), getattr(rep, name)
            if name in _REQUEST_KEYED:
                keys = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
                a = {k: a.get(k) for k in keys}
                b = {k: b.get(k) for k in keys}
            lines.append(f"  {name:<20} {_short(a, width):<{width}} {_short(b, width)}")
        if rec.index != rep.index:
            lines.append(f"  the recording has step {rec.index} where step {rep.index} was due: "
                         "a step is missing from the recording (or it was reordered)")
        if div.request_ids:
            lines.append("requests involved (state in the replay after this step):")
            lines.extend(self.describe_request(rid) for rid in div.request_ids[:20])
            if len(div.request_ids) > 20:
                lines.append(f"  ... and {len(div.request_ids) - 20} more")
        return "\n".join(lines)

    def render_state(self, max_runs: int = 60) -> str:
        """Queues, a compact block-owner map and the memory ledger, now."""
        sched = self.scheduler
        cfg = self.config
        step = self.last_replayed.index if self.last_replayed is not None else -1
        lines = [f"state after step {step}"]
        running = [f"{r.request_id}({r.num_computed_tokens}/{r.num_tokens} tok, {r.num_table_blocks} blk)"
                   for r in sched.running]
        waiting = [r.request_id + (" [preempted]" if r.status is RequestStatus.PREEMPTED else "") for r in sched.waiting]
        lines.append(f"running ({len(running)}/{cfg.max_num_seqs}): " + (", ".join(running) or "-"))
        lines.append(f"waiting ({len(waiting)}): " + (", ".join(waiting) or "-"))
        lines.append("block owners (id range: owner; '+' marks shared blocks, 'cached' = free with prefix-cache content):")
        lines.extend("  " + run for run in block_owner_runs(sched, max_runs))
        lines.append("memory ledger:")
        lines.extend("  " + row for row in self.ledger_rows())
        return "\n".join(lines)

    def ledger_rows(self) -> list[str]:
        pool = self.scheduler.kv.pool
        cfg = self.config
        used = pool.num_used
        e = self.phases.get("E", {})
        per_token = int(e.get("bytes_per_token") or 0)
        rows: list[str] = []
        for item in LEDGER:
            value = self.phases.get(item.phase, {}).get(item.name)
            if item.unit == "bytes" and item.name != "bytes_per_token" and isinstance(value, int | float):
                rows.append(f"{item.label:<18}{value / GiB:>10.3f} GiB")
        block_bytes = per_token * cfg.block_size
        kv_used = f" = {used * block_bytes / GiB:.3f} GiB" if block_bytes else ""
        rows.append(f"{'KV blocks used':<18}{used:>10,} of {cfg.num_blocks:,} ({used / cfg.num_blocks * 100:.1f} %){kv_used}")
        rows.append(f"{'free':<18}{pool.num_free:>10,} (of which {pool.num_cached_free:,} hold cached prefixes)")
        return rows


def block_owner_runs(sched: Scheduler, max_runs: int = 60) -> list[str]:
    """Runs of consecutive block ids with the same owner: ``"0-62: r0"``."""
    pool = sched.kv.pool
    owner: dict[int, str] = {}
    for rid, blocks in sched.block_table().items():
        for b in blocks:
            owner[b] = f"{owner[b]}+{rid}" if b in owner else rid
    runs: list[str] = []
    start = 0
    current = None
    count = 0
    for b in range(pool.num_blocks + 1):
        if b < pool.num_blocks:
            label = owner.get(b)
            if label is None:
                label = "null" if b == pool.null_block else "cached" if pool.block_hash[b] is not None else "free"
        else:
            label = None
        if b == 0:
            current = label
            continue
        if label != current or b == pool.num_blocks:
            count += 1
            if count <= max_runs:
                end = b - 1
                runs.append(f"{start}-{end}: {current}" if end > start else f"{start}: {current}")
            start, current = b, label
    if count > max_runs:
        runs.append(f"... {count - max_runs} more runs")
    return runs


def _short(value: Any, width: int) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def verify_recording(path: str | Path) -> tuple[Replayer, ReplayReport]:
    """Replay a whole recording with verification."""
    replayer = Replayer(load_recording(path))
    return replayer, replayer.run()

