"""Pipeline and data parallelism on this machine, and the same layouts on a GPU preset (issue 37).

On a 2-core CPU, PP and DP cannot be faster: every stage and every replica shares the
same cores and memory bandwidth. So this reports what the layouts *do* instead of a
speed-up, read from the engine's own events:

* **PP=2** (``--pipeline-parallel-size 2``, the bundled SmolLM2 in float32, two stage
  processes over gloo) against one rank on the same requests: each stage's bubble fraction
  (its ``pipeline_bubble_s`` over the step time), the bytes sent between stages per step,
  the fill-drain floor of 2 micro-batches over 2 stages, and output tok/s of both;
* **DP=2** (``engine serve --data-parallel-size 2``, the bundled model, identical requests
  sent 8 at a time): each rank's requests, output tokens, steps and peak waiting + running,
  from each core's recording (``run.dp0.jsonl``, ``run.dp1.jsonl``), and the spread
  (busiest / mean);
* the simulator (``engine simulate``'s cost model) with the same layouts, PP=1, PP=2,
  DP=2 and PP=2 x DP=2, for Llama-3.1-8B on the H100 preset under one Poisson workload:
  throughput, latency, each stage's bubble and each rank's share.

``--tiny`` runs a short workload (to check the benchmark works); ``--no-real`` only the
simulator.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.bench_server import wait_healthy
from bench.greedy_run import greedy_run
from bench.machine import cpu_isa, header_lines
from engine.budget.stages import DEFAULT_MICRO_BATCHES, fill_drain_bubble
from engine.config import EngineConfig
from engine.dp_core import rank_events_path
from engine.events import StepEvent, read_events
from engine.events.folds.dp_balance import DataParallelLoad
from engine.events.folds.pipeline_idle import PipelineIdle
from engine.sim.data_parallel import DataParallelSimulation
from engine.sim.simulate import SimResult, Simulation, build_setup
from engine.sim.workload import WorkloadSpec, generate_workload

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = "smollm2-135m"
SIM_MODEL, SIM_GPU = "llama-3.1-8b", "h100-80gb"


def _prompts(count: int, length: int) -> list[list[int]]:
    import torch

    generator = torch.Generator().manual_seed(0)
    return [torch.randint(100, 40000, (length,), generator=generator).tolist() for _ in range(count)]


def run_pipeline(stages: int, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    """The bundled model in ``stages`` stages on the prompts, greedy; figures from its events."""
    config = EngineConfig(model=BUNDLED, dtype="float32", quantization="none", max_model_len=512,
                          max_num_batched_tokens=256, max_num_seqs=16, stats_interval=0.0,
                          kv_cache_memory_bytes=64 << 20, pipeline_parallel_size=stages if stages > 1 else None)
    run = greedy_run(config, prompts, output_len)
    events, generated, ran = run.events, run.generated, run.run_s
    idle = PipelineIdle()
    for event in events:
        idle(event)
    steps = [e for e in events if isinstance(e, StepEvent) and e.scheduled]
    return {"layout": f"PP={stages}", "output_tok_s": round(generated / ran, 1), "run_s": round(ran, 2),
            "steps": len(steps), "bubble_fraction": [round(f, 3) for f in idle.fractions],
            "fill_drain_floor": round(fill_drain_bubble(stages, DEFAULT_MICRO_BATCHES), 3),
            "kib_sent_per_step": [round(b / 1024, 1) for b in idle.bytes_per_step()]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_data_parallel(requests: int, prompt_len: int, output_len: int, folder: Path) -> dict[str, Any]:
    """``engine serve --data-parallel-size 2`` with the bundled model; identical requests 8 at a
    time; each rank's share from its own recording."""
    import httpx

    port = _free_port()
    events = folder / "run.jsonl"
    log = folder / "serve.log"
    command = [sys.executable, "-m", "engine.cli", "serve", "--model", BUNDLED, "--data-parallel-size", "2",
               "--port", str(port), "--max-model-len", "512", "--dtype", "float32", "-q", "none",
               "--kv-cache-memory-bytes", "32Mi", "--max-num-batched-tokens", "256", "--max-num-seqs", "8",
               "--stats-interval", "0", "--events", str(events), "--uvicorn-log-level", "warning"]
    with log.open("w") as out:
        server = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, {server: log}, timeout_s=600)
        prompt = list(range(100, 100 + prompt_len))
        body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True}
        started = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(lambda _: httpx.post(f"{url}/v1/completions", json=body, timeout=600).status_code,
                                  range(requests)))
        ran = time.perf_counter() - started
        routed = httpx.get(f"{url}/debug/state", timeout=10).json().get("data_parallel", {})
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
    balance = DataParallelLoad(declared_size=2)
    for rank in range(2):
        path = Path(rank_events_path(str(events), rank) or "")
        for event in read_events(path.read_bytes(), name=str(path)).events:
            if hasattr(event, "dp_rank"):
                event.dp_rank = rank  # this core's own file: every event is its rank's
            balance(event)
    summary = balance.summary()
    return {"layout": "DP=2", "requests": requests, "ok": codes.count(200), "run_s": round(ran, 2),
            "output_tok_s": round(sum(r["output_tokens"] for r in summary["ranks"]) / ran, 1),
            "requests_spread": round(summary["requests_spread"], 3),
            "output_tokens_spread": round(summary["output_tokens_spread"], 3),
            "ranks": [{k: r[k] for k in ("rank", "requests", "output_tokens", "steps", "peak_load")}
                      for r in summary["ranks"]],
            "balancer_routed": [r.get("routed") for r in routed.get("ranks", [])]}


def simulated(requests: int, rate: float) -> list[dict[str, Any]]:
    """The same layouts on the cost model: one workload, four layouts."""
    workload = generate_workload(WorkloadSpec(requests, (500, 3000), (150, 400), arrival="poisson", rate=rate,
                                              unit="s"))
    rows = []
    for pp, dp in ((1, 1), (2, 1), (1, 2), (2, 2)):
        setup = build_setup(SIM_MODEL, SIM_GPU, EngineConfig(pipeline_parallel_size=pp if pp > 1 else None,
                                                             data_parallel_size=dp if dp > 1 else None,
                                                             max_model_len=8192))
        result: SimResult = (DataParallelSimulation(setup).run(workload) if dp > 1
                             else Simulation(setup).run(workload))
        s = result.summary()
        row: dict[str, Any] = {"layout": f"PP={pp} DP={dp}", "gpus": pp * dp,
                               "output_tok_s": round(s["output_tokens_per_s"]),
                               "ttft_p50_ms": round(s["ttft_p50_s"] * 1e3, 1), "ttft_p99_ms": round(s["ttft_p99_s"] * 1e3, 1),
                               "itl_p50_ms": round(s["itl_p50_s"] * 1e3, 2)}
        if result.pipeline.stages:
            row["bubble_fraction"] = [round(f, 3) for f in result.pipeline.fractions]
        if "data_parallel" in s:
            dps = s["data_parallel"]
            row["requests_by_rank"] = [r["requests"] for r in dps["ranks"]]
            row["load_spread"] = round(dps["load_spread"], 3)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a short workload: checks the benchmark works")
    parser.add_argument("--no-real", action="store_true", help="only the simulator's figures")
    args = parser.parse_args(argv)
    # requests for PP, prompt tokens, generated tokens, DP requests, simulated requests
    count, prompt_len, output_len, dp_requests, sim_requests = (4, 32, 8, 8, 60) if args.tiny else (8, 64, 32, 16, 400)
    for line in header_lines():
        print(line)
    isa = cpu_isa()
    if not args.no_real:
        print(f"\nreal engine ({isa}, {os.cpu_count()} cores): {BUNDLED} float32; PP: {count} requests x {prompt_len} "
              f"prompt tokens, {output_len} generated, greedy, all at once; DP: {dp_requests} identical requests, "
              "8 in flight")
        batch = _prompts(count, prompt_len)
        for stages in (1, 2):
            print(json.dumps(run_pipeline(stages, batch, output_len)), flush=True)
        with tempfile.TemporaryDirectory(prefix="kvscope-bench-dp-") as folder:
            print(json.dumps(run_data_parallel(dp_requests, prompt_len, output_len, Path(folder))), flush=True)
    rate = 10.0
    print(f"\nsimulated: {SIM_MODEL} on {SIM_GPU} (cost model, efficiency 0.6), {sim_requests} requests, prompts "
          f"500-3,000, outputs 150-400, Poisson {rate:g}/s; PP stages over a 50 GB/s link, "
          f"{DEFAULT_MICRO_BATCHES} micro-batches")
    print("| layout | GPUs | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | bubble per stage | "
          "requests per rank | load spread |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in simulated(sim_requests, rate):
        print(f"| {row['layout']} | {row['gpus']} | {row['output_tok_s']:,} | {row['ttft_p50_ms']} | "
              f"{row['ttft_p99_ms']} | {row['itl_p50_ms']} | {row.get('bubble_fraction', '-')} | "
              f"{row.get('requests_by_rank', '-')} | {row.get('load_spread', '-')} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
