"""The dashboard follows any data-parallel rank (issue 37): ``r`` / ``R`` switch the block
map, queues and charts to the next / previous rank, the header names the rank followed, the
next-preemption / next-arrival keys stop only where the followed rank changes, and the
Parallel panel shows every rank's pipeline stages.

On a real ``engine simulate -dp 2 -pp 2`` recording (both ranks' real schedulers on one bus,
a 32-block pool per rank so each rank preempts once: rank 1 first); what the dashboard shows
for a rank is checked against a view of that rank's own events alone (a core's own
recording)."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Sequence

import pytest
from textual.widgets import Footer

from engine.events import Event, RequestArrived, SnapshotEvent, StepEvent, read_events
from engine.events.feed import BusFeed, HttpFeed, LiveFeed
from engine.events.folds.parallel_window import WINDOW_S, ParallelWindow
from engine.events.folds.pipeline_idle import PipelineIdle
from engine.events.folds.view import EngineView, event_dp_rank
from monitor.app import MonitorApp
from monitor.state import Timeline
from monitor.widgets.block_map import BlockMap
from monitor.widgets.parallel_panel import ParallelPanel
from monitor.widgets.queues import RequestTable
from monitor.widgets.title_bar import TitleBar
from tests.monitor.test_fleet_app import plain
from tests.monitor.test_monitor_layout import widget_lines
from tests.monitor.test_parallel_panel import two_rank_run
from tests.monitor_fixtures import ManualClock, until

SHOWN = 100  # a step position where rank 0 holds r2, r4, r6 and rank 1 r3, r5, r7, r8


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> list[Event]:
    from engine.cli.main import main

    path = tmp_path_factory.mktemp("dp2pp2") / "dp2pp2.jsonl"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["simulate", "-pp", "2", "-dp", "2", "--max-model-len", "8192", "--num-prompts", "16",
                     "--random-input-len", "200:400", "--random-output-len", "20:40", "--arrival", "poisson",
                     "--request-rate", "20", "--arrival-unit", "s", "--num-gpu-blocks-override", "32",
                     "--events", str(path)]) == 0
    return read_events(path).events


def rank_alone(events: Sequence[Event], rank: int, position: int) -> EngineView:
    """What rank ``rank``'s own recording shows at step position ``position`` of the whole one:
    its stamped events and the unstamped ones (config, startup)."""
    end = [i for i, e in enumerate(events) if isinstance(e, StepEvent)][position] + 1
    return EngineView().fold(e for e in events[:end] if event_dp_rank(e) in (None, rank))


def arrival_positions(events: Sequence[Event]) -> dict[int, list[int]]:
    """Per rank: the step positions at which its requests have arrived (the first step folded
    after each arrival, any rank's)."""
    out: dict[int, set[int]] = {0: set(), 1: set()}
    position = -1
    for e in events:
        if isinstance(e, StepEvent):
            position += 1
        elif isinstance(e, RequestArrived):
            out[e.dp_rank].add(position + 1)
    return {rank: sorted(ks) for rank, ks in out.items()}


def table_ids(app: MonitorApp, table: str) -> set[str]:
    return {str(key.value) for key in app.query_one(f"#{table}-table", RequestTable).rows}


def header(app: MonitorApp) -> str:
    return " ".join(widget_lines(app.query_one(TitleBar)))


def footer(app: MonitorApp) -> str:
    return " ".join(widget_lines(app.query_one(Footer)))


def assert_shows(app: MonitorApp, alone: EngineView) -> None:
    """The block map, both queues and the charts are exactly the rank's own view."""
    assert table_ids(app, "running") == {r.request_id for r in alone.running}
    assert table_ids(app, "waiting") == {r.request_id for r in alone.waiting}
    assert app.query_one(BlockMap).owners_by_block() == {b: frozenset(o) for b, o in alone.block_owners.items() if o}
    assert (app.view.kv_used, app.view.finished, app.view.step) == (alone.kv_used, alone.finished, alone.step)
    assert list(app.view.series["waiting"]) == list(alone.series["waiting"])


def assert_stage_rows(panel: str, events: Sequence[Event], now: float) -> None:
    """DP x PP: a stage row per rank and stage, each from that rank's own steps' bubbles
    (pipeline_idle's fraction over the last 10 s), and a verdict per rank."""
    assert "2 DP ranks · 2 PP stages" in panel and "PP stages per DP rank" in panel
    rows = [line.split() for line in panel.splitlines()]
    for rank in (0, 1):
        idle = PipelineIdle()
        for e in events:
            if isinstance(e, StepEvent) and e.dp_rank == rank and now - WINDOW_S < e.t <= now:
                idle.add(list(e.pipeline_bubble_s), [], e.duration_s)
        assert idle.steps > 10
        for stage, fraction in enumerate(idle.fractions):
            busy = f"{100 * (1 - fraction):.0f}%"
            assert any(row[:3] == [str(rank), str(stage), busy] for row in rows), (rank, stage, busy, panel)
        assert any(line.startswith(f"verdict, rank {rank}: ") for line in panel.splitlines())


async def test_r_follows_rank_1_in_replay_and_the_header_names_it(recording: list[Event]) -> None:
    """Each key is followed by a wait for the state it brings (``until``), not a pause: a
    loaded machine runs a key's action after ``Pilot.press`` has returned."""
    rank0, rank1 = rank_alone(recording, 0, SHOWN), rank_alone(recording, 1, SHOWN)
    assert set(rank0.requests) == {"r2", "r4", "r6"} and set(rank1.requests) == {"r3", "r5", "r7", "r8"}
    timeline = Timeline(recording, checkpoint_every=50)
    app = MonitorApp(timeline=timeline, source_name="dp2pp2.jsonl", wall_clock=ManualClock())
    async with app.run_test(size=(120, 40)) as pilot:
        app.seek(SHOWN)  # the header is what the screen shows: drawn at the next refresh
        await until(pilot, lambda: "◆ DP rank 0 of 2" in header(app))
        assert_shows(app, rank0)
        # The footer is recomposed after the bindings change: the key fits beside the others at 120 columns.
        await until(pilot, lambda: "r R rank" in footer(app))
        assert "q quit" in footer(app)
        await pilot.press("r")
        await until(pilot, lambda: app.view.dp_rank == 1 and "◆ DP rank 1 of 2" in header(app))
        assert_shows(app, rank1)
        await pilot.press("2")
        await until(pilot, lambda: "the block map, queues and step charts show DP rank 1"
                    in plain(app.query_one(ParallelPanel)))
        assert_stage_rows(plain(app.query_one(ParallelPanel)), recording, app.view.t)
        # Moving on keeps rank 1: a short hop folds forward, a long one restores rank 1's checkpoint.
        await pilot.press("period", "right_square_bracket")
        await until(pilot, lambda: timeline.position == SHOWN + 101)
        assert_shows(app, rank_alone(recording, 1, SHOWN + 101))
        await pilot.press("comma")  # back one: from the checkpoint before it
        await until(pilot, lambda: timeline.position == SHOWN + 100)
        assert_shows(app, rank_alone(recording, 1, SHOWN + 100))
        await pilot.press("R")  # two ranks: the previous is rank 0
        await until(pilot, lambda: app.view.dp_rank == 0 and "◆ DP rank 0 of 2" in header(app))
        assert_shows(app, rank_alone(recording, 0, SHOWN + 100))


async def test_next_preemption_and_arrival_stop_at_the_followed_ranks_changes(recording: list[Event]) -> None:
    steps = [e for e in recording if isinstance(e, StepEvent)]
    preempting = {rank: [k for k, s in enumerate(steps) if s.preempted and s.dp_rank == rank] for rank in (0, 1)}
    assert preempting[1] and preempting[0] and preempting[1][0] < preempting[0][0]  # rank 1 preempts first
    app = MonitorApp(timeline=Timeline(recording, checkpoint_every=50))
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        await pilot.press("n")  # rank 0: rank 1's earlier preemption changes nothing here
        await pilot.pause()
        assert app.timeline is not None and app.timeline.position == preempting[0][0]
        assert (app.view.preemptions, app.view.series["preempted"][-1]) == (1, 1)
        await pilot.press("home", "r", "n")
        await pilot.pause()
        assert app.timeline.position == preempting[1][0] and app.view.dp_rank == 1
        assert (app.view.preemptions, app.view.series["preempted"][-1]) == (1, 1)
        # Rank 1's arrivals, each a new request in its queue; rank 0's are passed by.
        await pilot.press("home")
        stops = []
        for _ in range(3):
            before = set(app.view.requests)
            await pilot.press("a")
            await pilot.pause()
            stops.append(app.timeline.position)
            assert set(app.view.requests) - before, stops
    arrivals = arrival_positions(recording)
    assert stops == [k for k in arrivals[1] if k > 0][:3]
    assert any(stops[0] < k < stops[-1] and k not in stops for k in arrivals[0])  # rank 0's, passed by


def test_timeline_arrivals_and_preemptions_are_each_ranks(recording: list[Event]) -> None:
    timeline = Timeline(recording, checkpoint_every=50)
    assert timeline.ranks == [0, 1] and timeline.dp_rank == 0
    arrivals = arrival_positions(recording)
    rank0 = timeline.arrival_steps
    timeline.follow(1)
    assert (rank0, timeline.arrival_steps) == (arrivals[0], arrivals[1]) and rank0 != arrivals[1]
    with pytest.raises(ValueError, match="DP rank 2"):
        timeline.follow(2)


def test_stage_readings_per_rank_survive_the_snapshot() -> None:
    fold = ParallelWindow()
    for k in range(4):
        for rank, bubbles in ((0, [0.1, 0.3]), (1, [0.2, 0.2])):
            fold.apply(StepEvent(index=k, t=float(k), dp_rank=rank, duration_s=1.0, pipeline_bubble_s=bubbles,
                                 pipeline_bytes=[100, 0]))
    windows = fold.rank_stage_windows()
    assert {rank: [round(s.utilisation, 2) for s in stages] for rank, stages in windows.items()} == \
        {0: [0.9, 0.7], 1: [0.8, 0.8]}
    assert ParallelWindow.from_dict(fold.to_dict()).rank_stage_windows() == windows
    # A snapshot written when only rank 0 had stages (a list) still loads as rank 0's.
    older = fold.to_dict() | {"stages": fold.to_dict()["stages"]["0"]}
    assert ParallelWindow.from_dict(older).rank_stage_windows() == {0: windows[0]}


def test_the_live_feed_drops_what_a_followed_ranks_snapshot_holds() -> None:
    """After the stream's snapshot (rank 0's, seq 100) and rank 1's (``/debug/state?dp_rank=1``,
    seq 50): each rank's events the snapshots hold are dropped, the rest kept."""
    feed = LiveFeed()
    rank1_state = EngineView(dp_rank=1).snapshot() | {"last_seq": 50}
    for event in (SnapshotEvent(state=EngineView().snapshot() | {"last_seq": 100}, seq=100),
                  SnapshotEvent(state=rank1_state, seq=50),
                  StepEvent(index=1, seq=40, dp_rank=1), StepEvent(index=2, seq=51, dp_rank=1),
                  StepEvent(index=3, seq=90), StepEvent(index=4, seq=101)):
        feed.push(event)
    assert [e.seq for e in feed.drain()] == [100, 50, 51, 101]


async def test_the_in_process_dashboard_says_why_it_cannot_follow_another_rank() -> None:
    """``serve --monitor`` reads rank 0's bus alone: r names the command that can."""
    from engine.events import EventBus

    bus = EventBus()
    app = MonitorApp(feed=BusFeed(bus))
    async with app.run_test(size=(120, 40)) as pilot:
        for event in two_rank_run():
            bus.publish(event)
        await pilot.pause(0.3)
        assert "◆ DP rank 0 of 2" in header(app)
        await pilot.press("r")
        await pilot.pause()
        assert app.view.dp_rank == 0 and app.asked_rank is None
        notes = [str(n.message) for n in app._notifications]
    assert any("cannot follow DP rank 1" in n and "monitor http://HOST:PORT" in n for n in notes), notes


def test_one_rank_hides_the_key() -> None:
    timeline = Timeline([e for e in two_rank_run() if event_dp_rank(e) in (None, 0)])
    assert timeline.ranks == [0]
    app = MonitorApp(timeline=timeline)
    assert app.check_action("follow_rank", (1,)) is False and app.followed_rank_text() == ""


def test_a_rank_the_server_cannot_give_is_a_warning_naming_it() -> None:
    """Nothing listens on the port: the feed queues a warning the dashboard shows, saying which
    rank, where it asked and why."""
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again before the feed asks
    feed = HttpFeed(f"http://127.0.0.1:{port}", connect_timeout_s=2.0)
    assert feed.follow_rank(1) is None
    deadline = time.monotonic() + 10
    while not (events := feed.drain()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert [(type(e).__name__, e.data) for e in events] == [("LogEvent", {"follow_dp_rank": 1})]  # type: ignore[attr-defined]
    assert events[0].message == (f"cannot follow DP rank 1: http://127.0.0.1:{port}/debug/state?dp_rank=1: "  # type: ignore[attr-defined]
                                 "connection refused (is the server running?)")
