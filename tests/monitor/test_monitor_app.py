"""Pilot tests: the dashboard driven on recordings, a live bus and a local SSE server."""

from __future__ import annotations

import asyncio
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest

from engine.errors import UserError
from engine.events import EngineStopped, EventBus, LogEvent, SinkFailed, StepEvent, dumps, read_events
from engine.events.feed import BusFeed, HttpFeed, parse_sse
from engine.events.folds.view import EngineView
from monitor.app import MonitorApp
from monitor.cli import main as monitor_main
from monitor.sources import load_timeline
from monitor.widgets.block_map import BlockMap
from monitor.widgets.events_log import EventsLog
from monitor.widgets.queues import RequestTable
from monitor.widgets.replay_bar import ReplayBar
from tests.monitor_fixtures import SAMPLE, ManualClock, owners_at, record_driver_run, until
from tests.paths import SAMPLES

SIZE = (160, 50)


@pytest.fixture(scope="module")
def driver_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return record_driver_run(tmp_path_factory.mktemp("mon") / "driver.jsonl")


async def test_seek_to_step_k_shows_the_independently_folded_block_table(driver_file: Path) -> None:
    events = read_events(driver_file).events
    app = MonitorApp(timeline=load_timeline(driver_file, checkpoint_every=16), source_name="driver")
    async with app.run_test(size=SIZE) as pilot:
        for k in (40, 17, 95):
            await pilot.press("g", *str(k), "enter")
            await pilot.pause()
            assert app.view.step == k
            assert app.query_one(BlockMap).owners_by_block() == owners_at(events, k)
            assert f"step {k} " in str(app.query_one(ReplayBar).render())


async def test_replay_controls_move_through_the_recording() -> None:
    """Every key waits for the state it brings (``until``); playback moves by the seconds of
    the clock the test sets, at the speed the keys chose, however often the timer ticks."""
    timeline = load_timeline(SAMPLE, checkpoint_every=50)
    clock = ManualClock(50.0)
    app = MonitorApp(timeline=timeline, wall_clock=clock)

    async def keys(*pressed: str, step: int) -> None:
        await pilot.press(*pressed)  # pilot: the run_test's, below
        await until(pilot, lambda: app.view.step == step)

    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.view.step == 0)
        await keys("period", "period", "period", step=3)
        await keys("comma", step=2)
        await keys("right_square_bracket", step=102)
        await keys("left_square_bracket", "left_square_bracket", step=0)
        await keys("n", step=timeline.preemption_steps[0])
        assert app.view.series["preempted"][-1] > 0
        before = app.view.step
        await keys("a", step=min(k for k in timeline.arrival_steps if k > before))
        await keys("end", step=441)  # the recording's last step
        await keys("home", step=0)
        await pilot.press("f", "f")
        await until(pilot, lambda: app.speed == 50.0)
        await pilot.press("s")
        await until(pilot, lambda: app.speed == 20.0)
        await pilot.press("space")
        await until(pilot, lambda: app.playing)
        clock.now += 0.5  # 20 steps/s for half a second of the clock: 10 steps
        await until(pilot, lambda: app.view.step == 10)
        await pilot.press("space")
        await until(pilot, lambda: not app.playing)
        assert app.view.step == 10


async def test_selecting_a_request_highlights_its_blocks() -> None:
    app = MonitorApp(timeline=load_timeline(SAMPLE, checkpoint_every=50))
    async with app.run_test(size=SIZE) as pilot:
        app.seek_index(200)
        await pilot.pause()
        table = app.query_one("#running-table", RequestTable)
        table.focus()
        await pilot.press("down")
        await pilot.pause()
        block_map = app.query_one(BlockMap)
        rid = block_map.selected
        assert rid is not None and rid in app.view.requests
        blocks = app.view.requests[rid].blocks
        assert blocks
        lines = [block_map.render_line(y) for y in range(block_map.size.height)]
        # every block lit, its partly filled last one drawn ▪
        highlighted = sum(seg.text.count("■") + seg.text.count("▪") for line in lines for seg in line
                          if seg.style and seg.style.bgcolor)
        assert highlighted == len(blocks)


async def test_zoom_groups_blocks_and_the_legend_says_how_many() -> None:
    app = MonitorApp(timeline=load_timeline(SAMPLE, checkpoint_every=50))
    async with app.run_test(size=SIZE) as pilot:
        block_map = app.query_one(BlockMap)
        block_map.focus()
        assert block_map.effective_blocks_per_cell == 1
        await pilot.press("minus", "minus")
        assert block_map.effective_blocks_per_cell == 4
        assert "1 cell = 4 blocks" in block_map.legend()
        await pilot.press("plus")
        assert block_map.effective_blocks_per_cell == 2


async def test_events_log_filters() -> None:
    app = MonitorApp(timeline=load_timeline(SAMPLE, checkpoint_every=50))
    async with app.run_test(size=SIZE) as pilot:
        app.seek_index(300)
        await pilot.press("4")
        log = app.query_one(EventsLog)
        await pilot.click("#events-filter")
        await pilot.press(*"preempted")
        await pilot.pause()
        lines = log.matching()
        assert lines and all("preempted" in line for line in lines)


async def test_live_bus_feed_follows_an_engine_and_starts_from_a_snapshot() -> None:
    bus = EventBus()
    events = read_events(SAMPLE).events
    mirror = EngineView()  # what an engine would keep to answer snapshot_fn
    for event in events[:300]:
        bus.publish(event)
        mirror.apply(event)
    app = MonitorApp(feed=BusFeed(bus, snapshot_fn=mirror.snapshot))
    last_step = max(e.index for e in events[:600] if isinstance(e, StepEvent))

    async def settle(pilot, step: int | None) -> None:  # type: ignore[no-untyped-def]
        for _ in range(100):  # the app drains its feed on a 0.1 s timer; a loaded CPU may need longer
            await pilot.pause(0.05)
            if app.view.step == step:
                return

    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, mirror.step)
        assert app.view.step == mirror.step
        for event in events[300:600]:
            bus.publish(event)
        await settle(pilot, last_step)
        assert app.view.step == last_step
        assert app.query_one(BlockMap).owners_by_block() == owners_at(events[:600], last_step)
        assert "LIVE" in str(app.query_one(ReplayBar).render())
        assert app.check_action("goto", ()) is False


class _SSEHandler(http.server.BaseHTTPRequestHandler):
    lines: ClassVar[list[str]] = []
    api_key = "secret"

    def do_GET(self) -> None:
        if self.headers.get("Authorization") != f"Bearer {self.api_key}":
            self.send_response(401)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for line in self.lines:
            self.wfile.write(f"data: {line}\n\n".encode())
        self.wfile.flush()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def sse_server() -> Iterator[str]:
    events = read_events(SAMPLE).events[:400]
    view = EngineView().fold(events[:200])
    from engine.events import SnapshotEvent

    snapshot = SnapshotEvent(state=view.snapshot(), seq=view.last_seq)
    _SSEHandler.lines = [dumps(snapshot.to_dict())] + [dumps(e.to_dict()) for e in events[150:400]]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _SSEHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


async def test_http_feed_reads_sse_with_api_key(sse_server: str) -> None:
    events = read_events(SAMPLE).events[:400]
    feed = HttpFeed(sse_server, api_key="secret", retry_s=30)
    app = MonitorApp(feed=feed)
    async with app.run_test(size=SIZE) as pilot:
        for _ in range(40):
            await pilot.pause(0.1)
            if app.view.last_seq >= events[-1].seq:
                break
        expected = EngineView().fold(events)
        assert app.view.step == expected.step
        assert app.view.block_owners == expected.block_owners  # overlap after the snapshot was dropped
    feed.stop()


async def test_http_feed_reports_a_rejected_key(sse_server: str) -> None:
    feed = HttpFeed(sse_server, api_key="wrong")
    feed.start()
    for _ in range(50):
        drained = feed.drain()
        if drained:
            break
        await asyncio.sleep(0.05)
    assert drained and "--api-key" in drained[0].message  # type: ignore[attr-defined]


def test_parse_sse_joins_data_lines_and_skips_comments() -> None:
    lines = [": keep-alive", "data: {\"a\":", "data: 1}", "", "event: x", "data: [1]", "", "data: {\"b\":2}"]
    assert list(parse_sse(iter(lines))) == [{"a": 1}, {"b": 2}]


def test_cli_bad_inputs_are_one_line_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert monitor_main(["replay", str(tmp_path / "missing.jsonl")]) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text("hello\n")
    assert monitor_main(["replay", str(bad)]) == 2
    assert monitor_main(["ftp://nowhere"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3
    assert [line.split(" error: ")[0] for line in err] == ["monitor replay:", "monitor replay:", "monitor follow:"]
    with pytest.raises(UserError):
        load_timeline(tmp_path / "missing.jsonl")


@pytest.mark.slow  # 3-6 s each on a 2-core machine: in make test-slow, to keep the default suite under 5 min
@pytest.mark.parametrize(
    ("name", "steps"),
    [("smollm2_run.jsonl", (12, 150, 290)), ("sim_h100_llama8b.jsonl", (5, 200, 380))],
)
async def test_committed_recordings_seek_to_the_independent_block_table(name: str, steps: tuple[int, ...]) -> None:
    """The real bundled-model run (with preemptions) and the large simulated
    H100 run: after "go to step K" the map shows exactly the table at K."""
    path = SAMPLES / name
    events = read_events(path).events
    last_step = max(e.index for e in events if isinstance(e, StepEvent))
    app = MonitorApp(timeline=load_timeline(path), source_name=name)
    async with app.run_test(size=SIZE) as pilot:
        for k in steps:
            k = min(k, last_step)
            await pilot.press("g", *str(k), "enter")
            await pilot.pause()
            assert app.view.step == k
            assert app.query_one(BlockMap).owners_by_block() == owners_at(events, k)


async def test_an_engine_that_stops_shows_why_and_ends_the_in_process_dashboard() -> None:
    """`engine serve --monitor`: the engine thread's engine.stopped event ends the dashboard
    with return code 1 (the command then exits 1 for a supervisor); a dashboard of another
    process's stream keeps showing the stopped engine instead."""
    for exits in (True, False):
        bus = EventBus()
        app = MonitorApp(feed=BusFeed(bus), exit_when_engine_stops=exits)
        async with app.run_test(size=SIZE) as pilot:
            bus.publish(SinkFailed(sink="jsonl run.jsonl", error="OSError: [Errno 28] No space left on device"))
            bus.publish(LogEvent(message="still running"))
            for _ in range(100):
                await pilot.pause(0.05)
                if app.view.failed_sinks:
                    break
            assert "STOPPED jsonl run.jsonl" in str(app.query_one("#title").render())
            bus.publish(EngineStopped(error="RuntimeError: step failed"))
            for _ in range(100):
                await pilot.pause(0.05)
                if app.return_code is not None or app.view.engine_error:
                    break
            if exits:
                assert app.return_code == 1
            else:
                assert app.return_code is None and app.view.engine_error == "RuntimeError: step failed"
                assert "ENGINE STOPPED RuntimeError: step failed" in str(app.query_one("#title").render())
