"""Rebuild the KV block table by folding ``step`` events.

The monitor, replay and the tests use this to turn an event stream back into the
pool's state: which request holds which blocks (in position order) and which
blocks hold prefix-cache content. Applying every step event of a run in order
reproduces the scheduler's own table exactly (tests/core/test_step_events.py checks
this step by step).

The fold is per KV cache group (engine/core/kv_cache_coordinator.py): ``group_tables``
request id -> one list of real blocks per group (the null block a sliding window leaves
at freed positions is not listed), split by the step's ``allocated_groups`` counts; a
step without counts (one full-attention group's events) is one group's. ``freed_by_window``
(folded before ``allocated``) takes blocks out of a running request's table and marks
them ``window_freed`` (block id -> the group whose window released it: left by the
window, not by a finish) until a request takes them again or a finish or preemption
releases them (a block shared by two requests can leave one's window and later be freed
by the other's finish). ``tables`` is every request's blocks, group after group.

An abort frees a request's blocks between steps; those frees travel in the next
step event, and there may be none (the last request aborted). So the fold also
reads ``request.finished`` with reason ``abort``: the request's table is dropped
at once and the later ``freed`` entry is only checked against it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from engine.events import Event, RequestFinished, StepEvent


class FoldError(ValueError):
    """The events contradict each other (a gap or reordering in the stream)."""


@dataclass(slots=True)
class BlockTableState:
    """The pool as seen through events: ``tables`` request id -> block ids,
    ``cached`` block ids holding a prefix-cache hash, ``num_blocks`` pool size
    (0 until a step event says)."""

    tables: dict[str, list[int]] = field(default_factory=dict)
    cached: set[int] = field(default_factory=set)
    num_blocks: int = 0
    last_step: int = -1
    group_tables: dict[str, list[list[int]]] = field(default_factory=dict)  # request -> one list per group
    window_freed: dict[int, int] = field(default_factory=dict)  # block -> group: last released by a window
    _aborted: dict[str, list[int]] = field(default_factory=dict)

    def apply_event(self, event: Event, strict: bool = True) -> None:
        """Fold any event: step events and aborts change the table; others are ignored."""
        if isinstance(event, StepEvent):
            self.apply(event, strict)
        elif isinstance(event, RequestFinished) and event.reason == "abort":
            self.group_tables.pop(event.request_id, None)
            table = self.tables.pop(event.request_id, None)
            if table is not None:
                self._aborted[event.request_id] = table

    def apply(self, event: StepEvent, strict: bool = True) -> None:
        """Fold one step: evicted, then cached, then allocated, then freed.

        With ``strict``, a free that does not match the request's table raises
        :class:`FoldError` (the stream lost or reordered a step).
        """
        self.num_blocks = event.kv_blocks_total or self.num_blocks
        self.last_step = event.index
        self.cached.difference_update(event.evicted)
        self.cached.update(event.cached)
        tables = self.tables
        self._apply_window_frees(event, strict)
        self._apply_allocations(event)
        window_freed = self.window_freed
        for rid, blocks in event.freed.items():
            self.group_tables.pop(rid, None)
            if window_freed:
                for b in blocks:
                    window_freed.pop(b, None)
            held = self._aborted.pop(rid, []) + tables.pop(rid, [])
            if strict and held != list(blocks):
                raise FoldError(f"step {event.index}: {rid} freed {len(blocks)} blocks but held {len(held)}")

    def _apply_window_frees(self, event: StepEvent, strict: bool) -> None:
        """The step's window frees, before its allocations: a block leaves a window only
        after the step that computed past it, so a block freed by a window in this step
        may be taken again in it, never the other way round."""
        window_freed = self.window_freed
        for rid, blocks in event.freed_by_window.items():
            groups = self.group_tables.get(rid)
            if groups is None:
                if strict:
                    raise FoldError(f"step {event.index}: {rid} left the window with blocks it does not hold")
                continue
            counts = event.freed_by_window_groups.get(rid)
            if counts:  # listed group after group
                start = 0
                for g, count in enumerate(counts):
                    window_freed.update(dict.fromkeys(blocks[start : start + count], g))
                    start += count
            else:  # no counts: the group that held it
                held_in = {b: g for g, table in enumerate(groups) for b in table}
                window_freed.update({b: held_in.get(b, 0) for b in blocks})
            gone = set(blocks)
            for table in groups:
                table[:] = [b for b in table if b not in gone]
            self.tables[rid] = _concat(groups)

    def _apply_allocations(self, event: StepEvent) -> None:
        """Each request's new blocks, split into its groups by the step's counts (none: one group)."""
        window_freed = self.window_freed
        for rid, blocks in event.allocated.items():
            counts = event.allocated_groups.get(rid) or [len(blocks)]
            groups = self.group_tables.get(rid)
            if groups is None:
                groups = self.group_tables[rid] = [[] for _ in counts]
            start = 0
            for table, count in zip(groups, counts, strict=False):
                table.extend(blocks[start : start + count])
                start += count
            if window_freed:
                for b in blocks:
                    window_freed.pop(b, None)
            self.tables[rid] = _concat(groups)

    def block_groups(self) -> dict[int, int]:
        """Block id -> the KV cache group whose table holds it."""
        return {b: g for groups in self.group_tables.values() for g, table in enumerate(groups) for b in table}

    def owners(self) -> dict[int, list[str]]:
        """Block id -> request ids holding it (shared prefix blocks have several)."""
        out: dict[int, list[str]] = {}
        for rid, blocks in self.tables.items():
            for b in blocks:
                out.setdefault(b, []).append(rid)
        return out

    @property
    def num_used(self) -> int:
        return len(self.owners())


def fold_step_events(events: Iterable[Event], strict: bool = True) -> BlockTableState:
    """Fold a whole event stream (step events and aborts; others are ignored)."""
    state = BlockTableState()
    for event in events:
        state.apply_event(event, strict)
    return state


def _concat(groups: list[list[int]]) -> list[int]:
    """Every group's blocks, group after group (one group's list itself: it grows in place)."""
    return groups[0] if len(groups) == 1 else [b for table in groups for b in table]
