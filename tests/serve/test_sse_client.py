"""An ``/events`` client's queue (engine/serve/host.py ``SseClient``): what the engine thread posts
reaches the client's loop in order, taken as batches; a client too far behind is closed rather than
let grow; the hub encodes each event once for every client."""

from __future__ import annotations

import asyncio

import pytest

from engine.events import EventBus
from engine.events.request_records import RequestArrived
from engine.serve import host as host_module
from engine.serve.host import EventHub, SseClient


def test_posts_arrive_in_order_as_one_batch_and_the_end_closes_the_client() -> None:
    async def run() -> list[object]:
        client = SseClient(asyncio.get_running_loop())
        for seq in range(1, 6):
            client.post((0, seq, f"line {seq}"))
        first = await client.next_batch()
        client.post((0, 6, "line 6"))
        client.post(None)
        client.post((0, 7, "after the end"))  # ignored: the client has ended
        return [first, await client.next_batch(), await client.next_batch(), client.closed]

    first, second, end, closed = asyncio.run(run())
    assert first == [(0, seq, f"line {seq}") for seq in range(1, 6)]
    assert second == [(0, 6, "line 6")] and end is None and closed


def test_a_client_further_behind_than_the_bound_is_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_module, "SSE_CLIENT_MAX_QUEUE", 4)

    async def run() -> list[object]:
        client = SseClient(asyncio.get_running_loop())
        for seq in range(1, 4):
            client.post((0, seq, "x"))
        kept = await client.next_batch()  # three taken: three more fit again
        for seq in range(4, 9):  # five more while none is read: over the bound
            client.post((0, seq, "x"))
        return [kept, await client.next_batch(), client.closed]

    kept, after, closed = asyncio.run(run())
    assert [seq for _, seq, _ in kept] == [1, 2, 3]
    assert after is None and closed  # it reconnects and gets a fresh snapshot


def test_the_hub_gives_every_client_each_event_once_encoded() -> None:
    async def run() -> list[list[object] | None]:
        hub, bus = EventHub(), EventBus()
        bus.subscribe(hub)
        loop = asyncio.get_running_loop()
        clients = [hub.connect(loop), hub.connect(loop)]
        event = bus.publish(RequestArrived(request_id="r1", prompt_tokens=3, max_tokens=2))
        hub.disconnect(clients[1])
        bus.publish(RequestArrived(request_id="r2", prompt_tokens=3, max_tokens=2))
        return [await clients[0].next_batch(), await clients[1].next_batch(), [event.seq]]

    first, second, (seq,) = asyncio.run(run())
    assert [item[1] for item in first] == [seq, seq + 1]
    assert second == [first[0]] and second[0][2] is first[0][2]  # one line object for both clients
    assert '"request_id":"r1"' in first[0][2]
