"""``vllm bench serve --save-result`` JSON as a capacity trace (kvscope's ``run-workload
--result-json`` writes the same, engine/events/exporters/bench_outputs.py): ``input_lens`` and
``output_lens`` per request, arrivals from ``start_times`` (vLLM writes each request's
``perf_counter`` at its send, kvscope seconds from the first; either way only differences count).
A result without ``start_times`` (older vLLM) keeps its lengths and gets Poisson arrivals at its
``request_rate``, or at the rate it completed when that was ``inf``."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from engine.errors import UserError
from engine.sim.traces import Trace, finish_trace, json_document, poisson_arrivals, request
from engine.sim.workload import WorkloadRequest


def _rate(doc: dict[str, Any]) -> float:
    """The result's offered rate, or what it completed per second when it offered everything at once."""
    try:
        rate = float(doc.get("request_rate", math.inf))
    except (TypeError, ValueError):
        rate = math.inf
    if not math.isfinite(rate) or rate <= 0:
        rate = float(doc.get("request_throughput") or 0.0)
    return rate if rate > 0 else 1.0


def read_bench_serve_trace(path: str | Path, seed: int = 0) -> Trace:
    doc = json_document(path)
    if not isinstance(doc, dict) or not isinstance(doc.get("input_lens"), list):
        raise UserError(f"--trace {path}: a vllm bench serve result has input_lens and output_lens lists "
                        "(save it with --save-result)")
    inputs, outputs = doc["input_lens"], doc.get("output_lens") or []
    raw_starts = doc.get("start_times")
    starts: list[Any] = raw_starts if isinstance(raw_starts, list) else []
    timed = len(starts) >= len(inputs)
    rows: list[WorkloadRequest] = []
    for i, (p, o) in enumerate(zip(inputs, outputs, strict=False)):
        at = starts[i] if timed else 0.0
        row = request(p, o, at if isinstance(at, int | float) else 0.0)
        if row is not None:
            rows.append(row)
    notes = []
    if not timed and rows:
        rate = _rate(doc)
        rows = poisson_arrivals(rows, rate, seed)
        notes.append(f"the result has no start_times: Poisson arrivals at {rate:.3g} req/s (its request_rate, or "
                     "what it completed per second when it sent everything at once)")
    dropped = len(inputs) - len(rows)
    if dropped:
        notes.append(f"{dropped} requests without a positive output length (failed) left out")
    model = doc.get("model_id") if isinstance(doc.get("model_id"), str) else None
    return finish_trace(rows, "bench-serve", path, timed=timed, notes=notes, model=model or None)
