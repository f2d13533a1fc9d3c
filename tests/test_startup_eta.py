"""A startup that predicts itself (engine/startup_eta.py): the history file, the predictor, the
log line and its ticker as pure functions with injected clocks; then the real engine started
twice on the bundled model, the second start predicting from the first's durations."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from engine import startup_eta as eta
from engine.events import Event, EventBus, StartupEta, StartupPhase
from engine.modelspec.presets import bundled_gguf_path
from tests.monitor_fixtures import ManualClock

COLD = {"A": 0.6, "B": 0.01, "C": 9.0, "D": 3.0, "E": 0.1, "F": 12.0, "G": 0.01}
WARM = {"A": 0.4, "B": 0.01, "C": 0.8, "D": 0.02, "E": 0.1, "F": 0.5, "G": 0.01}


# ------------------------------------------------------------------ the predictor
def test_a_key_started_before_predicts_its_latest_start_then_the_median_of_three() -> None:
    history = eta.record_start(eta.History(), "k", COLD, now=100.0, model_bytes=10**9)
    first = eta.predict(history, "k", 10**9)
    assert first.starts == 1 and dict(first.phases) == COLD and set(first.sources.values()) == {"history"}
    history = eta.record_start(history, "k", WARM, now=200.0, model_bytes=10**9)
    assert dict(eta.predict(history, "k").phases) == WARM  # two starts: the latest, not a cold-warm mean
    slow = {**WARM, "C": 5.0}
    history = eta.record_start(history, "k", slow, now=300.0, model_bytes=10**9)
    third = eta.predict(history, "k")
    assert third.starts == 3
    assert third.phases["C"] == 5.0 and third.phases["F"] == 0.5  # medians of (9.0, 0.8, 5.0), (12, 0.5, 0.5)


def test_median_of_the_last_three() -> None:
    assert eta.recent_estimate([9.0]) == 9.0
    assert eta.recent_estimate([9.0, 0.8]) == 0.8
    assert eta.recent_estimate([9.0, 0.8, 5.0]) == 5.0
    assert eta.recent_estimate([100.0, 9.0, 0.8, 0.9]) == 0.9  # only the last three count


def test_a_new_model_predicts_phase_c_from_its_size_over_the_measured_read_rate() -> None:
    history = eta.record_start(eta.History(), "other", WARM, now=1.0, model_bytes=4 * 10**8)
    assert history.read_rates == (4 * 10**8 / 0.8,)  # 500 MB/s measured in phase C
    new = eta.predict(history, "new", model_bytes=2 * 10**9)
    assert new.starts == 0
    assert new.phases["C"] == pytest.approx(4.0) and new.sources["C"] == "read rate"
    assert new.phases["F"] == WARM["F"] and new.sources["F"] == "machine"  # this machine's other starts
    nothing = eta.predict(eta.History(), "new", model_bytes=2 * 2**30)
    assert nothing.phases["C"] == pytest.approx(2.0) and nothing.sources["C"] == "default"  # 1 GiB/s assumed
    assert nothing.phases["D"] == eta.DEFAULT_SECONDS["D"] and nothing.sources["D"] == "default"
    assert eta.predict(eta.History(), "new").phases["C"] == eta.DEFAULT_SECONDS["C"]  # size unknown


def test_the_history_is_bounded() -> None:
    history = eta.History()
    for i in range(eta.MAX_STARTS + 3):
        history = eta.record_start(history, "k", {"C": float(i)}, now=float(i), model_bytes=1000)
    assert [r.phases["C"] for r in history.starts["k"]] == [float(i) for i in range(3, eta.MAX_STARTS + 3)]
    assert len(history.read_rates) == eta.MAX_RATES
    for i in range(eta.MAX_KEYS + 2):
        history = eta.record_start(history, f"key{i}", WARM, now=1000.0 + i)
    assert len(history.starts) == eta.MAX_KEYS
    assert "k" not in history.starts and "key0" not in history.starts  # the least recently started went first
    assert "key1" not in history.starts and f"key{eta.MAX_KEYS + 1}" in history.starts


def test_the_file_round_trips_and_a_damaged_one_is_a_miss(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "history.json"
    assert eta.load_history(path) == eta.History()  # missing
    history = eta.record_start(eta.History(), "k", COLD, now=5.0, model_bytes=123)
    eta.save_history(path, history)
    assert eta.load_history(path).starts["k"][0].phases == COLD
    assert [p.name for p in path.parent.iterdir()] == ["history.json"]  # no temporary file left
    for damaged in (b"{not json", b'{"format": 99, "keys": {}}', b"[1, 2]",
                    json.dumps({"format": 1, "keys": {"k": [{"at": "x", "phases": {"C": "slow"}}]}}).encode(),
                    b"[" * 100_000, b" " * (eta.MAX_FILE_BYTES + 1)):
        path.write_bytes(damaged)
        loaded = eta.load_history(path)
        assert loaded.starts.get("k", ()) == () and eta.predict(loaded, "k").starts == 0
    # a directory where the file should be: still a miss, and writing it is an OSError the session logs
    path.unlink()
    path.mkdir()
    assert eta.load_history(path) == eta.History()


def test_the_key_follows_the_model_and_the_flags_that_change_startup(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x" * 100)
    flags = {"dtype": "float32", "max_num_seqs": 32, "seed": 0, "events_path": None}
    key = eta.start_key(flags, str(model), "m")
    assert key == eta.start_key({**flags, "seed": 7, "events_path": "run.jsonl"}, str(model), "m")
    assert key != eta.start_key({**flags, "max_num_seqs": 64}, str(model), "m")
    model.write_bytes(b"x" * 200)  # another file at the same path
    assert key != eta.start_key(flags, str(model), "m")
    assert eta.model_bytes_of(str(model)) == 200 and eta.model_bytes_of(str(tmp_path / "nope")) is None


# ------------------------------------------------------------------ the log line
def test_the_log_line() -> None:
    assert eta.eta_line("C", 12.0, 30.0) == "phase C load weights: 12 s of ~30 s"
    assert eta.eta_line("D", 2.5, 3.0) == "phase D profile run: 2.5 s of ~3.0 s"
    assert eta.eta_line("F", 40.0, 30.0) == "phase F graphs compile: 40 s, past the ~30 s predicted"
    assert eta.eta_line("C", 6.0, None) == "phase C load weights: 6.0 s"


def test_the_ticker_logs_a_running_phase_every_interval_from_the_events() -> None:
    clock = ManualClock(100.0)
    lines: list[str] = []
    ticker = eta.EtaTicker(lines.append, interval_s=5.0, clock=clock)
    bus = EventBus()
    bus.subscribe(ticker)
    bus.publish(StartupEta(phases={"C": 30.0}, sources={"C": "history"}, starts=1, key="k"))
    assert ticker.tick() is None  # nothing runs yet
    bus.publish(StartupPhase(phase="C", name="load_weights", status="begin"))
    clock.now = 104.0
    assert ticker.tick() is None  # under one interval: a short phase says nothing
    clock.now = 112.0
    assert ticker.tick() == "phase C load weights: 12 s of ~30 s"
    bus.publish(StartupPhase(phase="C", name="load_weights", status="begin", rank=1))  # another rank's: ignored
    clock.now = 118.0
    assert ticker.tick() == "phase C load weights: 18 s of ~30 s"
    bus.publish(StartupPhase(phase="C", name="load_weights", status="end", duration_s=18.0))
    clock.now = 130.0
    assert ticker.tick() is None
    assert lines == ["phase C load weights: 12 s of ~30 s", "phase C load weights: 18 s of ~30 s"]


# ------------------------------------------------------------------ the real engine, twice
@pytest.mark.skipif(bundled_gguf_path() is None, reason="the bundled SmolLM2 GGUF is not installed")
def test_a_second_start_predicts_each_phase_from_the_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.llm import LLM

    history_file = tmp_path / "startup-history.json"
    monkeypatch.setenv(eta.HISTORY_ENV, str(history_file))
    flags = dict(max_model_len=512, kv_cache_memory_bytes=32 * 2**20, max_num_batched_tokens=256, max_num_seqs=8,
                 stats_interval=0.0, dtype="float32")
    starts: list[tuple[StartupEta, dict[str, float]]] = []
    for _ in range(2):
        events: list[Event] = []
        bus = EventBus()
        bus.subscribe(events.append)
        llm = LLM("smollm2-135m", bus=bus, **flags)
        seconds = dict(llm.engine.startup.phase_seconds)
        llm.close()
        predictions = [e for e in events if isinstance(e, StartupEta)]
        assert len(predictions) == 1
        first_phase = next(i for i, e in enumerate(events) if isinstance(e, StartupPhase))
        assert events.index(predictions[0]) < first_phase  # published before phase A begins
        starts.append((predictions[0], seconds))
    (first, first_seconds), (second, _) = starts
    assert first.starts == 0 and "history" not in first.sources.values()
    assert second.key == first.key and second.starts == 1
    assert set(second.sources.values()) == {"history"}
    assert second.phases == pytest.approx(first_seconds)  # each phase: the first start's own seconds
    saved = json.loads(history_file.read_text())
    assert len(saved["keys"][first.key]) == 2 and saved["read_rates"]
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
