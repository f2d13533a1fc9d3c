"""Rebuild the KV block table by folding ``step`` events.

The monitor, replay and the tests use this to turn an event stream back into the
pool's state: which request holds which blocks (in position order) and which
blocks hold prefix-cache content. Applying every step event of a run in order
reproduces the scheduler's own table exactly (tests/test_step_events.py checks
this step by step).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from engine.events import Event, StepEvent


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
        for rid, blocks in event.allocated.items():
            table = tables.get(rid)
            if table is None:
                tables[rid] = list(blocks)
            else:
                table.extend(blocks)
        for rid, blocks in event.freed.items():
            table = tables.pop(rid, None)
            if strict and (table or []) != list(blocks):
                raise FoldError(f"step {event.index}: {rid} freed {len(blocks)} blocks but held {len(table or [])}")

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
    """Fold every ``step`` event of a stream (other events are ignored)."""
    state = BlockTableState()
    for event in events:
        if isinstance(event, StepEvent):
            state.apply(event, strict)
    return state
