"""The memory bar is scaled to the device total (the budget's unused part is its own
slice) and the Startup panel's memory deltas come from the phases' readings: process
RSS on CPU, where torch reports no allocations."""

from __future__ import annotations

from textual.geometry import Region
from textual.widget import Widget

from engine.events import StartupPhase, StepEvent, read_events
from engine.events.folds.view import EngineView
from monitor.app import MonitorApp
from monitor.sources import load_timeline
from monitor.widgets.memory_bar import GiB, MemoryBar, bar_cells, legend_lines, memory_segments
from monitor.widgets.startup_table import StartupTable, memory_delta_text
from tests.monitor_fixtures import SAMPLE
from tests.paths import SAMPLES

CPU_RUN = SAMPLES / "smollm2_run.jsonl"


def widget_text(widget: Widget) -> str:
    """What ``widget`` shows on screen, line by line."""
    strips = widget.render_lines(Region(0, 0, widget.size.width, widget.size.height))
    return "\n".join("".join(seg.text for seg in strip) for strip in strips)


def _startup_view(path) -> EngineView:  # type: ignore[no-untyped-def]
    return EngineView().fold(e for e in read_events(path).events if not isinstance(e, StepEvent))


def test_cpu_bar_is_scaled_to_the_device_total_with_the_unused_budget_shown() -> None:
    view = _startup_view(CPU_RUN)
    segments = dict(memory_segments(view))
    total = view.ledger["total_bytes"]
    util = view.ledger["gpu_memory_utilization"]
    assert abs(sum(segments.values()) - total) < 1.0
    assert abs(segments["outside budget"] - total * (1 - util)) < 1.0
    held = sum(v for k, v in segments.items() if k not in ("outside budget", "budget unused"))
    assert abs(segments["budget unused"] - (total * util - held)) < 1.0
    assert segments["budget unused"] > 0.8 * total  # a 135M model in 22 GiB of RAM leaves most of it
    cells = dict(zip(segments, bar_cells(list(segments.values()), 100), strict=True))
    assert sum(cells.values()) == 100
    assert 9 <= cells["outside budget"] <= 11  # 1 − util = 10 %, not ~80 % as when scaled to the items
    assert cells["budget unused"] >= 85
    assert cells["weights"] >= 1 and cells["KV free"] >= 1  # small slices keep a cell


def test_bar_cells_fill_the_width_and_keep_every_nonzero_slice() -> None:
    assert bar_cells([1.0, 0.0, 1.0], 10) == [5, 0, 5]
    cells = bar_cells([1000.0, 1.0, 1.0, 0.0, 1.0], 20)
    assert sum(cells) == 20 and cells[1:] == [1, 1, 0, 1]
    assert bar_cells([0.0, 0.0], 8) == [0, 0]


def test_legend_wraps_between_items_and_names_its_units() -> None:
    segments = memory_segments(_startup_view(SAMPLE))
    for width in (60, 116, 196):
        lines = legend_lines(segments, width)
        text = [line.plain for line in lines]
        assert all(len(line) <= width for line in text)
        items = [item.strip() for line in text for item in line.split("■") if item.strip()]
        assert [item.rsplit(" ", 2)[0] for item in items] == [label for label, _ in segments]
        assert all(item.endswith(" GiB") for item in items)


def test_cpu_phase_deltas_are_the_process_rss_growth() -> None:
    events = [e for e in read_events(CPU_RUN).events if isinstance(e, StartupPhase) and e.status != "begin"]
    view = _startup_view(CPU_RUN)
    for event in events:
        before, after = event.memory_before, event.memory_after
        assert before and after and before["allocated"] == after["allocated"] == 0  # torch reports nothing on CPU
        phase = view.phases[event.phase]
        assert phase.memory_delta == after["process_used"] - before["process_used"]
        assert phase.memory_measure == "rss"
    c = view.phases["C"]
    assert c.memory_delta is not None and c.memory_delta > 0.1 * GiB  # the weights' pages
    assert memory_delta_text(c) == f"{c.memory_delta / GiB:+.2f} RSS"


def test_simulated_phase_deltas_stay_allocated_bytes() -> None:
    view = _startup_view(SAMPLE)
    assert view.phases["C"].memory_measure == "allocated"
    assert memory_delta_text(view.phases["C"]) == f"{view.ledger['weights_bytes'] / GiB:+.2f}"


async def test_cpu_recording_shows_rss_deltas_and_the_unused_budget() -> None:
    app = MonitorApp(timeline=load_timeline(CPU_RUN), source_name="smollm2")
    async with app.run_test(size=(160, 48)) as pilot:
        await pilot.press("3")
        await pilot.pause()
        table = app.query_one(StartupTable)
        deltas = {row.value: str(table.get_cell(row, "memory Δ GiB")) for row in table.rows}
        assert deltas["C"] == memory_delta_text(app.view.phases["C"]) and deltas["C"] != "+0.00"
        assert deltas["A"].endswith(" RSS")
        bar = widget_text(app.query_one(MemoryBar))
        assert "budget unused" in bar and "process RSS" in bar
