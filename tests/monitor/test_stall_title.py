"""The dashboard's title bar names a stalled engine core while its ``engine.stalled`` holds
and drops it at ``engine.recovered`` (the events engine/serve/stall.py publishes), live on a
bus and in a snapshot a reconnecting dashboard loads; ``monitor vllm``'s replica title names
an engine whose token counters stay frozen with requests running."""

from __future__ import annotations

from engine.events import EventBus, MetricsScrape
from engine.events.engine_records import EngineRecovered, EngineStalled
from engine.events.feed import BusFeed
from engine.events.folds.view import EngineView
from monitor.app import MonitorApp
from monitor.replica import ReplicaState

SIZE = (160, 50)


def _title(app: MonitorApp) -> str:
    return str(app.query_one("#title").render())


async def test_the_title_shows_a_stall_until_the_core_recovers() -> None:
    bus = EventBus()
    app = MonitorApp(feed=BusFeed(bus))
    async with app.run_test(size=SIZE) as pilot:
        bus.publish(EngineStalled(rank=1, phase="forward", stalled_s=42.0, limit_s=30.0, last_step=7,
                                  requests=["cmpl-1"], dump="/tmp/run.stall-dp1.json"))
        for _ in range(100):
            await pilot.pause(0.05)
            if app.view.stalled:
                break
        assert "STALLED rank 1 in forward, no step for 42 s (limit 30 s)" in _title(app)
        bus.publish(EngineRecovered(rank=1, stalled_s=50.0, last_step=8))
        for _ in range(100):
            await pilot.pause(0.05)
            if not app.view.stalled:
                break
        await pilot.pause(0.05)
        assert "STALLED" not in _title(app)


def test_a_snapshot_carries_the_stall_to_a_new_view() -> None:
    view = EngineView()
    view.apply(EngineStalled(rank=0, phase="update", stalled_s=31.0, limit_s=30.0))
    state = view.snapshot()
    assert state["stalled"]["0"]["phase"] == "update"
    assert EngineView.from_snapshot(state).stalled == view.stalled
    assert "stalled" not in EngineView().snapshot()  # a snapshot without a stall is what it was


def _scrape(t: float, running: int, generated: int) -> MetricsScrape:
    text = (f'vllm:num_requests_running{{engine="0"}} {running}\n'
            f'vllm:prompt_tokens_total{{engine="0"}} 100\n'
            f'vllm:generation_tokens_total{{engine="0"}} {generated}\n')
    return MetricsScrape(source="http://vllm:8000", text=text, t=t)


def test_a_vllm_replica_with_frozen_counters_is_named_stalled() -> None:
    state = ReplicaState(source="http://vllm:8000")
    for t in range(0, 50, 5):
        state.apply(_scrape(float(t), 3, 500 + 40 * t))  # tokens flow
    assert state.stall_text() == ""
    for t in range(50, 120, 5):
        state.apply(_scrape(float(t), 3, 500 + 40 * 45))  # frozen from t=45 with 3 running
    assert "STALLED engine 0: 3 running, no token counted for 70 s" in state.stall_text()
    state.apply(_scrape(120.0, 3, 5000))
    assert state.stall_text() == ""
