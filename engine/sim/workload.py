"""Workloads: which requests arrive when, with how many prompt and output tokens,
and the token ids that fill those counts. One generator for every command:
``engine simulate`` (the cost model), ``engine run-workload`` and ``engine demo``
(the real engine), the benchmarks and the tests.

A workload is a list of :class:`WorkloadRequest` (token counts and an arrival,
not text). It is drawn from a :class:`WorkloadSpec` (length ranges, arrival
pattern, shared-prefix fraction) by :func:`generate_workload`, or read from a
trace file by :func:`load_trace` (JSONL, one request per line:
``{"arrival_time": 0.25, "prompt_tokens": 812, "output_tokens": 128}``).

Draws follow the background's notebook exactly so its figures can be
reproduced: lengths come from ``numpy.random.default_rng(seed)`` as
``integers(lo, hi, n)`` prompts then ``integers(lo, hi, n)`` outputs, arrivals
from a second ``default_rng(seed)``, the shared-prefix choice from
``default_rng(seed + 1)``. Every length range is ``(lo, hi)`` with ``hi``
exclusive, like numpy's ``integers`` and a Python slice; on the command line
``LO:HI`` means the same and one number ``N`` means exactly ``N`` (``(N, N + 1)``).

A request's counts become token ids through a :class:`TokenIds` source, the same
way for both executors: :class:`TokenIdSource` (the simulator's synthetic ids,
cheap ranges that never collide) or :class:`VocabTokenIds` (the real engine's:
seeded draws from the tokenizer's ordinary vocabulary, :func:`ordinary_token_ids`).
Either way the shared-prefix requests start with the same ids, so prefix caching
hits, and no other two prompts share a prefix by design.

:func:`drive_workload` feeds a workload to a real :class:`~engine.llm_engine.LLMEngine`
at its arrival times and folds the run's events into a :class:`WorkloadSummary`
(:class:`SummaryCollector`, also the demo's bus subscriber).
"""

from __future__ import annotations

import dataclasses
import json
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from engine.errors import UserError

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

ARRIVALS = ("at-once", "uniform", "poisson")
ARRIVAL_UNITS = ("step", "s")
SHARED_PREFIX_FIRST_ID = 100  # the synthetic shared system prompt's token ids start here
UNIQUE_FIRST_ID = 1_000_000  # each request's own synthetic token ids start above this


# ------------------------------------------------------------------ requests
@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    """One request of a workload, in token counts. ``arrival_step`` (scheduler
    ticks, the simulator only) wins over ``arrival_time`` (seconds) when set;
    the first ``shared_prefix_tokens`` prompt tokens are the shared prefix."""

    request_id: str
    prompt_tokens: int
    output_tokens: int
    arrival_time: float = 0.0
    arrival_step: int | None = None
    shared_prefix_tokens: int = 0
    priority: int = 0
    # vision-language requests: (modality, tokens) of each item, counted in prompt_tokens and
    # placed right after the shared prefix (a system prompt, the images, then the question)
    mm_items: tuple[tuple[str, int], ...] = ()


def with_mm_items(workload: Sequence[WorkloadRequest], items: tuple[tuple[str, int], ...]) -> list[WorkloadRequest]:
    """Every request of ``workload`` carrying ``items`` (their tokens added to its prompt)."""
    extra = sum(tokens for _, tokens in items)
    return [dataclasses.replace(w, prompt_tokens=w.prompt_tokens + extra, mm_items=items) for w in workload]


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """How to draw a workload. Ranges are ``(lo, hi)`` with ``hi`` exclusive (numpy's
    ``integers``). ``arrival``: ``at-once`` | ``uniform`` (over ``window``) |
    ``poisson`` (``rate`` per unit); ``unit``: ``step`` | ``s``. A
    ``shared_prefix_fraction`` of the requests start with the same
    ``shared_prefix_tokens`` tokens (cut to the prompt's length minus one)."""

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
            raise UserError(f"--num-prompts {self.num_requests}: give at least 1")
        for flag, (lo, hi) in (("--random-input-len", self.prompt_range), ("--random-output-len", self.output_range)):
            if lo < 1 or hi <= lo:
                raise UserError(f"{flag} {lo}:{hi}: give LO:HI with 1 <= LO < HI (HI exclusive), or one number")
        if self.arrival not in ARRIVALS:
            raise UserError(f"--arrival {self.arrival!r}: use one of {', '.join(ARRIVALS)}")
        if self.unit not in ARRIVAL_UNITS:
            raise UserError(f"--arrival-unit {self.unit!r}: use step or s")
        if self.arrival == "uniform" and self.window <= 0:
            raise UserError("--arrival uniform needs --arrival-window > 0 (steps or seconds)")
        if self.arrival == "poisson" and self.rate <= 0:
            raise UserError("--arrival poisson needs --request-rate > 0 (requests per step or per second)")
        if not 0.0 <= self.shared_prefix_fraction <= 1.0:
            raise UserError(f"--shared-prefix-fraction {self.shared_prefix_fraction}: must be in [0, 1]")
        if self.shared_prefix_fraction > 0 and self.shared_prefix_tokens < 1:
            raise UserError("--shared-prefix-fraction needs --shared-prefix-len > 0")


def parse_range(text: str, flag: str) -> tuple[int, int]:
    """``"500:3000"`` -> (500, 3000), HI exclusive as numpy's ``integers`` draws;
    ``"1000"`` -> (1000, 1001), exactly 1,000. Commas and underscores are ignored."""
    parts = str(text).replace(",", "").replace("_", "").split(":")
    try:
        values = [int(p) for p in parts] if len(parts) in (1, 2) else []
    except ValueError:
        values = []
    if len(values) == 1:
        values.append(values[0] + 1)
    lo, hi = values if len(values) == 2 else (0, 0)
    if lo < 1 or hi <= lo:
        raise UserError(f"{flag} {text!r}: give a length N or a range LO:HI with 1 <= LO < HI "
                        "(HI exclusive), for example 64:512")
    return lo, hi


def generate_workload(spec: WorkloadSpec) -> list[WorkloadRequest]:
    """Draw the workload ``spec`` describes (deterministic for its seed)."""
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


# ------------------------------------------------------------------ sending a workload (the simulator's clock)
class Arrivals:
    """A workload's requests not yet sent and when each is due: closed-loop (``concurrency``
    requests in flight, the next sent in workload order when one finishes), by scheduler tick
    (``arrival_step``) or by simulated time. ``tick`` counts the steps run; ``in_flight`` the
    requests sent and not finished."""

    def __init__(self, workload: Sequence[WorkloadRequest], concurrency: int | None) -> None:
        self.by_step = any(w.arrival_step is not None for w in workload)
        if concurrency is not None and concurrency < 1:
            raise UserError(f"concurrency {concurrency}: must be at least 1")
        self.concurrency = concurrency
        if concurrency is not None:
            self.pending: deque[WorkloadRequest] = deque(workload)
        elif self.by_step:
            self.pending = deque(sorted(workload, key=lambda w: w.arrival_step or 0))
        else:
            self.pending = deque(sorted(workload, key=lambda w: w.arrival_time))
        self.in_flight = 0
        self.tick = 0

    def send_due(self, now: float, send: Callable[[WorkloadRequest, float], bool]) -> None:
        """Send every request due at ``now`` through ``send(request, arrival time)``, which says
        whether the scheduler took it."""
        pending = self.pending
        if self.concurrency is not None:
            while pending and self.in_flight < self.concurrency:
                self._send(pending.popleft(), now, send)
        elif self.by_step:
            while pending and (pending[0].arrival_step or 0) <= self.tick:
                self._send(pending.popleft(), now, send)
        else:
            while pending and pending[0].arrival_time <= now:
                spec = pending.popleft()
                self._send(spec, spec.arrival_time, send)

    def _send(self, spec: WorkloadRequest, arrival_time: float, send: Callable[[WorkloadRequest, float], bool]) -> None:
        if send(spec, arrival_time):
            self.in_flight += 1

    def skip_idle(self, now: float) -> float:
        """Nothing runs and requests are still to come: the clock (or tick) moves to the next
        arrival; returns the simulated time. Closed-loop, every finished request freed a slot
        and the next :meth:`send_due` sends more."""
        if self.concurrency is not None:
            return now
        if self.by_step:
            self.tick = max(self.tick + 1, self.pending[0].arrival_step or 0)
            return now
        return max(now, self.pending[0].arrival_time)


# ------------------------------------------------------------------ token ids
class TokenIds(Protocol):
    """Turns a request's counts into its prompt's token ids."""

    def prompt(self, req: WorkloadRequest) -> list[int]: ...


class TokenIdSource:
    """The simulator's synthetic prompt token ids: a shared run for the shared
    prefix, then ids no other request uses. Cheap (``range`` lists),
    deterministic, never a stop id (no model reads them)."""

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


def ordinary_token_ids(vocab_size: int, special_ids: set[int]) -> np.ndarray:
    """Token ids safe for synthetic prompts: everything except special tokens."""
    ids = np.arange(vocab_size)
    if special_ids:
        ids = ids[~np.isin(ids, np.fromiter(special_ids, dtype=np.int64))]
    return ids


class VocabTokenIds:
    """The real engine's prompt token ids: seeded draws from ``vocab_ids`` (the
    tokenizer's ordinary vocabulary, :func:`ordinary_token_ids`). The shared
    prefix is one fixed draw (``prefix[:k]`` is the same for every ``k``), each
    prompt's remainder is drawn in the order prompts are asked for, so a
    workload asked for in the same order gets the same ids for the same seed."""

    def __init__(self, vocab_ids: Sequence[int] | np.ndarray, seed: int = 0) -> None:
        self._vocab = np.asarray(vocab_ids)
        if self._vocab.size == 0:
            raise UserError("the tokenizer has no ordinary (non-special) token ids to draw prompts from")
        self._prefix_rng = np.random.default_rng([seed, 1])
        self._rng = np.random.default_rng([seed, 2])
        self._prefix: list[int] = []

    @classmethod
    def for_engine(cls, engine: LLMEngine, seed: int = 0) -> VocabTokenIds:
        """Draws from a started :class:`~engine.llm_engine.LLMEngine`'s ordinary vocabulary."""
        tok = engine.tokenizer
        vocab_size = engine.startup.model_config.vocab_size
        return cls(ordinary_token_ids(vocab_size, set(getattr(tok, "special_token_ids", set()))), seed)

    def prompt(self, req: WorkloadRequest) -> list[int]:
        k = req.shared_prefix_tokens
        if k > len(self._prefix):
            self._prefix += self._prefix_rng.choice(self._vocab, k - len(self._prefix)).tolist()
        return self._prefix[:k] + self._rng.choice(self._vocab, req.prompt_tokens - k).tolist()


# ------------------------------------------------------------------ the real engine
@dataclass(slots=True)
class WorkloadSummary:
    """Folded from ``request.finished`` / ``step`` events, like every other view."""

    requests: int = 0
    finished: dict[str, int] | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    steps: int = 0
    preemptions: int = 0
    wall_s: float = 0.0
    ttft_s: list[float] | None = None
    itl_s: list[float] | None = None
    e2e_s: list[float] | None = None

    def percentile(self, values: list[float] | None, q: float) -> float:
        return float(np.percentile(values, q)) if values else float("nan")

    def lines(self) -> list[str]:
        tput = self.output_tokens / self.wall_s if self.wall_s else 0.0
        return [
            f"requests: {self.requests} ({', '.join(f'{k} {v}' for k, v in sorted((self.finished or {}).items()))})",
            f"tokens: {self.prompt_tokens:,} prompt, {self.output_tokens:,} generated in {self.wall_s:.2f} s "
            f"-> {tput:.1f} output tok/s over {self.steps:,} steps, {self.preemptions} preemptions",
            f"TTFT p50 {self.percentile(self.ttft_s, 50) * 1e3:.0f} ms, p99 {self.percentile(self.ttft_s, 99) * 1e3:.0f} ms; "
            f"ITL p50 {self.percentile(self.itl_s, 50) * 1e3:.1f} ms, p99 {self.percentile(self.itl_s, 99) * 1e3:.1f} ms; "
            f"e2e p50 {self.percentile(self.e2e_s, 50):.2f} s",
        ]


class SummaryCollector:
    """A bus subscriber that folds a run's events into a :class:`WorkloadSummary`."""

    def __init__(self) -> None:
        self.summary = WorkloadSummary(finished={}, ttft_s=[], itl_s=[], e2e_s=[])

    def __call__(self, event: object) -> None:
        from engine.events import RequestFinished, StepEvent

        s = self.summary
        if isinstance(event, RequestFinished):
            s.requests += 1
            assert s.finished is not None and s.ttft_s is not None and s.itl_s is not None and s.e2e_s is not None
            s.finished[event.reason] = s.finished.get(event.reason, 0) + 1
            s.prompt_tokens += event.prompt_tokens
            s.output_tokens += event.output_tokens
            if event.ttft_s is not None:
                s.ttft_s.append(event.ttft_s)
            s.itl_s.extend(event.inter_token_latencies_s)
            s.e2e_s.append(event.e2e_s)
        elif isinstance(event, StepEvent):
            s.steps += 1
            s.preemptions += len(event.preempted)


def drive_workload(engine: object, workload: Sequence[WorkloadRequest], token_ids: TokenIds,
                   realtime: bool = True, should_stop: object = None) -> WorkloadSummary:
    """Feed ``workload`` to an :class:`~engine.llm_engine.LLMEngine` at its arrival
    times in seconds (``realtime``) or all at once, stepping until every request
    is done. Prompts come from ``token_ids`` in arrival order; each request
    generates exactly its ``output_tokens`` (greedy, EOS ignored)."""
    import time

    from engine.core.sampling_params import SamplingParams
    from engine.llm_engine import LLMEngine

    assert isinstance(engine, LLMEngine)
    collector = SummaryCollector()
    engine.bus.subscribe(collector)
    pending = sorted(workload, key=lambda r: r.arrival_time)
    start = time.monotonic()
    index = 0
    try:
        while index < len(pending) or engine.has_unfinished():
            if callable(should_stop) and should_stop():
                break
            elapsed = time.monotonic() - start
            while index < len(pending) and (not realtime or pending[index].arrival_time <= elapsed):
                req = pending[index]
                engine.add_request(token_ids.prompt(req),
                                   SamplingParams(temperature=0.0, max_tokens=req.output_tokens, ignore_eos=True))
                index += 1
            if engine.has_unfinished():
                engine.step()
            elif index < len(pending):
                time.sleep(min(0.05, max(0.0, pending[index].arrival_time - elapsed)))
    finally:
        engine.bus.unsubscribe(collector)
    collector.summary.wall_s = time.monotonic() - start
    return collector.summary
