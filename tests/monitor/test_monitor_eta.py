"""startup.eta: the view keeps each phase's prediction (and its snapshot carries it), the ETA
is the running phase's rest plus the phases to come, and the dashboard's startup table shows
elapsed against predicted."""

from __future__ import annotations

import json

import pytest

from engine.events import EventBus, StartupEta, StartupPhase, StartupProgress
from engine.events.feed import BusFeed
from engine.events.folds.startup_state import PhaseView, snapshot_startup_eta, startup_eta
from engine.events.folds.view import EngineView
from monitor.app import MonitorApp
from monitor.widgets.startup_table import StartupTable, duration_text
from tests.monitor_fixtures import ManualClock

SIZE = (160, 50)
PREDICTED = {"A": 0.5, "B": 0.05, "C": 30.0, "D": 3.0, "E": 0.1, "F": 5.0, "G": 0.01}


def _start(bus: EventBus, clock: ManualClock) -> None:
    clock.now = 1.0
    bus.publish(StartupEta(phases=PREDICTED, sources=dict.fromkeys(PREDICTED, "history"), starts=2, key="k"))
    bus.publish(StartupPhase(phase="A", name="init", status="begin"))
    clock.now = 1.5
    bus.publish(StartupPhase(phase="A", name="init", status="end", duration_s=0.5))
    bus.publish(StartupPhase(phase="B", name="budget", status="begin"))
    bus.publish(StartupPhase(phase="B", name="budget", status="end", duration_s=0.01))
    bus.publish(StartupPhase(phase="C", name="load_weights", status="begin"))


def test_the_view_keeps_predictions_and_computes_the_eta() -> None:
    clock = ManualClock()
    bus = EventBus(clock=clock)
    view = EngineView()
    bus.subscribe(view.apply)
    assert startup_eta(view.phases, 0.0) is None  # no prediction yet
    _start(bus, clock)
    assert {k: p.predicted_s for k, p in view.phases.items()} == PREDICTED
    eta = startup_eta(view.phases, 13.5)
    assert eta is not None
    assert (eta["phase"], eta["name"], eta["status"], eta["elapsed_s"], eta["predicted_s"]) == (
        "C", "load_weights", "running", 12.0, 30.0)
    assert eta["eta_s"] == pytest.approx(18.0 + 3.0 + 0.1 + 5.0 + 0.01)  # C's rest, then D-G
    late = startup_eta(view.phases, 61.5)  # past C's prediction: its rest counts 0, never below
    assert late is not None and late["eta_s"] == pytest.approx(3.0 + 0.1 + 5.0 + 0.01)
    state = json.loads(json.dumps(view.snapshot()))
    assert EngineView.from_snapshot(state).snapshot() == view.snapshot()
    assert snapshot_startup_eta(state, 13.5) == eta
    for letter, name in (("C", "load_weights"), ("D", "profile_run"), ("E", "kv_cache"), ("F", "graphs_compile"),
                         ("G", "ready")):
        bus.publish(StartupPhase(phase=letter, name=name, status="end", duration_s=1.0))
    assert startup_eta(view.phases, 70.0) is None  # ready: nothing left to predict


def test_a_recording_without_predictions_snapshots_as_before() -> None:
    view = EngineView()
    view.apply(StartupPhase(phase="A", name="init", status="begin"))
    assert "predicted_s" not in view.snapshot()["phases"]["A"]


def test_duration_text() -> None:
    running = PhaseView(phase="C", name="load_weights", status="running", started_t=1.5, predicted_s=30.0)
    assert str(duration_text(running, 13.5)) == "12.0/~30"
    assert duration_text(running, 40.0).style == "red"  # past the prediction  # type: ignore[union-attr]
    done = PhaseView(phase="D", name="profile_run", status="end", duration_s=2.1, predicted_s=3.0)
    assert duration_text(done, 0.0) == "2.10/~3.0"
    assert duration_text(PhaseView(phase="E", name="kv_cache", predicted_s=0.1), 0.0) == "~0.1"
    assert duration_text(PhaseView(phase="E", name="kv_cache"), 0.0) == "-"
    assert str(duration_text(PhaseView(phase="C", name="load_weights", status="running", started_t=1.0), 3.0)) == (
        "2.0…")


async def test_the_startup_table_shows_elapsed_against_predicted() -> None:
    clock = ManualClock()
    wall = ManualClock(50.0)
    bus = EventBus(clock=clock)
    app = MonitorApp(feed=BusFeed(bus), wall_clock=wall)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("3")
        _start(bus, clock)
        clock.now = 13.5
        bus.publish(StartupProgress(phase="C", what="weights", done=10, total=272, unit="tensors"))  # moves t
        for _ in range(100):
            await pilot.pause(0.05)
            if (c := app.view.phases.get("C")) is not None and c.predicted_s and app.view.t >= 13.5:
                break
        await pilot.pause(0.1)
        table = app.query_one(StartupTable)

        def cell(letter: str) -> str:
            return {str(col.value): str(table.get_cell(letter, col)) for col in table.columns}["duration s"]

        assert cell("A") == "0.50/~0.5"
        assert cell("C") == "12.0/~30"
        assert cell("F") == "~5.0"
