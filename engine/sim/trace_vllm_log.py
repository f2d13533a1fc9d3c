"""A vLLM log's stats lines as a capacity trace, rates only: ``Engine 000: Avg prompt throughput:
P tokens/s, Avg generation throughput: G tokens/s, ...`` every ``VLLM_LOG_STATS_INTERVAL``
(10 s by default), one line per engine core. The lines give token rates, not requests, so the
request lengths are given (``--random-input-len``, default :data:`DEFAULT_INPUT_LEN`; ``--random-output-len``,
default the input length times the log's generated over prompt tokens), and each interval gets
``P x interval / input length`` requests (fractions carried to the next), arriving at seeded
uniform times within it. The engines' lines are summed: the trace is the whole server's load.

A line's interval is the time since that engine's previous line, at most 1.5 x the usual one
(vLLM skips lines while an engine is idle; the rate a line prints covers its own interval only).
Timestamps carry no year (``MM-DD hh:mm:ss``); a log that runs across New Year is read in order."""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass
from datetime import datetime
from itertools import pairwise
from pathlib import Path

import numpy as np

from engine.errors import UserError
from engine.events.bounded import iter_text_lines
from engine.sim.traces import Trace, finish_trace
from engine.sim.workload import WorkloadRequest

DEFAULT_INPUT_LEN = 1024
DEFAULT_INTERVAL_S = 10.0  # vLLM's VLLM_LOG_STATS_INTERVAL
STATS = re.compile(rb"(?P<month>\d\d)-(?P<day>\d\d) (?P<clock>\d\d:\d\d:\d\d)(?:\.\d+)?\b.*?Engine (?P<engine>\d+): "
                   rb"Avg prompt throughput: (?P<prompt>[\d.]+) tokens/s, "
                   rb"Avg generation throughput: (?P<gen>[\d.]+) tokens/s")
MAX_LOG_LINE = 1 << 20


@dataclass(frozen=True, slots=True)
class StatsLine:
    t: float  # seconds since the year's start (no year in the log)
    engine: int
    prompt_tps: float
    generation_tps: float


def stats_lines(path: str | Path) -> list[StatsLine]:
    out: list[StatsLine] = []
    offset = 0.0  # a year's seconds added once the clock runs backwards across New Year
    for _, raw in iter_text_lines(path, str(path), max_line_bytes=MAX_LOG_LINE, long_lines="cut"):
        if b"Avg prompt throughput" not in raw:
            continue
        m = STATS.search(raw)
        if m is None:
            continue
        stamp = datetime.strptime(f"2000-{m['month'].decode()}-{m['day'].decode()} {m['clock'].decode()}",
                                  "%Y-%m-%d %H:%M:%S")
        t = (stamp - datetime(2000, 1, 1)).total_seconds() + offset
        if out and t < out[-1].t - 180 * 86400:
            offset += 366 * 86400
            t += 366 * 86400
        out.append(StatsLine(t, int(m["engine"]), float(m["prompt"]), float(m["gen"])))
    return out


def intervals(lines: list[StatsLine]) -> list[tuple[float, float, StatsLine]]:
    """(start, end, line) of each line's interval, per engine (see the module doc)."""
    out = []
    for engine in sorted({ln.engine for ln in lines}):
        own = [ln for ln in lines if ln.engine == engine]
        gaps = [b.t - a.t for a, b in pairwise(own) if b.t > a.t]
        usual = statistics.median(gaps) if gaps else DEFAULT_INTERVAL_S
        prev = None
        for ln in own:
            length = usual if prev is None else min(max(ln.t - prev, 0.0), 1.5 * usual)
            out.append((ln.t - length, ln.t, ln))
            prev = ln.t
    return sorted(out, key=lambda x: x[0])


def read_vllm_log_trace(path: str | Path, *, input_len: int | None = None, output_len: int | None = None,
                        seed: int = 0) -> Trace:
    lines = stats_lines(path)
    if not lines:
        raise UserError(f"--trace {path}: no 'Engine NNN: Avg prompt throughput' stats lines in the log")
    spans = intervals(lines)
    prompt_tokens = sum(ln.prompt_tps * (end - start) for start, end, ln in spans)
    generated = sum(ln.generation_tps * (end - start) for start, end, ln in spans)
    if prompt_tokens <= 0:
        raise UserError(f"--trace {path}: its stats lines show no prompt tokens at all: no requests to replay")
    ilen = input_len or DEFAULT_INPUT_LEN
    olen = output_len or max(1, round(ilen * generated / prompt_tokens))
    rng = np.random.default_rng(seed)
    rows: list[WorkloadRequest] = []
    carry = 0.0
    for start, end, ln in spans:
        carry += ln.prompt_tps * (end - start) / ilen
        count = int(carry)
        carry -= count
        for at in np.sort(rng.uniform(start, end, count)):
            rows.append(WorkloadRequest("t", ilen, olen, arrival_time=float(at)))
    notes = [f"rates only: {len(lines):,} stats lines of {len({ln.engine for ln in lines})} engine(s), "
             f"{prompt_tokens:,.0f} prompt and {generated:,.0f} generated tokens; requests of "
             f"{ilen:,} prompt tokens ({'--random-input-len' if input_len else 'assumed: give --random-input-len'}) and {olen:,} "
             f"output tokens ({'--random-output-len' if output_len else 'from the ratio of generated to prompt tokens'})"]
    return finish_trace(rows, "vllm-log", path, timed=False, notes=notes)
