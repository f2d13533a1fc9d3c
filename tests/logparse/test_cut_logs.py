"""Cut logs named (issue 50): a log that starts mid-stream, ends mid-traceback or ends before
the server is ready says so in explain and doctor, with what is missing and which checks that
limits; a whole log says nothing of the kind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from doctor.cli import examine
from engine.cli.main import main as engine_main
from logparse.cli import main
from logparse.completeness import Cut
from logparse.explain import explain
from tests.paths import DATA

CORPUS = DATA / "vllm-logs"
PUBLIC = DATA / "vllm-logs-public"


def _cuts(path: Path) -> dict[str, Cut]:
    return {cut.kind: cut for cut in explain(path).cuts}


def test_whole_logs_are_not_cut() -> None:
    for name in ("v0.32.0-smollm2-135m-cpu-zen3-tp1-eager-complete.log", "v0.11.0rc2-gemma-3-27b-it-rocm-tp1-hybrid-kv-padding.log",
                 "v0.11.0-qwen2.5-0.5b-arm-cpu-backend-offline-complete.log"):
        assert explain(CORPUS / name).cuts == [], name


def test_ends_mid_traceback_names_the_missing_exception_line() -> None:
    # vllm#2418: the paste stops inside the traceback, before vLLM's ValueError
    cut = _cuts(PUBLIC / "v0.2.7-kv-below-max-model-len.log")["ends_mid_traceback"]
    assert cut.line == 9 and cut.missing.startswith("the exception line that ends the traceback")
    assert "starts_mid_stream" not in _cuts(PUBLIC / "v0.2.7-kv-below-max-model-len.log")  # it has its config line


def test_starts_mid_stream_lists_the_missing_figures_and_the_checks_they_limit() -> None:
    cuts = _cuts(CORPUS / "v0.10.1-unknown-model-unknowngpu-tp1-debug-graphcapture.log")
    head, tail = cuts["starts_mid_stream"], cuts["ends_before_ready"]
    assert head.line == 1 and "the model, max-model-len" in head.missing
    assert any("concurrency = tokens / max-model-len" in limit for limit in head.limits)
    assert tail.missing == "the lines after phase F (compile / CUDA graphs): G (server ready)"
    assert tail.limits == ["whether the server came up at all"]


def test_a_log_beginning_inside_a_traceback_starts_mid_stream() -> None:
    cut = _cuts(CORPUS / "v0.9.2dev-llama-tpu-v5e-8-kvmem-fail.log")["starts_mid_stream"]
    assert "it begins inside a record" in cut.missing


def test_ends_before_ready_lists_the_phases_not_reached() -> None:
    tail = _cuts(CORPUS / "v0.10.2-qwen3-4b-gguf-unknowngpu-tp1.log")["ends_before_ready"]
    assert tail.missing.startswith("the lines after phase C (weight loading): D (memory profiling), E (KV cache")
    assert any("KV below max-model-len" in limit for limit in tail.limits)


def test_cuts_in_every_view(capsys: pytest.CaptureFixture[str]) -> None:
    log = str(CORPUS / "v0.10.1-unknown-model-unknowngpu-tp1-debug-graphcapture.log")
    main(["explain", log, "--json"])
    out = json.loads(capsys.readouterr().out)
    assert [c["kind"] for c in out["cuts"]] == ["starts_mid_stream", "ends_before_ready"]
    main(["summary", log])
    assert "log cut: ends before the server is ready (line 14)" in capsys.readouterr().out
    assert engine_main(["doctor", log]) == 0
    text = capsys.readouterr().out
    assert "healthy (as far as the log goes: it is cut, see the notes)" in text
    assert "note: log cut: starts mid-stream (line 1)" in text
    _, _, notes = examine(log)
    assert sum(n.startswith("log cut:") for n in notes) == 2
