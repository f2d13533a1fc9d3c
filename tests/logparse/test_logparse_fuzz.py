"""logparse never raises: hypothesis-generated input and mutated real logs
(cut at random bytes, binary garbage, 10 MB lines, invalid UTF-8, shuffled lines)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from logparse.cli import main
from logparse.explain import explain
from logparse.options import Options
from logparse.render import render_json, render_markdown
from tests.paths import DATA, SAMPLES

CORPUS = DATA / "vllm-logs"  # kept in the repo: a clone runs every test
SAMPLE = SAMPLES / "vllm-startup.log"
LOGS = sorted(CORPUS.glob("*.log")) or [SAMPLE]
REAL_LINES = [line for log in LOGS for line in log.read_bytes().splitlines(keepends=True)]


def _explain_bytes(data: bytes, tmp_path: Path, name: str = "fuzz.log") -> None:
    path = tmp_path / name
    path.write_bytes(data)
    exp = explain(path, Options(model="llama-3.1-8b", gpu="h100"))
    render_json(exp)
    render_markdown(exp)


def _mutations(rng: random.Random, original: bytes) -> list[tuple[str, bytes]]:
    lines = original.splitlines(keepends=True)
    shuffled = lines[:]
    rng.shuffle(shuffled)
    cut = rng.randrange(len(original) + 1)
    pos = rng.randrange(len(original) + 1)
    return [
        ("cut", original[:cut]),
        ("garbage", original[:pos] + rng.randbytes(rng.randrange(1, 4096)) + original[pos:]),
        ("invalid-utf8", original.replace(b"e", b"\xc3\x28", 5).replace(b" ", b"\xff", 3)),
        ("shuffled", b"".join(shuffled)),
        ("crlf-and-nul", original.replace(b"\n", b"\r\n").replace(b"INFO", b"IN\x00FO", 2)),
    ]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=3000))
def test_arbitrary_bytes_never_raise(tmp_path: Path, data: bytes) -> None:
    _explain_bytes(data, tmp_path)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(st.sampled_from(REAL_LINES), st.text(max_size=200).map(str.encode),
                          st.sampled_from(REAL_LINES).map(lambda b: b[: len(b) // 2])), max_size=40))
def test_real_line_collages_never_raise(tmp_path: Path, pieces: list[bytes]) -> None:
    _explain_bytes(b"".join(pieces), tmp_path)


def test_mutated_real_logs_never_raise(tmp_path: Path) -> None:
    rng = random.Random(8)
    for log in rng.sample(LOGS, min(8, len(LOGS))):
        for kind, data in _mutations(rng, log.read_bytes()):
            _explain_bytes(data, tmp_path, f"{log.stem[:40]}-{kind}.log")


def test_ten_megabyte_line_is_bounded(tmp_path: Path) -> None:
    line = b"INFO 05-12 10:11:12 [gpu_worker.py:1] Available KV cache memory: 53.9 GiB " + b"x" * (10 * 2**20)
    path = tmp_path / "long.log"
    path.write_bytes(line + b"\nINFO 05-12 10:11:13 [kv_cache_utils.py:1] GPU KV cache size: 442,160 tokens\n")
    exp = explain(path)
    assert exp.ledger["kv_cache_gib"] == 53.9
    assert exp.ledger["kv_cache_tokens"] == 442_160
    assert max(len(r.text) for r in exp.records) <= 16384


def test_cli_on_garbage_exits_zero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bin.log"
    path.write_bytes(random.Random(1).randbytes(20000))
    assert main(["explain", str(path), "--json"]) == 0
    assert '"ledger"' in capsys.readouterr().out


@pytest.mark.slow
@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=20000))
def test_arbitrary_bytes_never_raise_heavy(tmp_path: Path, data: bytes) -> None:
    _explain_bytes(data, tmp_path)


@pytest.mark.slow
def test_every_real_log_mutated_many_times(tmp_path: Path) -> None:
    rng = random.Random(88)
    for log in LOGS:
        for _ in range(10):
            for kind, data in _mutations(rng, log.read_bytes()):
                _explain_bytes(data, tmp_path, f"m-{kind}.log")
