"""The machine a benchmark ran on, printed at the top of every report: CPU and ISA
(engine/model/cpu_caps.py), load average, threads and torch version. Numbers from a
2-core machine shared with other work mean little without these lines.

Also the machine's own limits that the engine benchmark measures itself against:
GEMM FLOP/s in fp32 and bf16 and memory read bandwidth.
"""

from __future__ import annotations

import importlib.metadata
import os
import time
from collections.abc import Callable
from typing import Any


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} / {five:.2f} / {fifteen:.2f} (1 / 5 / 15 min)"


def cpu_line() -> str:
    try:
        from engine.model.cpu_caps import detect
    except ImportError:  # an old checkout without cpu_caps: say so rather than fail
        return "unknown (engine.model.cpu_caps not importable)"
    return detect().line()


def cpu_isa() -> str:
    from engine.model.cpu_caps import detect

    return detect().isa


def torch_version() -> str:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def header_lines(threads: int | None = None) -> list[str]:
    """Markdown bullet lines: CPU, load average now, threads, torch."""
    thread_text = f"{threads} benchmark threads" if threads else "threads: each benchmark's default"
    return [f"- CPU: {cpu_line()}",
            f"- load average at start: {load_average()}",
            f"- {os.cpu_count()} logical CPUs; {thread_text}; torch {torch_version()}"]


# ---------------------------------------------------------------------- limits
def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _best_time(fn: Callable[[], Any], tries: int = 5, budget_s: float = 3.0) -> float:
    """Fastest of up to ``tries`` calls after one warm-up, stopping once ``budget_s`` is spent
    (emulated bf16 GEMM on an AVX2 CPU takes seconds a call)."""
    best = _timed(fn)
    spent = best
    for _ in range(tries - 1):
        if spent > budget_s:
            break
        t = _timed(fn)
        spent += t
        best = min(best, t)
    return best


def gemm_flops(dtype: Any, n: int = 1024) -> float:
    """FLOP/s of one n x n x n matmul in ``dtype`` (best of a few)."""
    import torch

    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    return 2 * n**3 / _best_time(lambda: a @ b)


def read_bandwidth(mib: int = 512) -> float:
    """Bytes/s of summing a ``mib`` MiB fp32 tensor (best of 5): the memory read bandwidth."""
    import torch

    big = torch.ones(mib * 1024 * 1024 // 4, dtype=torch.float32)
    return big.numel() * 4 / _best_time(big.sum, budget_s=10.0)


def machine_limits(threads: int) -> dict[str, float]:
    """GEMM FLOP/s in fp32 and bf16 (1024^3) and memory read bandwidth, on ``threads`` threads."""
    import torch

    torch.set_num_threads(threads)
    return {"gemm_float32_flops": gemm_flops(torch.float32), "gemm_bfloat16_flops": gemm_flops(torch.bfloat16),
            "read_bytes_per_s": read_bandwidth()}


def best_limits(*measurements: dict[str, float]) -> dict[str, float]:
    """Each limit's best over several measurements (a busy moment only ever lowers one)."""
    return {key: max(m[key] for m in measurements) for key in measurements[0]}
