"""A Mooncake trace (the FAST'25 release's JSONL; aiperf's ``mooncake_trace`` dataset is the
same) as a capacity trace: ``timestamp`` the arrival in milliseconds, ``input_length`` and
``output_length`` the lengths (the aliases ``created_time``, ``input_tokens``, ``output_tokens``
read the same), ``hash_ids`` one id per 512-token block, an id standing for its block and every
block before it. Rows of one ``session_id`` without a timestamp arrive ``delay`` ms
(``delay_ms``) after the session's previous turn arrived (the trace means after its answer: an
open-loop approximation). A file with no times at all keeps its lengths and gets Poisson
arrivals, whose rate does not matter: the capacity search scales it.

Prefix sharing: the simulator's prompts share one prefix run, so only the requests under the
trace's most common first block share, each for the leading blocks an earlier request already
had; requests under other roots share nothing (a lower hit rate than the trace's where it has
several roots, never a higher one)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from engine.sim.traces import Trace, finish_trace, json_rows, poisson_arrivals, request
from engine.sim.workload import WorkloadRequest

BLOCK_TOKENS = 512  # Mooncake's hash block (aiperf --isl-block-size's default)


def _first(row: dict[str, Any], *names: str) -> Any:
    return next((row[n] for n in names if row.get(n) is not None), None)


def _arrival(row: dict[str, Any], last_in_session: dict[str, float]) -> float | None:
    """Seconds: the row's timestamp, else its session's previous turn plus its delay."""
    stamp = _first(row, "timestamp", "created_time")
    session = row.get("session_id")
    if isinstance(stamp, int | float):
        at = stamp / 1000.0
    elif session is not None and str(session) in last_in_session:
        delay = _first(row, "delay", "delay_ms")
        at = last_in_session[str(session)] + (delay / 1000.0 if isinstance(delay, int | float) else 0.0)
    else:
        return None
    if session is not None:
        last_in_session[str(session)] = at
    return at


def _shared_tokens(ids: list[Any], root: Any, seen: set[Any]) -> int:
    if not ids or ids[0] != root:
        return 0
    blocks = 0
    for block in ids:
        if block not in seen:
            break
        blocks += 1
    seen.update(ids)
    return blocks * BLOCK_TOKENS


def read_mooncake_trace(path: str | Path, seed: int = 0) -> Trace:
    raw = [row for _, row in json_rows(path) if isinstance(row, dict)]
    roots = Counter(r["hash_ids"][0] for r in raw if isinstance(r.get("hash_ids"), list) and r["hash_ids"])
    root = roots.most_common(1)[0][0] if roots else None
    seen: set[Any] = set()
    last_in_session: dict[str, float] = {}
    rows: list[WorkloadRequest] = []
    untimed = 0
    for r in raw:
        ids: list[Any] = r["hash_ids"] if isinstance(r.get("hash_ids"), list) else []
        at = _arrival(r, last_in_session)
        untimed += at is None
        row = request(_first(r, "input_length", "input_tokens"), _first(r, "output_length", "output_tokens"),
                      at or 0.0, _shared_tokens(ids, root, seen))
        if row is not None:
            rows.append(row)
    notes = []
    timed = untimed == 0
    if not timed and rows:
        rows = poisson_arrivals(rows, 1.0, seed)
        notes.append(f"{untimed} rows have no timestamp: Poisson arrivals stand for the pattern (the search scales "
                     "the rate)")
    if len(roots) > 1:
        notes.append(f"prefix sharing kept under the most common of {len(roots)} first blocks only")
    return finish_trace(rows, "mooncake", path, timed=timed, notes=notes)
