"""Scheduling policies, one queue type each (vLLM V1's ``RequestQueue``): the waiting
queue's order and which running request gives way under KV pressure. Adding a policy
is one class here and one entry in :data:`POLICIES`; the scheduler, ``--scheduling-policy``
and the config check read the table."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator, Sequence
from itertools import islice
from typing import ClassVar

from engine.core.request import Request
from engine.events.request_records import PREEMPTION_KV_FULL, PREEMPTION_PRIORITY


class RequestQueue:
    """The waiting queue of one policy: ``append`` a new request, ``prepend`` a
    preempted one, ``peek``/``pop`` the next to admit, ``remove`` an aborted one; and
    ``pick_victim`` among the running requests when the KV pool is out of blocks."""

    name: ClassVar[str]

    def __len__(self) -> int:
        raise NotImplementedError

    def __iter__(self) -> Iterator[Request]:
        raise NotImplementedError

    def append(self, req: Request) -> None:
        raise NotImplementedError

    def prepend(self, req: Request) -> None:
        raise NotImplementedError

    def peek(self) -> Request:
        raise NotImplementedError

    def head(self, n: int) -> list[Request]:
        """The first ``n`` requests in admission order (without sorting the whole queue)."""
        raise NotImplementedError

    def pop(self) -> Request:
        raise NotImplementedError

    def remove(self, req: Request) -> None:
        raise NotImplementedError

    def pick_victim(self, running: Sequence[Request]) -> Request:
        raise NotImplementedError

    def preemption_reason(self, victim: Request, needing: Request) -> str:
        """Why ``victim`` gives way when ``needing`` found no free block (the ``reason``
        of ``request.preempted``, vLLM's ``num_preemptions_by_reason``): the pool ran out."""
        return PREEMPTION_KV_FULL


class FCFSQueue(RequestQueue):
    """First come, first served: a deque; a preempted request goes back to the front,
    and the victim is the latest admitted running request."""

    name = "fcfs"

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def append(self, req: Request) -> None:
        self._queue.append(req)

    def prepend(self, req: Request) -> None:
        self._queue.appendleft(req)

    def peek(self) -> Request:
        return self._queue[0]

    def head(self, n: int) -> list[Request]:
        return list(islice(self._queue, n))

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, req: Request) -> None:
        self._queue.remove(req)

    def pick_victim(self, running: Sequence[Request]) -> Request:
        return running[-1]


class PriorityQueue(RequestQueue):
    """Lower ``priority`` first, then arrival: a heap on (priority, arrival time,
    arrival order). The victim is the worst of the running requests by the same total
    order, so the best one always progresses and two equals never preempt each other
    back and forth."""

    name = "priority"

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return iter([entry[3] for entry in sorted(self._heap)])

    def append(self, req: Request) -> None:
        heapq.heappush(self._heap, (req.priority, req.queued_time, req.arrival_order, req))

    def prepend(self, req: Request) -> None:
        self.append(req)  # the heap orders by priority anyway

    def peek(self) -> Request:
        return self._heap[0][3]

    def head(self, n: int) -> list[Request]:
        return [entry[3] for entry in heapq.nsmallest(n, self._heap)]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, req: Request) -> None:
        self._heap = [entry for entry in self._heap if entry[3] is not req]
        heapq.heapify(self._heap)

    def pick_victim(self, running: Sequence[Request]) -> Request:
        return max(running, key=lambda r: (r.priority, r.queued_time, r.arrival_order))

    def preemption_reason(self, victim: Request, needing: Request) -> str:
        """``priority`` when a lower-priority request makes room for a higher-priority
        one; ``kv_full`` when the victim is ``needing`` itself or an equal (FCFS among equals)."""
        if victim is not needing and victim.priority > needing.priority:
            return PREEMPTION_PRIORITY
        return PREEMPTION_KV_FULL


POLICIES: dict[str, type[RequestQueue]] = {queue.name: queue for queue in (FCFSQueue, PriorityQueue)}


def create_request_queue(policy: str) -> RequestQueue:
    try:
        return POLICIES[policy]()
    except KeyError:
        raise ValueError(f"scheduling policy {policy!r}: use one of {', '.join(POLICIES)}") from None
