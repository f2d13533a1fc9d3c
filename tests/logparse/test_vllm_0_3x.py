"""logparse on vLLM 0.30–0.33 (issue 21): the CPU backend's own lines, startup-plan and
encoder-cache lines, noise shown by its source, failures placed by their traceback's frames
(an OOM at CUDA-graph capture with the fix in numbers), and the timeline under vLLM's
startup span names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.events.phase_names import PHASE_SPANS
from logparse.cli import main
from logparse.explain import explain
from logparse.options import Options
from logparse.parser import iter_records
from tests.paths import DATA

CPU_EAGER = DATA / "vllm-logs" / "v0.32.0-smollm2-135m-cpu-zen3-tp1-eager-complete.log"
CPU_COMPILE = DATA / "vllm-logs" / "v0.32.0-smollm2-135m-cpu-zen3-tp1-compile-cold.log"


def _by_pattern(path: Path) -> dict[str | None, list]:
    out: dict[str | None, list] = {}
    for record in iter_records(path):
        key = record.pattern_id or (f"vllm:{record.template.files[0]}" if record.template else record.noise)
        out.setdefault(key, []).append(record)
    return out


def test_cpu_backend_start_is_read_line_by_line() -> None:
    found = _by_pattern(CPU_EAGER)
    kv = found["cpu_kv_explicit"][0]
    assert kv.fields == {"kv_cache_gib": 4.0, "node_total_gib": 18.59, "numa_node": 0}
    assert [r.fields for r in found["omp_binding_detail"]] == [
        {"omp_threads_bind": "'0-1',"}, {"local_world_size": 1}, {"local_rank": 0, "core_ids": "[0, 1]"},
        {"reserved_cpus": "[]"}]
    assert [r.fields["library"] for r in found["cpu_ld_preload"]] == ["libtcmalloc", "libiomp"]
    assert found["initializing_model_took"][0].fields["init_model_s"] == 0.212092
    assert found["kv_cache_size_tokens"][0].fields["kv_cache_tokens"] == 93_184
    assert len(found["shutdown_step"]) == 19
    # what vLLM did not write is shown as its source, never as unrecognised
    assert {"python-warning", "numa", "nanobind", "blank"} <= set(found)
    assert "vllm:vllm/triton_utils/importing.py" in found  # vLLM's own Triton warning, from its source
    assert None not in found
    compiled = _by_pattern(CPU_COMPILE)
    assert compiled["profile_warmup_took"][0].fields["profile_warmup_s"] == 31.25  # "[backbone] Initial ..."
    assert "aot_compile_saved" in compiled and len(compiled["shm_broadcast_wait"]) == 9
    assert compiled["cpu_torch_threads_reduced"][0].fields == {"torch_threads_before": 2, "torch_threads": 1}


def test_cpu_auto_kv_startup_plan_and_encoder_budget_lines(tmp_path: Path) -> None:
    # the formats of vLLM 0.33's cpu_worker.py, startup_plan.py and the encoder-cache budget line
    log = tmp_path / "lines.log"
    log.write_text(
        "(Worker pid=5) INFO 12-01 10:00:00 [cpu_worker.py:282] Auto set (12.5/62.8) GiB for KV cache on node 0, "
        "with 56.52 GiB requested memory for the worker. 44.02 GiB memory was consumed by non-kv usages.\n"
        "(Worker_TP0 pid=9) INFO 12-01 10:00:01 [startup_plan.py:152] Applying persisted startup plan (fingerprint "
        "3f2a9c1d0b7e4a65): kv_cache_memory_bytes=64424509440 (60.00 GiB), recorded free-memory baseline 78.20 GiB, "
        "current 78.31 GiB. Memory profiling will be skipped.\n"
        "(Worker_TP0 pid=9) INFO 12-01 10:00:02 [startup_plan.py:112] Startup plan not applied: current free memory "
        "(70.10 GiB) is below the recorded baseline (78.20 GiB); falling back to full memory profiling.\n"
        "(Worker_TP0 pid=9) INFO 12-01 10:00:03 [startup_plan.py:183] Saved startup plan to "
        "/root/.cache/vllm/startup_plan/startup_plan_3f2a9c1d0b7e4a65.json\n"
        "(EngineCore pid=8) INFO 12-01 10:00:04 [gpu_model_runner.py:4560] Encoder cache will be initialized with a "
        "budget of 16384 tokens, and profiled with 4 image items of the maximum feature size.\n")
    found = _by_pattern(log)
    assert found["cpu_kv_auto"][0].fields == {"kv_cache_gib": 12.5, "node_total_gib": 62.8, "numa_node": 0,
                                              "requested_gib": 56.52, "non_kv_gib": 44.02}
    plan = found["startup_plan_applied"][0].fields
    assert (plan["kv_cache_memory_bytes"], plan["kv_cache_gib"], plan["free_gib"]) == (64424509440, 60.0, 78.31)
    assert found["startup_plan_not_applied"][0].fields == {"free_gib": 70.1, "plan_baseline_gib": 78.2}
    assert found["startup_plan_saved"][0].fields["path"].endswith("startup_plan_3f2a9c1d0b7e4a65.json")
    assert found["encoder_cache_budget"][0].fields == {"encoder_cache_tokens": 16384, "encoder_profile_items": 4,
                                                       "modality": "image"}
    # the CPU worker's own split holds: requested - non-KV = the KV pool it printed
    checks = {c.id: c for c in explain(log).checks}
    assert checks["kv_remainder"].ok is True


GRAPH_OOM = """\
(APIServer pid=1) INFO 12-01 10:00:00 [api_utils.py:286] non-default args: {'model': 'meta-llama/Llama-3.1-8B-Instruct', \
'gpu_memory_utilization': 0.92, 'max_model_len': 32768}
(EngineCore pid=7) INFO 12-01 10:00:20 [gpu_model_runner.py:5201] Estimated CUDA graph memory: 2.50 GiB total
(EngineCore pid=7) INFO 12-01 10:00:21 [gpu_worker.py:456] Available KV cache memory: 51.66 GiB
(EngineCore pid=7) INFO 12-01 10:00:21 [kv_cache_utils.py:2327] GPU KV cache size: 423,200 tokens, Maximum \
concurrency for 32,768 tokens per request: 12.92x
(EngineCore pid=7) ERROR 12-01 10:00:40 [core.py:1111] EngineCore failed to start.
(EngineCore pid=7) ERROR 12-01 10:00:40 [core.py:1111] Traceback (most recent call last):
(EngineCore pid=7) ERROR 12-01 10:00:40 [core.py:1111]   File "/usr/lib/python3.12/site-packages/vllm/v1/worker/\
gpu_worker.py", line 588, in compile_or_warm_up_model
(EngineCore pid=7) ERROR 12-01 10:00:40 [core.py:1111]     cuda_graph_memory_bytes = self.model_runner.capture_model()
(EngineCore pid=7) ERROR 12-01 10:00:40 [core.py:1111]                               ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
(EngineCore pid=7) ERROR 12-01 10:00:40 [core.py:1111]   File "/usr/lib/python3.12/site-packages/vllm/v1/worker/\
gpu_model_runner.py", line 5684, in capture_model
(EngineCore pid=7) ERROR 12-01 10:00:40 [core.py:1111]     self._capture_cudagraphs(
(EngineCore pid=7) ERROR 12-01 10:00:40 [core.py:1111]   File "/usr/lib/python3.12/site-packages/torch/cuda/graphs.py", \
line 186, in __exit__
(EngineCore pid=7) ERROR 12-01 10:00:40 [core.py:1111]     self.cuda_graph.capture_end()
(EngineCore pid=7) ERROR 12-01 10:00:40 [core.py:1111] torch.AcceleratorError: CUDA error: out of memory
(EngineCore pid=7) ERROR 12-01 10:00:40 [core.py:1111] CUDA kernel errors might be asynchronously reported at some \
other API call, so the stacktrace below might be incorrect.
"""


def test_oom_at_graph_capture_is_placed_by_its_frames_with_the_fix_in_numbers(tmp_path: Path) -> None:
    log = tmp_path / "graph-oom.log"
    log.write_text(GRAPH_OOM)
    records = list(iter_records(log))
    assert [r.noise for r in records[5:13]] == ["traceback"] * 8  # the frames, their code and carets
    assert records[13].pattern_id == "cuda_error_oom" and records[14].noise == "torch"
    checks = {c.id: c for c in explain(log, Options(gpu="h100")).checks}
    assert "oom" not in checks
    oom = checks["oom_graph_capture"]
    assert oom.ok is False and oom.kind == "failure" and oom.line == 14
    # 0.92 - 2.50 / 79.22 = 0.888 -> 0.88: 0.04 x 79.22 = 3.17 GiB outside the budget for the 2.50 GiB pool,
    # and kvscope's plan of the model (engine/budget) at 0.88 says what is left of the KV pool
    assert oom.fix[0].text().startswith("--gpu-memory-utilization 0.92 -> 0.88: leaves 3.17 GiB of 79.22 GiB outside "
                                 "the budget for the graph pool (2.50 GiB: the CUDA-graph estimate the log printed)")
    assert "kvscope's plan of llama-3.1-8b at 0.88: KV pool" in oom.fix[0].why
    assert oom.fix[1].text().startswith("--enforce-eager: captures no graphs and frees the whole 2.50 GiB pool")
    assert oom.fix[2].text().startswith("--max-cudagraph-capture-size 512 -> 256: (largest from vLLM's default 512)")


def test_oom_in_an_unprefixed_traceback_uses_the_logs_own_tokens_per_gib(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    # a bare traceback (no vLLM prefix) is joined into one record; the allocation that failed sizes the pool
    log = tmp_path / "bare.log"
    log.write_text(
        "INFO 12-01 10:00:21 [gpu_worker.py:456] Available KV cache memory: 50.0 GiB\n"
        "INFO 12-01 10:00:21 [kv_cache_utils.py:2327] GPU KV cache size: 400,000 tokens, Maximum concurrency for "
        "8,192 tokens per request: 48.83x\n"
        "Traceback (most recent call last):\n"
        '  File "/opt/vllm/v1/worker/gpu_model_runner.py", line 5795, in _capture_cudagraphs\n'
        "    self._warmup_and_capture(\n"
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.00 GiB. GPU 0 has a total capacity of "
        "79.19 GiB of which 1.00 GiB is free.\n")
    status = main(["summary", str(log), "--gpu-memory", "79.19", "--gpu-memory-utilization", "0.9", "--json"])
    assert status == 1
    oom = {c["id"]: c for c in json.loads(capsys.readouterr().out)["checks"]}["oom_graph_capture"]
    # 3.00 - 1.00 GiB missing: 0.9 - 2 / 79.19 = 0.8747 -> 0.87; the pool shrinks by 0.03 x 79.19 = 2.38 GiB
    assert oom["fix"][0].startswith("--gpu-memory-utilization 0.9 -> 0.87: leaves 2.38 GiB")
    assert oom["fixes"][0]["flag"] == "--gpu-memory-utilization" and oom["fixes"][0]["proposed"] == "0.87"
    assert "the KV pool shrinks from 50.00 GiB to 47.62 GiB (380,994 tokens at the log's 8,000 tokens per GiB, " \
           "46.51x at 8,192)" in oom["fix"][0]


def test_timeline_uses_vllms_startup_span_names(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["summary", str(CPU_EAGER), "--json"]) == 0
    timeline = {span["phase"]: span for span in json.loads(capsys.readouterr().out)["timeline"]}
    for letter in "ACEFG":
        assert timeline[letter]["name"] == PHASE_SPANS[letter].span_name
    assert (timeline["C"]["name"], timeline["C"]["vllm_span"]) == ("Load model", None)
    assert (timeline["E"]["vllm_span"], timeline["F"]["vllm_span"]) == ("Prepare model", "Prepare model")
    assert timeline["R"]["name"] == "runtime" and timeline["R"]["vllm_span"] is None
    assert main(["explain", str(CPU_EAGER)]) == 0
    text = capsys.readouterr().out
    assert "C Load model" in text and "F Compile/warmup" in text
    assert "152 recognised, 3 from vLLM's source, 13 noise" in text  # the header counts what is classed apart from what is unknown
