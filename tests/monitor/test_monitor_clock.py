"""Queue ages move on the engine clock: live, the latest event's time plus the wall
time since it arrived (so a long step does not look frozen); in replay, the
recording's time. TTFT stays blank until a request has generated a token."""

from __future__ import annotations

from engine.events import EventBus, RequestArrived, RequestFirstToken, RequestScheduled, StepEvent
from engine.events.feed import DISCONNECTED, BusFeed, Connection
from monitor.app import MonitorApp
from monitor.sources import load_timeline
from monitor.widgets.queues import RequestTable
from tests.monitor_fixtures import SAMPLE, ManualClock

SIZE = (160, 50)


def _cells(app: MonitorApp, table_id: str, rid: str) -> dict[str, str]:
    table = app.query_one(table_id, RequestTable)
    return {str(col.value): str(table.get_cell(rid, col)) for col in table.columns}


async def _settle(pilot, done) -> None:  # type: ignore[no-untyped-def]
    for _ in range(100):
        await pilot.pause(0.05)
        if done():
            return


async def test_live_ages_advance_between_events_and_ttft_waits_for_a_token() -> None:
    engine_t = ManualClock(10.0)
    wall = ManualClock(1000.0)
    bus = EventBus(clock=engine_t)
    app = MonitorApp(feed=BusFeed(bus), wall_clock=wall)
    async with app.run_test(size=SIZE) as pilot:
        bus.publish(RequestArrived(request_id="busy", prompt_tokens=20, max_tokens=8))
        bus.publish(RequestArrived(request_id="queued", prompt_tokens=30, max_tokens=8))
        engine_t.now = 10.5
        bus.publish(RequestScheduled(request_id="busy"))
        bus.publish(StepEvent(index=0, scheduled={"busy": [20, "prefill"]}, num_prefill_tokens=20,
                              num_running=1, num_waiting=1, kv_blocks_total=8))
        bus.publish(RequestFirstToken(request_id="busy", ttft_s=0.5))
        await _settle(pilot, lambda: app.view.step == 0)
        assert app.engine_now() == 10.5
        busy = _cells(app, "#running-table", "busy")
        queued = _cells(app, "#waiting-table", "queued")
        assert (busy["generated"], busy["TTFT s"], busy["age s"]) == ("1", "0.500", "0.5")
        assert (queued["generated"], queued["TTFT s"], queued["age s"]) == ("0", "", "0.5")
        # A long step: no events for 4.25 s of wall time. The ages move; the TTFT does not.
        wall.now += 4.25
        await pilot.pause(0.3)
        assert app.engine_now() == 14.75
        assert _cells(app, "#waiting-table", "queued")["age s"] == "4.75"
        busy = _cells(app, "#running-table", "busy")
        assert (busy["age s"], busy["TTFT s"]) == ("4.75", "0.500")
        assert "t 14.75 s" in str(app.query_one("#replay-bar").render())
        # The next event re-anchors the clock on the engine's own time.
        engine_t.now = 15.0
        bus.publish(StepEvent(index=1, scheduled={"busy": [1, "decode"]}, num_decode_tokens=1,
                              num_running=1, num_waiting=1, kv_blocks_total=8))
        await _settle(pilot, lambda: app.view.step == 1)
        assert app.engine_now() == 15.0
        assert _cells(app, "#waiting-table", "queued")["age s"] == "5.0"


async def test_the_clock_stops_while_the_feed_is_not_live() -> None:
    wall = ManualClock(0.0)
    bus = EventBus(clock=lambda: 3.0)
    feed = BusFeed(bus)
    app = MonitorApp(feed=feed, wall_clock=wall)
    async with app.run_test(size=SIZE) as pilot:
        bus.publish(RequestArrived(request_id="queued", prompt_tokens=30, max_tokens=8))
        await _settle(pilot, lambda: "queued" in app.view.requests)
        wall.now += 2.0
        assert app.engine_now() == 5.0
        feed.connection = Connection(DISCONNECTED, "the server dropped the stream")
        assert app.engine_now() == 3.0


async def test_replay_ages_are_the_recordings_time_and_ttft_is_blank_before_a_token() -> None:
    wall = ManualClock(0.0)
    app = MonitorApp(timeline=load_timeline(SAMPLE, checkpoint_every=50), wall_clock=wall)
    async with app.run_test(size=SIZE) as pilot:
        app.seek_index(199)
        await pilot.pause()
        wall.now += 100.0
        await pilot.pause(0.6)
        view = app.view
        assert app.engine_now() == view.t
        blank = 0
        for table_id, requests in (("#running-table", view.running), ("#waiting-table", view.waiting)):
            for req in requests:
                cells = _cells(app, table_id, req.request_id)
                assert cells["age s"] == str(round(view.t - req.arrived_t, 2))
                if req.generated_tokens == 0:
                    assert cells["TTFT s"] == ""
                    blank += 1
                else:
                    assert cells["TTFT s"] == f"{req.ttft_s:.3f}"
        assert blank > 0  # step 199 has requests still waiting for their first token
