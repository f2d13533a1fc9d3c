"""Synthetic workloads for ``engine run-workload`` and ``make demo``: random
prompts drawn from the tokenizer's ordinary vocabulary, optional shared prefixes
(to exercise prefix caching), Poisson arrivals in seconds."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.errors import UserError


@dataclass(slots=True)
class WorkloadRequest:
    arrival_s: float
    prompt_token_ids: list[int]
    max_tokens: int


def parse_range(text: str, flag: str, hi_exclusive: bool = False) -> tuple[int, int]:
    """``"64:512"`` -> (64, 512); ``"128"`` -> (128, 128). With ``hi_exclusive``
    (numpy's ``integers(lo, hi)``, as ``engine simulate`` draws the background's
    workloads) ``"1000"`` -> (1000, 1001) and LO must be below HI."""
    parts = str(text).replace(",", "").replace("_", "").split(":")
    try:
        values = [int(p) for p in parts] if len(parts) in (1, 2) else []
    except ValueError:
        values = []
    if len(values) == 1:
        values.append(values[0] + 1 if hi_exclusive else values[0])
    lo, hi = values if len(values) == 2 else (0, -1)
    if lo < 1 or hi < lo or (hi_exclusive and hi == lo):
        kind = "LO:HI with HI exclusive" if hi_exclusive else "A:B with 1 <= A <= B"
        raise UserError(f"{flag} {text!r}: give a length or a range {kind}, for example 64:512")
    return lo, hi


def make_workload(
    num_requests: int,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    vocab_ids: np.ndarray,
    rate: float = float("inf"),
    seed: int = 0,
    shared_prefix_fraction: float = 0.0,
    shared_prefix_len: int = 256,
) -> list[WorkloadRequest]:
    """``rate`` requests per second with exponential gaps (inf: all at time 0).
    A ``shared_prefix_fraction`` of the requests start with the same
    ``shared_prefix_len`` tokens (a system prompt), so prefix caching has hits."""
    if num_requests < 1:
        raise UserError(f"--num-requests {num_requests}: must be at least 1")
    if not 0 <= shared_prefix_fraction <= 1:
        raise UserError(f"--shared-prefix-fraction {shared_prefix_fraction}: must be in [0, 1]")
    if rate <= 0:
        raise UserError(f"--rate {rate}: must be positive (inf sends everything at once)")
    rng = np.random.default_rng(seed)
    prefix = rng.choice(vocab_ids, shared_prefix_len).tolist()
    t = 0.0
    out: list[WorkloadRequest] = []
    for _ in range(num_requests):
        n = int(rng.integers(prompt_len[0], prompt_len[1] + 1))
        m = int(rng.integers(output_len[0], output_len[1] + 1))
        ids = rng.choice(vocab_ids, n).tolist()
        if shared_prefix_fraction and rng.random() < shared_prefix_fraction:
            ids = (prefix + ids)[: max(n, shared_prefix_len + 1)]
        out.append(WorkloadRequest(arrival_s=t, prompt_token_ids=ids, max_tokens=m))
        if rate != float("inf"):
            t += float(rng.exponential(1.0 / rate))
    return out


def ordinary_token_ids(vocab_size: int, special_ids: set[int]) -> np.ndarray:
    """Token ids safe for synthetic prompts: everything except special tokens."""
    ids = np.arange(vocab_size)
    if special_ids:
        ids = ids[~np.isin(ids, np.fromiter(special_ids, dtype=np.int64))]
    return ids


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


def drive_workload(engine: object, workload: list[WorkloadRequest], realtime: bool = True,
                   should_stop: object = None) -> WorkloadSummary:
    """Feed ``workload`` to an :class:`~engine.llm_engine.LLMEngine` at its arrival
    times (``realtime``) or all at once, stepping until every request is done."""
    import time

    from engine.core.sampling_params import SamplingParams
    from engine.llm_engine import LLMEngine

    assert isinstance(engine, LLMEngine)
    collector = SummaryCollector()
    engine.bus.subscribe(collector)
    pending = sorted(workload, key=lambda r: r.arrival_s)
    start = time.monotonic()
    index = 0
    try:
        while index < len(pending) or engine.has_unfinished():
            if callable(should_stop) and should_stop():
                break
            elapsed = time.monotonic() - start
            while index < len(pending) and (not realtime or pending[index].arrival_s <= elapsed):
                req = pending[index]
                engine.add_request(req.prompt_token_ids,
                                   SamplingParams(temperature=0.0, max_tokens=req.max_tokens, ignore_eos=True))
                index += 1
            if engine.has_unfinished():
                engine.step()
            elif index < len(pending):
                time.sleep(min(0.05, max(0.0, pending[index].arrival_s - elapsed)))
    finally:
        engine.bus.unsubscribe(collector)
    collector.summary.wall_s = time.monotonic() - start
    return collector.summary
