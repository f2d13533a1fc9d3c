"""The Diagnosis panel runs the doctor's rules on what the monitor has seen: live
(events published on a real EventBus, the panel updating as they arrive) and in
replay (the recording up to the shown step), pointing at the step where each
finding started. An SVG snapshot at 120x40 (see test_monitor_snapshots.py)."""

from __future__ import annotations

import gzip

from engine.events import EventBus, read_events
from engine.events.feed import BusFeed
from monitor.app import MonitorApp
from monitor.sources import load_timeline
from monitor.widgets.diagnosis import Diagnosis
from tests.doctor.recordings import path_of
from tests.monitor_fixtures import SAMPLE, ManualClock

STEP = 199  # the sample's step of test_monitor_snapshots.py: 8 preemptions so far


def test_diagnosis_snapshot_at_120x40_judges_up_to_the_shown_step(snap_compare) -> None:  # type: ignore[no-untyped-def]
    async def judge_then_show(pilot) -> None:  # type: ignore[no-untyped-def]
        await pilot.press("5")  # the rules run while the panel is on screen
        panel = pilot.app.query_one(Diagnosis)
        pilot.app.seek_index(100)
        await pilot.pause()
        assert next(f for f in panel.findings if f.rule == "pool_binds").last_step < 100
        pilot.app.seek_index(60)  # backwards: refolded from the start
        await pilot.pause()
        assert "pool_binds" not in {f.rule for f in panel.findings}  # the first preemption is at step 73
        pilot.app.seek_index(STEP)
        await pilot.pause()
        pool = next(f for f in panel.findings if f.rule == "pool_binds")
        assert (pool.first_step, pool.last_step, pool.numbers["preemptions"]) == (73, 199, 8)

    app = MonitorApp(timeline=load_timeline(SAMPLE, checkpoint_every=50), source_name="samples/monitor_sim.jsonl")
    assert snap_compare(app, terminal_size=(120, 40), run_before=judge_then_show)


async def test_live_panel_follows_the_bus() -> None:
    events = read_events(gzip.decompress(path_of("long_prompts").read_bytes())).events
    clock = ManualClock()
    bus = EventBus(clock=clock)
    app = MonitorApp(feed=BusFeed(bus), source_name="live")
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("5")
        panel = app.query_one(Diagnosis)
        for event in events:
            clock.now = event.t
            bus.publish(event)
        for _ in range(100):
            await pilot.pause(0.05)
            if panel.findings and panel.facts.events >= len(events):
                break
        (finding,) = panel.findings
        assert finding.rule == "long_prompt_spikes" and finding.first_step == 74
        shown = panel.render_findings().plain
        assert "started at step 74 (to 116)" in shown
        assert "request doc1 (16,000-token prompt) arrived at step 74" in shown
