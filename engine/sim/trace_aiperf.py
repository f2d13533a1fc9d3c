"""aiperf's per-request ``profile_export.jsonl`` as a capacity trace: one record per request,
``metadata.request_start_ns`` (epoch nanoseconds) its arrival, ``metrics.input_sequence_length``
and ``metrics.output_sequence_length`` (or ``output_token_count``) its lengths, each a
``{"value": N, "unit": "tokens"}``. Failed or cancelled records (an ``error``, no output length)
are left out and counted. Only the profiling phase counts when records name one (warm-up
requests are not the workload)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from engine.sim.traces import Trace, finish_trace, json_rows, request
from engine.sim.workload import WorkloadRequest


def _value(metrics: dict[str, Any], *names: str) -> Any:
    for name in names:
        entry = metrics.get(name)
        if isinstance(entry, dict) and entry.get("value") is not None:
            return entry["value"]
        if isinstance(entry, int | float):
            return entry
    return None


def read_aiperf_trace(path: str | Path) -> Trace:
    rows: list[tuple[int, WorkloadRequest]] = []  # epoch ns kept whole: seconds from the first lose no precision
    skipped = 0
    for _, record in json_rows(path):
        if not isinstance(record, dict):
            skipped += 1
            continue
        meta = record.get("metadata") or {}
        metrics = record.get("metrics") or {}
        if meta.get("benchmark_phase", "profiling") != "profiling":
            continue
        start = meta.get("request_start_ns")
        row = None
        if not record.get("error") and isinstance(start, int | float) and isinstance(metrics, dict):
            row = request(_value(metrics, "input_sequence_length"),
                          _value(metrics, "output_sequence_length", "output_token_count"))
        if row is None:
            skipped += 1
        else:
            rows.append((int(start), row))
    first = min((ns for ns, _ in rows), default=0)
    timed = [dataclasses.replace(row, arrival_time=(ns - first) / 1e9) for ns, row in rows]
    notes = [f"{skipped} failed or incomplete records left out"] if skipped else []
    return finish_trace(timed, "aiperf", path, notes=notes)
