"""The traces ``engine capacity`` reads, as one :class:`Trace`: each request's prompt and output
tokens and its arrival in seconds from the first. One reader per format, each in its own module:

- a kvscope recording (``--events``, ``engine simulate --events``): engine/sim/trace_recording.py;
- ``vllm bench serve --save-result`` JSON (and kvscope's ``run-workload --result-json``):
  engine/sim/trace_bench_serve.py;
- aiperf's per-request ``profile_export.jsonl``: engine/sim/trace_aiperf.py;
- a Mooncake trace (``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids``; aiperf
  replays the same format): engine/sim/trace_mooncake.py;
- a vLLM log's ``Engine 000:`` stats lines, rates only: engine/sim/trace_vllm_log.py.

:func:`read_trace` tells the format from the file's first bytes (``--trace-format`` names it
instead). Where a file has no arrival times, its lengths are kept and arrivals are drawn, seeded
(:func:`poisson_arrivals`), and the trace says so: ``timed`` is False.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engine.errors import UserError
from engine.events import Recording
from engine.events.bounded import check_json_depth, iter_text_lines, open_binary
from engine.sim.workload import WorkloadRequest

TRACE_FORMATS = ("recording", "bench-serve", "aiperf", "mooncake", "vllm-log")
FORMAT_WORDS = {"recording": "kvscope recording", "bench-serve": "vllm bench serve result",
                "aiperf": "aiperf profile export", "mooncake": "Mooncake trace", "vllm-log": "vLLM log stats lines"}
MAX_JSON_BYTES = 256 << 20  # a bench result JSON is read whole: its per-request lists of a long run fit well within
SNIFF_BYTES = 64 << 10


@dataclass(slots=True)
class Trace:
    """A workload as a file recorded it. ``requests`` arrive in time order from 0 s."""

    requests: list[WorkloadRequest]
    kind: str  # one of TRACE_FORMATS
    path: str
    timed: bool = True  # False: the file has no arrival times and they were drawn (see notes)
    notes: list[str] = field(default_factory=list)
    model: str | None = None  # the model the file names, when it names one
    recording: Recording | None = None  # a kvscope recording: its steps can fit this machine's cost

    @property
    def rate(self) -> float:
        return arrival_rate(self.requests)

    def describe(self) -> str:
        how = "as recorded" if self.timed else "arrivals drawn"
        return (f"{FORMAT_WORDS[self.kind]}, {len(self.requests):,} requests, {self.rate:.3g} req/s {how}, "
                f"prompts {mean_of(self.requests, 'prompt_tokens'):,.0f} and outputs "
                f"{mean_of(self.requests, 'output_tokens'):,.0f} tokens on average")


def arrival_rate(requests: Sequence[WorkloadRequest]) -> float:
    """Requests per second: the arrivals after the first over the time they took (0: all at once)."""
    span = requests[-1].arrival_time - requests[0].arrival_time if requests else 0.0
    return (len(requests) - 1) / span if span > 0 else 0.0


def repeat_requests(requests: Sequence[WorkloadRequest], times: int) -> list[WorkloadRequest]:
    """``requests`` played ``times`` times back to back, each copy one mean gap after the last
    one's final arrival: a short trace held long enough for the queue to settle."""
    if times < 1:
        raise UserError(f"--repeat {times}: give 1 or more")
    span = requests[-1].arrival_time - requests[0].arrival_time if requests else 0.0
    period = span + (span / (len(requests) - 1) if len(requests) > 1 else 0.0)
    return [dataclasses.replace(r, request_id=f"{r.request_id}.{k}" if k else r.request_id,
                                arrival_time=r.arrival_time + k * period)
            for k in range(times) for r in requests]


def mean_of(requests: Sequence[WorkloadRequest], name: str) -> float:
    return sum(getattr(r, name) for r in requests) / len(requests) if requests else 0.0


def finish_trace(rows: list[WorkloadRequest], kind: str, path: str | Path, **kwargs: Any) -> Trace:
    """The trace of ``rows``: sorted by arrival, shifted to start at 0, ids made unique; a
    UserError when there is no request to replay."""
    if not rows:
        raise UserError(f"--trace {path}: no requests with prompt and output lengths in this {FORMAT_WORDS[kind]}")
    rows = sorted(rows, key=lambda r: r.arrival_time)
    first = rows[0].arrival_time
    rows = [dataclasses.replace(r, request_id=f"t{i}", arrival_time=r.arrival_time - first, arrival_step=None)
            for i, r in enumerate(rows)]
    return Trace(rows, kind, str(path), **kwargs)


def poisson_arrivals(rows: Sequence[WorkloadRequest], rate: float, seed: int = 0) -> list[WorkloadRequest]:
    """``rows`` in their order with Poisson arrivals at ``rate`` per second (seeded): the pattern
    for a file that keeps lengths but no times. The first arrives at 0."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, len(rows))
    times = np.cumsum(gaps) - gaps[0]
    return [dataclasses.replace(r, arrival_time=float(t)) for r, t in zip(rows, times, strict=True)]


def request(prompt: Any, output: Any, at: float = 0.0, shared: int = 0) -> WorkloadRequest | None:
    """One request from a file's fields, or None when they are not positive whole numbers."""
    try:
        p, o = int(prompt), int(output)
    except (TypeError, ValueError):
        return None
    if p < 1 or o < 1:
        return None
    return WorkloadRequest("t", p, o, arrival_time=float(at), shared_prefix_tokens=max(0, min(int(shared), p - 1)))


def json_rows(path: str | Path) -> Iterator[tuple[int, Any]]:
    """(line number, decoded JSON) of each non-blank line of a JSONL file, read through the
    bounded reader (gzipped or not, line and depth caps); a line that does not parse is a
    UserError naming it."""
    name = str(path)
    for number, raw in iter_text_lines(path, name):
        text = raw.decode("utf-8", errors="replace").strip()
        if not text:
            continue
        check_json_depth(text, name, number)
        try:
            yield number, json.loads(text)
        except json.JSONDecodeError as exc:
            raise UserError(f"--trace {name}: line {number} is not JSON ({exc.msg})") from None


def json_document(path: str | Path) -> Any:
    """A whole JSON file (a bench result), at most :data:`MAX_JSON_BYTES`."""
    with open_binary(path, str(path)) as fh:
        data = fh.read(MAX_JSON_BYTES + 1)
    if len(data) > MAX_JSON_BYTES:
        raise UserError(f"--trace {path}: more than {MAX_JSON_BYTES >> 20} MiB of JSON; not a bench result")
    text = data.decode("utf-8", errors="replace")
    check_json_depth(text, str(path), 1)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"--trace {path}: not JSON ({exc.msg} at line {exc.lineno})") from None


def sniff(path: str | Path) -> str:
    """The format of ``path`` from its first bytes (see the module doc)."""
    with open_binary(path, str(path)) as fh:
        head = fh.read(SNIFF_BYTES).decode("utf-8", errors="replace")
    first = head.lstrip().split("\n", 1)[0]
    if '"kvscope.events"' in first:
        return "recording"
    if "Avg prompt throughput" in head:
        return "vllm-log"
    if '"metadata"' in first and '"metrics"' in first:
        return "aiperf"
    if any(key in head for key in ('"input_lens"', '"start_times"', '"request_throughput"')):
        return "bench-serve"
    if any(key in first for key in ('"input_length"', '"input_tokens"', '"hash_ids"')):
        return "mooncake"
    raise UserError(f"--trace {path}: not a format engine capacity reads (a kvscope recording, a vllm bench serve "
                    "result JSON, an aiperf profile_export.jsonl, a Mooncake trace or a vLLM log with stats lines); "
                    "name it with --trace-format")


def read_trace(path: str | Path, kind: str = "auto", *, seed: int = 0, input_len: int | None = None,
               output_len: int | None = None) -> Trace:
    """The trace in ``path``. ``input_len`` / ``output_len`` give a vLLM log's request lengths
    (its stats lines hold token rates, not requests); ``seed`` draws arrivals a file lacks."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--trace {path}: no such file")
    kind = sniff(p) if kind == "auto" else kind
    if kind not in TRACE_FORMATS:
        raise UserError(f"--trace-format {kind}: use auto or one of {', '.join(TRACE_FORMATS)}")
    if kind == "recording":
        from engine.sim.trace_recording import read_recording_trace
        return read_recording_trace(p)
    if kind == "bench-serve":
        from engine.sim.trace_bench_serve import read_bench_serve_trace
        return read_bench_serve_trace(p, seed=seed)
    if kind == "aiperf":
        from engine.sim.trace_aiperf import read_aiperf_trace
        return read_aiperf_trace(p)
    if kind == "mooncake":
        from engine.sim.trace_mooncake import read_mooncake_trace
        return read_mooncake_trace(p, seed=seed)
    from engine.sim.trace_vllm_log import read_vllm_log_trace
    return read_vllm_log_trace(p, input_len=input_len, output_len=output_len, seed=seed)
