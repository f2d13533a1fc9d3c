"""engine replay --verify on a real CPU run left at every default the CPU resolves
differently from a GPU (engine/startup/: ``resolve_config`` and phase E's pool cap):
the replayer must schedule with the limits the engine used (the ``engine.config``
event's), not the flags as given (the header's ``max_num_batched_tokens`` 8,192)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.cli import main
from engine.events import EngineConfigEvent, RequestArrived, StartupPhase, StepEvent, read_events
from engine.events.phase_data import KvCacheData
from engine.startup.resolve import CPU_DEFAULT_MAX_NUM_BATCHED_TOKENS, GPU_DEFAULT_MAX_NUM_BATCHED_TOKENS


def test_verify_a_cpu_run_at_its_resolved_defaults(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # the fixed CPU budget: a stored kernel plan would derive another from its prefill speed (issue 34)
    monkeypatch.setenv("KVSCOPE_KERNEL_PLAN", "off")
    path = tmp_path / "cpu_defaults.jsonl"
    # No --max-num-batched-tokens, --dtype, --attention-backend, --quantization, --kv-cache-memory-bytes
    # or --device-memory: each is left for the CPU to resolve. A prompt longer than the CPU's token budget.
    prompt_len = CPU_DEFAULT_MAX_NUM_BATCHED_TOKENS + 88
    # --gpu-memory-utilization 0.5: the run is in this test process, whose own models (loaded by
    # earlier tests) count as used host memory; 0.9 of the host was refused once at 89.9 % free.
    code = main(["run-workload", "--num-prompts", "1", "--random-input-len", str(prompt_len),
                 "--random-output-len", "1", "--request-rate", "inf", "--threads", "1",
                 "--gpu-memory-utilization", "0.5", "--events", str(path), "--log-format", "json"])
    assert code == 0
    capsys.readouterr()
    rec = read_events(path)
    given = rec.config
    resolved = next(e for e in rec.events if isinstance(e, EngineConfigEvent)).config
    assert given["max_num_batched_tokens"] == GPU_DEFAULT_MAX_NUM_BATCHED_TOKENS
    assert resolved["max_num_batched_tokens"] == CPU_DEFAULT_MAX_NUM_BATCHED_TOKENS
    for flag in ("dtype", "attention_backend", "quantization"):
        assert given[flag] == "auto" and resolved[flag] != "auto", flag
    assert given["kv_cache_memory_bytes"] is None and given["device_memory_gib"] is None
    phase_e = next(e for e in rec.events if isinstance(e, StartupPhase) and e.phase == "E" and e.status == "end")
    assert KvCacheData.from_dict(phase_e.data).cpu_default_cap  # the CPU's 4 GiB pool, not the budget's
    assert all(e.prompt_tokens == prompt_len for e in rec.events if isinstance(e, RequestArrived))
    steps = [e for e in rec.events if isinstance(e, StepEvent)]
    assert max(s.num_prefill_tokens for s in steps) == CPU_DEFAULT_MAX_NUM_BATCHED_TOKENS  # the budget bound a step

    assert main(["replay", str(path), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "OK:" in out and f"max-num-batched-tokens {CPU_DEFAULT_MAX_NUM_BATCHED_TOKENS}" in out
