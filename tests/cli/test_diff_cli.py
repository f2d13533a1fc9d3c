"""``engine diff A B``: a run against itself, against a slowed run (the simulator's
cost model at half the efficiency; the real engine with a sleep in its forward, slow),
runs that are not comparable, and bad input. Exit status 0 / 1 / 2."""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import time
from pathlib import Path

import pytest

from engine.cli.main import main
from tests.paths import ROOT

WORKLOAD = "--num-prompts 24 --random-input-len 200:600 --random-output-len 30:80"


def engine(*argv: str | Path) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as exc:  # argparse's own errors
            code = int(exc.code or 0)
    return code, out.getvalue(), err.getvalue()


def simulate(path: Path, extra: str = "") -> Path:
    code, _, err = engine("simulate", *WORKLOAD.split(), *extra.split(), "--events", path)
    assert code == 0, err
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Simulated recordings of one workload: the baseline, the same on a cost model at half
    the efficiency (every step twice as long), and one with other flags and more requests."""
    folder = tmp_path_factory.mktemp("diff")
    return {"base": simulate(folder / "base.jsonl"),
            "slow": simulate(folder / "slow.jsonl", "--efficiency 0.3"),
            "other": simulate(folder / "other.jsonl", "--max-num-seqs 8 --num-prompts 30")}


def test_a_recording_against_itself_is_no_regression(runs: dict[str, Path]) -> None:
    code, out, _ = engine("diff", runs["base"], runs["base"])
    assert code == 0, out
    assert "comparable: same engine, model, flags and workload" in out
    assert "verdict: no regression beyond 10 %" in out


def test_a_real_recording_against_itself_is_no_regression() -> None:
    code, out, _ = engine("diff", ROOT / "samples" / "smollm2_run.jsonl", ROOT / "samples" / "smollm2_run.jsonl")
    assert code == 0 and "(real engine, smollm2-135m, 40 requests, 295 steps" in out


def test_a_slower_cost_model_is_a_regression_naming_the_shapes(runs: dict[str, Path]) -> None:
    code, out, _ = engine("diff", runs["base"], runs["slow"])
    assert code == 1, out
    assert "environment simulation.efficiency: 0.6 -> 0.3" in out  # the machine may differ; it is said
    verdict = out.splitlines()[-1]
    assert verdict.startswith("verdict: REGRESSION") and "prefill 0 tokens, decode 16-31 seqs 2.00x" in verdict
    code, out, _ = engine("diff", runs["slow"], runs["base"])  # the other way round: faster, exit 0
    assert code == 0 and "faster" in out.splitlines()[-1]


def test_json_for_ci(runs: dict[str, Path]) -> None:
    code, out, _ = engine("diff", runs["base"], runs["slow"], "--json", "--threshold", "150%")
    report = json.loads(out)
    assert code == 0 and report["exit_status"] == 0 and report["verdict"] == "no regression"  # 2x < 2.5x
    code, out, _ = engine("diff", runs["base"], runs["slow"], "--json")
    report = json.loads(out)
    assert code == 1 and report["verdict"] == "regression" and report["threshold"] == 0.1
    slower = [s for s in report["step_shapes"] if s["verdict"] == "regression"]
    assert slower and all(1.9 < s["ratio"] < 2.1 and s["interval"][0] > 1 for s in slower)
    assert {"prefill_tokens": "0", "decode_seqs": "16-31"}.items() <= slower[-1].items()
    assert report["kv_pool"]["blocks"][0] == report["kv_pool"]["blocks"][1] > 0
    assert set(report["latency_percentiles_s"]) == {"ttft", "itl", "e2e"}


def test_runs_that_are_not_comparable_are_named_and_forced(runs: dict[str, Path]) -> None:
    code, _, err = engine("diff", runs["base"], runs["other"])
    assert code == 2
    assert "not comparable" in err and "flags max_num_seqs: 256 vs 8" in err and "workload requests: 24 vs 30" in err
    assert "--force" in err
    code, out, _ = engine("diff", runs["base"], runs["other"], "--force")
    assert code in (0, 1) and "NOT COMPARABLE, compared anyway (--force)" in out
    code, out, _ = engine("diff", runs["base"], runs["other"], "--json")
    assert code == 2 and json.loads(out)["comparable"] is False


def test_bad_input_says_what_to_change(runs: dict[str, Path], tmp_path: Path) -> None:
    code, _, err = engine("diff", tmp_path / "missing.jsonl", runs["base"])
    assert code == 2 and "missing.jsonl: no such file" in err and "--events" in err
    code, _, err = engine("diff", ROOT / "README.md", runs["base"])
    assert code == 2 and "not a kvscope event file" in err
    cut = tmp_path / "cut.jsonl"
    cut.write_bytes(runs["base"].read_bytes()[:-30])
    code, _, err = engine("diff", runs["base"], cut)
    assert code == 2 and "last line is cut" in err and "--force" in err
    code, out, _ = engine("diff", runs["base"], cut, "--force")
    assert code == 0 and "ends in a cut line" in out
    code, _, err = engine("diff", runs["base"], runs["base"], "--threshold", "ten")
    assert code == 2 and "give a percentage" in err
    gz = tmp_path / "base.jsonl.gz"
    gz.write_bytes(gzip.compress(runs["base"].read_bytes()))
    assert engine("diff", runs["base"], gz)[0] == 0


@pytest.mark.slow  # two starts of the real engine and their runs: 1-3 minutes on a loaded 2-core machine
def test_a_real_engine_with_a_slowed_forward_is_a_regression(tmp_path: Path) -> None:
    """The second run's forward sleeps twice its own duration after each pass (3x the
    time), which holds however loaded the machine is while each run goes."""
    from engine.core.sampling_params import SamplingParams
    from engine.llm import LLM

    prompts = [f"Write a sentence about the number {i}." for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    # An explicit token budget: on CPU defaults the first start on a machine (no stored kernel plan)
    # runs 512 and the next the plan's derived budgets, and runs under other flags are not comparable.
    flags = dict(max_model_len=512, kv_cache_memory_bytes=32 * 2**20, max_num_seqs=8, stats_interval=0.0,
                 dtype="float32", threads=1, max_num_batched_tokens=512)

    def record(path: Path, slowed: bool) -> Path:
        with LLM("smollm2-135m", events=str(path), **flags) as llm:
            model = llm.engine.runner.model
            forward = model.forward
            if slowed:
                def slow_forward(*args, **kwargs):  # type: ignore[no-untyped-def]
                    start = time.perf_counter()
                    out = forward(*args, **kwargs)
                    time.sleep(2 * (time.perf_counter() - start))
                    return out
                model.forward = slow_forward
            llm.generate(prompts, params)
        return path

    base = record(tmp_path / "base.jsonl", slowed=False)
    slow = record(tmp_path / "slow.jsonl", slowed=True)
    code, out, _ = engine("diff", base, base)
    assert code == 0, out
    code, out, _ = engine("diff", base, slow)
    assert code == 1, out
    assert "comparable: same engine, model, flags and workload" in out
    assert "prefill 0 tokens, decode 8-15 seqs" in out.splitlines()[-1], out
