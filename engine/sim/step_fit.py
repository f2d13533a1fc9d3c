"""This machine's per-step cost, fitted to a recording's own step events (``engine capacity
--hardware this``): a step takes

    seconds = intercept + a x prompt tokens + b x decode rows + c x context tokens read

least squares (numpy) over every step that scheduled tokens. What a step costs the wall clock
is its ``duration_s`` plus the loop's time before it (output handling, new requests, the server's
hand-off): the gap from the previous step's end, where that step left work (the engine went
straight on); after an idle engine, the median such gap. So the simulated clock advances as the
recorded one did, not only by the forward pass.

Context read is the step event's ``kv_tokens_read``; a recording from before it existed gets it
rebuilt from the requests' scheduled tokens, prefix hits and preemptions. No coefficient may be
negative (a step never gets cheaper with more work): one that fits below zero is fixed at zero
and the rest fitted again. The fit's quality is reported: R² and the residuals' spread.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from engine.errors import UserError
from engine.events import Event, RequestScheduled, StepEvent

FEATURES = ("prompt tokens", "decode rows", "context tokens read")
MIN_STEPS = 8  # fewer steps than this cannot separate four coefficients from noise
MIN_STEP_S = 1e-6  # a step always moves the simulated clock


@dataclass(frozen=True, slots=True)
class StepSample:
    prefill: int
    decode: int
    kv_read: int
    seconds: float


@dataclass(frozen=True, slots=True)
class StepFit:
    """The fitted cost (``seconds`` is :class:`~engine.sim.simulate.StepCost`) and its quality."""

    intercept_s: float
    per_prompt_token_s: float
    per_decode_row_s: float
    per_context_token_s: float
    r2: float
    residual_p50_s: float  # median |measured - fitted|
    residual_p90_s: float
    relative_p50: float  # median |measured - fitted| / measured
    samples: int
    mean_step_s: float
    zeroed: tuple[str, ...] = ()  # features whose coefficient fitted below zero and was fixed at 0

    @property
    def coefficients(self) -> tuple[float, float, float, float]:
        return self.intercept_s, self.per_prompt_token_s, self.per_decode_row_s, self.per_context_token_s

    def seconds(self, prefill_tokens: int, decode_rows: int, kv_tokens_read: int) -> float:
        a, b, c, d = self.coefficients
        return max(MIN_STEP_S, a + b * prefill_tokens + c * decode_rows + d * kv_tokens_read)

    def formula(self) -> str:
        a, b, c, d = self.coefficients
        return (f"step = {a * 1e3:.3g} ms + {b * 1e3:.3g} ms x prompt tokens + {c * 1e3:.3g} ms x decode rows + "
                f"{d * 1e6:.3g} µs x context tokens read")

    def quality(self) -> str:
        zeroed = f"; fixed at 0: {', '.join(self.zeroed)}" if self.zeroed else ""
        return (f"R² {self.r2:.3f} over {self.samples:,} steps (mean {self.mean_step_s * 1e3:,.1f} ms); residuals "
                f"p50 {self.residual_p50_s * 1e3:,.1f} ms, p90 {self.residual_p90_s * 1e3:,.1f} ms "
                f"({self.relative_p50 * 100:.0f} % of a step at the median){zeroed}")

    def to_dict(self) -> dict[str, float | int | list[str]]:
        return {"intercept_s": self.intercept_s, "per_prompt_token_s": self.per_prompt_token_s,
                "per_decode_row_s": self.per_decode_row_s, "per_context_token_s": self.per_context_token_s,
                "r2": self.r2, "residual_p50_s": self.residual_p50_s, "residual_p90_s": self.residual_p90_s,
                "relative_p50": self.relative_p50, "samples": self.samples, "zeroed": list(self.zeroed)}


class ContextTracker:
    """Context tokens each step read, rebuilt for recordings without ``kv_tokens_read``: a
    request's context starts at its first admission's prefix hit, grows by what each step
    schedules for it, and starts over at 0 when it is preempted (its resumption's hit is not
    recorded)."""

    def __init__(self) -> None:
        self.context: dict[str, int] = {}

    def admitted(self, ev: RequestScheduled) -> None:
        self.context[ev.request_id] = ev.prefix_hit_tokens

    def step(self, ev: StepEvent) -> int:
        read = 0
        for rid, entry in ev.scheduled.items():
            n = int(entry[0])
            before = self.context.get(rid, 0)
            read += before + n
            self.context[rid] = before + n
        for rid in ev.preempted:
            self.context[rid] = 0
        for rid in ev.finished:
            self.context.pop(rid, None)
        return read


def step_samples(events: Iterable[Event]) -> list[StepSample]:
    """One sample per step that scheduled tokens, its seconds as the module doc says."""
    contexts = ContextTracker()
    last_end: dict[int, float] = {}
    left_work: dict[int, bool] = {}
    rows: list[tuple[int, int, int, float, float | None]] = []
    for ev in events:
        if isinstance(ev, RequestScheduled):
            contexts.admitted(ev)
        elif isinstance(ev, StepEvent):
            rebuilt = contexts.step(ev)
            rank = ev.dp_rank
            gap = max(0.0, ev.t - ev.duration_s - last_end[rank]) if left_work.get(rank) else None
            last_end[rank] = ev.t
            left_work[rank] = ev.num_running + ev.num_waiting > 0
            if ev.num_prefill_tokens + ev.num_decode_tokens > 0:
                rows.append((ev.num_prefill_tokens, ev.num_decode_tokens, ev.kv_tokens_read or rebuilt,
                             ev.duration_s, gap))
    gaps = [g for *_, g in rows if g is not None]
    usual = statistics.median(gaps) if gaps else 0.0
    return [StepSample(p, d, k, s + (usual if g is None else g)) for p, d, k, s, g in rows]


def _solve(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """Least squares with every coefficient >= 0: a coefficient that fits below zero is fixed at
    zero and the others fitted again (columns scaled to 1 so their sizes do not matter)."""
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active] / scale[active], y, rcond=None)
        sol = sol / scale[active]
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return coef, [i for i in range(x.shape[1]) if i not in active]


def fit_step_cost(samples: Sequence[StepSample]) -> StepFit:
    if len(samples) < MIN_STEPS:
        raise UserError(f"the recording has {len(samples)} steps with tokens: fitting this machine's step cost needs "
                        f"at least {MIN_STEPS} (record a longer run, or give --hardware a GPU preset)")
    x = np.array([[1.0, s.prefill, s.decode, s.kv_read] for s in samples])
    y = np.array([s.seconds for s in samples])
    coef, zeroed = _solve(x, y)
    resid = y - x @ coef
    ss_tot = float(((y - y.mean()) ** 2).sum())
    ss_res = float((resid**2).sum())
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)
    absolute = np.abs(resid)
    relative = absolute / np.maximum(y, MIN_STEP_S)
    a, b, c, d = (float(v) for v in coef)
    return StepFit(a, b, c, d, r2=r2, residual_p50_s=float(np.percentile(absolute, 50)),
                   residual_p90_s=float(np.percentile(absolute, 90)), relative_p50=float(np.median(relative)),
                   samples=len(samples), mean_step_s=float(y.mean()),
                   zeroed=tuple(("intercept", *FEATURES)[i] for i in zeroed))


def fit_recording(events: Iterable[Event]) -> StepFit:
    """The step cost of the machine that made a recording."""
    return fit_step_cost(step_samples(events))
