"""bench/bench_observability.py on a small real engine: every signal family subscribes, sees
the run, costs something measurable, and leaves the engine as it found it; the report's
verdict reads the all-on pairs against the targets."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bench import bench_observability as bench
from bench.run_all import observability_entry, observability_figures
from engine.llm import LLM

WORKLOAD = {"requests": 3, "prompt_len": 20, "output_len": 5}


@pytest.fixture(scope="module")
def ctx(tmp_path_factory: pytest.TempPathFactory) -> Iterator[bench.Context]:
    events: list[object] = []
    from engine.events import EventBus

    bus = EventBus()
    bus.subscribe(events.append)
    with LLM(load_format="dummy", bus=bus, max_model_len=256, kv_cache_memory_bytes=1 << 24, stats_interval=0.0,
             dtype="float32") as llm:
        bus.unsubscribe(events.append)
        context = bench.Context(llm, events, tmp_path_factory.mktemp("obs"))
        yield context
        context.close()


@pytest.mark.parametrize("family", [*bench.FAMILIES, "all"])
def test_each_family_sees_the_run_and_leaves_the_engine_as_it_was(ctx: bench.Context, family: str) -> None:
    engine = ctx.llm.engine
    subscribers = engine.bus._subscribers
    run = bench.run_once(ctx, family, **WORKLOAD)
    assert run.decode_tokens == 3 * 4 and len(run.itl_cpu_s) == len(run.itl_wall_s) == 3 * 4
    assert run.in_sinks_s > 0  # the family's sinks were called on the engine thread
    assert engine.bus._subscribers == subscribers and not engine.bus._deferred_subscribers  # unsubscribed again
    assert not engine.scheduler.kv.pool.record_contents  # the KV events' recording is off again
    if family in ("jsonl", "perfetto"):
        assert any(Path(ctx.folder).glob(f"run{ctx.runs}*")), "the file sink wrote nothing"


def test_the_verdict_reads_the_all_on_pairs() -> None:
    def run(tok_per_s: float, itl_s: float, sinks_s: float = 0.0) -> bench.Run:
        # 10 decode steps of 0.2 CPU seconds each at 100 tok/s
        return bench.Run(decode_tokens=100, decode_wall_s=100 / tok_per_s, decode_cpu_s=200 / tok_per_s,
                         itl_wall_s=[itl_s] * 10, itl_cpu_s=[2 * itl_s] * 10, in_sinks_s=sinks_s, steps=10,
                         decode_steps=10)

    fine = bench.Pairs("all", off=[run(100, 0.010)] * 3, on=[run(99.5, 0.0101, sinks_s=0.01)] * 3)
    slow = bench.Pairs("all", off=[run(100, 0.010)] * 3, on=[run(98, 0.0103, sinks_s=0.03)] * 3)
    assert [row.endswith("| pass |") for row in bench.verdict([fine])[2:]] == [True, True, True]  # 0.5 % a step
    assert [row.endswith("| MISS |") for row in bench.verdict([slow])[2:]] == [True, True, True]  # 1.5 % a step
    assert "n/a" in bench.verdict([bench.Pairs("jsonl")])[2]
    # pairs whose noise spans the target decide nothing, whichever side their median falls
    noisy = bench.Pairs("all", off=[run(100, 0.010)] * 5,
                        on=[run(r, 0.010) for r in (90.0, 99.5, 100.0, 104.0, 110.0)])
    assert "unresolved" in bench.verdict([noisy])[2] and "the median passes" in bench.verdict([noisy])[2]


REPORT = """## Machine

- CPU: AMD EPYC (x86_64); torch capability AVX512; ISA avx512_bf16; flags: avx512f
- load average at start: 0.40 / 0.60 / 0.70 (1 / 5 / 15 min)

## The price of observability

<!-- isa: avx512_bf16 -->

SmolLM2-135M float32, 2 threads.

| family | decode tok/s off / on (CPU) |
|---|---:|
| all | 100.0 / 99.5 |

## Verdict

| target | measured | verdict |
|---|---|---|
| all signals on: decode tok/s >= 0.99x all off | 0.9950 | pass |
"""


def test_make_bench_keeps_one_observability_table_per_cpu_kind() -> None:
    entry = observability_entry(REPORT, "2027-01-02")
    assert entry is not None and entry[0] == "avx512_bf16"
    other = ("### AVX2: AMD EPYC Zen 3\n<!-- isa: avx2 -->\n\nearlier\n")
    previous = observability_figures("", ("avx2", other))
    section = observability_figures(previous, entry)
    assert "earlier" in section and "| all | 100.0 / 99.5 |" in section and "2027-01-02" in section
    assert section.index("AVX2") < section.index("AVX-512 BF16")
