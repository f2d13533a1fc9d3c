"""SVG snapshots of every panel at a fixed step (pytest-textual-snapshot): at 160x48
(the README's screenshots are copies of these) and at the two sizes every panel must
be complete at, 120x40 and 200x50 (tests/monitor/test_monitor_layout.py checks that).

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
LAYOUT_SIZES = [(120, 40), (200, 50)]
TABS = ["1", "2", "3", "4"]
TAB_IDS = ["blocks", "steps", "startup", "events"]
STEP = 199  # a preemption (r35), 14 running, 19 waiting, a prefix hit at 195


def _app_at_step() -> MonitorApp:
    app = MonitorApp(timeline=load_timeline(SAMPLE, checkpoint_every=50), source_name="samples/monitor_sim.jsonl")
    return app


async def _seek(pilot) -> None:  # type: ignore[no-untyped-def]
    pilot.app.seek_index(STEP)
    await pilot.pause()


@pytest.mark.parametrize("tab", TABS, ids=TAB_IDS)
def test_panel_snapshot(snap_compare, tab: str) -> None:  # type: ignore[no-untyped-def]
    assert snap_compare(_app_at_step(), terminal_size=SIZE, press=[tab], run_before=_seek)


@pytest.mark.parametrize("tab", TABS, ids=TAB_IDS)
@pytest.mark.parametrize("size", LAYOUT_SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_panel_snapshot_at_size(snap_compare, size: tuple[int, int], tab: str) -> None:  # type: ignore[no-untyped-def]
    assert snap_compare(_app_at_step(), terminal_size=size, press=[tab], run_before=_seek)


def test_block_map_zoomed_out_with_selection_snapshot(snap_compare) -> None:  # type: ignore[no-untyped-def]
    async def select(pilot) -> None:  # type: ignore[no-untyped-def]
        await _seek(pilot)
        pilot.app.query_one("#running-table").focus()
        await pilot.press("down", "down")
        pilot.app.query_one("#blockmap").focus()
        await pilot.press("minus")

    assert snap_compare(_app_at_step(), terminal_size=SIZE, run_before=select)


def test_hybrid_block_map_snapshot(snap_compare) -> None:  # type: ignore[no-untyped-def]
    """A hybrid KV cache at 120x40 (tests/data/monitor_hybrid.jsonl, step 260): blocks coloured
    by group (five sliding-window groups, one full), ◁ where a window freed a block, the
    second running request selected with its blocks per group above the table."""
    from tests.monitor.hybrid_fixtures import HYBRID

    async def select(pilot) -> None:  # type: ignore[no-untyped-def]
        pilot.app.seek_index(260)
        await pilot.pause()
        pilot.app.query_one("#running-table").focus()
        await pilot.press("down")
        pilot.app.query_one("#blockmap").focus()
        await pilot.pause()

    app = MonitorApp(timeline=load_timeline(HYBRID, checkpoint_every=50), source_name="tests/data/monitor_hybrid.jsonl")
    assert snap_compare(app, terminal_size=(120, 40), run_before=select)
