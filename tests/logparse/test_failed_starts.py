"""Failed starts (issue 50): every way a vLLM start fails, read from public logs
(tests/data/vllm-logs-public, each with its thread), is a failure naming its cause and the
last phase reached: in ``logparse explain`` ("startup failed in phase X: ...") and as a
critical doctor finding (exit 2)."""

from __future__ import annotations

import json

import pytest

from doctor.cli import examine
from doctor.rules.finding import exit_status
from engine.cli.main import main as engine_main
from logparse.cli import main
from logparse.explain import explain
from tests.paths import DATA

PUBLIC = DATA / "vllm-logs-public"

# file -> (cause, phase, place read from the traceback's frames)
FAILED_STARTS = {
    "v0.8.x-engine-core-failed-kv-init.log": ("engine_core", "F", None),  # frames stop in _initialize_kv_caches
    "v0.8.x-tpu-engine-core-hit-exception.log": ("engine_core", "F", None),  # TPU precompile was the last phase
    "v0.8.x-engine-core-hit-exception-after-compile.log": ("engine_core", "F", None),
    "v0.12.0-ray-tp4-pp2-graph-capture-crash.log": ("engine_core", "F", None),  # 'Process EngineCore_DP0:'
    "vunknown-tpu-inference-engine-core-failed.log": ("engine_core", "F", None),
    "v0.12-engine-core-dp0-failed-executor.log": ("engine_core", "?", None),  # no startup line before it
    "v0.9.x-worker-proc-failed-to-start.log": ("worker_died", "C", "loading"),
    "v0.8.5-worker-exception-profile-run.log": ("worker_died", "D", "profiling"),
    "v0.5.3-nccl-init-device.log": ("nccl", "A", "device_init"),
    "v0.2.7-kv-below-max-model-len.log": ("kv_below_max_len", "E", None),
    # ray.init's own lines, then raylet: a node marked dead (its ranks with it); each line its own record
    "v0.4.x-ray-cluster-raylet-node-marked-dead.log": ("ray", "?", None),
}


@pytest.mark.parametrize("name", sorted(FAILED_STARTS))
def test_failed_start_names_cause_and_phase(name: str) -> None:
    cause, phase, place = FAILED_STARTS[name]
    exp = explain(PUBLIC / name)
    failure = exp.startup
    assert failure is not None and not failure.runtime
    assert (failure.cause, failure.phase, failure.place) == (cause, phase, place)
    assert failure.sentence().startswith(f"startup failed in phase {phase} (")
    assert any(c.kind == "failure" and c.ok is False for c in exp.checks)


@pytest.mark.parametrize("name", sorted(FAILED_STARTS))
def test_failed_start_is_a_critical_doctor_finding(name: str) -> None:
    kind, findings, _ = examine(str(PUBLIC / name))
    assert kind == "vllm-log" and exit_status(findings) == 2
    critical = [f for f in findings if f.severity == "critical"]
    assert critical and critical[0].numbers["phase"] == FAILED_STARTS[name][1]
    assert critical[0].numbers["failed_start"] is True


def test_kv_below_max_model_len_in_the_logs_own_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    # vllm#2418: 229 blocks x 16 = 3,664 tokens < max_seq_len 4,096; the paste lost vLLM's ValueError
    status = main(["explain", str(PUBLIC / "v0.2.7-kv-below-max-model-len.log"), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert status == 1
    (check,) = [c for c in out["checks"] if c["id"] == "kv_below_max_model_len"]
    assert check["detail"].startswith("229 blocks x 16 = 3,664 tokens < max-model-len 4,096")
    assert (check["expected"], check["actual"], check["line"]) == (4096, 3664, 2)
    fixes = {f["flag"]: f for f in check["fixes"]}
    assert (fixes["--max-model-len"]["current"], fixes["--max-model-len"]["proposed"]) == (4096, 3664)
    assert "1.118x" in fixes["--gpu-memory-utilization"]["why"]
    assert out["startup"]["phase"] == "E" and out["startup"]["cause"] == "kv_below_max_len"


def test_nccl_failure_placed_by_the_method_and_frames(capsys: pytest.CaptureFixture[str]) -> None:
    status = engine_main(["doctor", str(PUBLIC / "v0.5.3-nccl-init-device.log"), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert status == 2 and report["status"] == "critical"
    (finding,) = report["findings"]
    assert finding["rule"] == "startup_failed" and finding["title"] == "startup failed in phase A (init / config)"
    assert "NCCL error: unhandled cuda error" in finding["evidence"][0]
    assert finding["cause"] == "NCCL (GPU collective) error during init / config"
    assert [f["flag"] for f in finding["fixes"]][:2] == ["NCCL_DEBUG=INFO", "NCCL_P2P_DISABLE=1"]


def test_explain_says_startup_failed_in_phase(capsys: pytest.CaptureFixture[str]) -> None:
    main(["summary", str(PUBLIC / "v0.9.x-worker-proc-failed-to-start.log")])
    out = capsys.readouterr().out
    assert "startup failed in phase C (weight loading): a worker process died: WorkerProc failed to start." in out
    main(["explain", str(PUBLIC / "v0.9.x-worker-proc-failed-to-start.log"), "--markdown"])
    assert "**startup failed in phase C (weight loading)" in capsys.readouterr().out


def test_memory_failures_name_their_phase_too() -> None:
    # logparse's own memory checks keep their fixes; the doctor adds the phase to their evidence
    for name, phase in (("v0.9.2dev-llama-tpu-v5e-8-kvmem-fail.log", "E"), ("v0.9.1-unknown-48gb-gpu-tp1-freemem-fail.log", "B"),
                        ("v0.3.x-qwen-7b-rtx3090-tp1-docker-nocacheblocks.log", "E")):
        _, findings, _ = examine(str(DATA / "vllm-logs" / name))
        (finding,) = [f for f in findings if f.severity == "critical"]
        assert finding.numbers["phase"] == phase, name
        assert any(e.startswith(f"startup failed in phase {phase} (") for e in finding.evidence), name


def test_healthy_starts_are_not_failed_starts() -> None:
    for name in ("v0.10.2-qwen3-235b-a22b-fp8-8xl40s-tp8-ep-slice.log", "v0.32.0-smollm2-135m-cpu-zen3-tp1-eager-complete.log",
                 "v0.11.0rc2-gemma-3-27b-it-rocm-tp1-hybrid-kv-padding.log", "v0.6.4-llama3.1-8b-rtx3090-tp1-20k-ok.log"):
        assert explain(DATA / "vllm-logs" / name).startup is None, name


# Public pastes of an engine that died after its start, where the paste keeps no line a ready server
# prints: the traceback's frames say it (the busy loop, the output handler, shutdown) -> engine_died, phase R
RUNTIME_DEATHS = {
    "v0.2x-engine-core-dead-runtime-traceback.log": ("exception", "serving"),  # EngineDeadError, run_busy_loop
    "v0.2x-runtime-oom-async-llm-output-handler.log": ("oom", "serving"),  # AsyncLLM output_handler failed
    "v0.10.x-xpu-arc-a770-engine-core-busy-loop-traceback-bare.log": ("cut_traceback", "serving"),
    "v0.8.x-vllmworker-shutdown-destroy-process-group.log": ("cut_traceback", "shutdown"),
}


@pytest.mark.parametrize("name", sorted(RUNTIME_DEATHS))
def test_a_traceback_in_the_serving_loop_is_a_runtime_death_not_a_failed_start(name: str) -> None:
    cause, place = RUNTIME_DEATHS[name]
    exp = explain(PUBLIC / name)
    failure = exp.startup
    assert failure is not None and failure.runtime and failure.phase == "R"
    assert (failure.cause, failure.place) == (cause, place)
    assert failure.headline().startswith("the engine died at runtime")
    assert not any(c.id == "startup_failed" for c in exp.checks)


def test_a_cut_traceback_is_placed_by_its_frames_and_a_plugins_frames_count() -> None:
    # vllm-ascend's model_runner_v1.initialize_kv_cache_tensors: KV allocation (E), although the paste
    # ends before the exception line and shows no startup line
    failure = explain(PUBLIC / "v0.11.x-ascend-engine-core-dp0-initialize-kv-cache-assert.log").startup
    assert failure is not None and not failure.runtime
    assert (failure.cause, failure.place, failure.phase) == ("cut_traceback", "kv_allocation", "E")
