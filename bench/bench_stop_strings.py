"""What a long stop list costs everyone else (issue 30, item 4), printed (not asserted).

1. The matcher alone: the time per token (a 4-character piece of English text) of the
   old matcher (every stop string searched and every prefix of every stop string tried
   against the text's end: O(stops x length) per token; kept as the reference in
   tests/model/test_stop_matcher.py) and of the Aho-Corasick ``StopMatcher``, at the
   issue's 10,000 x 100 characters and at the server's cap (``MAX_STOP_STRINGS`` x
   ``MAX_STOP_STRING_CHARS``), plus the automaton's one-off build (the server builds it
   on the route's worker thread, before the engine thread needs it).
2. The real engine (the bundled model through ``LLMEngine``, greedy, ``--threads``, 1 by
   default: the matcher runs on the engine thread either way, and one torch thread keeps
   the step's time from swinging with other work on a shared 2-core machine): a
   greedy stream's median inter-token gap while a second request decodes beside it
   with no stop strings, with a maximal stop list at the cap, and with the issue's
   10,000 x 100 list through the automaton and through the old matcher; ``--pairs``
   interleaved repetitions (the order rotating), each variant's gap over the plain
   run's in the same repetition: in wall time (what a client sees) and in the process's
   CPU time between the stream's tokens (every thread; on a shared 2-core machine the
   wall gaps move several-fold with other work, the CPU gaps far less).

The stop strings begin with common words (" the", " of", ...) followed by random
letters: the text keeps matching their starts, so held-back tails are common (the
matcher's slow path), and none ever matches whole, so the second request runs to its
``max_tokens``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from bench.machine import header_lines
from engine.model.loading.tokenizer import StopMatcher, compile_stop_strings
from engine.serve.protocol import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS

TEXT = ("The history of the city is a long one, and the people of the valley tell it in many ways. "
        "Some say that the river came first and the houses after; others that the old road was there "
        "before either, and that the first market stood where the bridge is now. ") * 8
STARTS = [" the", " of", " and", " that", " river", " road", "The", " first", " is", " a"]


def stop_list(count: int, length: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    stops = []
    for _ in range(count):
        start = rng.choice(STARTS)
        stops.append(start + "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(length - len(start))))
    return stops


def naive_matcher(stops: Sequence[str]) -> Any:
    from tests.model.test_stop_matcher import NaiveStopMatcher

    return NaiveStopMatcher(stops)


def per_token_us(make: Callable[[], Any], tokens: int) -> float:
    """Microseconds per 4-character piece over the first ``tokens`` pieces of TEXT."""
    matcher = make()
    start = time.perf_counter()
    for n in range(1, tokens + 1):
        assert matcher.feed(TEXT[: 4 * n]) is None
    return (time.perf_counter() - start) / tokens * 1e6


def matcher_costs() -> list[dict[str, Any]]:
    rows = []
    for count, length, old_tokens in ((10_000, 100, 8), (MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS, 64)):
        stops = stop_list(count, length)
        start = time.perf_counter()
        compile_stop_strings.__wrapped__(tuple(stops))
        build_ms = (time.perf_counter() - start) * 1e3
        compile_stop_strings(tuple(stops))  # cached, as the route leaves it
        old = per_token_us(lambda stops=stops: naive_matcher(stops), old_tokens)
        new = per_token_us(lambda stops=stops: StopMatcher(stops), 400)
        rows.append({"stops": count, "chars": length, "old_us_per_token": round(old, 1),
                     "new_us_per_token": round(new, 2), "old_over_new": round(old / new, 1),
                     "automaton_build_ms": round(build_ms, 1)})
    return rows


STREAM_PROMPT = "Write a long story about a city by a river. " * 3  # the greedy stream whose gaps are timed
OTHER_PROMPT = "Describe the history of an old market town in detail. " * 3  # decodes beside it, with the stop list


def stop_variants() -> dict[str, tuple[list[str], bool]]:
    """Each variant's stop list for the second request, and whether it runs the old matcher;
    the automata built and cached, as the server's route does off the engine thread."""
    cap, issue = stop_list(MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS), stop_list(10_000, 100, seed=1)
    for stops in (cap, issue):
        StopMatcher(stops)
    return {
        "plain": ([], False),
        f"cap {MAX_STOP_STRINGS}x{MAX_STOP_STRING_CHARS}": (cap, False),
        "issue 10000x100, automaton": (issue, False),
        "issue 10000x100, old matcher": (issue, True),
    }


def stream_gaps(engine: Any, stops: list[str], old: bool, output_len: int) -> tuple[float, float, float]:
    """The greedy stream's median inter-token gap in wall and in process CPU seconds while the
    other request decodes with ``stops``, and the run's wall seconds."""
    from engine.core.sampling_params import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    other = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, stop=stops)
    a = engine.add_request(STREAM_PROMPT, greedy)
    b = engine.add_request(OTHER_PROMPT, other)
    if old:
        engine._detok[b].matcher = naive_matcher(stops)
    times: list[tuple[float, float]] = []
    start = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == a and out.new_token_ids:
                times.append((time.perf_counter(), time.process_time()))
            if out.request_id == b and out.finished:
                assert out.finish_reason == "length", out.finish_reason
    wall = [t1[0] - t0[0] for t0, t1 in itertools.pairwise(times)]
    cpu = [t1[1] - t0[1] for t0, t1 in itertools.pairwise(times)]
    return statistics.median(wall), statistics.median(cpu), time.perf_counter() - start


def variant_figures(medians: list[float], cpu_medians: list[float], walls: list[float], plain_medians: list[float],
                    plain_cpu_medians: list[float]) -> dict[str, Any]:
    """One variant's gaps per repetition and over the plain run's in the same repetition."""
    ratios = [m / p for m, p in zip(medians, plain_medians, strict=True)]
    cpu_ratios = [m / p for m, p in zip(cpu_medians, plain_cpu_medians, strict=True)]
    return {
        "median_gap_ms": [round(m * 1e3, 2) for m in medians],
        "gap_ratio_vs_plain": [round(r, 3) for r in ratios],
        "median_ratio": round(statistics.median(ratios), 3),
        "median_cpu_gap_ms": [round(m * 1e3, 2) for m in cpu_medians],
        "cpu_gap_ratio_vs_plain": [round(r, 3) for r in cpu_ratios],
        "median_cpu_ratio": round(statistics.median(cpu_ratios), 3),
        "run_s": [round(w, 2) for w in walls],
    }


def engine_gaps(pairs: int, threads: int, output_len: int) -> dict[str, Any]:
    from engine.llm import LLM

    llm = LLM(threads=threads, stats_interval=0.0, kv_cache_memory_bytes=1 << 28, max_model_len=1024)
    variants = stop_variants()
    stream_gaps(llm.engine, [], False, output_len)  # warm
    names = list(variants)
    medians: dict[str, list[float]] = {name: [] for name in names}
    cpu_medians: dict[str, list[float]] = {name: [] for name in names}
    walls: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(pairs):
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            gap, cpu_gap, wall = stream_gaps(llm.engine, *variants[name], output_len)
            medians[name].append(gap)
            cpu_medians[name].append(cpu_gap)
            walls[name].append(wall)
    llm.close()
    return {"threads": threads, "output_len": output_len, "pairs": pairs, "variants": {
        name: variant_figures(medians[name], cpu_medians[name], walls[name], medians["plain"], cpu_medians["plain"])
        for name in names}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--no-engine", action="store_true", help="the matcher costs only")
    args = parser.parse_args(argv)
    for line in header_lines():
        print(line)
    print("\nmatcher per token (4 characters of text), old (O(stops x length)) vs Aho-Corasick:")
    for row in matcher_costs():
        print(f"  {row['stops']:>6,} x {row['chars']:>3} chars: old {row['old_us_per_token']:>10,.1f} us, "
              f"new {row['new_us_per_token']:>6.2f} us ({row['old_over_new']:,.0f}x); "
              f"automaton build {row['automaton_build_ms']:.1f} ms once per list")
        print("  " + json.dumps(row))
    if args.no_engine:
        return 0
    result = engine_gaps(args.pairs, args.threads, args.output_len)
    print(f"\nreal engine, {args.threads} threads: a greedy stream's median inter-token gap beside a second "
          f"request ({args.output_len} tokens each), {args.pairs} interleaved repetitions:")
    for name, row in result["variants"].items():
        print(f"  {name:<30} wall gap ms {row['median_gap_ms']}, ratio vs plain {row['gap_ratio_vs_plain']} "
              f"(median {row['median_ratio']})")
        print(f"  {'':<30} CPU gap ms {row['median_cpu_gap_ms']}, ratio vs plain {row['cpu_gap_ratio_vs_plain']} "
              f"(median {row['median_cpu_ratio']}); run s {row['run_s']}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
