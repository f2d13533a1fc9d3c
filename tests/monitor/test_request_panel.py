"""The request panel (issue 33): pick a request in the queues and its life shows beside the
block map, step by step, moving with the replay; its blocks stay lit in the map."""

from __future__ import annotations

from monitor.app import MonitorApp
from monitor.sources import load_timeline
from monitor.widgets.block_map import BlockMap
from monitor.widgets.queues import RequestTable
from monitor.widgets.request_panel import RequestPanel
from tests.monitor_fixtures import SAMPLE

SIZE = (160, 50)


async def test_picking_a_waiting_request_shows_why_it_waits_and_follows_the_replay() -> None:
    app = MonitorApp(timeline=load_timeline(SAMPLE, checkpoint_every=50))
    async with app.run_test(size=SIZE) as pilot:
        app.seek_index(74)  # r13 was preempted at step 73 to make room for r5 and waits
        await pilot.pause()
        panel = app.query_one(RequestPanel)
        assert not panel.display  # nothing picked: the queues' layout as before
        table = app.query_one("#waiting-table", RequestTable)
        table.focus()
        table.move_cursor(row=table.get_row_index("r13"), animate=False)
        await pilot.press("enter")
        await pilot.pause()
        assert panel.display and panel.request_id == "r13"
        assert app.query_one(BlockMap).selected == "r13"
        shown = panel.timeline_text().plain
        assert "73 preempted (kv_full) to make room for r5: held 8 blocks and 126 computed tokens" in shown
        assert "74 waited 1 step: blocks short: needs 2, 0 free" in shown
        assert "resumed" not in shown  # not yet, at step 74
        await pilot.press("period")  # step 75: it resumes, its prefix match stopped at an evicted block
        await pilot.pause()
        shown = panel.timeline_text().plain
        assert "75 resumed; prefix cache: 96 tokens reused; stopped at token 96: the next block was evicted at step 74" \
            in shown
        table = app.query_one("#running-table", RequestTable)
        table.focus()
        table.move_cursor(row=table.get_row_index("r13"), animate=False)
        await pilot.press("enter")  # picked again: the panel closes
        await pilot.pause()
        assert not panel.display
