"""The summary's fast path (logparse/fastscan.py) counts runs of stats and access lines
instead of reading each; what it folds must be what the full record stream folds, at
chunk boundaries, over-long lines and every line shape that changes how records form."""

from __future__ import annotations

from pathlib import Path

import pytest

import logparse.fastscan as fastscan
import logparse.parser as parser
from logparse.explain import explain
from logparse.fastscan import BulkRun, iter_summary
from tests.paths import DATA

CPU_LOG = DATA / "vllm-logs" / "v0.32.0-smollm2-135m-cpu-zen3-tp1-eager-complete.log"


def _server_log(path: Path) -> Path:
    """A long-running server's log from the real 0.32 capture: its startup, then long runs of its
    stats and access lines broken by every shape the fast path must hand to the parser."""
    lines = CPU_LOG.read_bytes().splitlines(keepends=True)
    startup = b"".join(lines[:104])
    stats = [line for line in lines if b"Avg prompt throughput: " in line]
    access = [line for line in lines if b'HTTP/1.1" 200' in line]
    run = b"".join(stats[i % len(stats)] if i % 9 == 0 else access[i % len(access)] for i in range(300))
    preempting = stats[-1].replace(b", CPU KV cache usage", b", Preemptions: 3, CPU KV cache usage")  # vLLM's order
    breaks = [
        preempting * 3,  # inside a run: summed, first line kept
        b"  continued under a stats line\n",  # an indented line joins the record before it
        b"\n",  # an empty line is a record of its own
        stats[0].replace(b"\n", b"\r\n"),  # CRLF
        b"Capturing CUDA graphs:  50%|#####     | 1/2 [00:00<00:00, 9.1it/s]" + stats[1],  # glued to a tqdm bar
        b"(APIServer pid=5518) WARNING 12-01 16:02:35 [api.py:1] an unknown warning\n",
        b"x" * 5000 + b"\n",  # longer than the (lowered) line limit
        startup,
    ]
    with open(path, "wb") as fh:
        fh.write(startup)
        for piece in breaks:
            fh.write(run)
            fh.write(piece)
            fh.write(run[: len(run) // 3])
    return path


@pytest.fixture()
def small_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    # chunks, windows and the line limit small enough that the log above crosses each many times
    monkeypatch.setattr(fastscan, "CHUNK_BYTES", 64 * 1024)
    monkeypatch.setattr(fastscan, "MAX_WINDOW", 16 * 1024)
    monkeypatch.setattr(fastscan, "MIN_WINDOW", 1024)
    monkeypatch.setattr(fastscan, "MAX_LINE_BYTES", 4096)
    monkeypatch.setattr(parser, "MAX_LINE_BYTES", 4096)


def test_fast_summary_folds_what_the_record_stream_folds(tmp_path: Path, small_limits: None) -> None:
    log = _server_log(tmp_path / "server.log")
    items = list(iter_summary(log))
    runs = [item for item in items if isinstance(item, BulkRun)]
    counted = sum(run.records for run in runs)
    assert len(runs) > 10 and counted > 0.8 * sum(1 for _ in parser.iter_records(log))
    assert sum(run.preemptions for run in runs) > 0
    slow, fast = explain(log, keep_records=True), explain(log, keep_records=False)
    assert fast.to_json(with_records=False) == slow.to_json(with_records=False)
    assert (fast.record_count, fast.unrecognised) == (slow.record_count, slow.unrecognised)
    assert {c.id for c in fast.checks} >= {"preemption"}
    runtime = {span.phase: span for span in fast.timeline}["R"]
    assert runtime.records > counted and runtime.last_time == "12-01 16:13:05"  # the capture's last stats line
