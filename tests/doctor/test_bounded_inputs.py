"""Every reader streams with bounded memory (issue 50): engine doctor, engine diff, engine
replay, monitor replay and logparse read recordings and logs through engine/events/bounded.py.
A gzip bomb (a ~2 MB file inflating to 2 GiB, of one line or of many lines) and a line nested
200,000 deep end, under a 1 GiB address-space limit, in one error line naming the file and the
line: no MemoryError, no RecursionError, no traceback."""

from __future__ import annotations

import gzip
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from engine.events import SCHEMA_NAME
from engine.events.bounded import InputLimitError, json_depth
from engine.events.recording import read_events
from engine.events.schema import SCHEMA_VERSION

BIN = Path(sys.executable).parent
LIMIT = 1 << 30  # RLIMIT_AS: the whole process, Python and its imports included
CHUNK = 128 << 20
HEADER = json.dumps({"schema": SCHEMA_NAME, "version": SCHEMA_VERSION, "config": {}}).encode() + b"\n"


def _bomb(path: Path, member_text: bytes, head: bytes = b"") -> Path:
    # 16 identical gzip members of 128 MiB: the file inflates to 2 GiB (gzip readers concatenate members)
    member = gzip.compress(member_text * (CHUNK // len(member_text)), 9)
    path.write_bytes((gzip.compress(head) if head else b"") + member * 16)
    return path


@pytest.fixture(scope="module")
def bombs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("bombs")
    event = json.dumps({"type": "log", "t": 0.0, "level": "info", "message": "x" * 900}).encode() + b"\n"
    deep = d / "deep.jsonl"
    deep.write_bytes(HEADER + b"[" * 200_000 + b"]" * 200_000 + b"\n" + HEADER)
    return {"one_line": _bomb(d / "one-line.jsonl.gz", b"a" * (1 << 20)),
            "events": _bomb(d / "events.jsonl.gz", event, HEADER),
            "log_lines": _bomb(d / "log-lines.log.gz", b"c" * 65535 + b"\n"),
            "deep": deep}


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (LIMIT, LIMIT))


def run_limited(*argv: str) -> tuple[int, str]:
    proc = subprocess.run([str(BIN / argv[0]), *argv[1:]], preexec_fn=_limited, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    return proc.returncode, proc.stderr.strip()


def _one_error_line(stderr: str, path: Path, line: int, words: str) -> None:
    assert "Traceback" not in stderr and "MemoryError" not in stderr and "RecursionError" not in stderr, stderr
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    assert f"{path}: line {line}: " in lines[0] and words in lines[0], lines[0]


COMMANDS = {"doctor": (("engine", "doctor"), 3), "diff": (("engine", "diff"), 2), "replay": (("engine", "replay"), 2),
            "monitor": (("monitor", "replay"), 2)}


# engine doctor on the one-line bomb and the nested line run in `make test`; the rest in `make test-slow`
@pytest.mark.parametrize("command", [c if c == "doctor" else pytest.param(c, marks=pytest.mark.slow)
                                     for c in sorted(COMMANDS)])
@pytest.mark.parametrize(("bomb", "line", "words"), [
    ("one_line", 1, "longer than 16 MiB"),
    pytest.param("events", 35027, "more than 32 MiB of text", marks=pytest.mark.slow),
    ("deep", 2, "JSON nested deeper than 64 levels"),
])
def test_recording_readers_refuse_bombs_in_one_line(bombs: dict[str, Path], command: str, bomb: str, line: int,
                                                     words: str) -> None:
    argv, code = COMMANDS[command]
    extra = (str(bombs["deep"]),) if command == "diff" else ()  # diff reads its first file first
    status, stderr = run_limited(*argv, str(bombs[bomb]), *extra)
    assert status == code
    _one_error_line(stderr, bombs[bomb], line, words)


@pytest.mark.slow
@pytest.mark.parametrize("bomb", ["one_line", "log_lines"])
def test_logparse_refuses_a_gzip_bomb_in_one_line(bombs: dict[str, Path], bomb: str) -> None:
    status, stderr = run_limited("logparse", "summary", str(bombs[bomb]))
    assert status == 2
    assert "inflates more than 200-fold" in stderr and "decompression bomb" in stderr
    _one_error_line(stderr, bombs[bomb], 1 if bomb == "one_line" else int(stderr.split("line ")[1].split(":")[0]),
                    "decompression bomb")


def test_logparse_reads_a_deeply_nested_json_line_as_an_unknown_line(tmp_path: Path) -> None:
    log = tmp_path / "deep.log"
    log.write_text("{" * 30_000 + "}" * 30_000 + "\nINFO 05-01 10:00:00 [api_server.py:1] vLLM API server version 0.10.2\n")
    status, stderr = run_limited("logparse", "summary", str(log), "--json")
    assert status == 0 and "Traceback" not in stderr


def test_read_events_streams_and_names_the_line(tmp_path: Path) -> None:
    deep = tmp_path / "deep.jsonl"
    deep.write_bytes(HEADER + b"[" * 5000 + b"]" * 5000 + b"\n")
    with pytest.raises(InputLimitError, match=r"deep.jsonl: line 2: JSON nested deeper than 64 levels"):
        read_events(deep)
    gz = tmp_path / "run.jsonl.gz"
    gz.write_bytes(gzip.compress(HEADER + b'{"type": "log", "t": 0.5, "message": "hi"}\n'))
    assert [e.type for e in read_events(gz).events] == ["log"]  # gzipped recordings read anywhere
    assert json_depth('{"a": "[[[[", "b": [[1]]}') == 3  # brackets inside strings do not count


def test_a_gzipped_log_reads_as_the_plain_one_and_a_cut_one_up_to_its_cut(tmp_path: Path) -> None:
    from logparse.explain import explain
    from tests.paths import DATA

    plain = DATA / "vllm-logs" / "v0.10.2-qwen3-235b-a22b-fp8-8xl40s-tp8-ep-slice.log"
    packed = gzip.compress(plain.read_bytes())
    gz = tmp_path / "slice.log.gz"
    gz.write_bytes(packed)
    assert explain(gz).ledger == explain(plain).ledger
    cut = tmp_path / "cut.log.gz"
    cut.write_bytes(packed[: len(packed) // 2])  # a log gzipped while still being written
    assert 0 < explain(cut).record_count < 190
