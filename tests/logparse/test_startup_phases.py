"""A vLLM start's phase durations from its log (logparse/startup_phases.py), on two real
vLLM 0.32.0 CPU starts of SmolLM2-135M (tests/data/vllm-logs): one with torch.compile (a
cold, ten-minute compile) and one eager; ``logparse explain`` prints them and ``engine diff
a.log b.log`` sets the two side by side phase by phase."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.cli import main as engine_main
from logparse.cli import main as logparse_main
from logparse.explain import explain
from logparse.startup_phases import PhaseClock, diff_startups, log_seconds

DATA = Path(__file__).resolve().parents[1] / "data" / "vllm-logs"
COLD = DATA / "v0.32.0-smollm2-135m-cpu-zen3-tp1-compile-cold.log"
EAGER = DATA / "v0.32.0-smollm2-135m-cpu-zen3-tp1-eager-complete.log"


def test_log_seconds() -> None:
    assert log_seconds("12-01 19:52:20", "12-01 20:04:42") == 742.0
    assert log_seconds("12-31 23:59:50", "01-01 00:00:10") is None  # no year printed: not guessed
    assert log_seconds(None, "12-01 19:52:20") is None and log_seconds("garbage", "12-01 19:52:20") is None


def test_the_cold_compile_start_phase_by_phase() -> None:
    times = explain(COLD).startup_times
    by = {p.phase: p for p in times.phases}
    assert list(by) == ["A", "C", "D", "E", "F", "G"]  # in order; phase B prints nothing on this start
    assert (by["C"].seconds, by["C"].source) == (pytest.approx(1.604569 + 2.42), "printed")
    assert dict(by["C"].figures) == {"init_model_s": 1.604569, "load_weights_s": 2.42}
    assert (by["D"].seconds, by["D"].source) == (31.25, "printed")  # "Initial profiling/warmup run took"
    # "init engine (profile, create kv cache, warmup model) took 579.59 s" less the profiling run
    assert (by["F"].seconds, by["F"].source) == (pytest.approx(579.59 - 31.25), "printed − D")
    assert (by["A"].start, by["A"].seconds, by["A"].source) == ("12-01 19:52:20", 142.0, "log times")
    assert by["G"].seconds == 5.0
    assert times.total_s == 742.0  # first line 19:52:20 to the server's last ready line 20:04:42


def test_the_eager_start() -> None:
    times = explain(EAGER, keep_records=False).startup_times  # the fast summary reads the same
    by = {p.phase: p for p in times.phases}
    assert by["C"].seconds == pytest.approx(0.212092 + 1.77)
    assert (by["F"].seconds, by["F"].source) == (5.71, "printed")  # no profiling figure to take off
    assert times.total_s is not None and 30 <= times.total_s <= 40


def test_lines_of_a_later_phase_printed_early_do_not_reorder_the_phases() -> None:
    clock = PhaseClock()
    for phase, line, time in (("A", 1, "01-01 10:00:00"), ("F", 2, "01-01 10:00:01"),  # a config line tagged F
                              ("C", 3, "01-01 10:00:20"), ("E", 4, "01-01 10:00:30"), ("F", 5, "01-01 10:00:50"),
                              ("G", 6, "01-01 10:00:55"), ("R", 7, "01-01 10:01:00"), ("G", 8, "01-01 10:02:00")):
        clock.add(phase, line, time)
    times = clock.times({})
    assert [(p.phase, p.seconds) for p in times.phases] == [("A", 20.0), ("C", 10.0), ("E", 20.0), ("F", 5.0),
                                                            ("G", 0.0)]
    assert times.total_s == 55.0  # to phase G's last line before the runtime began


def test_logparse_explain_prints_the_phase_durations(capsys: pytest.CaptureFixture[str]) -> None:
    logparse_main(["summary", str(COLD)])
    out = capsys.readouterr().out
    assert "startup phases (seconds)" in out
    assert "D Profile run" in out and "31.25" in out and "printed − D" in out
    logparse_main(["explain", str(COLD), "--json"])
    data = json.loads(capsys.readouterr().out)
    assert data["startup_times"]["total_s"] == 742.0


def test_engine_diff_compares_two_vllm_startups_phase_by_phase(capsys: pytest.CaptureFixture[str]) -> None:
    assert engine_main(["diff", str(COLD), str(EAGER)]) == 0
    out = capsys.readouterr().out
    assert "two vLLM startups, phase by phase" in out
    c_row = next(line for line in out.splitlines() if line.startswith("C Load model"))
    assert c_row.split()[-3:] == ["4.02", "1.98", "-2.04"]
    whole = next(line for line in out.splitlines() if line.startswith("whole start"))
    assert whole.split()[2] == "742.00"
    assert engine_main(["diff", str(COLD), str(EAGER), "--json"]) == 0
    rows = {r["phase"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert rows["D"]["a"] == 31.25 and rows["D"]["b"] is None  # the eager start printed no profiling figure
    assert rows["total"]["difference"] == pytest.approx(rows["total"]["b"] - 742.0)
    assert diff_startups(explain(COLD).startup_times, explain(COLD).startup_times)[-1].difference == 0.0
