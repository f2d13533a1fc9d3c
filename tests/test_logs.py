"""Console logs as a real process writes them to stderr: vLLM's line format on a
pipe (the default, as on a terminal), JSON lines only when asked."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.paths import ROOT

VLLM_LINE = re.compile(r"^(DEBUG|INFO|WARNING|ERROR) \d\d-\d\d \d\d:\d\d:\d\d \[[\w.]+\.py:\d+\] ")
SCRIPT = """
import sys
from engine.logs import configure_logging, get_logger
configure_logging(sys.argv[1])
get_logger("kvscope.test").info("CPU KV cache size: 93,200 tokens", blocks=5825)
get_logger("kvscope.test").warning("Maximum concurrency for 8,192 tokens per request: 11.38x")
"""


def _stderr(fmt: str, tmp_path: Path) -> list[str]:
    script = tmp_path / "startup_demo.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script), fmt], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.stdout == ""
    return done.stderr.splitlines()


def test_a_pipe_gets_vllms_line_format(tmp_path: Path) -> None:
    lines = _stderr("auto", tmp_path)
    assert len(lines) == 2 and all(VLLM_LINE.match(line) for line in lines), lines
    assert lines[0].startswith("INFO ") and lines[0].endswith(" [startup_demo.py:5] CPU KV cache size: 93,200 tokens blocks=5825")
    assert lines[1].startswith("WARNING ") and " [startup_demo.py:6] Maximum concurrency" in lines[1]


def test_json_only_when_asked(tmp_path: Path) -> None:
    records = [json.loads(line) for line in _stderr("json", tmp_path)]
    assert [r["event"] for r in records] == ["CPU KV cache size: 93,200 tokens",
                                             "Maximum concurrency for 8,192 tokens per request: 11.38x"]
    assert records[0]["level"] == "info" and records[0]["blocks"] == 5825 and "timestamp" in records[0]


def test_logparse_reads_kvscope_text_logs(tmp_path: Path) -> None:
    from logparse.explain import explain

    log = tmp_path / "kvscope.log"
    log.write_text("\n".join(_stderr("text", tmp_path)) + "\n")
    exp = explain(log)
    assert exp.ledger["kv_cache_tokens"] == 93_200 and exp.ledger["max_concurrency"] == 11.38
