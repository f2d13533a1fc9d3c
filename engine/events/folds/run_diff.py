"""What changed between two recordings of a run (``engine diff A.jsonl B.jsonl``).

Each recording is folded into a :class:`RunProfile` from its events alone: the flags and
the model summary (``engine.config``), the requests as they arrived (the workload), the
startup phases' seconds, the KV pool (phase E), every step's time by batch shape, TTFT,
inter-token and end-to-end latencies, preemptions, prefix-cache hits and the block peak
(the last four through :class:`~engine.events.folds.tally.RunTally`, the simulator's and the
driver's own fold). :func:`diff_runs` sets two profiles side by side.

Two runs are comparable when the engine (real or simulated), the model, the flags and
the workload are the same; :func:`comparability` names each field that differs. What the
run happened on (torch, CPU, threads, the simulator's GPU and efficiency) is reported but
never blocks: a change of machine or cost model is what such a diff is for.

The verdict is noise-aware. Step times are compared per batch shape (a class of prefill
tokens x a class of decode sequences), so a workload whose batches differ does not pass
for a slower engine, and by the ratio of the two medians (B / A) with a seeded bootstrap
95 % interval: a shape regressed when its median ratio exceeds ``1 + threshold`` and the
whole interval lies above 1. A median, not a mean: one recompute after a preemption or a
pause of the host moves a mean and barely a median; the interval is wide where a shape
has few or scattered steps, so noise reads as unchanged. (A rank test such as
Mann-Whitney's would need scipy, which kvscope does not depend on; the bootstrap needs
numpy only.) Steps within one run are not independent (consecutive decode steps share a
batch and the host's load), so the interval is a guide to the noise, not an exact
probability; and it sees the noise within each run, not a host whose load changed between
the two runs, which only recording them back to back (or a larger threshold) guards against. TTFT, inter-token and end-to-end latencies are reported (percentiles, the
ratio of medians) but not judged: they follow from the step times and the scheduling,
and the requests of one batch share their TTFT, so a bootstrap over requests would claim
a certainty it does not have.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.events.folds.tally import RunTally
from engine.events.phase_data import InitData, KvCacheData, ProfileRunData, read_phase
from engine.events.record import Event
from engine.events.request_records import RequestArrived, RequestFinished
from engine.events.startup_records import PHASES, EngineConfigEvent, StartupPhase
from engine.events.step_records import StepEvent

# Flags that change what a run records or how it is named, not what it computes.
RECORDING_ONLY_FLAGS = frozenset({"events_path", "served_model_name", "stats_interval", "log_prompts"})
# Compared under "model" (the summary) and "environment" (the cost model), not as flags.
FLAGS_COMPARED_ELSEWHERE = frozenset({"model", "simulation"})
# The model summary's file path differs between machines that hold the same model.
MODEL_FIELDS_IGNORED = frozenset({"path"})
# Phase A's facts about the machine: reported when they differ, never blocking.
ENVIRONMENT_FIELDS = ("torch", "device", "gpu", "threads", "triton", "cuda", "gpu_name", "driver", "cpu_count",
                      "dtype", "cpu")

DEFAULT_THRESHOLD = 0.10
MIN_SAMPLES = 5  # fewer steps (or requests) of a kind in either run: too few to judge
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0
INTERVAL = (2.5, 97.5)  # percentiles of the bootstrap ratios: a 95 % interval
PERCENTILES = (50, 90, 99)

REGRESSION = "regression"
IMPROVEMENT = "improvement"
UNCHANGED = "unchanged"
TOO_FEW = "too few samples"
ONLY_IN_A = "only in A"
ONLY_IN_B = "only in B"

# Upper bounds of the prefill-token classes after 0 (factors of 4: one step of a CPU
# engine and one of an H100 both land in a few classes); above the last: one more class.
PREFILL_CLASS_BOUNDS = (64, 256, 1024, 4096, 16384)


@dataclass(frozen=True, order=True)
class BatchShape:
    """A class of steps: ``prefill`` the prefill-token class (0 for none, then up to 64,
    256, ... tokens), ``decode`` the decode-sequence class (0, 1, 2-3, 4-7, ...: the
    count's bit length)."""

    prefill: int
    decode: int

    @classmethod
    def of(cls, prefill_tokens: int, decode_seqs: int) -> BatchShape:
        if prefill_tokens <= 0:
            prefill = 0
        else:
            prefill = next((i + 1 for i, bound in enumerate(PREFILL_CLASS_BOUNDS) if prefill_tokens <= bound),
                           len(PREFILL_CLASS_BOUNDS) + 1)
        return cls(prefill, max(0, decode_seqs).bit_length())

    @property
    def prefill_label(self) -> str:
        if self.prefill == 0:
            return "0"
        if self.prefill > len(PREFILL_CLASS_BOUNDS):
            return f">{PREFILL_CLASS_BOUNDS[-1]}"
        low = PREFILL_CLASS_BOUNDS[self.prefill - 2] + 1 if self.prefill > 1 else 1
        return f"{low}-{PREFILL_CLASS_BOUNDS[self.prefill - 1]}"

    @property
    def decode_label(self) -> str:
        if self.decode <= 1:
            return str(self.decode)
        return f"{2 ** (self.decode - 1)}-{2 ** self.decode - 1}"

    @property
    def label(self) -> str:
        return f"prefill {self.prefill_label} tokens, decode {self.decode_label} seqs"


@dataclass(frozen=True)
class PhaseTime:
    name: str
    seconds: float | None
    status: str  # end | skipped | failed
    cached: bool = False  # phase D read a stored measurement instead of running


@dataclass
class RunProfile:
    """One recording, folded: what :func:`diff_runs` compares."""

    name: str
    simulated: bool = False
    truncated: bool = False
    flags: dict[str, Any] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)
    environment: dict[str, Any] = field(default_factory=dict)
    workload: tuple[tuple[Any, ...], ...] = ()  # one (prompt tokens, max tokens, priority, sampling) per request, sorted
    arrival_span_s: float = 0.0  # first arrival to last: 0 when every request came at once
    phases: dict[str, PhaseTime] = field(default_factory=dict)
    kv_blocks: int | None = None
    kv_pool_bytes: int | None = None
    step_seconds: dict[BatchShape, list[float]] = field(default_factory=dict)
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    tally: RunTally = field(default_factory=RunTally)

    @property
    def steps(self) -> int:
        return self.tally.steps

    @property
    def prefix_hit_rate(self) -> float | None:
        queried = self.tally.prefix_query_tokens
        return self.tally.prefix_hit_tokens / queried if queried else None

    @property
    def busy_seconds(self) -> float:
        return sum(sum(times) for times in self.step_seconds.values())

    @property
    def kind(self) -> str:
        return "simulator" if self.simulated else "real engine"


def profile_run(events: Iterable[Event], flags: Mapping[str, Any], name: str = "",
                truncated: bool = False) -> RunProfile:
    """Fold a recording's events. ``flags``: the run's resolved flags (the header's,
    updated by its ``engine.config`` event: ``engine.sim.replay.recorded_flags``)."""
    profile = RunProfile(name=name, truncated=truncated, flags=dict(flags))
    simulation = flags.get("simulation")
    if isinstance(simulation, Mapping):
        profile.simulated = True
        profile.environment.update({f"simulation.{k}": v for k, v in simulation.items() if k != "num_blocks"})
    requests: list[tuple[Any, ...]] = []
    arrivals: list[float] = []
    pool_in_steps = 0  # scripted recordings have no phase E: the pool is what the step events say
    for event in events:
        profile.tally(event)
        if isinstance(event, StepEvent):
            decode_seqs = sum(1 for entry in event.scheduled.values() if entry[1] == "decode")
            shape = BatchShape.of(event.num_prefill_tokens, decode_seqs or event.num_decode_tokens)
            seconds = event.duration_s or event.forward_s  # the whole step; scripted runs have only forward_s
            profile.step_seconds.setdefault(shape, []).append(seconds)
            pool_in_steps = event.kv_blocks_total or pool_in_steps
        elif isinstance(event, RequestArrived):
            sampling = tuple(sorted(event.sampling.items())) if event.sampling else ()
            requests.append((event.prompt_tokens, event.max_tokens, event.priority, sampling))
            arrivals.append(event.t)
        elif isinstance(event, RequestFinished):
            profile.e2e_s.append(event.e2e_s)
        elif isinstance(event, EngineConfigEvent):
            profile.model = {k: v for k, v in event.model.items() if k not in MODEL_FIELDS_IGNORED}
        elif isinstance(event, StartupPhase) and event.status != "begin" and not event.rank:
            _fold_phase(profile, event)
    profile.workload = tuple(sorted(requests, key=repr))
    profile.arrival_span_s = max(arrivals) - min(arrivals) if arrivals else 0.0
    profile.ttft_s = list(profile.tally.ttft_s.values())
    profile.itl_s = list(profile.tally.itl_s)
    if profile.kv_blocks is None and pool_in_steps:
        profile.kv_blocks = pool_in_steps
    return profile


def _fold_phase(profile: RunProfile, event: StartupPhase) -> None:
    if event.simulated:
        profile.simulated = True
    cached = False
    if event.phase == "A" and (init := read_phase(event, InitData)) is not None:
        for name in ENVIRONMENT_FIELDS:
            value = getattr(init, name)
            if value is not None:
                profile.environment[name] = dict(value) if isinstance(value, Mapping) else value
    elif event.phase == "D" and (profile_data := read_phase(event, ProfileRunData)) is not None:
        cached = bool(profile_data.cached)
    elif event.phase == "E" and (kv := read_phase(event, KvCacheData)) is not None:
        profile.kv_blocks = kv.num_blocks
        profile.kv_pool_bytes = kv.kv_pool_bytes
    profile.phases[event.phase] = PhaseTime(event.name or PHASES.get(event.phase, ""), event.duration_s,
                                            event.status, cached)


# ------------------------------------------------------------------ comparability
@dataclass(frozen=True)
class Difference:
    """A field that differs between the two runs; ``kind`` is engine, model, flags,
    workload or environment (the last never makes two runs incomparable)."""

    kind: str
    field: str
    a: Any
    b: Any

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "field": self.field, "a": self.a, "b": self.b}


def comparability(a: RunProfile, b: RunProfile) -> list[Difference]:
    """Every engine, model, flag and workload field that differs: empty when the two runs
    measured the same thing, so a difference in their times is the engine's."""
    out: list[Difference] = []
    if a.simulated != b.simulated:
        out.append(Difference("engine", "engine", a.kind, b.kind))
    out += _mapping_differences("model", a.model, b.model)
    if not a.model and not b.model:  # scripted recordings: only the flag names the model
        out += _mapping_differences("model", {"model": a.flags.get("model")}, {"model": b.flags.get("model")})
    ignored = RECORDING_ONLY_FLAGS | FLAGS_COMPARED_ELSEWHERE
    out += _mapping_differences("flags", {k: v for k, v in a.flags.items() if k not in ignored},
                                {k: v for k, v in b.flags.items() if k not in ignored})
    out += workload_differences(a, b)
    return out


def environment_differences(a: RunProfile, b: RunProfile) -> list[Difference]:
    return _mapping_differences("environment", a.environment, b.environment)


def _mapping_differences(kind: str, a: Mapping[str, Any], b: Mapping[str, Any]) -> list[Difference]:
    return [Difference(kind, key, a.get(key), b.get(key)) for key in sorted(set(a) | set(b))
            if a.get(key) != b.get(key)]


_WORKLOAD_PARTS = ("prompt_tokens", "max_tokens", "priority", "sampling")
# Arrival spans this close are one arrival pattern: a real run's arrivals jitter by the
# host's timing, and a simulator's are published at step boundaries.
ARRIVAL_SPAN_SLACK_S = 0.5
ARRIVAL_SPAN_TOLERANCE = 0.25


def workload_differences(a: RunProfile, b: RunProfile) -> list[Difference]:
    """How two workloads differ: the number of requests; each part of a request (prompt
    lengths, output limits, priorities, sampling) whose values differ, lengths with their
    totals; and the arrival pattern (all at once, or spread over how long)."""
    out: list[Difference] = []
    if len(a.workload) != len(b.workload):
        out.append(Difference("workload", "requests", len(a.workload), len(b.workload)))
    for i, part in enumerate(_WORKLOAD_PARTS):
        values_a = sorted((r[i] for r in a.workload), key=repr)
        values_b = sorted((r[i] for r in b.workload), key=repr)
        if part in ("prompt_tokens", "max_tokens"):
            if values_a != values_b:
                out.append(Difference("workload", part, _lengths(values_a), _lengths(values_b)))
        elif set(map(repr, values_a)) != set(map(repr, values_b)) or (
                len(values_a) == len(values_b) and values_a != values_b):
            out.append(Difference("workload", part, _tally(values_a), _tally(values_b)))
    if not out and a.workload != b.workload:  # every part alike on its own, paired differently
        out.append(Difference("workload", "requests", "the same lengths, paired differently", "(see A)"))
    span_a, span_b = a.arrival_span_s, b.arrival_span_s
    if abs(span_a - span_b) > ARRIVAL_SPAN_SLACK_S + ARRIVAL_SPAN_TOLERANCE * max(span_a, span_b):
        out.append(Difference("workload", "arrivals", _arrivals(span_a), _arrivals(span_b)))
    return out


def _arrivals(span_s: float) -> str:
    return "all at once" if span_s < ARRIVAL_SPAN_SLACK_S else f"over {span_s:.2f} s"


def _tally(values: Sequence[Any]) -> str:
    counts: dict[str, int] = {}
    for v in values:
        counts[repr(v)] = counts.get(repr(v), 0) + 1
    return ", ".join(f"{n} x {v}" for v, n in sorted(counts.items()))


def _lengths(values: Sequence[int]) -> str:
    if not values:
        return "none"
    return f"{sum(values):,} in all ({min(values):,}-{max(values):,} per request)"


# ------------------------------------------------------------------- the verdict
@dataclass(frozen=True)
class Comparison:
    """One quantity judged: its samples' medians in A and B, the ratio B / A with its
    bootstrap interval, and the verdict (:data:`REGRESSION`, :data:`IMPROVEMENT`,
    :data:`UNCHANGED`, :data:`TOO_FEW`, :data:`ONLY_IN_A`, :data:`ONLY_IN_B`)."""

    name: str
    n_a: int
    n_b: int
    median_a: float | None
    median_b: float | None
    ratio: float | None
    low: float | None
    high: float | None
    verdict: str

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "n_a": self.n_a, "n_b": self.n_b, "median_a": self.median_a,
                "median_b": self.median_b, "ratio": self.ratio,
                "interval": None if self.low is None else [self.low, self.high], "verdict": self.verdict}


def median_ratio_interval(a: Sequence[float], b: Sequence[float], seed: int = BOOTSTRAP_SEED,
                          resamples: int = BOOTSTRAP_RESAMPLES) -> tuple[float, float, float]:
    """median(b) / median(a) and the bootstrap 95 % interval of that ratio: both samples
    resampled with replacement ``resamples`` times (seeded, so a diff is reproducible)."""
    xa, xb = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    rng = np.random.default_rng(seed)
    ratios = np.empty(resamples)
    rows = max(1, 2_000_000 // max(len(xa), len(xb)))  # resample in chunks: bounded memory for long runs
    for start in range(0, resamples, rows):
        n = min(rows, resamples - start)
        med_a = np.median(rng.choice(xa, size=(n, len(xa))), axis=1)
        med_b = np.median(rng.choice(xb, size=(n, len(xb))), axis=1)
        ratios[start:start + n] = _ratio(med_b, med_a)
    low, high = np.percentile(ratios, INTERVAL)
    return float(_ratio(np.median(xb), np.median(xa))), float(low), float(high)


def _ratio(b: Any, a: Any) -> Any:
    """b / a where 0 / 0 is 1 (two runs that took no time took the same time) and x / 0 is inf."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where((a == 0) & (b == 0), 1.0, np.divide(b, a))


def compare_samples(name: str, a: Sequence[float], b: Sequence[float], threshold: float,
                    seed: int = BOOTSTRAP_SEED) -> Comparison:
    median_a = float(np.median(a)) if len(a) else None
    median_b = float(np.median(b)) if len(b) else None
    if not len(a) or not len(b):
        return Comparison(name, len(a), len(b), median_a, median_b, None, None, None,
                          ONLY_IN_B if not len(a) else ONLY_IN_A)
    if len(a) < MIN_SAMPLES or len(b) < MIN_SAMPLES:  # no interval worth drawing
        ratio = float(_ratio(np.float64(median_b), np.float64(median_a)))
        return Comparison(name, len(a), len(b), median_a, median_b, ratio, None, None, TOO_FEW)
    ratio, low, high = median_ratio_interval(a, b, seed)
    if ratio > 1 + threshold and low > 1:
        verdict = REGRESSION
    elif ratio < 1 / (1 + threshold) and high < 1:
        verdict = IMPROVEMENT
    else:
        verdict = UNCHANGED
    return Comparison(name, len(a), len(b), median_a, median_b, ratio, low, high, verdict)


def percentiles(samples: Sequence[float]) -> dict[str, float] | None:
    if not len(samples):
        return None
    values = np.percentile(np.asarray(samples, dtype=np.float64), PERCENTILES)
    return {f"p{p}": float(v) for p, v in zip(PERCENTILES, values, strict=True)}


LATENCIES = (("ttft", "TTFT", "ttft_s"), ("itl", "inter-token latency", "itl_s"), ("e2e", "end-to-end latency", "e2e_s"))


@dataclass
class RunDiff:
    a: RunProfile
    b: RunProfile
    threshold: float
    differences: list[Difference]
    environment: list[Difference]
    shapes: list[tuple[BatchShape, Comparison]]
    latency_percentiles: dict[str, dict[str, dict[str, float] | None]]  # ttft/itl/e2e -> a/b -> p50/p90/p99

    @property
    def comparable(self) -> bool:
        return not self.differences

    @property
    def regressions(self) -> list[Comparison]:
        return [c for _, c in self.shapes if c.verdict == REGRESSION]

    @property
    def improvements(self) -> list[Comparison]:
        return [c for _, c in self.shapes if c.verdict == IMPROVEMENT]

    @property
    def exit_status(self) -> int:
        """1 when anything regressed beyond the threshold, else 0 (a usage error is 2, the CLI's)."""
        return 1 if self.regressions else 0

    def to_json(self) -> dict[str, Any]:
        return {
            "a": _profile_json(self.a),
            "b": _profile_json(self.b),
            "comparable": self.comparable,
            "differences": [d.to_json() for d in self.differences],
            "environment": [d.to_json() for d in self.environment],
            "threshold": self.threshold,
            "startup_phases": [
                {"phase": letter, "name": name, "a_s": sa, "b_s": sb, "cached_a": ca, "cached_b": cb}
                for letter, name, sa, sb, ca, cb in startup_rows(self.a, self.b)],
            "kv_pool": {"blocks": [self.a.kv_blocks, self.b.kv_blocks],
                        "bytes": [self.a.kv_pool_bytes, self.b.kv_pool_bytes],
                        "peak_blocks_used": [self.a.tally.peak_blocks_used, self.b.tally.peak_blocks_used]},
            "requests": {"finished": [self.a.tally.finished, self.b.tally.finished],
                         "preemptions": [self.a.tally.preemptions, self.b.tally.preemptions],
                         "prefix_hit_rate": [self.a.prefix_hit_rate, self.b.prefix_hit_rate]},
            "latency_percentiles_s": self.latency_percentiles,
            "step_shapes": [{"prefill_tokens": shape.prefill_label, "decode_seqs": shape.decode_label,
                             **c.to_json()} for shape, c in self.shapes],
            "regressions": [c.name for c in self.regressions],
            "verdict": REGRESSION if self.regressions else "no regression",
            "exit_status": self.exit_status,
        }


def _profile_json(p: RunProfile) -> dict[str, Any]:
    return {"recording": p.name, "engine": p.kind, "model": p.model.get("name") or p.flags.get("model"),
            "requests": len(p.workload), "steps": p.steps, "busy_s": p.busy_seconds, "truncated": p.truncated}


def startup_rows(a: RunProfile, b: RunProfile) -> list[tuple[str, str, float | None, float | None, bool, bool]]:
    """(phase, name, seconds in A, in B, A's phase D cached, B's) for each phase either run has."""
    rows = []
    for letter in sorted(set(a.phases) | set(b.phases)):
        pa, pb = a.phases.get(letter), b.phases.get(letter)
        either = pa or pb
        name = either.name if either is not None else PHASES.get(letter, "")
        rows.append((letter, name, pa.seconds if pa else None, pb.seconds if pb else None,
                     bool(pa and pa.cached), bool(pb and pb.cached)))
    return rows


def diff_runs(a: RunProfile, b: RunProfile, threshold: float = DEFAULT_THRESHOLD,
              seed: int = BOOTSTRAP_SEED) -> RunDiff:
    """Set two profiles side by side. The verdicts are computed whether or not the runs
    are comparable; the caller decides whether to trust them (``RunDiff.comparable``)."""
    if threshold < 0:
        raise ValueError(f"threshold {threshold}: must be 0 or more")
    shapes = [(shape, compare_samples(shape.label, a.step_seconds.get(shape, []), b.step_seconds.get(shape, []),
                                      threshold, seed))
              for shape in sorted(set(a.step_seconds) | set(b.step_seconds))]
    table = {key: {"a": percentiles(getattr(a, attr)), "b": percentiles(getattr(b, attr))}
             for key, _, attr in LATENCIES}
    return RunDiff(a, b, threshold, comparability(a, b), environment_differences(a, b), shapes, table)
