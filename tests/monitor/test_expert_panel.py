"""The expert-load panel (monitor/widgets/expert_load.py): its lines from the fold, and in the
dashboard shown for a MoE recording (step events with expert_counts), hidden for a dense one."""

from __future__ import annotations

import pytest

from engine.events import StepEvent
from engine.events.folds.expert_load import ExpertLoad
from monitor.app import MonitorApp
from monitor.state import Timeline
from monitor.widgets.expert_load import ExpertPanel, expert_lines
from monitor.widgets.spark import BARS
from tests.monitor_fixtures import SAMPLE

HOT = [[4, 4, 4, 4], [13, 1, 1, 1]]  # layer 1: expert 0 takes 13 of 16 slots


def test_lines_name_the_hot_expert_and_draw_a_bar_per_expert() -> None:
    load = ExpertLoad()
    load.add(HOT)
    head, even, hot = (line.plain for line in expert_lines(load, width=40, max_layers=12))
    assert "2 MoE layers x 4 experts, last 1 steps" in head
    assert "imbalance x3.25 (max/mean, layer 1); expert 0 takes 81.2% of its tokens, 25.0% if even" in head
    assert even.startswith("L0   x1.00") and even.endswith(BARS[2] * 4)  # 4 of the busiest cell's 13
    assert hot.startswith("L1   x3.25") and hot.endswith(BARS[-1] + BARS[1] * 3)  # 1 of 13: the lowest bar but one
    many = ExpertLoad()
    many.add([[0] * 127 + [9]] * 30)  # 128 experts in 30 cells: the hot one stays visible; 12 of 30 layers shown
    lines = expert_lines(many, width=30, max_layers=12)
    assert len(lines) == 1 + 12 + 1 and "18 more balanced layers" in lines[-1].plain
    assert lines[1].plain.endswith(BARS[-1]) and len(lines[1].plain) <= 30


@pytest.mark.slow  # two dashboards: ~8 s on a shared 2-core machine
async def test_the_panel_shows_only_for_a_moe_recording() -> None:
    from engine.events import read_events

    moe_events = [StepEvent(index=i, t=float(i), num_decode_tokens=8, expert_counts=HOT) for i in range(5)]
    for events, shown in ((moe_events, True), (read_events(SAMPLE).events, False)):
        app = MonitorApp(timeline=Timeline(events, checkpoint_every=50))
        async with app.run_test(size=(160, 50)) as pilot:
            await pilot.press("2", "]")  # the Steps tab, then to the end
            await pilot.pause()
            panel = app.query_one(ExpertPanel)
            assert panel.display is shown
            if shown:
                assert "imbalance x3.25" in str(panel.render())
