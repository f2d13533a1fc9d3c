"""The dashboard on a hybrid KV cache (issue 31): the block map coloured by KV cache
group, blocks a sliding window released drawn apart from blocks a finish freed, the
legend naming the groups, the selected request's blocks per group; every check against
an independent fold of the recording's events (tests/monitor/hybrid_fixtures.py)."""

from __future__ import annotations

from pathlib import Path

from rich.style import Style

from engine.cli import main
from engine.events import read_events
from monitor.app import MonitorApp
from monitor.sources import load_timeline
from monitor.widgets.block_map import (
    CACHED_CHAR,
    FREE_CHAR,
    PARTIAL_CHAR,
    SELECTED_STYLE,
    SHADES,
    USED_CHAR,
    WINDOW_CHAR,
    BlockMap,
)
from monitor.widgets.legend import group_colour
from tests.monitor.hybrid_fixtures import HYBRID, HYBRID_COMMAND, hybrid_state_at

SIZE = (120, 40)
STEPS = (260, 380)  # 199 blocks held, 126 left their windows, 51 cached-free; then 143, 125 and 96


async def test_the_block_map_draws_each_blocks_group_and_what_the_window_freed() -> None:
    events = read_events(HYBRID).events
    app = MonitorApp(timeline=load_timeline(HYBRID, checkpoint_every=50), source_name="hybrid")
    async with app.run_test(size=SIZE) as pilot:
        block_map = app.query_one(BlockMap)
        for step in STEPS:
            app.seek_index(step)
            await pilot.pause()
            assert app.view.step == step
            plain = hybrid_state_at(events, step)
            window = plain.free_window_freed()
            assert len(window) > 20 and plain.owners(), "the step no longer shows window frees beside held blocks"
            assert block_map.owners_by_block() == plain.owners()
            assert block_map.groups_by_block() == plain.groups()
            assert block_map.window_freed_blocks() == window
            assert block_map.effective_blocks_per_cell == 1
            selected = block_map.selected
            cached = app.view.cached
            # a request's partly filled last block is ▪ (engine/events/folds/kv_occupancy.py, checked against
            # the scheduler in tests/events/test_kv_occupancy.py)
            partial = app.view.occupancy.partial
            assert partial and set(partial) <= set(plain.owners())
            for b in range(384):  # each cell as drawn
                char, style = block_map.cell(b)
                if b in plain.owners():
                    expected = SELECTED_STYLE if selected in plain.owners()[b] else Style(color=group_colour(
                        plain.groups()[b]))
                    assert (char, style) == (PARTIAL_CHAR if b in partial else USED_CHAR, expected), b
                elif b in window:
                    assert (char, style) == (WINDOW_CHAR, Style(color=group_colour(window[b]))), b
                else:
                    assert char == (CACHED_CHAR if b in cached else FREE_CHAR), b
            assert {block_map.cell(b)[1].color.name for b in plain.owners() if block_map.cell(b)[1] != SELECTED_STYLE} \
                == {group_colour(g) for g in range(6)}  # six groups, six colours (colour names the group)
        legend = block_map.legend()
        assert "■■■■■ sliding 128 (5 groups × 3 layers)" in legend and "■ full (3 layers)" in legend
        assert "◁◁◁◁◁ freed by the window" in legend and "○ cached-free" in legend

        await pilot.press("minus")  # zoomed out: a cell with a held block is shaded; else ◁ if a window freed one
        assert block_map.effective_blocks_per_cell == 2
        owners = plain.owners()
        for cell in range(192):
            char, _ = block_map.cell(cell)
            pair = (2 * cell, 2 * cell + 1)
            if any(b in owners for b in pair):
                assert char in SHADES
            elif any(b in window for b in pair):
                assert char == WINDOW_CHAR
        assert "share used (colour = group)" in block_map.legend()


async def test_the_selected_requests_blocks_per_group() -> None:
    events = read_events(HYBRID).events
    app = MonitorApp(timeline=load_timeline(HYBRID, checkpoint_every=50), source_name="hybrid")
    async with app.run_test(size=SIZE) as pilot:
        app.seek_index(STEPS[0])
        await pilot.pause()
        app.query_one("#running-table").focus()
        await pilot.press("down")  # the second running request
        await pilot.pause()
        rid = app.query_one(BlockMap).selected
        assert rid is not None and rid == app.view.running[1].request_id
        counts = [len(t) for t in hybrid_state_at(events, STEPS[0]).tables[rid]]
        label = str(app.query_one("#request-groups").render())
        assert label == f"{rid} blocks by group: sliding 128 {' '.join(map(str, counts[:5]))} · full {counts[5]}"
        assert app.query_one("#request-groups").display
        app.query_one("#waiting-table").focus()
        await pilot.press("down")  # a waiting request holds no blocks: no line
        await pilot.pause()
        assert not app.query_one("#request-groups").display


async def test_a_full_attention_recording_has_no_group_line_or_group_legend() -> None:
    from tests.monitor_fixtures import SAMPLE

    app = MonitorApp(timeline=load_timeline(SAMPLE, checkpoint_every=50), source_name="sample")
    async with app.run_test(size=SIZE) as pilot:
        app.seek_index(199)
        await pilot.pause()
        legend = app.query_one(BlockMap).legend()
        assert "used (colour = request)" in legend and "window" not in legend and "sliding" not in legend
        assert not app.query_one("#request-groups").display


def test_the_hybrid_recording_is_reproduced_by_its_command(tmp_path: Path) -> None:
    """tests/data/monitor_hybrid.jsonl is exactly what its command records (byte for byte once
    the output path is the committed one)."""
    out = tmp_path / "monitor_hybrid.jsonl"
    assert main([*HYBRID_COMMAND, "--events", str(out)]) == 0
    recorded = out.read_text().replace(str(out), "tests/data/monitor_hybrid.jsonl").splitlines()
    assert recorded == HYBRID.read_text().splitlines()
