"""Every panel is complete at 120x40 and at 200x50: no column, footer key, legend
item or event field is cut off, key names are the keys a person presses, every
colour the block map draws is in its legend, and numbers read as numbers."""

from __future__ import annotations

import re

import pytest
from rich.style import Style
from textual.widget import Widget
from textual.widgets import Footer, Label, Sparkline, Static
from textual.widgets._footer import FooterKey

from engine.events.feed import DISCONNECTED, Connection, LiveFeed
from monitor.app import MonitorApp
from monitor.sources import load_timeline
from monitor.widgets.block_map import (
    CACHED_STYLE,
    FREE_STYLE,
    GROUP_USED_STYLE,
    PALETTE,
    SELECTED_STYLE,
    BlockMap,
)
from monitor.widgets.events_log import EventsLog
from monitor.widgets.memory_bar import ALWAYS_SHOWN, GiB, MemoryBar, memory_segments
from monitor.widgets.queues import COLUMNS, RequestTable
from monitor.widgets.startup_table import StartupTable
from monitor.widgets.step_charts import AXIS_WIDTH, CHARTS
from monitor.widgets.title_bar import TitleBar
from tests.monitor_fixtures import SAMPLE

SIZES = [(120, 40), (200, 50)]
LONG_FLOAT = re.compile(r"\d\.\d{5,}|e[+-]\d\d")


def widget_lines(widget: Widget) -> list[str]:
    """What the screen shows inside ``widget``'s region, row by row (children included)."""
    screen = widget.screen
    strips = screen._compositor.render_strips()  # the composed screen, as the terminal gets it
    region = widget.region
    rows = []
    for strip in strips[region.y : region.bottom]:
        text = "".join(seg.text for seg in strip)
        rows.append(text[region.x : region.right].rstrip())
    return rows


def _app() -> MonitorApp:
    return MonitorApp(timeline=load_timeline(SAMPLE, checkpoint_every=50), source_name="samples/monitor_sim.jsonl")


async def _at_step(pilot, tab: str) -> None:  # type: ignore[no-untyped-def]
    pilot.app.seek_index(199)
    await pilot.pause()
    await pilot.press(tab)
    await pilot.pause(0.2)


def _assert_footer_complete(app: MonitorApp, width: int, replay: bool = True) -> None:
    keys = list(app.query(FooterKey))
    assert keys
    for key in keys:
        assert key.region.width > 0 and key.region.right <= width, key.key_display
    text = " ".join(widget_lines(app.query_one(Footer)))
    assert "period" not in text and "comma" not in text and "square" not in text
    for shown in ("space play/pause", ". , ±1 step", "] [ ±100", "g go to step", "n a next preempt/arrival",
                  "f s speed") if replay else ():
        assert shown in text
    assert "q quit" in text


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
async def test_blocks_panel_is_complete(size: tuple[int, int]) -> None:
    app = _app()
    async with app.run_test(size=size) as pilot:
        await _at_step(pilot, "1")
        width = size[0]
        _assert_footer_complete(app, width)
        title = app.query_one(TitleBar)
        assert len(widget_lines(title)[0]) <= width
        bar = app.query_one(MemoryBar)
        lines = widget_lines(bar)
        assert all(len(line) <= bar.size.width for line in lines)
        legend = [line for line in lines[1:] if "■" in line]  # the info lines after it (KV, tokens, device) have none
        items = [item.strip().rsplit(" ", 2) for line in legend for item in line.split("■") if item.strip()]
        expected = [[label, f"{b / GiB:.2f}", "GiB"] for label, b in memory_segments(app.view)
                    if b > 0 or label in ALWAYS_SHOWN]
        assert items == expected  # every slice, whole, with its unit
        for table in app.query(RequestTable).results(RequestTable):
            assert [str(c.key.value) for c in table.ordered_columns] == list(COLUMNS)
            assert table.virtual_size.width <= table.scrollable_content_region.width, "a column is off screen"
        block_map = app.query_one(BlockMap)
        legend_label = app.query_one("#blockmap-legend", Label)
        assert all(len(line) <= block_map.size.width for line in widget_lines(legend_label))
        for words in ("used (colour = request)", "selected request", "cached-free", "free"):
            assert words in " ".join(widget_lines(legend_label))


async def test_every_block_cell_colour_is_in_the_legend() -> None:
    app = _app()
    async with app.run_test(size=(120, 40)) as pilot:
        await _at_step(pilot, "1")
        block_map = app.query_one(BlockMap)
        app.query_one("#running-table", RequestTable).focus()
        await pilot.press("down")
        block_map.focus()
        for zoom in ([], ["minus"]):
            await pilot.press(*zoom)
            await pilot.pause()
            legend = block_map.legend_text()
            legend_styles = {span.style for span in legend.spans if isinstance(span.style, Style)}
            drawn = {style for _, style in block_map._cells}
            palette = {Style(color=c) for c in PALETTE}
            per_request = drawn & palette
            assert drawn - per_request <= legend_styles, drawn - per_request - legend_styles
            assert (GROUP_USED_STYLE in legend_styles) == bool(zoom)
            assert {SELECTED_STYLE, CACHED_STYLE, FREE_STYLE} <= legend_styles
            assert SELECTED_STYLE in drawn  # a request is selected: its colour is explained


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
async def test_steps_panel_has_y_axes_and_readable_numbers(size: tuple[int, int]) -> None:
    app = _app()
    async with app.run_test(size=size) as pilot:
        await _at_step(pilot, "2")
        _assert_footer_complete(app, size[0])
        steps = list(app.view.series["step"])
        for key, title in CHARTS:
            values = list(app.view.series[key])
            spark = app.query_one(f"#chart-{key}", Sparkline)
            shown = len(spark.data)
            assert spark.region.width == shown  # one column per step
            assert spark.region.right <= size[0]
            axis = widget_lines(app.query_one(f"#chart-axis-{key}", Static))
            label = widget_lines(app.query_one(f"#chart-label-{key}", Label))[0]
            assert label.startswith(title)
            assert not LONG_FLOAT.search(label + " ".join(axis)), (label, axis)
            top, bottom = (line.rsplit(" ┤", 1)[0].strip() for line in axis[:2])
            shown_values = values[-shown:]
            assert float(top.replace(",", "")) == pytest.approx(max(shown_values), rel=0.01, abs=0.01)
            assert float(bottom.replace(",", "")) == pytest.approx(min(shown_values), rel=0.01, abs=0.01)
        ruler = widget_lines(app.query_one("#chart-preemptions", Static))[0]
        shown = len(app.query_one("#chart-prefill", Sparkline).data)
        marks = ruler[AXIS_WIDTH : AXIS_WIDTH + shown]
        preempted = list(app.view.series["preempted"])[-shown:]
        assert [m == "▲" for m in marks] == [bool(c) for c in preempted]
        axis_line = widget_lines(app.query_one("#chart-axis", Static))[0]
        assert axis_line.strip().startswith(f"step {int(steps[-shown])}") and axis_line.endswith(str(int(steps[-1])))
        assert len(axis_line) == AXIS_WIDTH + shown


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
async def test_startup_panel_shows_every_detail(size: tuple[int, int]) -> None:
    app = _app()
    async with app.run_test(size=size) as pilot:
        await _at_step(pilot, "3")
        _assert_footer_complete(app, size[0])
        table = app.query_one(StartupTable)
        assert table.virtual_size.width <= table.scrollable_content_region.width
        text = " ".join(line.strip() for line in widget_lines(table))
        for part in ("kv_pool_overridden True", "requested 71.30 GiB", "bytes_per_token 131,072",
                     "max_model_len 4,096", "no CUDA graphs are captured"):
            assert part in text.replace("  ", " "), part


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
async def test_events_panel_shows_whole_events_with_readable_numbers(size: tuple[int, int]) -> None:
    app = _app()
    async with app.run_test(size=size) as pilot:
        await _at_step(pilot, "4")
        _assert_footer_complete(app, size[0])
        lines = [line for line in widget_lines(app.query_one("#events-lines", Static)) if line]
        assert lines and all(len(line) <= size[0] for line in lines)
        assert not any("…" in line for line in lines)  # whole events: continued, never cut
        assert not any(LONG_FLOAT.search(line) for line in lines), [ln for ln in lines if LONG_FLOAT.search(ln)]
        newest = app.view.recent[-1]
        assert any(line.startswith(f"#{newest.seq} ") for line in lines)
        log = app.query_one(EventsLog)
        assert "queue_time_s=0.704" in " ".join(log.matching())  # 0.7039213775220021 in the recording
        assert "values: min" in " ".join(log.matching())  # inter-token latencies summarised


class _Disconnected(LiveFeed):
    description = "http://a-rather-long-host-name.example.internal:8000/events"
    connection = Connection(DISCONNECTED, "connection refused (is the server running?)", None, 3)


async def test_the_title_bar_cuts_the_source_never_the_connection_state() -> None:
    app = MonitorApp(feed=_Disconnected())
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause(0.2)
        line = widget_lines(app.query_one(TitleBar))[0].strip()
        assert len(line) <= 120
        assert line.endswith("○ DISCONNECTED connection refused (is the server running?) · reconnecting…")
        assert line.startswith("kvscope monitor · http://a-") and "…" in line.split("○")[0]
        # the live state hides the replay keys: the footer recomposes, which can take more than
        # 0.2 s on a loaded machine; wait (at most 5 s) until it has laid its keys out again
        for _ in range(50):
            keys = list(app.query(FooterKey))
            if keys and all(key.region.width > 0 for key in keys):  # recomposing: no keys at all for a moment
                break
            await pilot.pause(0.1)
        _assert_footer_complete(app, 120, replay=False)
        footer = " ".join(widget_lines(app.query_one(Footer)))
        assert "±1 step" not in footer  # replay keys are hidden while live
