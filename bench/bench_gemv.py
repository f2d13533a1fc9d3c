"""Decode-GEMV speed at SmolLM2-135M's shapes: torch fp32/bf16/int8 vs kvscope's Q8_0/Q4_1 kernels,
and single-stream decode tok/s of the real model in fp32, int8 and int4, printed as markdown.

Every (shape, rows) cell times all methods interleaved (A, B, C, A, B, C, ...) over several
rounds and quotes the median, so a neighbour's load on a shared CPU hits all methods alike.
GB/s is the weight bytes a call reads divided by its time; "% bw" compares that with this
machine's read bandwidth, measured first as the median speed of summing a 512 MiB tensor.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.model.kernels import cpu_gemv

SHAPES = {  # name -> (out, in)
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "head": (49152, 576),
}
# q8_0+a8 / q4_1+a8: the same kernels with activations quantized to int8 per 32-block (llama.cpp's way)
METHODS = ("fp32", "bf16", "int8pack", "q8_0", "q8_0+a8", "q4_1", "q4_1+a8")


def read_bandwidth_gbs(mib: int = 512, repeats: int = 7) -> float:
    """Median GB/s of ``tensor.sum()`` over a tensor far bigger than the caches."""
    data = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    data.sum()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        times.append(time.perf_counter() - start)
    return data.numel() * 4 / statistics.median(times) / 1e9


def _copies(tensor: torch.Tensor, cold_bytes: int) -> list[torch.Tensor]:
    """Enough copies of ``tensor`` to exceed ``cold_bytes``: cycling through them streams
    the weights from memory as a decode step does (30 layers' weights dwarf the caches)."""
    count = max(1, min(1024, -(-cold_bytes // (tensor.numel() * tensor.element_size()))))
    return [tensor] + [tensor.clone() for _ in range(count - 1)]


def make_calls(out: int, inp: int, rows: int, kernel_ok: bool,
               cold_bytes: int = 128 * 2**20) -> dict[str, tuple[Callable[[], object], int]]:
    """method -> (one call, weight bytes it reads); each call takes the next copy of its weight."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(out, inp, generator=gen) * 0.05
    x = torch.randn(rows, inp, generator=gen)
    x_bf16 = x.bfloat16()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q_int8 = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)

    def cycle(tensors: list[torch.Tensor], call: Callable[[torch.Tensor], object]) -> Callable[[], object]:
        state = {"i": 0}

        def run() -> object:
            state["i"] = (state["i"] + 1) % len(tensors)
            return call(tensors[state["i"]])

        return run

    calls: dict[str, tuple[Callable[[], object], int]] = {
        "fp32": (cycle(_copies(w, cold_bytes), lambda t: F.linear(x, t)), w.numel() * 4),
        "bf16": (cycle(_copies(w.bfloat16(), cold_bytes), lambda t: F.linear(x_bf16, t)), w.numel() * 2),
        "int8pack": (cycle(_copies(q_int8, cold_bytes), lambda t: torch.ops.aten._weight_int8pack_mm(x, t, scale)),
                     q_int8.numel() + scale.numel() * 4),
    }
    if kernel_ok:
        q8, q4 = cpu_gemv.quantize_q8_0(w), cpu_gemv.quantize_q4_1(w)
        for fmt, blocks in (("q8_0", q8), ("q4_1", q4)):
            copies = _copies(blocks, cold_bytes)
            calls[fmt] = (cycle(copies, lambda t, f=fmt: cpu_gemv.gemv(x, t, f)), blocks.numel())
            calls[f"{fmt}+a8"] = (cycle(copies, lambda t, f=fmt: cpu_gemv.gemv(x, t, f, int8_activations=True)),
                                  blocks.numel())
    return calls


def time_interleaved(calls: dict[str, tuple[Callable[[], object], int]], rounds: int,
                     budget_s: float = 0.02) -> dict[str, float]:
    """Median seconds per call of each method, the methods alternating within every round."""
    inner: dict[str, int] = {}
    for name, (fn, _) in calls.items():
        fn()
        start = time.perf_counter()
        fn()
        one = max(time.perf_counter() - start, 1e-6)
        inner[name] = max(1, min(200, int(budget_s / one)))
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, (fn, _) in calls.items():
            start = time.perf_counter()
            for _ in range(inner[name]):
                fn()
            samples[name].append((time.perf_counter() - start) / inner[name])
    return {name: statistics.median(values) for name, values in samples.items()}


def gemv_table(rows_list: list[int], rounds: int, bandwidth: float, kernel_ok: bool) -> list[str]:
    methods = [m for m in METHODS if kernel_ok or not m.startswith("q")]
    lines = ["| shape (out x in) | rows | " + " | ".join(f"{m} µs (GB/s, % bw)" for m in methods) + " |",
             "|---|---|" + "---|" * len(methods)]
    for shape, (out, inp) in SHAPES.items():
        for rows in rows_list:
            calls = make_calls(out, inp, rows, kernel_ok)
            times = time_interleaved(calls, rounds)
            cells = []
            for m in methods:
                gbs = calls[m][1] / times[m] / 1e9
                cells.append(f"{times[m] * 1e6:.0f} ({gbs:.1f}, {100 * gbs / bandwidth:.0f}%)")
            lines.append(f"| {shape} {out}x{inp} | {rows} | " + " | ".join(cells) + " |")
    return lines


def decode_table(tokens: int, rounds: int, methods: list[str | None]) -> list[str]:
    """Single-stream greedy decode tok/s of the bundled model in float32, per quantization."""
    from engine.core.sampling_params import SamplingParams
    from engine.model.runner import ModelRunner, ScheduledSeq
    from engine.modelspec.readers import load_model_config

    config = load_model_config("smollm2-135m")
    runners = {}
    for method in methods:
        runner = ModelRunner(config, dtype="float32", quantization=method)
        runner.load_weights()
        runner.allocate_kv_cache(64)
        runner.enable_cpu_decode_kernel()
        runners[method or "fp32"] = runner
    prompt = list(range(100, 164))
    blocks = list(range(64))
    greedy = SamplingParams(temperature=0.0)

    def run(runner: ModelRunner) -> float:
        seq = ScheduledSeq("a", list(prompt), 0, blocks, True, greedy)
        token = runner.execute([seq])["a"]
        start = time.perf_counter()
        for step in range(tokens):
            seq = ScheduledSeq("a", [token], len(prompt) + step, blocks, True, greedy)
            token = runner.execute([seq])["a"]
        return tokens / (time.perf_counter() - start)

    samples: dict[str, list[float]] = {name: [] for name in runners}
    for runner in runners.values():
        run(runner)  # warm-up
    for _ in range(rounds):
        for name, runner in runners.items():
            samples[name].append(run(runner))
    lines = ["| weights | decode tok/s (median) | min | max | weight bytes held (MB) |", "|---|---|---|---|---|"]
    for name, values in samples.items():
        held = runners[name].model.weights_bytes() / 1e6
        lines.append(f"| {name} | {statistics.median(values):.1f} | {min(values):.1f} | {max(values):.1f} | "
                     f"{held:.0f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,8,16", help="activation rows (tokens), comma-separated")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"subset of {','.join(SHAPES)}")
    parser.add_argument("--decode-tokens", type=int, default=32, help="0 skips the engine-level decode table")
    parser.add_argument("--decode-rounds", type=int, default=5)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    kernel_ok = cpu_gemv.load_kernel(print) is not None
    isa = torch.backends.cpu.get_cpu_capability()
    kernel_isa = cpu_gemv.load_kernel().isa() if kernel_ok else f"unavailable ({cpu_gemv.unavailable_reason()})"  # type: ignore[attr-defined]
    for name in list(SHAPES):
        if name not in args.shapes.split(","):
            del SHAPES[name]
    bandwidth = read_bandwidth_gbs()
    print(f"## GEMV (torch ISA {isa}, kernel {kernel_isa}, {torch.get_num_threads()} threads)\n")
    print(f"read bandwidth (512 MiB sum, median): {bandwidth:.1f} GB/s\n")
    print("\n".join(gemv_table([int(r) for r in args.rows.split(",")], args.rounds, bandwidth, kernel_ok)))
    if args.decode_tokens > 0:
        print(f"\n## single-stream decode, float32 activations, {args.decode_tokens} tokens after a 64-token prompt\n")
        methods: list[str | None] = [None, "int8", "int4"]
        print("\n".join(decode_table(args.decode_tokens, args.decode_rounds, methods)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
