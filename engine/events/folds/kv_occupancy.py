"""KV occupancy as it really is: token slots filled against slots allocated, per KV cache group.

``vllm:kv_cache_usage_perc`` counts blocks, the allocation unit; a block holding one token
counts as a full one, so with short prompts it can read nearly double the slots that hold
anything (vLLM PR#57336: 66.7 % of blocks for 36.5 % of token slots). This fold reads the
difference off the events: a request's KV covers its computed tokens (``EngineView``'s
``computed_tokens``, prefix hits included) and its table holds ``ceil(computed / block_size)``
positions, so only its last block can be partly filled, by ``computed mod block_size``
slots. A block two requests share is a full prefix-cache block, so the pool's filled slots
per group are its distinct held blocks' slots less each holder's unfilled tail; a sliding
window's group holds fewer blocks but the same tail.

``token_usage`` is PR#57336's gauge, filled slots over every slot of the pool (the block
gauge's denominator), exported as ``vllm:kv_cache_token_usage_perc`` (experimental, the PR is
open); ``fill`` per group is filled over allocated, the internal fragmentation's complement.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.events.step_records import StepEvent

if TYPE_CHECKING:
    from engine.events.folds.view import EngineView, RequestView


@dataclass(slots=True)
class GroupOccupancy:
    """One KV cache group: ``blocks`` distinct blocks held, ``allocated`` = blocks x block
    size slots, ``filled`` of them holding a token's K/V."""

    blocks: int = 0
    allocated: int = 0
    filled: int = 0

    @property
    def fill(self) -> float:
        """Filled over allocated slots (1.0 with nothing allocated: no slot is wasted)."""
        return self.filled / self.allocated if self.allocated else 1.0


@dataclass(slots=True)
class KvOccupancy:
    """The pool's token occupancy: per group, and against the pool's every slot."""

    block_size: int = 0
    total_slots: int = 0  # pool blocks x block size
    groups: list[GroupOccupancy] = field(default_factory=list)
    partial: dict[int, int] = field(default_factory=dict)  # held block -> filled slots, when partly filled

    @property
    def filled(self) -> int:
        return sum(g.filled for g in self.groups)

    @property
    def allocated(self) -> int:
        return sum(g.allocated for g in self.groups)

    @property
    def token_usage(self) -> float:
        """Filled slots over the pool's slots (PR#57336's ``kv_cache_token_usage_perc``, 0..1)."""
        return self.filled / self.total_slots if self.total_slots else 0.0

    @property
    def block_usage(self) -> float:
        """Allocated slots over the pool's: the block gauge's figure, for comparison."""
        return self.allocated / self.total_slots if self.total_slots else 0.0

    @property
    def fill(self) -> float:
        return self.filled / self.allocated if self.allocated else 1.0


def tail_slots(req: RequestView, block_size: int) -> int:
    """The unfilled slots of ``req``'s last block (in each group where it holds blocks)."""
    return -req.computed_tokens % block_size


def unfilled_slots(requests: Iterable[RequestView], block_size: int) -> int:
    """The unfilled slots of the blocks ``requests`` hold: each one's last block's tail, in
    every group where it holds blocks. The pool's filled slots are its held blocks' slots less
    this (O(requests): what the metrics compute every step)."""
    if block_size <= 0:
        return 0
    return sum(tail_slots(req, block_size) * sum(1 for table in req.group_blocks if table)
               for req in requests)


def token_occupancy(requests: Iterable[RequestView], block_size: int, num_blocks: int) -> KvOccupancy:
    """The occupancy of the blocks ``requests`` hold (each with ``computed_tokens`` and
    ``group_blocks``), in a pool of ``num_blocks`` blocks of ``block_size`` tokens."""
    out = KvOccupancy(block_size=block_size, total_slots=num_blocks * block_size)
    if block_size <= 0:
        return out
    held: list[set[int]] = []
    tails: list[int] = []
    for req in requests:
        tail = tail_slots(req, block_size)
        for g, table in enumerate(req.group_blocks):
            while len(held) <= g:
                held.append(set())
                tails.append(0)
            if not table:
                continue
            held[g].update(table)
            if tail:
                tails[g] += tail
                out.partial[table[-1]] = block_size - tail
    for blocks, tail in zip(held, tails, strict=True):
        allocated = len(blocks) * block_size
        out.groups.append(GroupOccupancy(len(blocks), allocated, allocated - tail))
    return out


def view_occupancy(view: EngineView) -> KvOccupancy:
    """The occupancy of the pool ``view`` shows (its DP rank's), from its folded requests."""
    return token_occupancy(view.requests.values(), view_block_size(view), view.num_blocks)


def view_block_size(view: EngineView) -> int:
    return int(view.ledger.get("block_size") or view.config.get("block_size") or 0)


def step_token_usage(view: EngineView, step: StepEvent) -> float:
    """PR#57336's gauge after ``step`` (already folded into ``view``): the step's used blocks'
    slots less the held tails, over the pool's slots; 0 until the block size is known."""
    block_size = view_block_size(view)
    if block_size <= 0 or step.kv_blocks_total <= 0:
        return 0.0
    # unfilled_slots(view.requests.values(), block_size), read from the records and the table
    # without a RequestView per request: the metrics compute it every step
    # the requests holding blocks, not every live one: a long waiting queue holds none
    lives = view.request_fold.lives
    unfilled = 0
    for request_id, tables in view.table.group_tables.items():
        record = lives.get(request_id)
        tail = -record.computed_tokens % block_size if record is not None else 0
        if tail:
            unfilled += tail * sum(1 for table in tables if table)
    filled = step.kv_blocks_used * block_size - unfilled
    return max(0, filled) / (step.kv_blocks_total * block_size)
