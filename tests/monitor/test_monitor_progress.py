"""startup.progress: EngineView keeps the latest reading per phase, the snapshot
carries it, and the Startup panel draws it next to the running phase."""

from __future__ import annotations

import json

from engine.events import EventBus, StartupPhase, StartupProgress
from engine.events.feed import BusFeed
from engine.events.folds.view import EngineView
from monitor.app import MonitorApp
from monitor.widgets.startup_table import StartupTable, progress_text
from tests.monitor_fixtures import ManualClock

SIZE = (160, 50)


def _publish_loading(bus: EventBus, clock: ManualClock) -> None:
    clock.now = 1.0
    bus.publish(StartupPhase(phase="A", name="init", status="begin"))
    clock.now = 1.5
    bus.publish(StartupPhase(phase="A", name="init", status="end", duration_s=0.5))
    bus.publish(StartupPhase(phase="C", name="load_weights", status="begin"))
    for done in (0, 56, 112):
        clock.now += 0.5
        bus.publish(StartupProgress(phase="C", what="weights", done=done, total=272, unit="tensors"))


def test_the_view_keeps_the_latest_progress_per_phase_and_snapshots_it() -> None:
    clock = ManualClock()
    bus = EventBus(clock=clock)
    view = EngineView()
    bus.subscribe(view.apply)
    _publish_loading(bus, clock)
    bus.publish(StartupProgress(phase="F", what="kernel builds", done=0, total=None, unit="waits"))
    c = view.phases["C"]
    assert (c.status, c.started_t) == ("running", 1.5)
    assert c.progress == {"what": "weights", "done": 112, "total": 272, "unit": "tensors", "t": 3.0}
    assert view.phases["A"].progress is None
    assert view.phases["F"].status == "running" and view.phases["F"].name == "graphs_compile"
    restored = EngineView.from_snapshot(json.loads(json.dumps(view.snapshot())))
    assert restored.snapshot() == view.snapshot()
    assert restored.phases["C"].progress == c.progress
    # The phase's end keeps the last reading; a new begin (a retry) clears it.
    bus.publish(StartupPhase(phase="C", name="load_weights", status="end", duration_s=2.0))
    assert view.phases["C"].progress is not None and view.phases["C"].status == "end"
    bus.publish(StartupPhase(phase="C", name="load_weights", status="begin"))
    assert view.phases["C"].progress is None


def test_progress_text() -> None:
    assert progress_text({"what": "weights", "done": 112, "total": 272, "unit": "tensors"}).plain == (
        "weights 112/272 tensors (41%) ████░░░░░░░░")
    assert progress_text({"what": "kernel builds", "done": 3, "total": None, "unit": "waits"}).plain == (
        "kernel builds 3 waits")
    assert progress_text({"what": "weights", "done": 2**30, "total": 2**32, "unit": "bytes"}).plain.startswith(
        "weights 1.00/4.00 GiB (25%) ")


async def test_the_startup_panel_draws_progress_next_to_the_running_phase() -> None:
    clock = ManualClock()
    wall = ManualClock(50.0)
    bus = EventBus(clock=clock)
    app = MonitorApp(feed=BusFeed(bus), wall_clock=wall)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("3")
        _publish_loading(bus, clock)
        for _ in range(100):
            await pilot.pause(0.05)
            if (p := app.view.phases.get("C")) is not None and p.progress and p.progress["done"] == 112:
                break
        table = app.query_one(StartupTable)

        def row(letter: str) -> dict[str, str]:
            return {str(col.value): str(table.get_cell(letter, col)) for col in table.columns}

        c = row("C")
        assert (c["name"], c["status"]) == ("load_weights", "running")
        assert c["details"] == "weights 112/272 tensors (41%) ████░░░░░░░░"
        assert c["duration s"] == "1.5…"  # begun at 1.5 s, latest event at 3.0 s
        assert (row("A")["status"], row("A")["details"]) == ("done", "")  # progress is only the running phase's
        assert row("D")["status"] == "pending"
        wall.now += 2.0  # the phase runs on with no new event: its elapsed time moves
        await pilot.pause(0.6)
        assert row("C")["duration s"] == "3.5…"
        clock.now = 4.0
        bus.publish(StartupProgress(phase="C", what="weights", done=272, total=272, unit="tensors"))
        bus.publish(StartupPhase(phase="C", name="load_weights", status="end", duration_s=2.5,
                                 data={"weights_bytes": 2**30}))
        for _ in range(100):
            await pilot.pause(0.05)
            if app.view.phases["C"].status == "end":
                break
        await pilot.pause(0.1)
        c = row("C")
        assert (c["status"], c["duration s"], c["details"]) == ("done", "2.50", "weights 1.00 GiB")
