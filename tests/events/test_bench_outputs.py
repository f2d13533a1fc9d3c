"""vllm bench's output shapes from kvscope's events (engine/events/exporters/bench_outputs.py), on the
bundled real recording (samples/smollm2_run.jsonl: 40 requests through the real engine)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np
import pytest

from engine.cli.main import main
from engine.events import RequestFinished, read_events
from engine.events.exporters.bench_outputs import serve_result, startup_lines, startup_result, startup_run

SAMPLE = Path(__file__).resolve().parents[2] / "samples" / "smollm2_run.jsonl"

# vLLM 0.32's vllm/benchmarks/serve.py: the setup keys main() writes, benchmark()'s result for a
# generation run, and process_one_metric's keys for ttft, tpot, itl at --metric-percentiles 99.
VLLM_SETUP_KEYS = {"date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts",
                   "request_rate", "burstiness", "max_concurrency"}
VLLM_RESULT_KEYS = {"duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
                    "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
                    "input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times", "queue_times",
                    "generated_texts", "errors", "max_output_tokens_per_s", "max_concurrent_requests", "rtfx"}
VLLM_METRIC_KEYS = {f"{stat}_{metric}_ms" for metric in ("ttft", "tpot", "itl")
                    for stat in ("mean", "median", "std", "p99")}
# vllm/benchmarks/startup.py's _metric_to_json for cold starts without an encoder
VLLM_STARTUP_KEYS = {f"{prefix}cold_{metric}{suffix}" for metric in ("startup", "compilation")
                     for prefix, suffix in (("avg_", "_time"), ("", "_times"), ("", "_percentiles"))}


def test_serve_result_has_vllm_bench_serve_keys_and_the_events_figures() -> None:
    recording = read_events(SAMPLE)
    result = serve_result(recording.events)
    assert set(result) == VLLM_SETUP_KEYS | VLLM_RESULT_KEYS | VLLM_METRIC_KEYS
    finished = [e for e in recording.events if isinstance(e, RequestFinished)]
    assert result["completed"] == len(finished) == 40 and result["failed"] == 0
    assert result["model_id"] == "smollm2-135m" and result["request_rate"] == "inf"
    assert result["total_output_tokens"] == sum(e.output_tokens for e in finished)
    assert len(result["ttfts"]) == len(result["itls"]) == len(result["latencies"]) == 40
    assert result["mean_ttft_ms"] == pytest.approx(statistics.fmean(e.ttft_s for e in finished) * 1000)
    itls = [x for e in finished for x in e.inter_token_latencies_s]
    assert result["p99_itl_ms"] == pytest.approx(float(np.percentile(itls, 99)) * 1000)
    assert result["duration"] > 0 and result["output_throughput"] == pytest.approx(
        result["total_output_tokens"] / result["duration"])
    assert 1 <= result["max_concurrent_requests"] <= 40
    json.dumps(result)  # the file vllm bench writes is plain JSON


def test_serve_result_refuses_a_metric_vllm_does_not_have() -> None:
    with pytest.raises(ValueError, match="ttft, tpot, itl, e2el"):
        serve_result([], percentile_metrics=("goodput",))


def test_startup_report_has_vllm_bench_startup_keys_and_the_phases(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    run = startup_run(read_events(SAMPLE).events, str(SAMPLE))
    assert run is not None and run.total_s == pytest.approx(sum(run.phases.values()))
    assert [name[0] for name in run.phases] == list("ABCDEFG")
    result = startup_result([run])
    assert set(result) - {"phases"} == (VLLM_STARTUP_KEYS if not run.warm else
                                        {k.replace("cold", "warm") for k in VLLM_STARTUP_KEYS})
    assert "STARTUP TIME BENCHMARK RESULTS" in startup_lines(result)
    out = tmp_path / "startup.json"
    assert main(["startup-report", str(SAMPLE), "--output-json", str(out)]) == 0
    assert json.loads(out.read_text())["phases"] == json.loads(json.dumps(result["phases"]))
    assert "Avg startup time:" in capsys.readouterr().out


def test_startup_report_names_a_recording_without_a_start(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recording = tmp_path / "no-start.jsonl"
    lines = [line for line in SAMPLE.read_text().splitlines() if '"startup.phase"' not in line]
    recording.write_text("\n".join(lines) + "\n")
    assert main(["startup-report", str(recording)]) != 0
    assert "no finished startup (phase G)" in capsys.readouterr().err


@pytest.mark.slow
def test_run_workload_writes_vllm_bench_serve_result_json(tmp_path: Path) -> None:
    """The real engine on the bundled model: the file has vLLM's keys and the run's requests."""
    out, events = tmp_path / "result.json", tmp_path / "run.jsonl"
    assert main(["run-workload", "--num-prompts", "3", "--prompt-len", "16", "--output-len", "4", "--max-model-len",
                 "256", "--max-num-seqs", "4", "--result-json", str(out), "--events", str(events)]) == 0
    result = json.loads(out.read_text())
    assert set(result) == VLLM_SETUP_KEYS | VLLM_RESULT_KEYS | VLLM_METRIC_KEYS
    assert result["completed"] == 3 and result["output_lens"] == [4, 4, 4] and result["model_id"] == "smollm2-135m"
    finished = [e for e in read_events(events).events if isinstance(e, RequestFinished)]
    assert sorted(result["ttfts"]) == sorted(e.ttft_s for e in finished)
