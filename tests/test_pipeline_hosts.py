"""Pipeline stages across hosts (issue 37): two "hosts", each its own process tree started
by its own command (``engine serve ... --nnodes 2 --node-rank N``), meeting through
torch.distributed's TCPStore rendezvous over loopback; a host that never arrives, named
with its rank within the rendezvous timeout; and a stage killed on host 1, named by host 0
(its rank, host, layers, pid, how it ended) from host 1's word in the store, with no
process of either host left. Slow: each host loads the model (a tiny dummy-weight Llama;
~30-60 s on two cores)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from bench.bench_server import free_port, wait_healthy
from engine.config import EngineConfig
from engine.errors import UserError
from engine.pipeline import Rendezvous
from tests.paths import ROOT
from tests.processes import wait_gone
from tests.test_data_parallel import TINY_LLAMA


def test_the_rendezvous_reads_the_flags_else_torchruns_environment() -> None:
    flags = Rendezvous.of(EngineConfig(pipeline_parallel_size=4, nnodes=2, node_rank=1, master_addr="10.0.0.1",
                                       master_port=1234, rendezvous_timeout_s=9))
    assert flags == Rendezvous("10.0.0.1", 1234, 2, 1, 9.0)
    assert list(flags.stages_of(1, 4)) == [2, 3] and flags.node_of(3, 4) == 1
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h0", "MASTER_PORT": "29511"}
    assert Rendezvous.of(EngineConfig(pipeline_parallel_size=2), env) == Rendezvous("h0", 29511, 2, 1, 300.0)
    with pytest.raises(UserError, match=r"--node-rank 2: give 0\.\.1"):
        Rendezvous.of(EngineConfig(nnodes=2, node_rank=2))
    with pytest.raises(UserError, match="--pipeline-parallel-size 3 over --nnodes 2: give a multiple of 2"):
        flags.stages_of(0, 3)




def _host(folder: Path, node: int, master_port: int, port: int, timeout: float = 240) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "engine.cli", "serve", "--model", str(folder), "--load-format", "dummy",
               "--pipeline-parallel-size", "2", "--nnodes", "2", "--node-rank", str(node), "--master-addr",
               "127.0.0.1", "--master-port", str(master_port), "--rendezvous-timeout", str(timeout), "--port",
               str(port), "--max-model-len", "256", "--dtype", "float32", "--kv-cache-memory-bytes", "4Mi",
               "--max-num-batched-tokens", "64", "--max-num-seqs", "8", "--stats-interval", "0",
               "--uvicorn-log-level", "warning", "--events", str(folder / f"host{node}.jsonl")]
    log = (folder / f"host{node}.log").open("w")
    return subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _gone(process: subprocess.Popen[bytes], tree: list[int]) -> None:
    wait_gone(tree, "a process of a host outlived it", timeout_s=15)


@pytest.fixture
def model_folder(tmp_path: Path) -> Iterator[Path]:
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    yield tmp_path


@pytest.mark.slow
def test_two_hosts_started_by_two_commands_serve_one_model_in_two_stages(model_folder: Path) -> None:
    master, port = free_port(), free_port()
    host1 = _host(model_folder, 1, master, free_port())  # the stage host may start first: it waits for host 0
    host0 = _host(model_folder, 0, master, port)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, {host0: model_folder / "host0.log", host1: model_folder / "host1.log"}, timeout_s=300)
        body = {"prompt": [5, 17, 29, 31], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 8
        tree1 = [host1.pid] + [c.pid for c in psutil.Process(host1.pid).children(recursive=True)]
    finally:
        host0.terminate()
        host0.wait(60)
    assert host1.wait(60) == 0, (model_folder / "host1.log").read_text()[-3000:]  # host 0 stopped its stages
    _gone(host1, tree1)
    rows = [json.loads(line) for line in (model_folder / "host0.jsonl").read_text().splitlines()[1:]]
    steps = [r for r in rows if r["type"] == "step" and r["scheduled"]]
    tokens = [r["num_prefill_tokens"] + r["num_decode_tokens"] for r in steps]
    # each stage sends every token's fp32 hidden state (128 wide) once; each waited on the other
    assert [r["pipeline_bytes"] for r in steps] == [[n * 128 * 4] * 2 for n in tokens]
    assert all(len(r["pipeline_bubble_s"]) == 2 for r in steps)
    # host 1's stage ran phases A-G itself; rank 0 published them once every rank was ready
    ended = [r for r in rows if r["type"] == "startup.phase" and r["status"] == "end"]
    for stage in (0, 1):
        assert [r["phase"] for r in ended if r.get("pp_rank") == stage] == list("ABCDEFG")
        assert all(r["rank"] == stage and r["tp_rank"] == 0 for r in ended if r.get("pp_rank") == stage)


@pytest.mark.slow
def test_a_host_that_never_arrives_is_named_with_its_rank_within_the_timeout(model_folder: Path) -> None:
    host0 = _host(model_folder, 0, free_port(), free_port(), timeout=10)
    tree = [host0.pid]
    code = host0.wait(240)
    log = (model_folder / "host0.log").read_text()
    assert code != 0
    assert "stage 1 (host 1) never arrived within 10 s (--rendezvous-timeout)" in log, log[-3000:]
    _gone(host0, tree)


@pytest.mark.slow
def test_a_stage_killed_on_another_host_is_named_by_host_0_and_no_process_is_left(model_folder: Path) -> None:
    import signal

    master, port = free_port(), free_port()
    host1 = _host(model_folder, 1, master, free_port())
    host0 = _host(model_folder, 0, master, port)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, {host0: model_folder / "host0.log", host1: model_folder / "host1.log"}, timeout_s=300)
        tree1 = [host1.pid] + [c.pid for c in psutil.Process(host1.pid).children(recursive=True)]
        stage = next(c for c in psutil.Process(host1.pid).children()
                     if "spawn_main" in " ".join(c.cmdline()))
        stage.send_signal(signal.SIGKILL)
        time.sleep(1.0)  # host 1 sees it and writes its word in the store
        body = {"prompt": [5, 17, 29, 31], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        with pytest.raises(httpx.HTTPError):  # the replica stops under the request: an error reply or a cut
            httpx.post(f"{url}/v1/completions", json=body, timeout=120).raise_for_status()
        assert host0.wait(60) != 0
    finally:
        if host0.poll() is None:
            host0.terminate()
            host0.wait(60)
    log = (model_folder / "host0.log").read_text()
    assert (f"pipeline stage 1 (host 1, layers 1-1) (pid {stage.pid}) was killed by SIGKILL during step 1; its "
            "last phase: G (ready) end, then serving steps. The replica is stopped") in log, log[-3000:]
    assert host1.wait(60) != 0
    _gone(host1, tree1)
