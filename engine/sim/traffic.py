"""Simulation workloads: which requests arrive when, with how many prompt and output
tokens (token counts, not text; ``engine run-workload`` has its own in engine.sim.workload).

A workload is a list of :class:`WorkloadRequest` (token counts, not text). It is
drawn from a :class:`WorkloadSpec` (length ranges, arrival pattern, shared-prefix
fraction) or read from a trace file (JSONL, one request per line:
``{"arrival_time": 0.25, "prompt_tokens": 812, "output_tokens": 128}``).

Draws follow the background's notebook exactly so its figures can be
reproduced: lengths come from ``numpy.random.default_rng(seed)`` as
``integers(lo, hi, n)`` prompts then ``integers(lo, hi, n)`` outputs (``hi``
exclusive), and arrivals from a second ``default_rng(seed)``.

Token ids are synthetic: every request gets its own run of ids (so prompts
never share a prefix by accident), and the shared-prefix requests start with
the same ``shared_prefix_tokens`` ids.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from engine.errors import UserError
from engine.sim.workload import parse_range as parse_length_range

ARRIVALS = ("at-once", "uniform", "poisson")
ARRIVAL_UNITS = ("step", "s")
SHARED_PREFIX_FIRST_ID = 100  # the shared system prompt's token ids start here
UNIQUE_FIRST_ID = 1_000_000  # each request's own token ids start above this


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    """One request of a workload. ``arrival_step`` (scheduler ticks) wins over
    ``arrival_time`` (seconds) when set."""

    request_id: str
    prompt_tokens: int
    output_tokens: int
    arrival_time: float = 0.0
    arrival_step: int | None = None
    shared_prefix_tokens: int = 0
    priority: int = 0


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """How to draw a workload. Ranges are ``(lo, hi)`` with ``hi`` exclusive (numpy's
    ``integers``). ``arrival``: ``at-once`` | ``uniform`` (over ``window``) |
    ``poisson`` (``rate`` per unit); ``unit``: ``step`` | ``s``."""

    num_requests: int
    prompt_range: tuple[int, int]
    output_range: tuple[int, int]
    arrival: str = "at-once"
    unit: str = "step"
    window: float = 0.0
    rate: float = 0.0
    shared_prefix_fraction: float = 0.0
    shared_prefix_tokens: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise UserError(f"--num-requests {self.num_requests}: give at least 1")
        for flag, (lo, hi) in (("--prompt-tokens", self.prompt_range), ("--output-tokens", self.output_range)):
            if lo < 1 or hi <= lo:
                raise UserError(f"{flag} {lo}:{hi}: give LO:HI with 1 <= LO < HI (HI exclusive), or one number")
        if self.arrival not in ARRIVALS:
            raise UserError(f"--arrival {self.arrival!r}: use one of {', '.join(ARRIVALS)}")
        if self.unit not in ARRIVAL_UNITS:
            raise UserError(f"--arrival-unit {self.unit!r}: use step or s")
        if self.arrival == "uniform" and self.window <= 0:
            raise UserError("--arrival uniform needs --arrival-window > 0 (steps or seconds)")
        if self.arrival == "poisson" and self.rate <= 0:
            raise UserError("--arrival poisson needs --rate > 0 (requests per step or per second)")
        if not 0.0 <= self.shared_prefix_fraction <= 1.0:
            raise UserError(f"--shared-prefix-fraction {self.shared_prefix_fraction}: must be in [0, 1]")
        if self.shared_prefix_fraction > 0 and self.shared_prefix_tokens < 1:
            raise UserError("--shared-prefix-fraction needs --shared-prefix-tokens > 0")


def parse_range(text: str, flag: str) -> tuple[int, int]:
    """``"500:3000"`` -> (500, 3000) with HI exclusive, as numpy's ``integers`` draws."""
    return parse_length_range(text, flag, hi_exclusive=True)


def generate_workload(spec: WorkloadSpec) -> list[WorkloadRequest]:
    """Draw the workload ``spec`` describes (deterministic for its seed)."""
    import numpy as np  # workload drawing only; the scheduler core stays dependency-free

    n = spec.num_requests
    rng = np.random.default_rng(spec.seed)
    prompts = rng.integers(*spec.prompt_range, n)
    outputs = rng.integers(*spec.output_range, n)
    arrival_rng = np.random.default_rng(spec.seed)
    if spec.arrival == "at-once":
        arrivals = np.zeros(n)
    elif spec.arrival == "uniform":
        if spec.unit == "step":
            arrivals = np.sort(arrival_rng.integers(0, int(spec.window), n))
        else:
            arrivals = np.sort(arrival_rng.uniform(0.0, spec.window, n))
    else:
        gaps = arrival_rng.exponential(1.0 / spec.rate, n)
        arrivals = np.cumsum(gaps) - gaps[0]
        if spec.unit == "step":
            arrivals = np.floor(arrivals)
    shared = np.zeros(n, dtype=bool)
    if spec.shared_prefix_fraction > 0:
        shared = np.random.default_rng(spec.seed + 1).random(n) < spec.shared_prefix_fraction
    out: list[WorkloadRequest] = []
    for i in range(n):
        prompt = int(prompts[i])
        prefix = min(spec.shared_prefix_tokens, prompt - 1) if shared[i] else 0
        at = float(arrivals[i])
        out.append(
            WorkloadRequest(
                request_id=f"r{i}",
                prompt_tokens=prompt,
                output_tokens=int(outputs[i]),
                arrival_time=0.0 if spec.unit == "step" else at,
                arrival_step=int(at) if spec.unit == "step" else None,
                shared_prefix_tokens=prefix,
            )
        )
    return out


def load_trace(path: str | Path) -> list[WorkloadRequest]:
    """Read a trace: one JSON object per line with ``arrival_time`` (seconds; or
    ``arrival_step``), ``prompt_tokens``, ``output_tokens`` and optional
    ``request_id``, ``shared_prefix_tokens``, ``priority``."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--trace {path}: no such file")
    out: list[WorkloadRequest] = []
    with p.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            try:
                row = json.loads(line)
                step = row.get("arrival_step")
                req = WorkloadRequest(
                    request_id=str(row.get("request_id", f"r{len(out)}")),
                    prompt_tokens=int(row["prompt_tokens"]),
                    output_tokens=int(row["output_tokens"]),
                    arrival_time=float(row.get("arrival_time", 0.0)),
                    arrival_step=None if step is None else int(step),
                    shared_prefix_tokens=int(row.get("shared_prefix_tokens", 0)),
                    priority=int(row.get("priority", 0)),
                )
            except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
                raise UserError(
                    f"--trace {path}:{lineno}: each line must be a JSON object with arrival_time, "
                    f"prompt_tokens and output_tokens ({type(exc).__name__}: {exc})"
                ) from None
            if req.prompt_tokens < 1 or req.output_tokens < 1:
                raise UserError(f"--trace {path}:{lineno}: prompt_tokens and output_tokens must be at least 1")
            out.append(req)
    if not out:
        raise UserError(f"--trace {path}: no requests in the file")
    steps = {r.arrival_step is None for r in out}
    if len(steps) > 1:
        raise UserError(f"--trace {path}: give every line arrival_time or every line arrival_step, not a mix")
    return out


class TokenIdSource:
    """Synthetic prompt token ids: a shared run for the shared prefix, then ids
    no other request uses. Cheap (``range`` lists), deterministic, never a stop id."""

    def __init__(self) -> None:
        self._next_unique = UNIQUE_FIRST_ID

    def unique(self, n: int) -> list[int]:
        start = self._next_unique
        self._next_unique += n
        return list(range(start, start + n))

    def prompt(self, req: WorkloadRequest) -> list[int]:
        prefix = req.shared_prefix_tokens
        shared = list(range(SHARED_PREFIX_FIRST_ID, SHARED_PREFIX_FIRST_ID + prefix))
        return shared + self.unique(req.prompt_tokens - prefix)
