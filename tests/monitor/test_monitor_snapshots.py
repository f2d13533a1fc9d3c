"""SVG snapshots of every panel at a fixed size and step (pytest-textual-snapshot).

Deterministic by construction: the sample recording's simulated clock, a paused
player, no wall-clock widgets. Update with ``pytest --snapshot-update``."""

from __future__ import annotations

import os
import time

import pytest

from monitor.app import MonitorApp
from monitor.sources import load_timeline
from tests.monitor_fixtures import SAMPLE

os.environ["TZ"] = "UTC"
time.tzset()
SIZE = (160, 48)
STEP = 199  # a preemption (r35), 14 running, 19 waiting, a prefix hit at 195


def _app_at_step() -> MonitorApp:
    app = MonitorApp(timeline=load_timeline(SAMPLE, checkpoint_every=50), source_name="samples/monitor_sim.jsonl")
    return app


async def _seek(pilot) -> None:  # type: ignore[no-untyped-def]
    pilot.app.seek_index(STEP)
    await pilot.pause()


@pytest.mark.parametrize("tab", ["1", "2", "3", "4"], ids=["blocks", "steps", "startup", "events"])
def test_panel_snapshot(snap_compare, tab: str) -> None:  # type: ignore[no-untyped-def]
    assert snap_compare(_app_at_step(), terminal_size=SIZE, press=[tab], run_before=_seek)


def test_block_map_zoomed_out_with_selection_snapshot(snap_compare) -> None:  # type: ignore[no-untyped-def]
    async def select(pilot) -> None:  # type: ignore[no-untyped-def]
        await _seek(pilot)
        pilot.app.query_one("#running-table").focus()
        await pilot.press("down", "down")
        pilot.app.query_one("#blockmap").focus()
        await pilot.press("minus")

    assert snap_compare(_app_at_step(), terminal_size=SIZE, run_before=select)
