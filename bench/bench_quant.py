"""GGUF block-type matmul speed (engine/model/kernels/cpu_quant.py) at Gemma 3 270M's shapes:
every format against torch's float32 ``F.linear`` over the dequantized weight and, for Q4_1,
cpu_gemv's interleaved ``q4_1x8`` kernel; printed as markdown.

Shapes are named as GGUF lists them (ggml order, ``in x out``): ``640x2048`` is the gate/up
projection (in 640, out 2048), ``2048x640`` the down projection, ``1024x640`` the attention
output. K-quants need ``in`` a multiple of 256, so they skip ``in = 640`` (as llama.cpp's
Q4_K_M mix does, using Q5_0 there). Each (shape, rows) cell times every method interleaved
(A, B, C, A, B, C, ...) over several rounds and quotes the median, so a neighbour's load on a
shared CPU hits all methods alike. Each call takes the next of enough copies of its weight to
fill ``--cold-mib`` MiB, so weights stream from memory as in a decode step. GB/s is the weight
bytes a call reads divided by its time.

``--clock cpu`` times each method by its thread's CPU time instead of wall time (with
``--threads 1`` only): on a machine shared with other engineers' jobs (load 10 on 2 cores), a
2-thread call waits whenever either thread is descheduled, so wall-clock medians there measure
the scheduler (cells of one 28 ms quantum), not the kernel.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.model.kernels import cpu_gemv, cpu_quant

SHAPES = {"640x2048": (640, 2048), "2048x640": (2048, 640), "1024x640": (1024, 640)}  # name -> (in, out)
FORMATS = tuple(cpu_quant.FORMAT_IDS)


def random_blocks(fmt: str, out: int, inp: int, gen: torch.Generator) -> torch.Tensor:
    """Valid ``fmt`` bytes: random quants, fp16 scales (and minimums) of a sane size."""
    weights, nbytes = cpu_quant.block_geometry(fmt)
    nblk = inp // weights
    blocks = torch.randint(0, 256, (out, nblk, nbytes), dtype=torch.uint8, generator=gen)
    scale_at = 208 if fmt == "q6_k" else 0
    scale = (torch.rand(out, nblk, generator=gen) * 0.01 + 0.001).half()
    blocks[..., scale_at : scale_at + 2] = scale.view(torch.uint8).view(out, nblk, 2)
    if fmt in ("q4_1", "q5_1", "q4_k", "q5_k"):
        low = (torch.rand(out, nblk, generator=gen) * 0.01).half()
        blocks[..., 2:4] = low.view(torch.uint8).view(out, nblk, 2)
    return blocks.reshape(out, nblk * nbytes)


def _copies(tensor: torch.Tensor, cold_bytes: int) -> list[torch.Tensor]:
    count = max(1, min(1024, -(-cold_bytes // (tensor.numel() * tensor.element_size()))))
    return [tensor] + [tensor.clone() for _ in range(count - 1)]


def _cycle(tensors: list[torch.Tensor], call: Callable[[torch.Tensor], object]) -> Callable[[], object]:
    state = {"i": 0}

    def run() -> object:
        state["i"] = (state["i"] + 1) % len(tensors)
        return call(tensors[state["i"]])

    return run


def make_calls(inp: int, out: int, rows: int, formats: list[str], isas: list[str], cold_bytes: int,
               with_gemv: bool) -> dict[str, tuple[Callable[[], object], int]]:
    """method -> (one call, weight bytes it reads)."""
    gen = torch.Generator().manual_seed(inp * 31 + out)
    x = torch.randn(rows, inp, generator=gen)
    calls: dict[str, tuple[Callable[[], object], int]] = {}
    dense = None
    for fmt in formats:
        if inp % cpu_quant.block_geometry(fmt)[0]:
            continue
        blocks = random_blocks(fmt, out, inp, gen)
        if dense is None:
            dense = cpu_quant.dequantize(blocks, fmt)
        copies = _copies(blocks, cold_bytes)
        for isa in isas:
            kernel = cpu_quant.load_kernel(isa)
            assert kernel is not None, cpu_quant.unavailable_reason(isa)
            code = cpu_quant.format_id(fmt)
            name = fmt if len(isas) == 1 else f"{fmt}/{isa}"
            calls[name] = (_cycle(copies, lambda t, k=kernel, c=code: k.quant_matmul(x, t, c)), blocks.numel())
        if fmt == "q4_1" and with_gemv:
            x8 = _copies(cpu_gemv.interleave_q4_1(blocks), cold_bytes)
            calls["gemv q4_1x8"] = (_cycle(x8, lambda t: cpu_gemv.gemv(x, t, "q4_1x8")), blocks.numel())
    if dense is not None:
        calls = {"fp32": (_cycle(_copies(dense, cold_bytes), lambda t: F.linear(x, t)), dense.numel() * 4), **calls}
    return calls


def time_interleaved(calls: dict[str, tuple[Callable[[], object], int]], rounds: int,
                     budget_s: float = 0.02, clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Median seconds per call of each method, the methods alternating within every round."""
    inner: dict[str, int] = {}
    for name, (fn, _) in calls.items():
        fn()
        start = clock()
        fn()
        one = max(clock() - start, 1e-6)
        inner[name] = max(1, min(500, int(budget_s / one)))
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, (fn, _) in calls.items():
            start = clock()
            for _ in range(inner[name]):
                fn()
            samples[name].append((clock() - start) / inner[name])
    return {name: statistics.median(values) for name, values in samples.items()}


def table(shapes: list[str], rows_list: list[int], formats: list[str], isas: list[str], rounds: int,
          cold_bytes: int, with_gemv: bool, clock: Callable[[], float] = time.perf_counter) -> list[str]:
    lines = ["| shape (in x out) | rows | method | µs | weight GB/s | x fp32 |", "|---|---|---|---|---|---|"]
    for shape in shapes:
        inp, out = SHAPES[shape]
        for rows in rows_list:
            calls = make_calls(inp, out, rows, formats, isas, cold_bytes, with_gemv)
            times = time_interleaved(calls, rounds, clock=clock)
            for name, seconds in times.items():
                gbs = calls[name][1] / seconds / 1e9
                lines.append(f"| {shape} | {rows} | {name} | {seconds * 1e6:.0f} | {gbs:.1f} | "
                             f"{times['fp32'] / seconds:.2f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,64,512", help="activation rows (tokens), comma-separated")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"subset of {','.join(SHAPES)}")
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--isa", default="native", help="cpu_quant builds to time, comma-separated "
                        f"({', '.join(cpu_quant.ISAS)})")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--cold-mib", type=int, default=128, help="weight copies cycled per method (0: one copy)")
    parser.add_argument("--no-gemv", action="store_true", help="leave out cpu_gemv's q4_1x8")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: the thread's CPU time (needs --threads 1; for a shared, loaded machine)")
    args = parser.parse_args(argv)
    if args.clock == "cpu" and args.threads != 1:
        parser.error("--clock cpu times the calling thread only: add --threads 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    isas = args.isa.split(",")
    kernels = {isa: cpu_quant.load_kernel(isa, print) for isa in isas}
    missing = [isa for isa, kernel in kernels.items() if kernel is None]
    if missing:
        print(f"cpu_quant unavailable for {missing}: {cpu_quant.unavailable_reason(missing[0])}")
        return 1
    with_gemv = not args.no_gemv and cpu_gemv.load_kernel(print) is not None
    names = ", ".join(f"{isa}: {kernel.isa()}" for isa, kernel in kernels.items())  # type: ignore[union-attr]
    print(f"## cpu_quant ({names}; torch {torch.backends.cpu.get_cpu_capability()}, "
          f"{torch.get_num_threads()} threads, {args.cold_mib} MiB of weight copies, {args.clock} clock)\n")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    lines = table(args.shapes.split(","), [int(r) for r in args.rows.split(",")], args.formats.split(","), isas,
                  args.rounds, args.cold_mib * 2**20, with_gemv, clock)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
