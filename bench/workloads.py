"""What bench/bench_engine.py runs on every engine, and what one run measured.

Token-id prompts (random ids from a seeded generator, greedy, every engine emits
the requested lengths), one fresh set per repetition so no engine's prefix cache
carries over from the previous repetition:

* ``batch-16`` / ``batch-64``: offline batches (prompts 64-512 tokens, outputs
  64-256); measured as output tok/s over the batch's wall time.
* ``single``: one request, 64-token prompt, 128 output tokens; measured as decode
  tok/s, the tokens after the first over the time after the first.
* ``prefill-500``: one 500-token prompt, one output token; measured as prompt
  tok/s over the time to that first token.

``--scale`` multiplies every length (at least 4 tokens) for a quick run.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

# How a workload's result is turned into its one number, and that number's unit.
MEASURES = {"output": "output tok/s", "decode": "decode tok/s", "prefill": "prefill tok/s"}
WORKLOAD_NAMES = ("batch-16", "batch-64", "single", "prefill-500")


@dataclass(slots=True)
class Workload:
    name: str
    prompts: list[list[int]]
    outputs: list[int]
    measure: str = "output"  # a key of MEASURES


@dataclass(slots=True)
class RunResult:
    output_tokens: int
    wall_s: float
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)

    @property
    def tok_per_s(self) -> float:
        return self.output_tokens / self.wall_s


def metric(workload: Workload, result: RunResult) -> float:
    """The workload's one number (see MEASURES) for this run."""
    if workload.measure == "decode":
        first = max(result.ttft_s)
        return (result.output_tokens - len(result.ttft_s)) / (result.wall_s - first)
    if workload.measure == "prefill":
        return sum(len(p) for p in workload.prompts) / max(result.ttft_s)
    return result.tok_per_s


def make_workloads(seed: int, scale: float) -> list[Workload]:
    rng = random.Random(seed)

    def draw(name: str, n: int, prompt_range: tuple[int, int], out_range: tuple[int, int],
             measure: str = "output") -> Workload:
        lo_p, hi_p = (max(4, int(v * scale)) for v in prompt_range)
        lo_o, hi_o = (max(4, int(v * scale)) for v in out_range)
        prompts = [[rng.randrange(1000, 40000) for _ in range(rng.randint(lo_p, hi_p))] for _ in range(n)]
        return Workload(name, prompts, [rng.randint(lo_o, hi_o) for _ in range(n)], measure)

    prefill = draw("prefill-500", 1, (500, 500), (1, 1), "prefill")
    prefill.outputs = [1]
    return [
        draw("batch-16", 16, (64, 512), (64, 256)),
        draw("batch-64", 64, (64, 512), (64, 256)),
        draw("single", 1, (64, 64), (128, 128), "decode"),
        prefill,
    ]


WARMUP = Workload("warmup", [list(range(1000, 1032))] * 2, [8, 8])


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]
