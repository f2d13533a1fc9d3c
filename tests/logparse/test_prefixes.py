"""Prefixes recognised generically (issue 50): each log's own line prefix is learned from its
first lines (logparse/prefixes.py) and stripped, whatever wrote it: docker compose, Kubernetes
and journald timestamps, a launcher's own format, torch's [rank0], indentation; nested Ray
process prefixes, Ray's repeat counts, ANSI remnants and glued tqdm bars are read too."""

from __future__ import annotations

from pathlib import Path

import pytest

from doctor.cli import examine
from doctor.rules.finding import exit_status
from logparse.explain import explain
from logparse.parser import iter_records, learn_prefix
from logparse.prefixes import learn, strip_ansi
from tests.paths import DATA

PUBLIC = DATA / "vllm-logs-public"
CORPUS = DATA / "vllm-logs"
VLLM = "(APIServer pid=1) INFO 05-01 20:54:16 [api_server.py:1885] vLLM API server version 0.10.2"


@pytest.mark.parametrize(("prefix", "expected"), [
    ("2026-05-01 20:54:16.988 | ", r"^\d+\-\d+\-\d+\ \d+:\d+:\d+\.\d+\ \|[ \t]?"),
    ("vllm-1  | ", r"^vllm\-\d+\ \ \|[ \t]?"),
    ("2024-06-28T06:11:52.685300953Z ", r"^\d+\-\d+\-\d+T\d+:\d+:\d+\.\d+Z[ \t]?"),
    ("Aug 19 18:34:27 host vllm[8727]: ", r"^Aug\ \d+\ \d+:\d+:\d+\ host\ vllm\[\d+\]:[ \t]?"),
    ("    ", r"^\ \ \ \ "),  # a Markdown list's indentation, kept exact so deeper indentation still shows
])
def test_learned_prefix_shapes(prefix: str, expected: str) -> None:
    lines = [prefix + VLLM.replace("16 [", f"{10 + i} [") for i in range(6)]
    learned = learn(lines)
    assert learned is not None and learned.pattern == expected
    assert learned.sub("", lines[0], count=1) == lines[0][len(prefix):]


def test_a_word_that_varies_is_generalised_and_vllm_lines_learn_nothing() -> None:
    levels = ["2026-05-08 11:47:02.256 [Info] (Process) " + VLLM, "2026-05-08 11:47:03.001 [Error] (Process) " + VLLM] * 3
    learned = learn(levels)
    assert learned is not None and r"\[[A-Za-z_]+\]" in learned.pattern
    assert learn([VLLM] * 10) is None  # vLLM's own prefix is the parser's, not learned
    assert learn(["no vLLM line here"] * 10) is None


def test_compose_timestamp_prefix_glues_no_line(tmp_path: Path) -> None:
    # the 190-line real slice under docker compose's timestamp prefix (derived file, see the README):
    # every line stays its own record and the ledger equals the unprefixed log's
    derived = explain(PUBLIC / "derived-compose-timestamp-prefix-v0.10.2-slice.log")
    original = explain(CORPUS / "v0.10.2-qwen3-235b-a22b-fp8-8xl40s-tp8-ep-slice.log")
    assert derived.record_count == original.record_count == 190
    assert derived.coverage.recognised == original.coverage.recognised == 189
    assert all(r.end_line == r.line for r in derived.records)
    assert derived.ledger == original.ledger and derived.facts == original.facts


def test_launcher_prefix_oom_in_kv_allocation() -> None:
    # lemonade-sdk/vllm-rocm#5: "<time> [Error] (Process) (EngineCore pid=N) ERROR ... [core.py:1136]"
    path = PUBLIC / "vunknown-rocm-gfx1151-oom-kv-allocation-lemonade.log"
    assert learn_prefix(path) is not None
    exp = explain(path)
    assert exp.coverage.unknown == 0 and all(r.process == "EngineCore pid=2651" for r in exp.records)
    assert exp.startup is not None and (exp.startup.cause, exp.startup.phase, exp.startup.place) == (
        "oom", "E", "kv_allocation")
    oom = next(c for c in exp.checks if c.id == "oom")
    assert oom.title == "CUDA out of memory during KV-cache allocation" and oom.detail == "tried to allocate 12.95 GiB"
    _, findings, _ = examine(str(path))
    assert exit_status(findings) == 2


def test_torch_rank_prefix_graph_capture_oom() -> None:
    # vllm#6746: "[rank0]: " before every line; the capture_model frames place the OOM in graph capture
    exp = explain(PUBLIC / "v0.5.x-oom-graph-capture-rank0.log")
    assert [c.id for c in exp.checks if c.kind == "failure"] == ["oom_graph_capture"]
    assert exp.startup is not None and exp.startup.phase == "F" and exp.coverage.unknown == 0


def test_ray_task_error_is_an_oom_through_ray() -> None:
    exp = explain(PUBLIC / "v0.7.x-ray-tp8-pp2-task-error-oom.log")
    assert exp.startup is not None and exp.startup.cause == "oom" and exp.startup.via_ray
    assert "out of memory (through Ray)" in exp.startup.headline()


def test_compose_service_prefix_runtime_death() -> None:
    # intel/llm-scaler#154: the server answered /health, then a worker died: a runtime death, not a failed start
    exp = explain(PUBLIC / "v0.11-xpu-worker-died-compose.log")
    assert exp.records[0].pattern_id == "uvicorn_access" and exp.coverage.unknown == 0
    assert exp.startup is not None and exp.startup.runtime and exp.startup.cause == "worker_died"
    assert exp.startup.headline() == "the engine died at runtime: a worker process died"
    _, findings, _ = examine(str(PUBLIC / "v0.11-xpu-worker-died-compose.log"))
    assert [f.rule for f in findings] == ["engine_died"] and exit_status(findings) == 2


def test_nested_ray_prefixes_repeats_ansi_remnants_and_glued_bars(tmp_path: Path) -> None:
    log = tmp_path / "ray.log"
    log.write_text(
        "(MapWorker(MapBatches(vLLMEngineStageUDF)) pid=4242, ip=10.0.0.7) (Worker pid=4300) INFO 07-27 22:30:35 "
        "[gpu_worker.py:276] Available KV cache memory: 31.5 GiB [repeated 3x across cluster] (Ray deduplicates logs "
        "by default. Set RAY_DEDUP_LOGS=0 to disable log deduplication)\n"
        "[0;36m(APIServer pid=1)[0;0m INFO 05-01 20:54:16 [api_server.py:1885] vLLM API server version 0.10.2\n"
        "Capturing CUDA graphs: 100%|██████████| 67/67 [00:14<00:00,  4.71it/s](EngineCore_DP0 pid=7) INFO 05-01 "
        "20:54:31 [gpu_model_runner.py:2196] Graph capturing finished in 14 secs, took 0.84 GiB\n")
    records = list(iter_records(log))
    assert records[0].process == "Worker pid=4300" and records[0].repeated == 3
    assert records[0].fields["kv_cache_gib"] == 31.5
    assert records[1].pattern_id == "api_server_version" and records[1].process == "APIServer pid=1"
    assert [r.noise or r.pattern_id for r in records[2:]] == ["cuda_graph_progress", "graph_capture_finished"]
    assert explain(log).coverage.ray_folded == 2
    assert strip_ansi("^[[0;36mINFO[0m x") == "INFO x"
