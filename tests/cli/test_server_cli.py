"""`engine serve` / `engine demo` command lines: flag errors exit 2 with one
line before any startup; the headless demo runs end to end (slow)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from engine.cli import main
from engine.modelspec.presets import bundled_gguf_path
from tests.paths import ROOT


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["serve", "--metrics-require-key"], "--metrics-require-key needs an API key"),
        (["serve", "--port", "70000"], "--port 70000"),
        (["serve", "--max-waiting-requests", "0"], "--max-waiting-requests 0"),
        (["serve", "--shutdown-timeout", "-1"], "--shutdown-timeout -1"),
    ],
)
def test_serve_flag_errors_exit_2(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str],
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSCOPE_API_KEY", raising=False)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err and "Traceback" not in err


def test_a_busy_port_is_refused_before_startup_begins(tmp_path: Path) -> None:
    """The port is bound before any phase runs: no weights load, no profile run."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        events = tmp_path / "events.jsonl"
        done = subprocess.run(
            [sys.executable, "-m", "engine.cli", "serve", "--port", str(port), "--log-format", "json",
             "--events", str(events)],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert f"--port {port}" in last and "pick another --port" in last and "Traceback" not in done.stderr
    assert "phase" not in done.stderr and not events.exists()


def test_serve_accepts_the_gpu_check_flags() -> None:
    """bench/gpu_check.py starts serve with these; parsing must not change under it."""
    from engine.cli import build_parser
    from engine.cli.commands.serve import settings_from_args
    from engine.cli.flags import engine_config_from_args

    args = build_parser().parse_args([
        "serve", "--model", "llama-3.1-8b", "--load-format", "dummy", "--device", "cuda", "--attention-backend",
        "triton", "--max-model-len", "4096", "--port", "18123", "--log-format", "console",
    ])  # fmt: skip
    settings = settings_from_args(args)
    config = engine_config_from_args(args)
    assert (settings.served_model_name, config.load_format, config.attention_backend) == ("llama-3.1-8b", "dummy",
                                                                                         "triton")
    assert args.host == "127.0.0.1" and args.port == 18123


@pytest.mark.slow
@pytest.mark.skipif(bundled_gguf_path() is None, reason="the bundled SmolLM2 GGUF is not installed")
def test_make_demo_headless_completes_what_it_sends() -> None:
    # what `make demo < /dev/null | cat` runs: the Makefile's command line, stdin closed, stdout a pipe
    engine = Path(sys.executable).with_name("engine")
    done = subprocess.run([str(engine), "demo"], cwd=ROOT, stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=400)
    assert done.returncode == 0, done.stdout + done.stderr
    m = re.search(r"ready after [\d.]+ s; sent (\d+) of 40 requests.*?(\d+) completed in ([\d.]+) s", done.stdout)
    assert m, done.stdout
    sent, completed, load_s = int(m.group(1)), int(m.group(2)), float(m.group(3))
    assert sent >= 4 and completed == sent and load_s < 45 + 30  # --duration 45 from ready, then the drain grace
    assert f"requests: {completed} (length {completed})" in done.stdout
    ttft = re.search(r"TTFT p50 ([\d.]+) ms, p99 ([\d.]+) ms", done.stdout)
    assert ttft and 0 < float(ttft.group(1)) <= float(ttft.group(2)), done.stdout
    assert "nan" not in done.stdout and "terminate called" not in done.stderr
