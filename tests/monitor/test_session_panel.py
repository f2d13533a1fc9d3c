"""The request panel shows the picked request's session (engine/events/folds/sessions.py): each turn's
previous-turn blocks still resident, and each lost block's evicting request and step, moving
with the replay. The recording is the scripted multi-turn workload of tests/events/test_sessions.py
under a small pool, replayed in the real Textual app through Pilot."""

from __future__ import annotations

from pathlib import Path

from engine.events import EventBus, StepEvent, read_events
from engine.events.folds.sessions import SessionFold
from engine.events.recording import JsonlSink
from monitor.app import MonitorApp
from monitor.sources import load_timeline
from monitor.widgets.request_panel import RequestPanel
from tests.events.test_sessions import BLOCK, run_sessions

SIZE = (160, 50)


async def test_the_request_panel_shows_its_sessions_turns(tmp_path: Path) -> None:
    path = tmp_path / "sessions.jsonl"
    sink = JsonlSink(path, {"block_size": BLOCK})
    bus = EventBus(clock=lambda: 0.0)
    bus.subscribe(sink)
    run_sessions(40, bus)
    sink.close()
    events = read_events(path).events
    fold = SessionFold()
    for event in events:
        fold(event)
    session, turn = fold.lost_turns()[0]  # a turn whose context was lost, and who took it
    lost = turn.lost[0]
    steps = [e.index for e in events if isinstance(e, StepEvent)]
    app = MonitorApp(timeline=load_timeline(path, checkpoint_every=50))
    async with app.run_test(size=SIZE) as pilot:
        panel = app.query_one(RequestPanel)
        app.seek_index(steps.index(turn.admitted_step))  # the step that admitted the turn
        await pilot.pause()
        panel.select(turn.request_id)
        await pilot.pause()
        shown = panel.timeline_text().plain
        assert f"session {session.key}: " in shown
        assert f"{turn.resident} of {turn.prev_blocks} blocks of {turn.previous} still resident" in shown
        assert f"block {lost.block} evicted at step {lost.step} by {lost.by_request}" in shown
        app.seek_index(0)  # back before the session began: no turn is judged yet
        await pilot.pause()
        assert "still resident" not in panel.timeline_text().plain
