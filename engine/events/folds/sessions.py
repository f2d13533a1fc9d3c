"""Sessions: whether a conversation's context survived from one turn to the next.

A session is the requests that share a session key (``request.arrived``'s ``session``: an
``X-Session-Id`` header, else the request's ``cache_salt``, else its ``user``), in arrival
order; each request is a turn. An agent's turn N+1 repeats turn N's context and adds to it,
so it can reuse turn N's KV from the prefix cache if those blocks are still resident. This
fold answers, per turn, from the events alone:

- ``prev_blocks``: the blocks holding cached content that turn N released when it finished
  (its full blocks; the partly filled last one is never cached);
- ``resident``: how many of them were still resident (not evicted) when turn N+1 was
  admitted, and ``hit_tokens`` how much of its prompt came from the cache;
- ``lost``: each block evicted in between, with the request whose allocation took it
  and the step (in the step event, an ``evicted`` block is one of some request's
  ``allocated`` blocks: the free block it was handed);
- ``pool_to_keep``: the pool that would have kept turn N's blocks: the blocks in use when it
  released them, those blocks, and the blocks handed out before turn N+1 came. The free queue
  hands out its least recently freed block first and turn N's were the most recent, so they
  survive while what is taken from the queue (fresh blocks, and cached ones a hit takes out)
  stays within the free blocks ahead of them (the doctor's fix; ``gap_peak_blocks``, the most
  blocks in use in between, is a lower bound).

Evictions of a step made by requests allocated before the turn (``allocated`` keeps
allocation order) count as before its admission; its own and later ones do not.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.events.record import Event
from engine.events.request_records import RequestArrived, RequestFinished, RequestScheduled
from engine.events.step_records import StepEvent

REPREFILL_SHARE = 0.5  # a turn that re-prefills more than this share of its prefix lost its context


@dataclass(slots=True)
class LostBlock:
    """A block of the previous turn's context evicted before this turn was admitted."""

    block: int
    by_request: str  # whose allocation took it ("" when the step names no taker)
    step: int
    t: float

    def to_dict(self) -> dict[str, Any]:
        return {"block": self.block, "by_request": self.by_request, "step": self.step, "t": self.t}


@dataclass(slots=True)
class SessionTurn:
    """One request of a session. The fields about the previous turn stay None for the first
    turn, and for a turn admitted before the previous one finished (nothing to keep yet)."""

    index: int  # 1-based
    request_id: str
    arrived_t: float
    prompt_tokens: int
    previous: str | None = None
    prefix_tokens: int = 0  # the previous turn's context (prompt + output), what this one can reuse
    prev_blocks: int | None = None
    resident: int | None = None
    hit_tokens: int | None = None
    admitted_step: int | None = None
    gap_peak_blocks: int = 0
    pool_to_keep: int = 0
    lost: list[LostBlock] = field(default_factory=list)
    context_tokens: int = 0  # its own prompt + output, once finished
    finished: bool = False

    @property
    def reprefill_tokens(self) -> int:
        """Tokens of the previous turn's context this turn computed again."""
        if self.hit_tokens is None or self.prev_blocks is None:
            return 0
        return max(0, min(self.prefix_tokens, self.prompt_tokens) - self.hit_tokens)

    @property
    def context_lost(self) -> bool:
        """It re-prefilled more than :data:`REPREFILL_SHARE` of its prefix."""
        return self.prefix_tokens > 0 and self.reprefill_tokens > REPREFILL_SHARE * self.prefix_tokens

    def to_dict(self) -> dict[str, Any]:
        return {"turn": self.index, "request_id": self.request_id, "arrived_t": self.arrived_t,
                "prompt_tokens": self.prompt_tokens, "previous": self.previous, "prefix_tokens": self.prefix_tokens,
                "prev_blocks": self.prev_blocks, "resident": self.resident, "hit_tokens": self.hit_tokens,
                "reprefill_tokens": self.reprefill_tokens, "context_lost": self.context_lost,
                "admitted_step": self.admitted_step, "gap_peak_blocks": self.gap_peak_blocks,
                "pool_to_keep": self.pool_to_keep,
                "lost": [b.to_dict() for b in self.lost]}

    def render(self) -> list[str]:
        head = f"turn {self.index}  {self.request_id}  prompt {self.prompt_tokens:,} tokens"
        if self.prev_blocks is None or self.resident is None:
            why = "first turn" if self.previous is None else (
                "admitted before the previous turn finished" if self.admitted_step is not None else "not admitted yet")
            return [f"{head}: {why}"]
        hit = self.hit_tokens or 0
        lines = [f"{head}: {self.resident} of {self.prev_blocks} blocks of {self.previous} still resident; "
                 f"prefix-cache hit {hit:,} of {self.prefix_tokens:,} prefix tokens"
                 + (f", {self.reprefill_tokens:,} re-prefilled" if self.reprefill_tokens else "")
                 + ("  CONTEXT LOST" if self.context_lost else "")]
        lines += [f"    block {b.block} evicted at step {b.step} by {b.by_request or 'an allocation'}"
                  for b in self.lost]
        return lines


@dataclass(slots=True)
class Session:
    key: str
    turns: list[SessionTurn] = field(default_factory=list)
    # the last finished turn's cached blocks, watched until the next turn is admitted
    watched: set[int] = field(default_factory=set)
    watched_turn: SessionTurn | None = None
    pending_lost: list[LostBlock] = field(default_factory=list)
    gap_peak: int = 0
    released_used: int = 0  # blocks in use when the watched turn released its own
    released_step: int = -1
    fresh: int = 0  # fresh blocks handed out since

    def to_dict(self) -> dict[str, Any]:
        return {"session": self.key, "turns": [t.to_dict() for t in self.turns]}

    def render(self) -> str:
        lost = sum(t.context_lost for t in self.turns)
        lines = [f"session {self.key}: {len(self.turns)} turns"
                 + (f", {lost} re-prefilled more than half their prefix" if lost else "")]
        for turn in self.turns:
            lines += ["  " + line for line in turn.render()]
        return "\n".join(lines)


class SessionFold:
    """Folds request and step events into :class:`Session` records (``sessions`` by key).
    Events of one data-parallel rank (block ids are per rank's pool)."""

    __slots__ = ("_cached", "_open", "_turns", "_watchers", "sessions")

    def __init__(self) -> None:
        self.sessions: dict[str, Session] = {}
        self._turns: dict[str, tuple[Session, SessionTurn]] = {}  # request id -> its turn (until its blocks are freed)
        self._cached: set[int] = set()  # blocks holding prefix-cache content now
        self._watchers: dict[int, set[str]] = {}  # block -> sessions whose last context holds it
        self._open: dict[str, Session] = {}  # sessions between a finished turn and the next admission

    def __call__(self, event: Event) -> None:
        if isinstance(event, StepEvent):
            self._step(event)
        elif isinstance(event, RequestArrived):
            if event.session:
                self._arrived(event)
        elif isinstance(event, RequestScheduled):
            entry = self._turns.get(event.request_id)
            if entry is not None:
                entry[1].hit_tokens = event.prefix_hit_tokens
        elif isinstance(event, RequestFinished):
            entry = self._turns.get(event.request_id)
            if entry is not None:
                entry[1].finished = True
                entry[1].context_tokens = event.prompt_tokens + event.output_tokens

    def get(self, key: str) -> Session | None:
        return self.sessions.get(key)

    def lost_turns(self) -> list[tuple[Session, SessionTurn]]:
        return [(s, t) for s in self.sessions.values() for t in s.turns if t.context_lost]

    # ------------------------------------------------------------------ internals
    def _arrived(self, event: RequestArrived) -> None:
        session = self.sessions.setdefault(event.session, Session(event.session))
        previous = session.turns[-1] if session.turns else None
        turn = SessionTurn(len(session.turns) + 1, event.request_id, event.t, event.prompt_tokens,
                           previous=previous.request_id if previous else None)
        session.turns.append(turn)
        self._turns[event.request_id] = (session, turn)

    def _step(self, ev: StepEvent) -> None:
        evicted = set(ev.evicted)
        handed_out = [b for blocks in ev.allocated.values() for b in blocks] if self._open else []
        for rid, blocks in ev.allocated.items():
            entry = self._turns.get(rid)
            if entry is not None and rid in ev.new:  # admitted now: judge what its prefix found
                self._admit(entry[0], entry[1], ev.index)
            for block in blocks:
                if block in evicted:
                    self._evict(block, rid, ev)
                    evicted.discard(block)
        for block in evicted:  # a step naming no taker (older recordings)
            self._evict(block, "", ev)
        for rid in ev.new:
            entry = self._turns.get(rid)
            if entry is not None and entry[1].admitted_step is None:
                self._admit(entry[0], entry[1], ev.index)
        self._cached.update(ev.cached)
        for rid, blocks in ev.freed.items():
            entry = self._turns.get(rid)
            if entry is not None and entry[1].finished:
                self._released(entry[0], entry[1], blocks, ev)
                del self._turns[rid]
        for session in self._open.values():
            session.gap_peak = max(session.gap_peak, ev.kv_blocks_used)
            if session.released_step != ev.index:  # this step's allocations came before the release
                # every block handed out may be a free one ahead of the context (a fresh one, or
                # another's cached block a hit takes out of the queue); its own are not
                session.fresh += sum(1 for b in handed_out if b not in session.watched)

    def _admit(self, session: Session, turn: SessionTurn, step: int) -> None:
        turn.admitted_step = step
        watched = session.watched_turn
        if watched is None or watched.request_id != turn.previous:
            return  # the first turn, or the previous one had not finished
        turn.prefix_tokens = watched.context_tokens
        turn.prev_blocks = len(session.watched) + len(session.pending_lost)
        turn.resident = len(session.watched)
        turn.lost = session.pending_lost
        turn.gap_peak_blocks = session.gap_peak
        turn.pool_to_keep = session.released_used + turn.prev_blocks + session.fresh
        self._unwatch(session)

    def _evict(self, block: int, by_request: str, ev: StepEvent) -> None:
        self._cached.discard(block)
        for key in self._watchers.pop(block, ()):
            session = self.sessions[key]
            session.watched.discard(block)
            session.pending_lost.append(LostBlock(block, by_request, ev.index, ev.t))

    def _released(self, session: Session, turn: SessionTurn, blocks: list[int], ev: StepEvent) -> None:
        """A finished turn freed its blocks: watch its cached ones for the next turn."""
        if session.turns[-1] is not turn:
            return  # the next turn arrived already; it is judged without this one
        self._unwatch(session)
        session.watched_turn = turn
        session.released_used, session.released_step = ev.kv_blocks_used, ev.index
        session.watched = {b for b in blocks if b in self._cached}
        self._open[session.key] = session
        for block in session.watched:
            self._watchers.setdefault(block, set()).add(session.key)

    def _unwatch(self, session: Session) -> None:
        for block in session.watched:
            keys = self._watchers.get(block)
            if keys is not None:
                keys.discard(session.key)
                if not keys:
                    del self._watchers[block]
        session.watched = set()
        session.watched_turn = None
        self._open.pop(session.key, None)
        session.pending_lost = []
        session.gap_peak = session.fresh = 0
