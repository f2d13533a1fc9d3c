"""`make gpu-check`: everything that can only be verified on an NVIDIA GPU, in one
run of at most ten minutes, with the results in one JSON file.

1. device: name, compute capability, memory (torch.cuda).
2. kernel_tests: tests/model/test_triton_attention.py natively (no interpreter).
3. runner: a dummy-weights Llama-3.1-8B-shaped ModelRunner on the Triton backend,
   a prefill step and decode steps, logits compared with the torch backend.
4. engine_phases: HOOK: start the engine through all startup phases once
   `engine serve` exists (engine/cli/commands/serve.py); skipped until then.
5. kernel_bench: Llama-3.1-8B attention shapes (32 query heads, 8 KV heads,
   head dim 128, bf16, 16-token blocks), Triton vs torch backend.
6. nvml: the monitor's NVML reader (monitor/gpu.py) on the real library, its
   memory total against CUDA's; the snapshot is kept for the GPU panel's tests.

``bench/gpu_check.sh`` calls this only when a GPU is present. ``--device cpu``
(with TRITON_INTERPRET=1 and ``--smoke``) runs the same code on tiny shapes so
the script itself can be tested without a GPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from engine.model.runner import ModelRunner, ScheduledSeq
    from engine.modelspec.config import ModelConfig

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / ".bench" / "gpu_check.json"
GPU_MODEL = "llama-3.1-8b"


# --------------------------------------------------------------------------- 1. device
def device_info(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {"device": str(device), "torch": torch.__version__}
    import triton

    info["triton"] = triton.__version__
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        free, total = torch.cuda.mem_get_info(device)
        info |= {
            "name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "multiprocessors": props.multi_processor_count,
            "memory_total_gib": round(total / 2**30, 2),
            "memory_free_gib": round(free / 2**30, 2),
        }
    return info


# --------------------------------------------------------------------------- 2. kernel tests
def kernel_tests(device: torch.device) -> dict[str, Any]:
    env = dict(os.environ)
    if device.type == "cuda":
        env.pop("TRITON_INTERPRET", None)  # native kernels
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "triton", "-p", "no:cacheprovider"]
    cmd.append("tests/model/test_triton_attention.py")
    start = time.perf_counter()
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    lines = (result.stdout + result.stderr).strip().splitlines()
    return {
        "ok": result.returncode == 0,
        "returncode": result.returncode,
        "summary": lines[-1] if lines else "",
        "seconds": round(time.perf_counter() - start, 1),
        "tail": lines[-40:] if result.returncode else [],
    }


# --------------------------------------------------------------------------- 3. runner
def _triton_runner(config: ModelConfig, dtype: str, device: torch.device, block_size: int,
                   num_blocks: int) -> tuple[ModelRunner, float]:
    """The model on dummy weights with the Triton backend and a KV cache of ``num_blocks``
    blocks, and the seconds that took."""
    from engine.model.runner import ModelRunner

    start = time.perf_counter()
    runner = ModelRunner(
        config,
        dtype=dtype,
        block_size=block_size,
        device=str(device),
        attention_backend="triton",
        load_format="dummy",
    )
    runner.load_weights()
    runner.allocate_kv_cache(num_blocks)
    return runner, time.perf_counter() - start


def _decode(runner: ModelRunner, device: torch.device, sampled: dict[str, int], tables: list[list[int]],
            prompt_len: int, decode_steps: int) -> tuple[list[ScheduledSeq], dict[str, torch.Tensor], list[float]]:
    """``decode_steps`` decode steps of every sequence, the last returning its logits instead
    of sampling: that step's batch, its logits and each step's seconds."""
    from engine.model.runner import ScheduledSeq

    decode_times = []
    batch: list[ScheduledSeq] = []
    triton_logits: dict[str, torch.Tensor] = {}
    for step in range(decode_steps):
        batch = [
            ScheduledSeq(str(i), [sampled[str(i)]], prompt_len + step, tables[i]) for i in range(len(tables))
        ]
        start = time.perf_counter()
        if step == decode_steps - 1:
            triton_logits = runner.logits_for(batch)
        else:
            sampled = runner.execute(batch)
        sync(device)
        decode_times.append(time.perf_counter() - start)
    return batch, triton_logits, decode_times


def _torch_logits(runner: ModelRunner, batch: list[ScheduledSeq]) -> dict[str, torch.Tensor]:
    """Same weights and cache, torch attention: the last decode step again (it rewrites the same slots)."""
    from engine.model.attention.torch_backend import TorchAttentionBackend

    triton_backend = runner.model.backend
    runner.model.backend = TorchAttentionBackend()
    torch_logits = runner.logits_for(batch)
    runner.model.backend = triton_backend
    return torch_logits


def runner_check(device: torch.device, smoke: bool) -> dict[str, Any]:
    """A dummy-weights model on the Triton backend: one prefill step of several
    prompts, then decode steps; the last step's logits are recomputed with the
    torch backend on the same weights and cache contents."""
    from engine.model.runner import ScheduledSeq
    from engine.modelspec.readers import load_model_config

    config = load_model_config("smollm2-135m" if smoke else GPU_MODEL)
    dtype = "float32" if smoke else "bfloat16"
    num_seqs, prompt_len, decode_steps = (2, 20, 2) if smoke else (8, 512, 16)
    block_size = 16
    blocks_per_seq = -(-(prompt_len + decode_steps) // block_size)
    runner, load_s = _triton_runner(config, dtype, device, block_size, num_seqs * blocks_per_seq)

    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, config.vocab_size, (prompt_len,), generator=gen).tolist() for _ in range(num_seqs)
    ]
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(num_seqs)]
    sync(device)
    start = time.perf_counter()
    sampled = runner.execute([ScheduledSeq(str(i), p, 0, tables[i]) for i, p in enumerate(prompts)])
    sync(device)
    prefill_s = time.perf_counter() - start
    batch, triton_logits, decode_times = _decode(runner, device, sampled, tables, prompt_len, decode_steps)
    torch_logits = _torch_logits(runner, batch)

    max_diff = max(float((triton_logits[k] - torch_logits[k]).abs().max()) for k in triton_logits)
    scale = max(float(v.abs().max()) for v in torch_logits.values())
    argmax_agree = sum(int(triton_logits[k].argmax()) == int(torch_logits[k].argmax()) for k in triton_logits)
    del runner
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        # Random weights give near-flat logits, so argmax agreement is reported, not required.
        "ok": max_diff <= 0.05 * max(scale, 1.0),
        "model": config.name,
        "dtype": dtype,
        "load_s": round(load_s, 2),
        "prefill_tokens": num_seqs * prompt_len,
        "prefill_s": round(prefill_s, 4),
        "decode_step_ms_median": round(1000 * sorted(decode_times)[len(decode_times) // 2], 2),
        "logits_max_abs_diff_vs_torch": max_diff,
        "logits_max_abs": scale,
        "argmax_agree": f"{argmax_agree}/{num_seqs}",
    }


# --------------------------------------------------------------------------- 4. engine phases (HOOK)
def engine_phases(device: torch.device, timeout_s: float = 300.0) -> dict[str, Any]:
    """HOOK for the full engine: start a dummy-weights Llama-3.1-8B-shaped engine
    through startup phases A-G with the Triton backend and collect its log lines.

    Until engine/cli/commands/serve.py exists this reports "skipped". Once it does,
    this starts `engine serve` on 127.0.0.1, waits for /health, and stops it;
    adjust the flags here if serve's differ."""
    if importlib.util.find_spec("engine.cli.commands.serve") is None:
        return {
            "ok": True,
            "status": "skipped",
            "reason": "engine serve (engine/cli/commands/serve.py) does not exist yet",
        }
    engine_bin = shutil.which("engine", path=str(Path(sys.executable).parent)) or "engine"
    port = 18123
    cmd = [
        engine_bin, "serve", "--model", GPU_MODEL, "--load-format", "dummy", "--device", device.type,
        "--attention-backend", "triton" if device.type == "cuda" else "torch", "--max-model-len", "4096",
        "--port", str(port), "--log-format", "console",
    ]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ready = False
    try:
        while time.perf_counter() - start < timeout_s and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                    ready = response.status == 200
            except OSError:
                pass
            if ready:
                break
            time.sleep(1.0)
    finally:
        proc.terminate()
        try:
            output, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
    lines = output.splitlines()
    print("\n".join(lines))
    return {
        "ok": ready,
        "status": "ready" if ready else f"not ready (exit code {proc.returncode})",
        "command": " ".join(cmd),
        "seconds_to_ready": round(time.perf_counter() - start, 1),
        "log_lines": lines[-200:],
    }


# --------------------------------------------------------------------------- 5. kernel bench
@dataclass(frozen=True)
class BenchCase:
    name: str
    seq_lens: list[int]
    query_lens: list[int]


def bench_cases(smoke: bool) -> list[BenchCase]:
    if smoke:
        return [BenchCase("decode 2x40", [40, 40], [1, 1]), BenchCase("prefill 1x20", [20], [20])]
    return [
        BenchCase("decode 64 seqs x 1k context", [1024] * 64, [1] * 64),
        BenchCase("decode 256 seqs x 2k context", [2048] * 256, [1] * 256),
        BenchCase("decode 8 seqs x 16k context (split-K)", [16384] * 8, [1] * 8),
        BenchCase("prefill 4 x 1024", [1024] * 4, [1024] * 4),
        BenchCase(
            "mixed: 2 chunks of 512 on 4k context + 32 decodes",
            [4096] * 2 + [1024] * 32,
            [512] * 2 + [1] * 32,
        ),
    ]


def time_call(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    """Median seconds per call after one warm-up call."""
    fn()
    sync(device)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


BENCH_SHAPE = {"num_heads": 32, "num_kv_heads": 8, "head_dim": 128, "block_size": 16}  # Llama-3.1-8B
SMOKE_SHAPE = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 64, "block_size": 16}


def bench_case(
    case: BenchCase, device: torch.device, dtype: torch.dtype, shape: dict[str, int], iters: int
) -> dict[str, Any]:
    """One attention call's shape, random cache contents in a shuffled block
    layout; median time of Triton and torch backends and their largest difference."""
    from engine.model.attention.base import AttentionMetadata
    from engine.model.attention.torch_backend import TorchAttentionBackend
    from engine.model.attention.triton_backend import TritonAttentionBackend

    num_heads, num_kv_heads, head_dim, block_size = (
        shape["num_heads"], shape["num_kv_heads"], shape["head_dim"], shape["block_size"],
    )  # fmt: skip
    blocks_per_seq = [-(-n // block_size) for n in case.seq_lens]
    num_blocks = sum(blocks_per_seq)
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).to(torch.int32)
    block_tables = torch.zeros(len(case.seq_lens), max(blocks_per_seq), dtype=torch.int32)
    first = 0
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = perm[first : first + n]
        first += n
    kv_cache = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_dim, device=device).to(dtype)
    num_tokens = sum(case.query_lens)
    query = torch.randn(num_tokens, num_heads, head_dim, device=device).to(dtype)
    query_start_loc = torch.zeros(len(case.query_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(torch.tensor(case.query_lens), 0)
    meta = AttentionMetadata(
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
        query_start_loc=query_start_loc.to(device),
        seq_lens=torch.tensor(case.seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        max_query_len=max(case.query_lens),
        max_seq_len=max(case.seq_lens),
        query_lens_cpu=case.query_lens,
        seq_lens_cpu=case.seq_lens,
    )
    scale = head_dim**-0.5
    triton_backend, torch_backend = TritonAttentionBackend(), TorchAttentionBackend()
    start = time.perf_counter()
    triton_out = triton_backend.forward(query, kv_cache, meta, scale)
    sync(device)
    first_call_s = time.perf_counter() - start  # includes compilation
    torch_out = torch_backend.forward(query, kv_cache, meta, scale)
    triton_s = time_call(lambda: triton_backend.forward(query, kv_cache, meta, scale), device, iters)
    torch_s = time_call(lambda: torch_backend.forward(query, kv_cache, meta, scale), device, iters)
    kv_bytes = sum(case.seq_lens) * 2 * num_kv_heads * head_dim * kv_cache.element_size()
    row: dict[str, Any] = {
        "case": case.name,
        "split_k": triton_backend.uses_split_k(meta),
        "triton_ms": round(1000 * triton_s, 3),
        "torch_ms": round(1000 * torch_s, 3),
        "speedup_vs_torch": round(torch_s / triton_s, 2),
        "triton_kv_read_gb_s": round(kv_bytes / triton_s / 1e9, 1),
        "triton_first_call_s": round(first_call_s, 2),
        "max_abs_diff_vs_torch": float((triton_out.float() - torch_out.float()).abs().max()),
    }
    if row["split_k"]:
        single_pass = TritonAttentionBackend(split_k_min_seq_len=10**9)
        single_pass_s = time_call(lambda: single_pass.forward(query, kv_cache, meta, scale), device, iters)
        row["single_pass_ms"] = round(1000 * single_pass_s, 3)
    return row


def kernel_bench(device: torch.device, smoke: bool) -> dict[str, Any]:
    shape = SMOKE_SHAPE if smoke else BENCH_SHAPE
    dtype = torch.float32 if smoke else torch.bfloat16
    iters = 2 if smoke else 20
    rows = [bench_case(case, device, dtype, shape, iters) for case in bench_cases(smoke)]
    if device.type == "cuda":
        torch.cuda.empty_cache()
    tolerance = 1e-4 if smoke else 2e-2
    return {
        "ok": all(r["max_abs_diff_vs_torch"] <= tolerance for r in rows),
        "shape": shape | {"dtype": str(dtype)},
        "cases": rows,
    }


# --------------------------------------------------------------------------- driver
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------ 6. nvml
def nvml_check(device: torch.device) -> dict[str, Any]:
    """The monitor's GPU panel reader (monitor/gpu.py NvmlReader) on the real library:
    every device read, memory total as CUDA reports it; the readings are kept, in the
    format RecordedGpuReader replays (tests/data/nvml)."""
    from monitor.gpu import NvmlReader

    snapshot = NvmlReader().read()
    if device.type != "cuda":
        return {"ok": True, "status": "skipped", "reason": f"not on a GPU; NVML says: {snapshot.unavailable}"}
    if snapshot.unavailable is not None:
        return {"ok": False, "error": f"NVML unavailable on a CUDA machine: {snapshot.unavailable}"}
    _, total = torch.cuda.mem_get_info(device)
    first = snapshot.devices[0]
    return {
        "ok": abs(first.memory_total - total) <= 0.01 * total and first.utilization_pct is not None,
        "devices": len(snapshot.devices), "driver": snapshot.driver,
        "memory_total_nvml": first.memory_total, "memory_total_cuda": total,
        "snapshot": snapshot.to_dict(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"results file (default {DEFAULT_OUT})")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (for testing this script on CPU)")
    parser.add_argument("--skip", action="append", default=[], help="skip a check by name (repeatable)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)

    checks: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("kernel_tests", lambda: kernel_tests(device)),
        ("runner", lambda: runner_check(device, args.smoke)),
        ("engine_phases", lambda: engine_phases(device)),
        ("kernel_bench", lambda: kernel_bench(device, args.smoke)),
        ("nvml", lambda: nvml_check(device)),
    ]
    report: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "device": device_info(device)}
    wall = time.perf_counter()
    for name, check in checks:
        if name in args.skip:
            report[name] = {"ok": True, "status": "skipped", "reason": "--skip"}
            continue
        print(f"gpu-check: {name} ...", flush=True)
        start = time.perf_counter()
        try:
            report[name] = check()
        except Exception as exc:  # one failing check must not lose the others' results
            report[name] = {
                "ok": False,
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(),
            }
        report[name]["check_seconds"] = round(time.perf_counter() - start, 1)
        print(
            f"gpu-check: {name}: {'ok' if report[name]['ok'] else 'FAILED'} ({report[name]['check_seconds']} s)"
        )
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))  # after every check, so a timeout keeps what ran
    report["wall_seconds"] = round(time.perf_counter() - wall, 1)
    report["ok"] = all(report[name]["ok"] for name, _ in checks)
    args.out.write_text(json.dumps(report, indent=2))
    for row in report.get("kernel_bench", {}).get("cases", []):
        print(f"  {row['case']:<52} triton {row['triton_ms']:>9} ms  torch {row['torch_ms']:>9} ms")
    print(f"gpu-check: {'all ok' if report['ok'] else 'FAILURES'}; results in {args.out}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
