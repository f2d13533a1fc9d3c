"""A hybrid KV cache recording for the monitor tests, and an independent fold of it.

``HYBRID`` (tests/data/monitor_hybrid.jsonl: 484 steps, 384 blocks, 16 requests, 2
preemptions, shared-prefix hits; Gemma 3 270M's 18 layers as five sliding-window groups
of 128 tokens and one full-attention group, three layers each) is ``engine simulate``'s
recording, made from the repository root with::

    engine simulate --model gemma-3-270m --layer-pattern 5:1 --sliding-window 128
    --num-gpu-blocks-override 384 --max-model-len 2048 --max-num-seqs 8 --max-num-batched-tokens 512
    --num-prompts 16 --random-input-len 100:600 --random-output-len 40:160 --arrival poisson
    --request-rate 0.25 --arrival-unit step --shared-prefix-fraction 0.5 --shared-prefix-len 128
    --workload-seed 7 --events tests/data/monitor_hybrid.jsonl

The simulated clock makes it byte-for-byte reproducible (the header records the
``--events`` path, so keep that argument as written;
tests/monitor/test_monitor_hybrid.py re-runs it)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from engine.events import Event, StepEvent
from tests.paths import DATA

HYBRID = DATA / "monitor_hybrid.jsonl"
HYBRID_COMMAND = (  # noqa: SIM905 - the docstring's command as a person types it
    "simulate --model gemma-3-270m --layer-pattern 5:1 --sliding-window 128 --num-gpu-blocks-override 384 "
    "--max-model-len 2048 --max-num-seqs 8 --max-num-batched-tokens 512 --num-prompts 16 "
    "--random-input-len 100:600 --random-output-len 40:160 --arrival poisson --request-rate 0.25 "
    "--arrival-unit step --shared-prefix-fraction 0.5 --shared-prefix-len 128 --workload-seed 7"
).split()


@dataclass
class HybridState:
    """What a hybrid pool looks like after a step, folded plainly: ``tables`` request ->
    one block list per group; ``window_freed`` block -> group, for blocks whose last
    release was a window's (a later allocation or finish forgets it)."""

    tables: dict[str, list[list[int]]]
    window_freed: dict[int, int]

    def owners(self) -> dict[int, frozenset[str]]:
        out: dict[int, set[str]] = {}
        for rid, groups in self.tables.items():
            for table in groups:
                for b in table:
                    out.setdefault(b, set()).add(rid)
        return {b: frozenset(o) for b, o in out.items()}

    def groups(self) -> dict[int, int]:
        return {b: g for groups in self.tables.values() for g, table in enumerate(groups) for b in table}

    def free_window_freed(self) -> dict[int, int]:
        """The free blocks a window released: what the block map draws ◁."""
        owners = self.owners()
        return {b: g for b, g in self.window_freed.items() if b not in owners}


def _split(blocks: list[int], counts: list[int]) -> list[list[int]]:
    out, i = [], 0
    for n in counts:
        out.append(blocks[i : i + n])
        i += n
    assert i == len(blocks), "counts do not add up to the blocks"
    return out


def hybrid_state_at(events: Iterable[Event], step_index: int) -> HybridState:
    """The pool after step ``step_index``: a step's window frees, then its allocations,
    then its finish/preemption frees, each split into groups by the step's counts."""
    tables: dict[str, list[list[int]]] = {}
    window: dict[int, int] = {}
    for event in events:
        if not isinstance(event, StepEvent):
            continue
        for rid, blocks in event.freed_by_window.items():
            for g, part in enumerate(_split(blocks, event.freed_by_window_groups[rid])):
                for b in part:
                    tables[rid][g].remove(b)
                    window[b] = g
        for rid, blocks in event.allocated.items():
            parts = _split(blocks, event.allocated_groups[rid])
            held = tables.setdefault(rid, [[] for _ in parts])
            for g, part in enumerate(parts):
                held[g].extend(part)
                for b in part:
                    window.pop(b, None)
        for rid, blocks in event.freed.items():
            held_blocks = sorted(b for table in tables.pop(rid) for b in table)
            assert held_blocks == sorted(blocks), f"step {event.index}: {rid} freed what it did not hold"
            for b in blocks:
                window.pop(b, None)
        if event.index == step_index:
            break
    return HybridState(tables, window)
