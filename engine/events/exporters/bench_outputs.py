"""The outputs of ``vllm bench``, folded from kvscope's events, so a kvscope run can sit in
the tables people keep of vLLM's.

:func:`serve_result` is ``vllm bench serve --save-result``'s JSON (vLLM 0.32,
``vllm/benchmarks/serve.py``: the setup keys, ``benchmark_result``'s totals and
per-request lists, then ``mean_/median_/std_/pNN_`` of each selected metric in
milliseconds; ttft, tpot and itl by default, percentile 99) from a run's
``request.arrived`` / ``request.finished`` events. :func:`startup_result` is ``vllm
bench startup --output-json``'s (``vllm/benchmarks/startup.py``: ``avg_cold_startup_time``,
``cold_startup_times``, ``cold_startup_percentiles`` and the same for compilation and
warm starts) from recordings' ``startup.phase`` events, with each phase beside it.

A start is *warm* when it reused stored work (phase D's stored activation
measurement, ``cached``), as vLLM's warm start reuses its compile cache; else cold.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import numpy as np

from engine.events.folds.request_record import RequestFold, RequestRecord
from engine.events.phase_data import GraphsCompileData, ProfileRunData, read_phase
from engine.events.record import Event
from engine.events.request_records import RequestFinished
from engine.events.startup_records import EngineConfigEvent, StartupPhase

DEFAULT_PERCENTILES: tuple[float, ...] = (99.0,)  # vllm bench serve --metric-percentiles
DEFAULT_PERCENTILE_METRICS: tuple[str, ...] = ("ttft", "tpot", "itl")  # its default for generation
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
STARTUP_PERCENTAGES = (10, 25, 50, 75, 90, 99)  # vllm bench startup's PERCENTAGES


def serve_result(events: Iterable[Event], *, model_id: str | None = None, tokenizer_id: str | None = None,
                 backend: str = "kvscope", label: str | None = None, num_prompts: int | None = None,
                 request_rate: float = math.inf, burstiness: float = 1.0, max_concurrency: int | None = None,
                 percentiles: Sequence[float] = DEFAULT_PERCENTILES,
                 percentile_metrics: Sequence[str] = DEFAULT_PERCENTILE_METRICS,
                 date: datetime | None = None) -> dict[str, Any]:
    """``vllm bench serve``'s result JSON for the requests in ``events``. Each request's
    clock starts when it was received (``request.arrived``'s time less its
    ``preprocess_s``), as the client's does; durations are seconds in the lists and
    milliseconds in the statistics, as vLLM writes them. ``model_id`` defaults to the
    model the run's ``engine.config`` event names."""
    unknown = [m for m in percentile_metrics if m not in PERCENTILE_METRICS]
    if unknown:
        raise ValueError(f"percentile metrics {unknown}: vllm bench serve knows {', '.join(PERCENTILE_METRICS)}")
    model_id, done = _finished_requests(events, model_id)
    finishes = [_finish(r) for r in done]
    ok = [f.reason in ("stop", "length") for f in finishes]
    return {
        "date": (date or datetime.now()).strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": backend,
        "backend": backend,
        "label": label,
        "model_id": model_id or "",
        "tokenizer_id": tokenizer_id or model_id or "",
        "num_prompts": num_prompts if num_prompts is not None else len(done),
        "request_rate": request_rate if request_rate < math.inf else "inf",
        "burstiness": burstiness,
        "max_concurrency": max_concurrency,
        **_benchmark_result(done, finishes, ok),
        **_statistics(_series(finishes, ok), percentile_metrics, percentiles),
    }


def _benchmark_result(done: list[RequestRecord], finishes: list[RequestFinished], ok: list[bool]) -> dict[str, Any]:
    """``benchmark_result``'s totals and per-request lists, in vLLM's key order."""
    starts = [_received(r) for r in done]
    first = min(starts, default=0.0)
    ends = [start + f.e2e_s for start, f in zip(starts, finishes, strict=True)]
    duration = (max(ends) - first) if ends else 0.0
    total_input = sum(r.prompt_tokens for r, good in zip(done, ok, strict=True) if good)
    total_output = sum(f.output_tokens for f, good in zip(finishes, ok, strict=True) if good)
    per_second, concurrent = _per_second_peaks(starts, finishes, first)
    return {
        "duration": duration,
        "completed": sum(ok),
        "failed": len(done) - sum(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": sum(ok) / duration if duration else 0.0,
        "request_goodput": None,
        "output_throughput": total_output / duration if duration else 0.0,
        "total_token_throughput": (total_input + total_output) / duration if duration else 0.0,
        "input_lens": [r.prompt_tokens for r in done],
        "output_lens": [f.output_tokens for f in finishes],
        "ttfts": [f.ttft_s or 0.0 for f in finishes],
        "itls": [list(f.inter_token_latencies_s) for f in finishes],
        "latencies": [f.e2e_s for f in finishes],
        "start_times": [start - first for start in starts],
        "queue_times": [f.queue_time_s for f in finishes],
        "generated_texts": [f.output_text or "" for f in finishes],
        "errors": [f.error or "" for f in finishes],
        "max_output_tokens_per_s": per_second,
        "max_concurrent_requests": concurrent,
        "rtfx": 0.0,
    }


def _series(finishes: list[RequestFinished], ok: list[bool]) -> dict[str, list[float]]:
    """Each percentile metric's values over the successful requests, in seconds."""
    good = [f for f, success in zip(finishes, ok, strict=True) if success]
    return {"ttft": [f.ttft_s or 0.0 for f in good],
            "tpot": [(f.e2e_s - (f.ttft_s or 0.0)) / (f.output_tokens - 1) for f in good if f.output_tokens > 1],
            "itl": [x for f in good for x in f.inter_token_latencies_s],
            "e2el": [f.e2e_s for f in good]}


def _finished_requests(events: Iterable[Event], model_id: str | None) -> tuple[str | None, list[RequestRecord]]:
    """The records of the requests that arrived and finished, in the order they were received,
    and ``model_id`` or else the model the run's first ``engine.config`` names."""
    fold = RequestFold(finished_kept=None)
    for event in events:
        fold(event)
        if isinstance(event, EngineConfigEvent) and model_id is None:
            model_id = str(event.model.get("name") or event.config.get("model") or "")
    done = [r for r in fold.lives.values() if r.arrival is not None and r.finished is not None]
    done.sort(key=_received)
    return model_id, done


def _received(request: RequestRecord) -> float:
    """When the server received it: its arrival less the preprocessing before it."""
    arrival = request.arrival
    assert arrival is not None
    return arrival.t - arrival.preprocess_s


def _finish(request: RequestRecord) -> RequestFinished:
    assert request.finished is not None
    return request.finished


def _statistics(series: dict[str, list[float]], metrics: Sequence[str],
                percentiles: Sequence[float]) -> dict[str, float]:
    """``mean_/median_/std_/pNN_`` of each selected metric, in milliseconds."""
    out: dict[str, float] = {}
    for metric in metrics:
        values = series[metric] or [0.0]
        out[f"mean_{metric}_ms"] = float(np.mean(values)) * 1000
        out[f"median_{metric}_ms"] = float(np.median(values)) * 1000
        out[f"std_{metric}_ms"] = float(np.std(values)) * 1000
        for p in percentiles:
            word = str(int(p)) if int(p) == p else str(p)
            out[f"p{word}_{metric}_ms"] = float(np.percentile(values, p)) * 1000
    return out


def _per_second_peaks(starts: list[float], finishes: list[RequestFinished], first: float) -> tuple[float, int]:
    """vLLM's ``max_output_tokens_per_s`` and ``max_concurrent_requests``: tokens by the
    whole second they arrived in (first token at TTFT, each next one an ITL later), and the
    most requests in flight in any such second."""
    tokens: dict[int, int] = {}
    active: dict[int, int] = {}
    for start, f in zip(starts, finishes, strict=True):
        if f.ttft_s is None:
            continue
        t = start - first + f.ttft_s
        stamps = [t]
        for gap in f.inter_token_latencies_s:
            t += gap
            stamps.append(t)
        for stamp in stamps:
            tokens[int(stamp)] = tokens.get(int(stamp), 0) + 1
        for second in range(int(start - first), int(start - first + f.e2e_s) + 1):
            active[second] = active.get(second, 0) + 1
    return float(max(tokens.values(), default=0)), max(active.values(), default=0)


# ------------------------------------------------------------------ startup
@dataclass(slots=True)
class StartupRun:
    """One start as its phase events tell it."""

    source: str
    total_s: float
    compilation_s: float
    warm: bool
    phases: dict[str, float] = field(default_factory=dict)  # "A init" -> seconds


def startup_run(events: Iterable[Event], source: str = "") -> StartupRun | None:
    """A recording's start (rank 0's phases), or None when it has no finished phase G."""
    phases: dict[str, float] = {}
    warm, compilation = False, 0.0
    ready = False
    for event in events:
        if not isinstance(event, StartupPhase) or event.rank or event.status not in ("end", "skipped"):
            continue
        phases[f"{event.phase} {event.name}"] = event.duration_s or 0.0
        profile = read_phase(event, ProfileRunData)
        graphs = read_phase(event, GraphsCompileData)
        if profile is not None:
            warm = profile.cached is True
        elif graphs is not None:
            compile_s = graphs.compile_seconds
            compilation = float(compile_s) if isinstance(compile_s, int | float) else 0.0  # torch.compile's, as vLLM's
        elif event.phase == "G":
            ready = True
    if not ready:
        return None
    return StartupRun(source, sum(phases.values()), compilation, warm, phases)


def startup_result(runs: Sequence[StartupRun]) -> dict[str, Any]:
    """``vllm bench startup --output-json``'s object, plus ``phases``: each phase's
    mean seconds over the cold and the warm starts (kvscope's own breakdown)."""
    out: dict[str, Any] = {}
    for kind in ("cold", "warm"):
        chosen = [r for r in runs if r.warm == (kind == "warm")]
        if not chosen:
            continue
        for suffix, values in (("startup", [r.total_s for r in chosen]),
                               ("compilation", [r.compilation_s for r in chosen])):
            key = f"{kind}_{suffix}"
            out[f"avg_{key}_time"] = float(np.mean(values))
            out[f"{key}_times"] = values
            out[f"{key}_percentiles"] = dict(zip(STARTUP_PERCENTAGES,
                                                 np.percentile(values, STARTUP_PERCENTAGES).tolist(), strict=True))
        names = list(dict.fromkeys(name for r in chosen for name in r.phases))
        out.setdefault("phases", {})[kind] = {
            name: statistics.fmean(r.phases.get(name, 0.0) for r in chosen) for name in names}
    return out


def startup_lines(result: dict[str, Any]) -> list[str]:
    """The report as ``vllm bench startup`` prints it, then the phases."""
    lines = ["=" * 60, "STARTUP TIME BENCHMARK RESULTS", "=" * 60]
    for kind in ("cold", "warm"):
        if f"avg_{kind}_startup_time" not in result:
            continue
        lines += ["", f"{kind.upper()} STARTUP:"]
        for suffix, name in (("startup", "Startup time"), ("compilation", "Compilation time")):
            lines.append(f"Avg {name.lower()}: {result[f'avg_{kind}_{suffix}_time']:.2f} seconds")
        for suffix, name in (("startup", "Startup time"), ("compilation", "Compilation time")):
            lines.append(f"{name} percentiles:")
            lines += [f"  {pct}%: {val:.2f} seconds" for pct, val in result[f"{kind}_{suffix}_percentiles"].items()]
        lines.append("Phases (mean seconds):")
        lines += [f"  {name}: {seconds:.2f}" for name, seconds in result["phases"][kind].items()]
    lines.append("=" * 60)
    return lines
