"""Phase D's stored measurement: a second start with the same inputs reuses it (and says
so in its event), a changed input or a damaged entry measures again, and the switch
turns it off."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.events import Event, EventBus, StartupPhase
from engine.llm import LLM
from engine.model.memory import profile_cache

# A small step shape keeps each measured profile run short.
SMALL = dict(max_model_len=256, kv_cache_memory_bytes=16 * 2**20, max_num_batched_tokens=64, max_num_seqs=4,
             stats_interval=0.0)


def phase_d(**flags: object) -> dict:
    events: list[Event] = []
    bus = EventBus()
    bus.subscribe(events.append)
    llm = LLM("smollm2-135m", bus=bus, **{**SMALL, **flags})
    llm.close()
    (d,) = [e for e in events if isinstance(e, StartupPhase) and e.phase == "D" and e.status == "end"]
    return d.data


def test_second_start_reuses_the_measurement_and_a_changed_flag_measures(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(profile_cache.PROFILE_CACHE_ENV, str(tmp_path))
    first = phase_d()
    assert first["cached"] is False and first["activation_peak_bytes"] > 0
    assert len(list(tmp_path.glob("*.json"))) == 1
    second = phase_d()
    assert second["cached"] is True
    for name in ("activation_peak_bytes", "non_torch_bytes", "measured_at", "method"):
        assert second[name] == first[name]
    other = phase_d(max_num_batched_tokens=96)
    assert other["cached"] is False
    assert other["activation_peak_bytes"] > first["activation_peak_bytes"]
    assert len(list(tmp_path.glob("*.json"))) == 2


def test_damaged_entry_is_measured_again_and_rewritten(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(profile_cache.PROFILE_CACHE_ENV, str(tmp_path))
    phase_d()
    (entry,) = tmp_path.glob("*.json")
    entry.write_text('{"activation_peak_bytes": ')
    again = phase_d()
    assert again["cached"] is False and again["activation_peak_bytes"] > 0
    assert phase_d()["cached"] is True  # the measurement replaced the damaged entry


def test_switched_off_always_measures(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(profile_cache.PROFILE_CACHE_ENV, "0")
    assert profile_cache.profile_root() is None
    assert phase_d()["cached"] is False


def test_key_depends_on_every_part_and_on_the_sources() -> None:
    parts = {"weights": "abc", "dtype": "float32", "max_num_batched_tokens": 512, "threads": 2}
    key = profile_cache.profile_key(parts)
    assert profile_cache.profile_key(dict(parts)) == key
    for name, value in (("weights", "abd"), ("dtype", "bfloat16"), ("max_num_batched_tokens", 513), ("threads", 1)):
        assert profile_cache.profile_key({**parts, name: value}) != key
    assert len(profile_cache.source_hash()) == 16


def test_weights_identity_follows_content_not_path(tmp_path: Path) -> None:
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"GGUF" + bytes(100))
    b.write_bytes(b"GGUF" + bytes(100))
    assert profile_cache.weights_identity(str(a), {}) == profile_cache.weights_identity(str(b), {})
    b.write_bytes(b"GGUF" + bytes(101))
    assert profile_cache.weights_identity(str(a), {}) != profile_cache.weights_identity(str(b), {})


def test_startup_panel_says_when_phase_d_reused_a_measurement() -> None:
    import time

    from engine.events.folds.startup_state import PhaseView
    from monitor.widgets.startup_table import phase_detail

    when = time.mktime((2026, 12, 1, 15, 5, 0, 0, 0, -1))
    reused = PhaseView("D", "profile_run", "end", data={"activation_peak_bytes": 2**30, "cached": True,
                                                        "measured_at": when})
    assert phase_detail(reused) == "activation_peak 1.00 GiB, reused measurement of 2026-12-01 15:05"
    measured = PhaseView("D", "profile_run", "end", data={"activation_peak_bytes": 2**30, "cached": False,
                                                          "measured_at": when})
    assert phase_detail(measured) == "activation_peak 1.00 GiB"


def test_a_whole_step_entry_covers_a_smaller_budget_and_not_a_bigger_one(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A hybrid layout's step is profiled whole at one size: a later start whose kernel plan chose a
    smaller budget (2,112 then 2,048 tokens on Gemma 3) reuses the bigger step's peak as an upper
    bound instead of a second multi-second profile run; a bigger budget measures."""
    monkeypatch.setenv(profile_cache.PROFILE_CACHE_ENV, str(tmp_path))
    base = profile_cache.profile_key({"whole_step": True, "weights": "abc"})
    for tokens, peak in ((2112, 300), (4096, 600)):
        profile_cache.store(profile_cache.whole_step_key(base, tokens), profile_cache.ProfileResult(
            peak, 1, "tracked", 1.0, 0.1, 1.0, tokens=tokens, profiled_tokens=(tokens,)))
    exact = profile_cache.load_covering(base, 2112)
    assert exact is not None and exact.activation_peak_bytes == 300 and exact.method == "tracked"
    smaller = profile_cache.load_covering(base, 2048)
    assert smaller is not None and smaller.cached and smaller.activation_peak_bytes == 300  # the nearest bigger
    assert smaller.method == "tracked; measured at 2,112 tokens, an upper bound at 2,048"
    assert profile_cache.load_covering(base, 3000) is not None
    assert profile_cache.load_covering(base, 4097) is None
    assert profile_cache.load_covering(profile_cache.profile_key({"whole_step": True, "weights": "abd"}), 16) is None
    (tmp_path / f"{base}-t2112.json").write_text("{")  # a damaged entry is passed over
    again = profile_cache.load_covering(base, 2048)
    assert again is not None and again.activation_peak_bytes == 600
