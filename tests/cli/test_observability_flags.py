"""vLLM's observability flags of issue 18 part 4 through the real command line:
--enable-logging-iteration-details logs vLLM's line per step of a simulation and of
a replayed recording, and
serve's --kv-cache-metrics reaches the server settings, its sample rate checked
as vLLM checks it."""

from __future__ import annotations

import io
import re

import pytest

from engine.cli.commands.serve import settings_from_args
from engine.cli.main import build_parser, main
from engine.events import StepEvent, read_events
from engine.logs import configure_logging
from tests.monitor_fixtures import SAMPLE

LINE = re.compile(r"^INFO \d\d-\d\d \d\d:\d\d:\d\d \[iteration_details\.py:\d+\] Iteration\((\d+)\): (\d+) context "
                  r"requests, (\d+) context tokens, (\d+) generation requests, (\d+) generation tokens, iteration "
                  r"elapsed time: (\d+\.\d\d) ms$")


def test_simulate_logs_one_vllm_iteration_line_per_step(capsys) -> None:
    stream = io.StringIO()
    configure_logging("text", stream=stream)
    try:
        assert main(["simulate", "--num-prompts", "3", "--random-input-len", "40", "--random-output-len", "4",
                     "--enable-logging-iteration-details"]) == 0
    finally:
        configure_logging("text")
    capsys.readouterr()
    lines = [LINE.match(line) for line in stream.getvalue().splitlines() if "Iteration(" in line]
    assert lines and all(lines), stream.getvalue()[-500:]
    assert [int(m[1]) for m in lines] == list(range(len(lines)))
    # every prompt token is a context token, every later token a generation token
    assert sum(int(m[3]) for m in lines) == 3 * 40
    assert sum(int(m[5]) for m in lines) == 3 * (4 - 1)
    assert float(lines[0][6]) > 0  # the cost model's seconds for the step


def test_replay_logs_a_recordings_iteration_lines(capsys) -> None:
    recording = read_events(SAMPLE)
    busy = [e for e in recording.events if isinstance(e, StepEvent) and e.num_prefill_tokens + e.num_decode_tokens]
    stream = io.StringIO()
    configure_logging("text", stream=stream)
    try:
        assert main(["replay", str(SAMPLE), "--enable-logging-iteration-details"]) == 0
    finally:
        configure_logging("text")
    capsys.readouterr()
    lines = [LINE.match(line) for line in stream.getvalue().splitlines() if "Iteration(" in line]
    assert len(lines) == len(busy) and all(lines)
    assert sum(int(m[3]) + int(m[5]) for m in lines) == sum(e.num_prefill_tokens + e.num_decode_tokens for e in busy)


def test_serve_kv_cache_metrics_flags() -> None:
    args = build_parser().parse_args(["serve", "--kv-cache-metrics", "--kv-cache-metrics-sample", "0.05"])
    assert settings_from_args(args).kv_cache_metrics is True
    assert settings_from_args(build_parser().parse_args(["serve"])).kv_cache_metrics is False
    build_parser().parse_args(["serve", "--enable-mfu-metrics"])  # a vllm serve line keeps it; always on here


@pytest.mark.parametrize("rate", ["0", "1.5", "often"])
def test_a_sample_rate_outside_vllms_range_is_refused(rate: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", "--kv-cache-metrics-sample", rate])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--kv-cache-metrics-sample" in err and "must be a fraction in (0, 1]" in err
