"""`engine plan` end to end through the console script, as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.events import StartupPhase, read_events

ENGINE = [sys.executable, "-m", "engine.cli"]
# The background's worked example. Its H100 reads 79.6 GiB; the h100-80gb preset is 79.22 GiB,
# what CUDA reports and vLLM logs (total_gpu_memory (79.22GiB)), so the example names its total.
WORKED = ["plan", "--model", "llama-3.1-8b", "--gpu-memory", "79.6", "--gpu-memory-utilization", "0.92",
          "--max-model-len", "32768", "--activation-peak", "4.0", "--non-torch", "0.3"]


def run_engine(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*ENGINE, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.slow  # 3-6 s each on a 2-core machine: in make test-slow, to keep the default suite under 5 min
def test_worked_example_prints_vllm_lines() -> None:
    out = run_engine(*WORKED, "--weights", "14.957")
    assert out.returncode == 0, out.stderr
    assert "GPU KV cache size: 442,160 tokens" in out.stdout
    assert "Maximum concurrency for 32,768 tokens per request: 13.49x" in out.stdout
    assert "27,635 blocks" in out.stdout


def test_json_keys_and_exact_parameter_count() -> None:
    out = run_engine(*WORKED, "--json")
    data = json.loads(out.stdout)
    for key in ("requested_gib", "weights_gib", "peak_activation_gib", "non_torch_gib", "kv_cache_gib",
                "num_blocks", "kv_cache_tokens", "max_concurrency", "bytes_per_token"):
        assert key in data
    assert data["num_blocks"] == 27_634 and data["kv_cache_tokens"] == 442_144
    assert data["bytes_per_token"] == 131_072


def test_bundled_model_plan_json() -> None:
    data = json.loads(run_engine("plan", "--gpu", "l4", "--max-model-len", "8192", "--json").stdout)
    assert data["bytes_per_token"] == 23_040 and data["model"] == "smollm2-135m"
    assert set(data["estimated"]) == {"activation_peak", "non_torch"}


@pytest.mark.slow  # 3-6 s each on a 2-core machine: in make test-slow, to keep the default suite under 5 min
def test_plan_events_file(tmp_path: Path) -> None:
    path = tmp_path / "plan.jsonl"
    assert run_engine(*WORKED, "--weights", "14.957", "--events", str(path)).returncode == 0
    recording = read_events(path)
    phases = [e for e in recording.events if isinstance(e, StartupPhase)]
    assert [p.phase for p in phases] == list("ABCDEFG")
    assert all(p.planned for p in phases)
    e = next(p for p in phases if p.phase == "E")
    assert e.data["num_blocks"] == 27_635 and e.data["kv_cache_tokens"] == 442_160
    assert recording.events[0].type == "engine.config" and recording.events[0].model["bytes_per_kv_token"] == 131_072


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--gpu", "h1000"], "--gpu"),
        (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
        (["--weights", "12 GB"], "--weights"),
        (["--activation-peak", "-3"], "--activation-peak"),
        (["--max-model-len", "-5"], "--max-model-len"),
        (["--model", "/nonexistent/model"], "unknown model"),
        (["--model", "llama-3.1-8b", "--gpu-memory", "16"], "no memory left for the KV cache"),
        (["--model", "llama-3.1-8b", "--gpu", "h100-80gb", "--kv-cache-memory-bytes", "1Gi"], "max seq len"),
    ],
)
def test_bad_input_is_one_line_exit_2(args: list[str], needle: str) -> None:
    out = run_engine("plan", *args)
    assert out.returncode == 2
    assert needle in out.stderr
    assert "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_file_that_is_not_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "weights.gguf"
    bad.write_bytes(b"\x00" * 100)
    out = run_engine("plan", "--model", str(bad))
    assert out.returncode == 2 and "weights.gguf" in out.stderr and "Traceback" not in out.stderr


def test_folder_without_config(tmp_path: Path) -> None:
    out = run_engine("plan", "--model", str(tmp_path))
    assert out.returncode == 2 and "config.json" in out.stderr


def test_h100_preset_is_the_total_vllm_logs_on_an_h100() -> None:
    # tests/data/vllm-logs: "total_gpu_memory (79.22GiB)" on an H100 80 GB
    data = json.loads(run_engine("plan", "--model", "llama-3.1-8b", "--gpu", "h100", "--json").stdout)
    assert data["total_gib"] == pytest.approx(79.22)


@pytest.mark.slow  # 3-6 s each on a 2-core machine: in make test-slow, to keep the default suite under 5 min
def test_tensor_parallel_figures_are_labelled_per_gpu_with_units() -> None:
    out = run_engine("plan", "--model", "llama-3.1-70b", "--gpu", "h100", "-tp", "4").stdout
    assert "Memory ledger (per GPU: each of the 4 ranks holds 1/4" in out
    assert "2 KV heads" in out and "(the engine's: every rank holds its heads of these tokens)" in out
    legend = next(line for line in out.splitlines() if "■ weights" in line)
    assert legend.count(" GiB") == 5 and legend.rstrip().endswith("(per GPU)")
    single = run_engine("plan", "--model", "llama-3.1-8b", "--gpu", "h100").stdout
    assert "per GPU" not in single and "■ weights 14.96 GiB" in single


@pytest.mark.slow  # 3-6 s each on a 2-core machine: in make test-slow, to keep the default suite under 5 min
def test_gemma3_27b_plan_shows_the_hybrid_layout_beside_full_attention() -> None:
    # A 20 GiB pool (by hand, tests/budget/test_hybrid_budget.py): hybrid 20 x 2^30 / 131,072 // 10 =
    # 16,384 blocks, 16,384 // 7 x 16 = 37,440 tokens, 16,384 / 11,654 = 1.41x; full attention
    # 2,642 blocks of 16 x 507,904 B, 42,272 tokens, 42,272 / 131,072 = 0.32x.
    args = ("plan", "--model", "gemma-3-27b", "--gpu", "h100-80gb", "--kv-cache-memory-bytes", "20GiB")
    out = run_engine(*args)
    assert out.returncode == 0, out.stderr
    assert "GPU KV cache size: 37,440 tokens" in out.stdout
    assert "Maximum concurrency for 131,072 tokens per request: 1.41x" in out.stdout
    assert "group 6: full attention   10 layers" in out.stdout and "+ 1 padding" in out.stdout
    assert "versus full attention everywhere" in out.stdout and "2,642 blocks, 42,272 tokens, 0.32x" in out.stdout
    data = json.loads(run_engine(*args, "--json").stdout)
    assert data["kv_cache_layout"] == "hybrid" and data["num_blocks"] == 16_384 and data["kv_cache_tokens"] == 37_440
    assert data["blocks_per_request"] == 11_654 and len(data["kv_cache_groups"]) == 7
    full = data["full_attention_everywhere"]
    assert (full["num_blocks"], full["kv_cache_tokens"], full["fits_one_request"]) == (2_642, 42_272, False)
    assert full["concurrency_gain"] == pytest.approx((16_384 / 11_654) / (42_272 / 131_072))
