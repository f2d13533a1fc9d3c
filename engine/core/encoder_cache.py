"""The encoder cache: a vision-language request's second budget (vLLM V1's
``EncoderCacheManager`` and the scheduler's encoder compute budget).

A multimodal input (an image or a video) sits in the prompt as ``length``
placeholder tokens from ``offset``. Before a prefill chunk may cover any of them
the encoder runs once on the whole item and its ``length`` embeddings are parked
here; the chunks that follow read them, and the entry is freed as soon as the
request's computed tokens have passed the item's end (or when the request is
preempted or finishes). Capacity and usage count embeddings (tokens), integers only.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.core.request import Request


@dataclass(frozen=True, slots=True)
class MultimodalInput:
    """One item's placeholder run in the prompt: positions ``offset`` .. ``offset + length - 1``."""

    offset: int
    length: int  # embeddings the encoder produces, one per placeholder token
    modality: str = "image"

    @property
    def end(self) -> int:
        return self.offset + self.length


class EncoderCacheManager:
    """Which (request, item) embeddings are held, against ``capacity`` tokens."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self.peak = 0
        self._held: dict[str, dict[int, int]] = {}  # request id -> item index -> tokens
        self._freed: list[tuple[str, int]] = []  # freed since take_freed, in order

    def holds(self, request_id: str, index: int) -> bool:
        return index in self._held.get(request_id, {})

    def can_allocate(self, tokens: int) -> bool:
        return self.used + tokens <= self.capacity

    def allocate(self, request_id: str, index: int, tokens: int) -> None:
        assert self.can_allocate(tokens), "encoder cache over capacity"
        self._held.setdefault(request_id, {})[index] = tokens
        self.used += tokens
        self.peak = max(self.peak, self.used)

    def free_consumed(self, requests: Iterable[Request]) -> None:
        """Free each request's items whose every placeholder is computed."""
        for req in requests:
            held = self._held.get(req.request_id)
            if not held:
                continue
            done = [i for i in held if req.mm_inputs[i].end <= req.num_computed_tokens]
            for i in done:
                self.used -= held.pop(i)
            if not held:
                del self._held[req.request_id]
            self._freed.extend((req.request_id, i) for i in done)

    def free_request(self, request_id: str) -> None:
        """Free everything the request holds (preempted, finished or aborted)."""
        held = self._held.pop(request_id, {})
        self.used -= sum(held.values())
        self._freed.extend((request_id, i) for i in held)

    def take_freed(self) -> list[tuple[str, int]]:
        """The (request id, item index) pairs freed since the last call: a step's ``encoder_freed``."""
        freed, self._freed = self._freed, []
        return freed
