"""From records to an explanation: ledger, budget, timeline, checks, failures with
fixes, and kvscope's own plan (and optionally a real kvscope run) beside vLLM's.

All budget arithmetic on kvscope's side comes from :mod:`engine.budget.memory`; this
module only reads vLLM's printed numbers and compares.

Tolerance rule for checks: a number printed with d decimals is known to one
unit of its last digit (10^-d). Rounding alone would allow half a unit, but the
figures people paste are not always rounded (the background notebook prints
53.97 GiB as "53.9"), and vLLM's ``format_gib`` drops trailing zeros, so "53.9"
may stand for anything from 53.85 to 53.99. A derived quantity carries the sum
of its inputs' tolerances.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from engine.budget.fixes import Fix
from engine.budget.memory import GiB, MemoryPlan, bytes_per_kv_token, gpu_preset, plan_memory
from engine.budget.vision import multimodal_from_flags
from engine.errors import UserError
from engine.events import Recording
from engine.events.ledger import BY_NAME as LEDGER_ITEM
from engine.events.phase_data import (
    BudgetData,
    GraphsCompileData,
    KvCacheData,
    LoadWeightsData,
    PhaseData,
    ProfileRunData,
    phase_record,
)
from engine.events.phase_names import PHASE_SPANS, vllm_group
from engine.modelspec.config import ModelConfig
from engine.modelspec.presets import resolve_preset_name
from engine.modelspec.readers import load_model_config
from logparse.catalogue import mask
from logparse.completeness import CompletenessWatch, Cut
from logparse.failed_start import StartupFailure, StartupWatch, kv_below_check, startup_outcome
from logparse.fastscan import BulkRun, iter_summary
from logparse.parser import Record, iter_records
from logparse.patterns import FIGURE_NAMES, LEDGER_KEYS, NOISE_SOURCES, PHASE_NAMES
from logparse.reconcile import (
    block_size,
    graph_in_pool,
    hybrid_concurrency,
    hybrid_hint,
    model_name,
    own_figures,
    tokens_follow_concurrency,
)
from logparse.startup_phases import PhaseClock, StartupTimes
from logparse.tracebacks import PLACE_PHASES, TracebackTracker

STARTUP_PHASES = "ABCDEFG"


@dataclass(slots=True)
class Options:
    """What the user told us beyond the log."""

    model: str | None = None
    gpu: str | None = None
    gpu_memory_gib: float | None = None
    gpu_memory_utilization: float | None = None
    profile: str | None = None


@dataclass(slots=True)
class Check:
    id: str
    title: str
    ok: bool | None  # None: not judged (an input is missing)
    detail: str
    kind: str = "check"  # check | failure | warning
    formula: str | None = None
    expected: float | None = None
    actual: float | None = None
    tolerance: float | None = None
    line: int | None = None
    fix: list[Fix] = field(default_factory=list)  # structured (engine/budget/fixes.py); text only at the edge

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "kind": self.kind,
            "title": self.title,
            "ok": self.ok,
            "formula": self.formula,
            "expected": self.expected,
            "actual": self.actual,
            "tolerance": self.tolerance,
            "detail": self.detail,
            "line": self.line,
            "fix": [f.text() for f in self.fix],
            "fixes": [f.to_json() for f in self.fix],
        }


@dataclass(slots=True)
class PhaseSpan:
    phase: str
    first_line: int
    last_line: int
    first_time: str | None = None
    last_time: str | None = None
    records: int = 0
    durations: dict[str, float] = field(default_factory=dict)

    @property
    def span_s(self) -> float | None:
        if not self.first_time or not self.last_time:
            return None
        try:
            a = datetime.strptime("2000-" + self.first_time, "%Y-%m-%d %H:%M:%S")
            b = datetime.strptime("2000-" + self.last_time, "%Y-%m-%d %H:%M:%S")
        except ValueError:
            return None
        return (b - a).total_seconds()

    @property
    def span_name(self) -> str:
        """The phase under vLLM's startup span name (engine/events/phase_names.py), so a
        timeline read from a log and a trace of the same start use the same words; R and X,
        which no span covers, keep logparse's own names."""
        span = PHASE_SPANS.get(self.phase)
        return span.span_name if span else PHASE_NAMES.get(self.phase, self.phase)

    def to_json(self) -> dict[str, Any]:
        return {
            "phase": self.phase,
            "name": self.span_name,
            "vllm_span": vllm_group(self.phase) if self.phase in PHASE_SPANS else None,
            "first_line": self.first_line,
            "last_line": self.last_line,
            "first_time": self.first_time,
            "last_time": self.last_time,
            "span_s": self.span_s,
            "records": self.records,
            "durations": dict(self.durations),
        }


UNKNOWN_TEMPLATES_KEPT = 2000  # distinct unknown templates counted (memory stays bounded on any log)
UNKNOWN_TEMPLATES_SHOWN = 20


@dataclass(slots=True)
class UnknownTemplate:
    """Unknown records that are one line masked alike (:func:`logparse.catalogue.mask`)."""

    template: str
    count: int
    first_line: int

    def to_json(self) -> dict[str, Any]:
        return {"template": self.template, "count": self.count, "first_line": self.first_line}


@dataclass(slots=True)
class Coverage:
    """How much of a log logparse explains, per record (line) and per template: records a
    hand-written pattern recognised (meaning, figures), records only the generated catalogue
    of vLLM's source knows (``catalogued``), records classed as another program's
    (``noise``, by source), and the unknown rest with their first lines (at most
    :data:`UNKNOWN_LINES_KEPT`), grouped by masked template so a warning printed a hundred
    times is one unknown template."""

    recognised: int = 0
    catalogued: int = 0
    noise: dict[str, int] = field(default_factory=lambda: dict.fromkeys(NOISE_SOURCES, 0))
    unknown: int = 0
    unknown_lines: list[int] = field(default_factory=list)
    known_templates: set[str] = field(default_factory=set)  # pattern ids, catalogue ids, noise sources
    unknown_templates: dict[str, UnknownTemplate] = field(default_factory=dict)
    unknown_templates_dropped: int = 0  # records of unknown templates past UNKNOWN_TEMPLATES_KEPT
    ray_folded: int = 0  # lines Ray printed once for many ('[repeated Nx across cluster]': N - 1 each)

    @property
    def records(self) -> int:
        return self.recognised + self.catalogued + sum(self.noise.values()) + self.unknown

    def add(self, record: Record) -> None:
        self.ray_folded += record.repeated - 1
        if record.pattern is not None:
            self.recognised += 1
            self.known_templates.add(record.pattern.id)
        elif record.template is not None:
            self.catalogued += 1
            self.known_templates.add(f"vllm:{record.template.id}")
        elif record.noise is not None:
            self.noise[record.noise] += 1
            self.known_templates.add(f"noise:{record.noise}")
        else:
            self.unknown += 1
            if len(self.unknown_lines) < UNKNOWN_LINES_KEPT:
                self.unknown_lines.append(record.line)
            key = mask(record.text)
            group = self.unknown_templates.get(key)
            if group is not None:
                group.count += 1
            elif len(self.unknown_templates) < UNKNOWN_TEMPLATES_KEPT:
                self.unknown_templates[key] = UnknownTemplate(key, 1, record.line)
            else:
                self.unknown_templates_dropped += 1

    def add_bulk(self, run: BulkRun) -> None:
        self.recognised += run.records
        self.known_templates.update(p.id for p in run.patterns)

    def top_unknown(self, n: int = UNKNOWN_TEMPLATES_SHOWN) -> list[UnknownTemplate]:
        return sorted(self.unknown_templates.values(), key=lambda t: (-t.count, t.first_line))[:n]

    def to_json(self) -> dict[str, Any]:
        total = self.records or 1
        templates = len(self.known_templates) + len(self.unknown_templates)
        return {"records": self.records, "recognised": self.recognised, "catalogued": self.catalogued,
                "noise": sum(self.noise.values()), "unknown": self.unknown,
                "unknown_share": round(self.unknown / total, 6), "ray_folded_lines": self.ray_folded,
                "noise_by_source": {k: v for k, v in self.noise.items() if v}, "unknown_lines": list(self.unknown_lines),
                "templates": {"known": len(self.known_templates), "unknown": len(self.unknown_templates),
                              "unknown_share": round(len(self.unknown_templates) / (templates or 1), 6),
                              "unknown_records_beyond_kept": self.unknown_templates_dropped},
                "unknown_templates": [t.to_json() for t in self.top_unknown()]}

UNKNOWN_LINES_KEPT = 200
MAX_KEPT_RECORDS = 10_000  # records explain keeps to show (each up to ~18 kB); the fold sees every one


@dataclass(slots=True)
class Explanation:
    path: str
    records: list[Record]
    record_count: int
    unrecognised: int  # records neither recognised nor classed as noise
    facts: dict[str, Any]
    printed: dict[str, str]
    fact_lines: dict[str, int]
    timeline: list[PhaseSpan]
    checks: list[Check]
    budget: dict[str, Any]
    plan: dict[str, Any]
    kvscope_plan: MemoryPlan | None = None
    coverage: Coverage = field(default_factory=Coverage)
    startup: StartupFailure | None = None  # the failed start (or runtime death) logparse/failed_start.py found
    cuts: list[Cut] = field(default_factory=list)  # how the log is not whole (logparse/completeness.py)
    # each startup phase's seconds (logparse/startup_phases.py)
    startup_times: StartupTimes = field(default_factory=lambda: StartupTimes([], None))

    @property
    def ledger(self) -> dict[str, Any]:
        return {key: self.facts.get(key) for key in LEDGER_KEYS}

    def to_json(self, with_records: bool = True) -> dict[str, Any]:
        return {
            "records": [r.to_json() for r in self.records] if with_records else [],
            "checks": [c.to_json() for c in self.checks],
            "plan": self.plan,
            "ledger": self.ledger,
            "coverage": self.coverage.to_json(),
            "timeline": [span.to_json() for span in self.timeline],
            "startup": self.startup.to_json() if self.startup is not None else None,
            "cuts": [cut.to_json() for cut in self.cuts],
            "startup_times": self.startup_times.to_json(),
        }


# ------------------------------------------------------------------ folding records
def _decimals(printed: str | None) -> int:
    if not printed or "." not in printed:
        return 0
    return len(printed.split(".", 1)[1])


def unit(printed: str | None) -> float:
    """One unit of the last printed digit (see the module doc)."""
    return 10.0 ** -_decimals(printed) if printed and "." in printed else 0.0


def explain(source: str | Path | Iterable[bytes | str], options: Options | None = None,
            keep_records: bool = True) -> Explanation:
    """Fold a log's records into an explanation. Without ``keep_records`` a file is read by
    the fast summary (logparse/fastscan.py), which counts runs of stats and access lines
    instead of reading each; both fold the same records."""
    options = options or Options()
    fold = _Fold(keep_records)
    items: Iterable[Record | BulkRun] = (
        iter_summary(source) if not keep_records and isinstance(source, str | Path) else iter_records(source))
    for item in items:
        if isinstance(item, BulkRun):
            fold.add_run(item)
        else:
            fold.add(item)
    facts, printed, fact_lines, spans = fold.facts, fold.printed, fold.fact_lines, fold.spans
    failures, count = fold.failures, fold.coverage.records
    preemptions_v0, preemptions_v1, preemption_line = fold.preemptions_v0, fold.preemptions_v1, fold.preemption_line
    timeline = sorted(spans.values(), key=lambda s: s.first_line)
    if "block_size" not in facts:  # the log's tokens over its blocks (logparse/reconcile.py), not an assumed 16
        size, size_source = block_size(facts)
        if size_source != "vLLM's default":
            facts["block_size"], facts["block_size_source"] = size, size_source
    model, model_note = _identify_model(options, facts)
    budget = _vllm_budget(facts, printed, options)
    graph = graph_in_pool(budget, facts, _remainder_tolerance(printed) + unit(printed.get("cuda_graph_gib")))
    kv_plan, plan_json = _kvscope_plan(facts, budget, model, model_note, graph)
    checks = _derived_checks(facts, printed, fact_lines, budget, model)
    for record, phase in failures:
        check = _failure(record, phase, facts, budget, model, kv_plan, fold.tracebacks.place_of(record),
                         plan_json.get("inputs"))
        if check.id == "no_cache_blocks" and any(c.id == check.id for c in checks):
            continue  # '# GPU blocks: 0' and the ValueError after it report one failure
        checks.append(check)
    kv_below = kv_below_check(facts, fact_lines, budget, checks)
    if kv_below is not None:
        checks.append(kv_below)
    startup = startup_outcome(fold.watch, fold.failures, fold.last_phase, fold.last_line, checks)
    cuts = fold.complete.cuts(facts, fold.watch.in_traceback, fold.watch.ready_line is not None,
                              startup is not None and not startup.runtime, fold.last_line)
    if preemptions_v0 or preemptions_v1:
        checks.append(_preemption(preemptions_v0, preemptions_v1, preemption_line, facts))
    if options.profile:
        recording = read_profile(options.profile)
        plan_json["profile"] = compare_profile(recording, facts)
        model_check = profile_model_check(recording, facts, fact_lines)
        if model_check is not None:
            checks.append(model_check)
    return Explanation(
        path=str(source) if isinstance(source, str | Path) else "<stream>",
        records=fold.records,
        record_count=count,
        unrecognised=fold.coverage.unknown,
        facts=facts,
        printed=printed,
        fact_lines=fact_lines,
        timeline=timeline,
        checks=checks,
        budget=budget,
        plan=plan_json,
        kvscope_plan=kv_plan,
        coverage=fold.coverage,
        startup=startup,
        cuts=cuts,
        startup_times=fold.clock.times({s.phase: s.durations for s in timeline}),
    )


class _Fold:
    """What explain keeps of the records as they stream past: the first value of each
    startup figure (runtime readings, phase R, are series and stay with their records),
    the phase spans, the failures with the startup phase before each, preemptions, the
    coverage and the tracebacks' frames."""

    def __init__(self, keep_records: bool) -> None:
        self.keep_records = keep_records
        self.records: list[Record] = []
        self.facts: dict[str, Any] = {}
        self.printed: dict[str, str] = {}
        self.fact_lines: dict[str, int] = {}
        self.spans: dict[str, PhaseSpan] = {}
        self.failures: list[tuple[Record, str]] = []  # (record, last startup phase before it)
        self.preemptions_v0 = self.preemptions_v1 = 0
        self.preemption_line: int | None = None
        self.last_phase = "A"
        self.coverage = Coverage()
        self.tracebacks = TracebackTracker()
        self.watch = StartupWatch()
        self.complete = CompletenessWatch()
        self.clock = PhaseClock()
        self.last_line = 0

    def add(self, record: Record) -> None:
        if self.keep_records and len(self.records) < MAX_KEPT_RECORDS:
            self.records.append(record)  # past the cap the log is folded, not kept: memory stays bounded
        self.coverage.add(record)
        if "hybrid_hint_line" not in self.facts and hybrid_hint(record.text):
            self.facts["hybrid_hint_line"] = record.line  # a hybrid KV layout: concurrency counts per group
        self.tracebacks.add(record)
        self.watch.add(record, self.last_phase)
        self.complete.add(record)
        self.last_line = record.end_line
        pattern = record.pattern
        if pattern is None:
            return
        self.clock.add(pattern.phase if record.duplicate_of is None else None, record.line, record.time)
        if pattern.phase != "R":
            for name, value in record.fields.items():
                if name not in self.facts:
                    self.facts[name] = value
                    self.fact_lines[name] = record.line
                    if name in record.printed:
                        self.printed[name] = record.printed[name]
        span = self._span(pattern.phase, record.line, record.time)
        span.last_line = record.line
        span.records += 1
        if record.time:
            span.first_time = span.first_time or record.time
            span.last_time = record.time
        for name, value in record.fields.items():
            if name.endswith("_s") and isinstance(value, int | float) and name not in span.durations:
                span.durations[name] = float(value)
        if pattern.failure == "preemption":
            self.preemptions_v0 = max(self.preemptions_v0, int(record.fields.get("preemptions_total", 1)))
            self.preemption_line = self.preemption_line or record.line
        elif pattern.failure and record.duplicate_of is None:
            self.failures.append((record, self.last_phase))
        if "preemptions" in record.fields:
            self.preemptions_v1 += int(record.fields["preemptions"])
            self.preemption_line = self.preemption_line or record.line
        if pattern.phase in STARTUP_PHASES:
            self.last_phase = pattern.phase

    def add_run(self, run: BulkRun) -> None:
        """A run of stats/access lines (phase R, no durations, no failures), counted."""
        self.coverage.add_bulk(run)
        self.tracebacks.interrupt()
        self.watch.add_run(run.first_line)
        self.complete.add_run(run.first_line)
        self.clock.add("R", run.first_line, run.first_time)
        self.last_line = run.last_line
        for pattern in run.patterns:
            span = self._span(pattern.phase, run.first_line, run.first_time)
            span.last_line = max(span.last_line, run.last_line)
            span.records += run.counts[pattern.id]
            if run.first_time:
                span.first_time = span.first_time or run.first_time
            if run.last_time:
                span.last_time = run.last_time
        if run.preemption_line is not None:
            self.preemptions_v1 += run.preemptions
            self.preemption_line = self.preemption_line or run.preemption_line

    def _span(self, phase: str, line: int, time: str | None) -> PhaseSpan:
        span = self.spans.get(phase)
        if span is None:
            span = self.spans[phase] = PhaseSpan(phase, line, line, time, time)
        return span


# ------------------------------------------------------------------ vLLM's own budget
def _total_gib(facts: dict[str, Any], options: Options) -> tuple[float | None, str]:
    if "total_gib" in facts:
        return float(facts["total_gib"]), "log"
    if options.gpu_memory_gib is not None:
        return options.gpu_memory_gib, "--gpu-memory"
    if options.gpu:
        return gpu_preset(options.gpu).total_gib, f"--gpu {options.gpu}"
    return None, "unknown"


def _vllm_budget(facts: dict[str, Any], printed: dict[str, str], options: Options) -> dict[str, Any]:
    """vLLM's budget from whatever lines exist; derived figures say how they were derived."""
    total, total_src = _total_gib(facts, options)
    weights = facts.get("weights_gib")
    peak = facts.get("peak_activation_gib")
    non_torch = facts.get("non_torch_gib")
    graph = facts.get("cuda_graph_gib")
    kv = facts.get("kv_cache_gib")
    non_kv, non_kv_src = facts.get("non_kv_gib"), "log"
    if non_kv is None and None not in (weights, peak, non_torch):
        non_kv, non_kv_src = weights + peak + non_torch, "weights + activation peak + non-torch"
    elif non_kv is None and "consumed_gib" in facts and peak is not None:
        non_kv, non_kv_src = facts["consumed_gib"] + peak, "consumed + activation peak"
    util, util_src = facts.get("gpu_memory_utilization"), "log"
    if util is None and options.gpu_memory_utilization is not None:
        util, util_src = options.gpu_memory_utilization, "--gpu-memory-utilization"
    requested, requested_src = facts.get("requested_gib"), "log"
    if requested is None and total is not None and util is not None:
        requested, requested_src = total * util, "total x utilization"
    elif requested is None and kv is not None and non_kv is not None:
        requested, requested_src = kv + non_kv, "KV pool + non-KV"
    if util is None and requested is not None and total:
        util, util_src = requested / total, "requested / total"
    remainder = None
    if requested is not None and kv is not None and non_kv is not None:
        remainder = requested - non_kv - kv
    return {
        "total_gib": total, "total_source": total_src,
        "gpu_memory_utilization": util, "gpu_memory_utilization_source": util_src if util is not None else None,
        "requested_gib": requested, "requested_source": requested_src if requested is not None else None,
        "weights_gib": weights, "peak_activation_gib": peak, "non_torch_gib": non_torch,
        "non_kv_gib": non_kv, "non_kv_source": non_kv_src if non_kv is not None else None,
        "cuda_graph_gib": graph, "kv_cache_gib": kv,
        "unexplained_gib": remainder,
        "outside_budget_gib": (total - requested) if total is not None and requested is not None else None,
    }


# ------------------------------------------------------------------ kvscope's plan
def _identify_model(options: Options, facts: dict[str, Any]) -> tuple[ModelConfig | None, str]:
    candidates = [(options.model, "--model")] if options.model else []
    if facts.get("model"):
        printed = model_name(str(facts["model"]))  # vLLM's elision dropped: "Qwen3-8B..." is Qwen3-8B
        candidates.append((printed, "log"))
        served = Path(printed).name  # a local folder named as the hub id: /google/gemma-3-27b-it
        if served and served != printed and resolve_preset_name(served):
            candidates.append((served, "log, the folder's name"))
    reasons: list[str] = []
    for name, origin in candidates:
        try:
            return load_model_config(name), f"{name} (from {origin})"
        except UserError as exc:
            reasons.append(f"{origin}: {exc}")
    if not candidates:
        return None, "no model named in the log; pass --model PRESET | HF folder | GGUF"
    return None, "; ".join(reasons)


def _kv_dtype(facts: dict[str, Any]) -> str:
    value = str(facts.get("kv_cache_dtype", "auto")).lower()
    return "fp8" if value.startswith("fp8") else value


def _model_dtype(facts: dict[str, Any], model: ModelConfig) -> str:
    value = str(facts.get("dtype", model.dtype)).replace("torch.", "").lower()
    return value if value in ("bfloat16", "float16", "float32") else model.dtype


def kv_bytes_per_token(facts: dict[str, Any], model: ModelConfig | None) -> int | None:
    if model is None:
        return None
    try:
        return bytes_per_kv_token(model, _kv_dtype(facts), int(facts.get("tensor_parallel_size", 1)),
                                  _model_dtype(facts, model))
    except UserError:
        return None


def _plan_inputs(facts: dict[str, Any], budget: dict[str, Any], model: ModelConfig, total: float) -> dict[str, Any]:
    """The flags kvscope's plan takes, each from the log where it prints it, with where it came from."""
    util = budget["gpu_memory_utilization"]
    util_src = budget["gpu_memory_utilization_source"]
    if util is None:
        util, util_src = 0.9, "assumed (vLLM default)"
    max_len = facts.get("max_model_len")
    max_len_src = "log"
    if not isinstance(max_len, int) or max_len <= 0:
        max_len, max_len_src = model.max_position_embeddings, "model's max_position_embeddings"
    return {
        "total_gib": total, "gpu_memory_utilization": round(util, 6), "gpu_memory_utilization_source": util_src,
        "max_model_len": max_len, "max_model_len_source": max_len_src,
        "dtype": _model_dtype(facts, model), "kv_cache_dtype": _kv_dtype(facts),
        "tensor_parallel_size": int(facts.get("tensor_parallel_size", 1)),
        "block_size": int(facts.get("block_size", 16)),
        "block_size_source": facts.get("block_size_source", "log" if "block_size" in facts else "vLLM's default"),
        "max_num_batched_tokens": int(facts.get("max_num_batched_tokens", 8192)),
        "max_num_seqs": int(facts.get("max_num_seqs", 256)),
    }


def _kvscope_plan(facts: dict[str, Any], budget: dict[str, Any], model: ModelConfig | None, model_note: str,
                  graph: float | None) -> tuple[MemoryPlan | None, dict[str, Any]]:
    """kvscope's plan for the log's model and flags, on the log's own figures where it prints them
    (``graph``: the CUDA-graph GiB the log shows vLLM took out of the KV pool, logparse/reconcile.py)."""
    out: dict[str, Any] = {"model": model.name if model else None, "model_source": model_note,
                           "vllm": budget, "kvscope": None, "inputs": {}, "rows": [], "profile": None}
    if model is None:
        out["unavailable"] = f"kvscope plan needs the model: {model_note}"
        return None, out
    total = budget["total_gib"]
    if total is None:
        out["unavailable"] = "kvscope plan needs the device size: the log does not print it; pass --gpu or --gpu-memory"
        return None, out
    inputs = _plan_inputs(facts, budget, model, total)
    util = budget["gpu_memory_utilization"] if budget["gpu_memory_utilization"] is not None else 0.9  # unrounded
    max_len = inputs["max_model_len"]
    own = own_figures(facts)  # the log's measured weights / activation / non-torch, before any estimate
    inputs["from_log"] = sorted([*own, *(["cuda_graph"] if graph is not None else [])])
    out["inputs"] = inputs
    arguments: dict[str, Any] = dict(
        model=model, total_bytes=int(total * GiB), gpu_memory_utilization=min(1.0, max(1e-6, util)),
        max_model_len=max_len, block_size=inputs["block_size"], kv_cache_dtype=inputs["kv_cache_dtype"],
        dtype=inputs["dtype"], tensor_parallel_size=inputs["tensor_parallel_size"],
        max_num_batched_tokens=inputs["max_num_batched_tokens"], max_num_seqs=inputs["max_num_seqs"],
        check_fits=False, weights=own.get("weights"), activation_peak=own.get("activation_peak"),
        non_torch=own.get("non_torch"),
        multimodal=multimodal_from_flags(  # a VL preset's vision weights and encoder; None for text models
            model, max_num_batched_tokens=inputs["max_num_batched_tokens"], max_num_seqs=inputs["max_num_seqs"],
            dtype=inputs["dtype"], tensor_parallel_size=inputs["tensor_parallel_size"]))
    try:
        plan = plan_memory(**arguments)
        if graph is not None:  # the same pool less the graph estimate, its blocks and tokens recounted
            graph_bytes = int(graph * GiB)
            pool = plan_memory(**arguments, kv_cache_memory_bytes=max(0, plan.kv_pool_bytes - graph_bytes))
            plan = replace(pool, cuda_graph_bytes=graph_bytes, kv_pool_overridden=plan.kv_pool_overridden)
    except UserError as exc:
        out["unavailable"] = f"kvscope plan: {exc}"
        return None, out
    out["kvscope"] = plan.to_json()
    out["rows"] = _comparison_rows(facts, budget, plan)
    return plan, out


_ROW_NOTES = {
    "weights_gib": "kvscope: parameters x dtype bytes / TP from the model's shapes; vLLM: measured allocator growth "
                   "(quantised or multimodal models differ)",
    "peak_activation_gib": "kvscope estimates the spike from shapes (max-num-batched-tokens, sampler logits); vLLM "
                           "measures one dummy worst-case step",
    "non_torch_gib": "kvscope assumes a fixed 0.3 GiB (0.7 with TP); vLLM measures CUDA context growth, NCCL, workspaces",
    "cuda_graph_gib": "vLLM since v0.21 subtracts an estimated CUDA graph pool from the KV pool (kvscope's plan then "
                      "takes the log's estimate out of its pool too), earlier versions take it from the 1 - util "
                      "margin (kvscope's plan reserves nothing)",
    "kv_cache_gib": "the remainder: differs by exactly the non-KV differences above",
}


# The comparison rows, in order: each a figure of the log (FIGURE_NAMES' key); kvscope's side is
# the plan's JSON under the ledger's report key of the same quantity (engine/events/ledger.py).
_ROW_FIGURES = ("total_gib", "gpu_memory_utilization", "requested_gib", "weights_gib", "peak_activation_gib",
                "non_torch_gib", "non_kv_gib", "cuda_graph_gib", "kv_cache_gib", "kv_cache_tokens", "gpu_blocks",
                "max_concurrency")


def _comparison_rows(facts: dict[str, Any], budget: dict[str, Any], plan: MemoryPlan) -> list[dict[str, Any]]:
    planned = plan.to_json()
    mine: dict[str, float | int | None] = {}
    for key in _ROW_FIGURES:
        kvscope_name = FIGURE_NAMES[key].kvscope if key in FIGURE_NAMES else None
        item = LEDGER_ITEM.get(kvscope_name or "")
        if item is not None and item.report_key in planned:
            mine[key] = planned[item.report_key]
        elif item is not None:  # a ledger quantity the plan's JSON leaves out (its CUDA-graph reserve)
            mine[key] = item.report_value(getattr(plan, item.name))
        else:  # non-KV: the sum vLLM prints
            mine[key] = (plan.weights_bytes + plan.activation_peak_bytes + plan.non_torch_bytes) / GiB
    theirs = {**{k: budget.get(k) for k in mine}, "kv_cache_tokens": facts.get("kv_cache_tokens"),
              "gpu_blocks": facts.get("gpu_blocks"), "max_concurrency": facts.get("max_concurrency")}
    rows = []
    for key, value in mine.items():
        vllm_value = theirs.get(key)
        note = _ROW_NOTES.get(key, "")
        if key in ("peak_activation_gib", "non_torch_gib") and key.split("_gib")[0].replace("peak_", "") in plan.estimated:
            note = note or "estimated"
        rows.append({"item": key, "vllm": vllm_value, "kvscope": value,
                     "difference": (value - vllm_value) if isinstance(vllm_value, int | float) else None,
                     "note": note})
    return rows


# ------------------------------------------------------------------ derived checks
def _within(a: float, b: float, tol: float) -> bool:
    return abs(a - b) <= tol + 1e-9


def _hybrid_layout(facts: dict[str, Any], model: ModelConfig | None,
                   pool_gib: float | None = None) -> MemoryPlan | None:
    """kvscope's plan of the log's KV pool under vLLM's hybrid layout (the one budget formula,
    engine/budget/memory.py), or None when the model is unknown or attends fully everywhere."""
    max_len = facts.get("max_model_len")
    if model is None or not isinstance(max_len, int) or max_len <= 0:
        return None
    pool = pool_gib if pool_gib is not None else facts.get("kv_cache_gib") or 1.0
    try:
        plan = plan_memory(
            model=model, total_bytes=int(pool * GiB) + 1, gpu_memory_utilization=1.0, max_model_len=max_len,
            block_size=int(facts.get("block_size", 16)), kv_cache_dtype=_kv_dtype(facts),
            dtype=_model_dtype(facts, model), tensor_parallel_size=int(facts.get("tensor_parallel_size", 1)),
            max_num_batched_tokens=int(facts.get("max_num_batched_tokens", 8192)),
            kv_cache_memory_bytes=int(pool * GiB), check_fits=False)
    except UserError:
        return None
    return plan if plan.is_hybrid else None


def _hybrid_checks(facts: dict[str, Any], printed: dict[str, str], lines: dict[str, int],
                   plan: MemoryPlan | None, model: ModelConfig | None, tokens_follow: bool = False) -> list[Check]:
    """The KV lines of a hybrid model reconciled with kvscope's plan: the padding vLLM warns of,
    the tokens the printed pool holds, and the concurrency the printed size implies. Where the
    printed tokens are the concurrency's (``tokens_follow``), only the padding is the layout's."""
    tokens, kv, conc = facts.get("kv_cache_tokens"), facts.get("kv_cache_gib"), facts.get("max_concurrency")
    padding = facts.get("padding_layers")
    if plan is None:
        judged = ("the printed tokens are its concurrency x max-model-len, judged as such; pass --model to reconcile "
                  "the pool" if tokens_follow else "so the KV size and concurrency follow per-group blocks; pass "
                  "--model to reconcile them")
        return [Check("hybrid_layout", "hybrid KV layout", None,
                      f"vLLM added {padding} padding layers: its hybrid KV cache manager groups sliding-window and "
                      f"full-attention layers, {judged}", line=lines.get("padding_layers"))]
    checks: list[Check] = []
    groups = len(plan.kv_cache_groups)
    block = plan.block_size
    windows = sorted({g.sliding_window for g in plan.kv_cache_groups if g.sliding_window})
    layout = (f"{groups} KV cache groups of at most {plan.layers_per_group} layers (window "
              f"{', '.join(f'{w:,}' for w in windows)}), page {plan.page_size_bytes:,} B")
    pad = sum(plan.layers_per_group - len(g.layers) for g in plan.kv_cache_groups)
    if padding is not None:
        checks.append(Check(
            "hybrid_padding", "padding layers = groups x G - layers", pad == padding,
            f"kvscope's grouping: {layout}: {groups} x {plan.layers_per_group} - "
            f"{sum(len(g.layers) for g in plan.kv_cache_groups)} layers = {pad} padding layers against a printed {padding}",
            formula="num_groups x layers_per_group - num_layers", expected=padding, actual=pad, tolerance=0,
            line=lines.get("padding_layers")))
    if tokens_follow:  # tokens = int(concurrency x max-model-len): per-group blocks are not in them
        return checks
    if kv is not None and tokens is not None:
        half = unit(printed.get("kv_cache_gib")) / 2
        lo, mid, hi = (_hybrid_layout(facts, model, p) for p in (kv - half, kv, kv + half))
        if lo is not None and mid is not None and hi is not None:
            tol = max(hi.kv_cache_tokens - mid.kv_cache_tokens, mid.kv_cache_tokens - lo.kv_cache_tokens)
            ok = _within(mid.kv_cache_tokens, tokens, tol)
            checks.append(Check(
                "hybrid_kv_tokens", "hybrid: tokens = pool // page // G // groups x block", ok,
                f"{kv} GiB / {plan.page_size_bytes:,} B // {plan.layers_per_group} = {mid.num_blocks:,} blocks; "
                f"// {groups} groups x {block} = {mid.kv_cache_tokens:,} tokens against a printed {tokens:,} "
                f"(tolerance {tol:,}: the printed GiB's last digit); {layout}",
                formula="kv_cache_gib x 2^30 // page_size // layers_per_group // num_groups x block_size",
                expected=tokens, actual=mid.kv_cache_tokens, tolerance=tol, line=lines.get("kv_cache_tokens")))
    max_len = facts.get("max_model_len")
    if conc is not None and (tokens is not None or facts.get("num_gpu_blocks_info") is not None):
        per_request = " + ".join(_per_request_terms(plan))
        exact = facts.get("num_gpu_blocks_info")
        if exact is not None:
            n_lo = n_hi = int(exact)
            source = f"{n_lo:,} blocks (num_gpu_blocks)"
        else:
            n_lo = int(tokens) // block * groups
            n_hi = n_lo + groups - 1
            source = f"{tokens:,} tokens = {n_lo:,}..{n_hi:,} blocks"
        lo_c, hi_c = n_lo / plan.blocks_per_request, n_hi / plan.blocks_per_request
        actual = (lo_c + hi_c) / 2
        tol = (hi_c - lo_c) / 2 + unit(printed.get("max_concurrency"))
        ok = _within(actual, conc, tol)
        full = f"; tokens / max-model-len would say {int(tokens) / max_len:.2f}x" if tokens and max_len else ""
        checks.append(Check(
            "hybrid_concurrency", "hybrid: concurrency = blocks / blocks per request", ok,
            f"{source} / {plan.blocks_per_request:,} blocks per {max_len:,}-token request ({per_request}) = "
            f"{actual:.4f} against a printed {printed.get('max_concurrency', conc)}x (tolerance {tol:.4f}){full}",
            formula="num_blocks / sum(blocks_per_request over groups)", expected=conc, actual=round(actual, 4),
            tolerance=tol, line=lines.get("max_concurrency")))
    return checks


def _per_request_terms(plan: MemoryPlan) -> list[str]:
    """Each spec's blocks per request once, with its group count: '6 x 257 (window 1,024)'."""
    counts: dict[tuple[int | None, int], int] = {}
    for g in plan.kv_cache_groups:
        key = (g.sliding_window, g.blocks_per_request)
        counts[key] = counts.get(key, 0) + 1
    return [(f"{n} x " if n > 1 else "") + f"{blocks:,}" + (f" (window {w:,})" if w else " (full)")
            for (w, blocks), n in counts.items()]


def _derived_checks(facts: dict[str, Any], printed: dict[str, str], lines: dict[str, int],
                    budget: dict[str, Any], model: ModelConfig | None) -> list[Check]:
    checks: list[Check] = []
    tokens = facts.get("kv_cache_tokens")
    kv = facts.get("kv_cache_gib")
    per_token = kv_bytes_per_token(facts, model)
    block = int(facts.get("block_size", 16))
    if tokens is None and facts.get("gpu_blocks") is not None:
        tokens = int(facts["gpu_blocks"]) * block
    follows = tokens_follow_concurrency(facts, lines)  # tokens = int(concurrency x max-model-len), any layout
    hybrid = _hybrid_layout(facts, model)
    if hybrid is not None or facts.get("padding_layers") is not None:
        # vLLM's hybrid layout: tokens x every layer's bytes does not hold, nor (before vLLM printed the
        # tokens its concurrency implies) tokens / max-model-len
        checks += _hybrid_checks(facts, printed, lines, hybrid, model, follows)
        per_token = None
        tokens = tokens if follows else None
    if tokens is not None and kv is not None and per_token is not None and tokens > 0:
        actual = tokens * per_token / GiB
        tol = unit(printed.get("kv_cache_gib")) + block * per_token / GiB
        ok = _within(actual, kv, tol)
        checks.append(Check(
            "kv_tokens_x_bytes", "tokens x bytes per token = KV pool", ok,
            f"{tokens:,} tokens x {per_token / 1024:g} KiB/token = {actual:.3f} GiB against a printed {printed.get('kv_cache_gib', kv)} GiB"
            f" (tolerance {tol:.3f}: one unit of the printed digit + one block)"
            + ("" if ok else "; vLLM may pad layers, use hybrid/sliding-window groups, or the model/KV dtype differs"),
            formula="kv_cache_tokens x bytes_per_token / 2^30", expected=kv, actual=round(actual, 4), tolerance=tol,
            line=lines.get("kv_cache_tokens", lines.get("gpu_blocks"))))
    max_len = facts.get("max_model_len")
    conc = facts.get("max_concurrency")
    if tokens is not None and isinstance(max_len, int) and max_len > 0 and conc is not None:
        actual = tokens / max_len
        tol = unit(printed.get("max_concurrency"))
        ok: bool | None = _within(actual, conc, tol)
        why = "; since 0.9.2 vLLM counts blocks per request, which differs for sliding-window or hybrid models"
        if not ok and "hybrid_hint_line" in facts and not follows and hybrid_concurrency(conc, tokens, max_len, tol):
            # a line names Mamba / linear attention / padding layers (logparse/reconcile.py): not judged, explained
            ok, why = None, ("; vLLM counted blocks per request over its KV cache groups (Mamba / linear-attention "
                             "state takes one block, a sliding window its window), so its figure is higher: pass "
                             "--model to reconcile it")
        checks.append(Check(
            "concurrency", "concurrency = tokens / max-model-len", ok,
            f"{tokens:,} / {max_len:,} = {actual:.4f} against a printed {printed.get('max_concurrency', conc)}x"
            f" (tolerance {tol:g})" + ("" if ok else why),
            formula="kv_cache_tokens / max_model_len", expected=conc, actual=round(actual, 4), tolerance=tol,
            line=lines.get("max_concurrency")))
    total, util = facts.get("total_gib"), facts.get("gpu_memory_utilization")
    requested = facts.get("requested_gib")
    if total is not None and util is not None and requested is not None:
        actual = total * util
        # utilization is the user's exact flag value; only total and requested are rounded
        tol = unit(printed.get("requested_gib")) + unit(printed.get("total_gib")) * util
        ok = _within(actual, requested, tol)
        checks.append(Check(
            "requested", "requested = total x utilization", ok,
            f"{total} x {util} = {actual:.3f} GiB against a printed {requested} GiB (tolerance {tol:.3f})",
            formula="total_gib x gpu_memory_utilization", expected=requested, actual=round(actual, 4),
            tolerance=tol, line=lines.get("requested_gib")))
    non_kv = facts.get("non_kv_gib")
    parts = [facts.get(k) for k in ("weights_gib", "peak_activation_gib", "non_torch_gib")]
    if non_kv is not None and None not in parts:
        actual = sum(parts)  # type: ignore[arg-type]
        tol = unit(printed.get("non_kv_gib")) + sum(
            unit(printed.get(k)) for k in ("weights_gib", "peak_activation_gib", "non_torch_gib"))
        ok = _within(actual, non_kv, tol)
        checks.append(Check(
            "non_kv", "non-KV = weights + activation peak + non-torch", ok,
            f"{' + '.join(str(p) for p in parts)} = {actual:.3f} GiB against a printed {non_kv} GiB (tolerance {tol:.3f})",
            formula="weights_gib + peak_activation_gib + non_torch_gib", expected=non_kv, actual=round(actual, 4),
            tolerance=tol, line=lines.get("non_kv_gib")))
    req_b, non_kv_b = budget["requested_gib"], budget["non_kv_gib"]
    if kv is not None and req_b is not None and non_kv_b is not None:
        if budget["requested_source"] == "KV pool + non-KV":
            checks.append(Check(
                "kv_remainder", "KV = requested - non-KV", None,
                f"requested is not printed; derived as KV {kv} + non-KV {non_kv_b:.2f} = {req_b:.2f} GiB "
                "(give --gpu and --gpu-memory-utilization to judge it)",
                formula="requested_gib - non_kv_gib", expected=kv, actual=round(req_b - non_kv_b, 4),
                line=lines.get("kv_cache_gib")))
        else:
            actual = req_b - non_kv_b
            tol = _remainder_tolerance(printed)
            graph_note = ""
            ok = _within(actual, kv, tol)
            graph = facts.get("cuda_graph_gib")
            if not ok and graph is not None and _within(actual - graph, kv, tol + unit(printed.get("cuda_graph_gib"))):
                ok, graph_note = True, f"; matches once the CUDA-graph estimate {graph} GiB is also subtracted (v0.21+)"
            checks.append(Check(
                "kv_remainder", "KV = requested - non-KV", ok,
                f"{req_b:.2f} ({budget['requested_source']}) - {non_kv_b:.2f} ({budget['non_kv_source']}) = "
                f"{actual:.3f} GiB against a printed {kv} GiB (tolerance {tol:.3f}){graph_note}",
                formula="requested_gib - non_kv_gib", expected=kv, actual=round(actual, 4), tolerance=tol,
                line=lines.get("kv_cache_gib")))
    return checks


def _remainder_tolerance(printed: dict[str, str]) -> float:
    """The precision of KV = requested - non-KV as printed: one unit of each figure's last digit."""
    return unit(printed.get("kv_cache_gib")) + unit(printed.get("requested_gib") or "0.01") + (
        unit(printed.get("non_kv_gib")) if "non_kv_gib" in printed else sum(
            unit(printed.get(k)) for k in ("weights_gib", "peak_activation_gib", "non_torch_gib")))


# ------------------------------------------------------------------ failures and their fixes
def _gib(x: float) -> str:
    return f"{x:.2f} GiB"


def _note(text: str) -> Fix:
    """Advice that is no single flag change (a figure to know, memory to free)."""
    return Fix("", None, None, text)


def _fp8_and_tp_fixes(facts: dict[str, Any], model: ModelConfig | None, pool_gib: float | None,
                      need_gib: float | None) -> list[Fix]:
    fixes = []
    if _kv_dtype(facts) != "fp8" and pool_gib is not None and need_gib is not None:
        fits = pool_gib >= need_gib / 2
        fixes.append(Fix("--kv-cache-dtype", _kv_dtype(facts), "fp8",
                         f"halves bytes per token: one request would need {_gib(need_gib / 2)} "
                         f"against {_gib(pool_gib)} available ({'fits' if fits else 'still short'})",
                         numbers={"request_gib": need_gib / 2, "pool_gib": pool_gib}))
    tp = int(facts.get("tensor_parallel_size", 1))
    if model is not None and model.num_kv_heads >= 2 * tp and need_gib is not None:
        fixes.append(Fix("--tensor-parallel-size", tp, 2 * tp, f"splits KV heads over twice the GPUs: per-GPU need "
                         f"{_gib(need_gib / 2)} per request, and the weights per GPU halve too"))
    return fixes


def _failure(record: Record, phase: str, facts: dict[str, Any], budget: dict[str, Any],
             model: ModelConfig | None, plan: MemoryPlan | None, place: str | None = None,
             plan_inputs: dict[str, Any] | None = None) -> Check:
    kind = record.pattern.failure if record.pattern else None
    f = record.fields
    total = budget["total_gib"]
    util = budget["gpu_memory_utilization"]
    if kind == "free_below_request":
        free, tot, u, req = f["free_gib"], f["total_gib"], f["gpu_memory_utilization"], f["requested_gib"]
        fit = math.floor(free / tot * 100) / 100 if tot else 0.0
        fixes = [Fix("--gpu-memory-utilization", u, f"{fit:.2f}", f"fits the {free} GiB free now ({free} / {tot})"),
                 _note(f"or free {req - free:.2f} GiB held by other processes (requested {req} GiB = {tot} x {u})")]
        if plan is not None:
            non_kv = (plan.weights_bytes + plan.activation_peak_bytes + plan.non_torch_bytes) / GiB
            kv_left = tot * fit - non_kv
            fixes.append(_note(f"at {fit:.2f} kvscope's plan leaves a KV pool of {kv_left:.2f} GiB "
                               f"({max(0, int(kv_left * GiB / plan.bytes_per_token)):,} tokens)"))
        return Check("free_below_request", "free memory below the request", False,
                     f"only {free} of {tot} GiB free at startup, but {u} x {tot} = {req} GiB requested",
                     kind="failure", line=record.line, fix=fixes)
    if kind == "max_seq_len_exceeds_kv":
        max_len = int(f["max_model_len"])
        per_token = kv_bytes_per_token(facts, model)
        if "kv_needed_gib" in f:
            need, avail = float(f["kv_needed_gib"]), float(f["kv_cache_gib"])
            fit_len = f.get("estimated_max_model_len") or int(max_len * avail / need) // 16 * 16
        else:
            tokens = int(f["kv_cache_tokens"])
            fit_len = tokens
            need = max_len * per_token / GiB if per_token else None
            avail = tokens * per_token / GiB if per_token else None
        fixes = [Fix("--max-model-len", max_len, int(fit_len), "fits the current pool")]
        if need is not None and avail is not None:
            extra = need - avail
            if total and util is not None:
                fixes.append(Fix("--gpu-memory-utilization", util, f"{util + extra / total:.3f}",
                                 f"adds the missing {_gib(extra)}"
                                 + (" (beyond 1.0: not possible on this device)" if util + extra / total > 1 else "")))
            elif total:
                fixes.append(Fix("--gpu-memory-utilization", None, None,
                                 f"raise it by {extra / total:.3f} ({_gib(extra)} of {total} GiB)"))
            else:
                fixes.append(Fix("--gpu-memory-utilization", None, None,
                                 f"raise it by {_gib(extra)} / total device memory"))
        else:
            fixes.append(Fix("--gpu-memory-utilization", util, None,
                             f"the pool holds {fit_len:,} of the {max_len:,} tokens needed: raise it so the pool grows "
                             f"by {max_len / max(fit_len, 1):.2f}x (pass --model to get GiB)"))
        fixes += _fp8_and_tp_fixes(facts, model, avail, need)
        return Check("max_seq_len_exceeds_kv", "max model length beyond the KV cache", False,
                     f"one {max_len:,}-token request does not fit the KV pool"
                     + (f" ({_gib(need)} needed, {_gib(avail)} available)" if need is not None and avail is not None else ""),
                     kind="failure", line=record.line, fix=fixes)
    if kind == "no_cache_blocks":
        return _no_cache_blocks(record, facts, budget, model, plan)
    if kind == "oom" and place == "graph_capture":
        return _oom_graph_capture(record, facts, budget, model if plan is not None else None, plan_inputs or {})
    if kind in ("oom", "oom_sampler"):
        return _oom(record, PLACE_PHASES.get(place or "", phase), facts, total)
    return Check(kind or "error", "memory profiling error", False,
                 "free memory grew while vLLM profiled: another process released GPU memory", kind="failure",
                 line=record.line, fix=[_note("run vLLM alone on the GPU (or in its own container) so the profile is stable")])


SWAP_SPACE_DEFAULT_GIB = 4  # vLLM V0's --swap-space default: the CPU pool the '# CPU blocks' count divides


def _one_request_kv(facts: dict[str, Any], model: ModelConfig | None) -> tuple[str, float | None] | None:
    """What one max-model-len request needs of the KV pool: a sentence with its blocks (and
    GiB where the block size in bytes is known: from the model, else from the CPU pool)."""
    max_len = facts.get("max_model_len")
    if not isinstance(max_len, int) or max_len <= 0:
        return None
    block = int(facts.get("block_size", 16))
    blocks = -(-max_len // block)
    per_token = kv_bytes_per_token(facts, model)
    cpu_blocks = facts.get("cpu_blocks")
    if per_token:
        block_bytes: float = block * per_token
        how = f"{model.name if model else 'the model'}: {per_token / 1024:g} KiB per token"
    elif isinstance(cpu_blocks, int) and cpu_blocks > 0:
        block_bytes = SWAP_SPACE_DEFAULT_GIB * GiB / cpu_blocks
        how = (f"if --swap-space is vLLM's default {SWAP_SPACE_DEFAULT_GIB} GiB, its {cpu_blocks:,} CPU blocks make "
               f"a block {block_bytes / 2**20:.2f} MiB; pass --model for the exact size")
    else:
        return (f"one {max_len:,}-token request needs {blocks:,} blocks of {block} tokens (pass --model for their "
                "size in GiB)"), None
    need = blocks * block_bytes / GiB
    return (f"one {max_len:,}-token request needs {blocks:,} blocks of {block} tokens = {_gib(need)} of KV memory "
            f"({how})"), need


def _no_cache_blocks(record: Record, facts: dict[str, Any], budget: dict[str, Any], model: ModelConfig | None,
                     plan: MemoryPlan | None) -> Check:
    fixes = []
    non_kv, req = budget["non_kv_gib"], budget["requested_gib"]
    total, util = budget["total_gib"], budget["gpu_memory_utilization"]
    request = _one_request_kv(facts, model)
    need = request[1] if request else None
    if request:
        fixes.append(_note(request[0]))
    beyond = " (beyond 1.0: more GPUs or a smaller model)"
    if plan is not None:
        need_util = (plan.weights_bytes + plan.activation_peak_bytes + plan.non_torch_bytes
                     + plan.max_model_len * plan.bytes_per_token) / plan.total_bytes
        if util is not None and need_util <= util:
            fixes.append(_note(f"kvscope's plan needs only --gpu-memory-utilization {need_util:.3f} for non-KV plus one "
                               f"{plan.max_model_len:,}-token request, yet vLLM found no room at {util:g}: the device "
                               "had less free than its total (another process?) or the model is not "
                               f"{model.name if model else 'the one planned'}, so that figure is a floor, not a fix"))
        else:
            fixes.append(Fix("--gpu-memory-utilization", util, f"{need_util:.3f}", "kvscope's plan: fits non-KV plus one "
                             f"{plan.max_model_len:,}-token request" + (beyond if need_util > 1 else "")))
    elif need is not None and total and non_kv is not None:
        need_util = (non_kv + need) / total
        fixes.append(Fix("--gpu-memory-utilization", util, f"{need_util:.3f}", f"fits vLLM's non-KV {_gib(non_kv)} plus "
                         f"that request on {total} GiB" + (beyond if need_util > 1 else "")))
    elif non_kv is not None and req is not None:
        fixes.append(Fix("--gpu-memory-utilization", util, None, f"non-KV {_gib(non_kv)} exceeds the requested "
                         f"{_gib(req)}: raise it by at least {_gib(non_kv - req)} / total"))
    elif need is not None and total and util is not None:
        need_util = util + need / total
        fixes.append(Fix("--gpu-memory-utilization", util, f"{need_util:.3f}", f"at least: the budget needs those "
                         f"{_gib(need)} more" + (beyond if need_util > 1 else "")))
    elif need is not None and total:
        fixes.append(Fix("--gpu-memory-utilization", None, None,
                         f"raise it by at least {need / total:.3f} ({_gib(need)} of {total} GiB)"))
    elif need is not None:
        fixes.append(Fix("--gpu-memory-utilization", None, None, f"raise it by at least {_gib(need)} / the device's "
                         "total (pass --gpu or --gpu-memory for the figure)"))
    fixes.append(Fix("--max-num-batched-tokens", facts.get("max_num_batched_tokens"), None,
                     "lower it or --max-num-seqs to shrink the profiled activation peak, or quantise / add "
                     "--tensor-parallel-size to shrink weights per GPU"))
    used_up = "weights + activation peak + non-torch used up the whole requested budget"
    if record.pattern is not None and record.pattern.id == "zero_gpu_blocks":
        cpu = record.fields.get("cpu_blocks")
        detail = ("vLLM sized the KV pool at 0 GPU blocks" + (f" ({cpu:,} CPU blocks)" if isinstance(cpu, int) else "")
                  + f": {used_up}")
    else:
        detail = used_up
    return Check("no_cache_blocks", "no memory left for the KV cache", False, detail, kind="failure",
                 line=record.line, fix=fixes)


def _oom(record: Record, phase: str, facts: dict[str, Any], total: float | None) -> Check:
    f = record.fields
    if record.pattern and record.pattern.failure == "oom_sampler":
        n = f.get("num_dummy_requests")
        return Check("oom_sampler", "out of memory in the sampler warm-up", False,
                     f"sampling for {n} dummy requests (max-num-seqs) did not fit after the KV pool was allocated",
                     kind="failure", line=record.line,
                     fix=[Fix("--max-num-seqs", n, max(1, int(n or 256) // 2), "halves the sampler's logits buffer"),
                          Fix("--gpu-memory-utilization", facts.get("gpu_memory_utilization"), None,
                              "or lower it by a few hundredths to leave room outside the pool")])
    scale = {"GiB": 1.0, "MiB": 1 / 1024, "KiB": 1 / 1024**2}
    tried = f.get("oom_tried")
    tried_gib = tried * scale.get(f.get("oom_unit", "GiB"), 1.0) if tried is not None else None
    free_gib = f["oom_free"] * scale.get(f.get("oom_free_unit", "GiB"), 1.0) if "oom_free" in f else None
    where = {"D": "profiling (the dummy worst-case step)", "F": "CUDA-graph capture",
             "E": "KV-cache allocation", "C": "weight loading"}.get(phase, f"phase {phase}")
    fixes = []
    short = (tried_gib - (free_gib or 0.0)) if tried_gib is not None else None
    device_total = f.get("oom_total_gib") or total
    if phase == "D":
        fixes.append(Fix("--max-num-batched-tokens", facts.get("max_num_batched_tokens", "default"), None,
                         "lower it or --max-num-seqs: the profiling step allocates activations for them"))
    if phase == "F":
        fixes.append(Fix("--enforce-eager", None, None, "skips CUDA-graph capture"))
    if short is not None and device_total:
        util = facts.get("gpu_memory_utilization")
        target = f"{util - short / device_total:.3f}" if util is not None else f"{short / device_total:.3f} lower"
        fixes.append(Fix("--gpu-memory-utilization", util, target,
                         f"leaves the {short:.2f} GiB that were missing outside the budget"))
    return Check("oom", f"CUDA out of memory during {where}", False,
                 f"tried to allocate {tried_gib:.2f} GiB" if tried_gib is not None else "allocation failed",
                 kind="failure", line=record.line, fix=fixes)


DEFAULT_MAX_CAPTURE_SIZE = 512  # vLLM's largest CUDA-graph batch when --max-cudagraph-capture-size is not given


def _oom_graph_capture(record: Record, facts: dict[str, Any], budget: dict[str, Any], model: ModelConfig | None,
                       plan_inputs: dict[str, Any]) -> Check:
    """Out of memory while CUDA graphs were captured (the frames say so): the graph pool did
    not fit beside the KV pool. The fixes in the log's own numbers: the utilization that
    leaves the pool outside the budget (and the KV pool that remains, through
    engine/budget's formula when the model is known), --enforce-eager, fewer capture sizes."""
    total, util = budget["total_gib"], budget["gpu_memory_utilization"]
    kv, tokens, max_len = facts.get("kv_cache_gib"), facts.get("kv_cache_tokens"), facts.get("max_model_len")
    need, need_src = facts.get("cuda_graph_gib"), "the CUDA-graph estimate the log printed"
    f = record.fields
    if "oom_tried" in f:
        scale = {"GiB": 1.0, "MiB": 1 / 1024, "KiB": 1 / 1024**2}
        tried = f["oom_tried"] * scale.get(f.get("oom_unit", "GiB"), 1.0)
        free = f.get("oom_free", 0.0) * scale.get(f.get("oom_free_unit", "GiB"), 1.0)
        if need is None or tried - free > need:
            need, need_src = tried - free, "the allocation that failed less what was free"
    fixes: list[Fix] = []
    if need is not None and total and util is not None:
        new_util = math.floor((util - need / total) * 100) / 100
        why = (f"leaves {_gib(util * total - new_util * total)} of {total:g} GiB outside the budget for the graph pool "
               f"({_gib(need)}: {need_src})")
        why += _kv_after_lowering(new_util, util, total, kv, tokens, max_len, model, plan_inputs)
        fixes.append(Fix("--gpu-memory-utilization", util, f"{new_util:.2f}", why, numbers={"graph_pool_gib": need}))
    elif need is not None:
        fixes.append(Fix("--gpu-memory-utilization", None, None, f"lower it by {_gib(need)} / the device's total "
                         f"({need_src}; pass --gpu or --gpu-memory for the figure)"))
    else:
        fixes.append(Fix("--gpu-memory-utilization", None, None, "lower it by the graph pool's size (the log prints "
                         "no estimate; vLLM 0.21+ prints 'Estimated CUDA graph memory')"))
    fixes.append(Fix("--enforce-eager", None, None, "captures no graphs"
                     + (f" and frees the whole {_gib(need)} pool" if need else "")
                     + "; decode steps of small batches get slower (one kernel launch per op)"))
    largest = facts.get("max_cudagraph_capture_size") or facts.get("capture_size_capped")
    largest_src = "the log" if largest else f"vLLM's default {DEFAULT_MAX_CAPTURE_SIZE}"
    largest = int(largest or DEFAULT_MAX_CAPTURE_SIZE)
    fixes.append(Fix("--max-cudagraph-capture-size", largest, max(1, largest // 2), f"(largest from {largest_src}) "
                     "the pool grows with the largest captured batch, so about half of it; larger batches run eager"))
    return Check("oom_graph_capture", "CUDA out of memory during CUDA-graph capture", False,
                 "the traceback's frames are CUDA-graph capture (capture_model / torch.cuda.graph): the graph pool "
                 "did not fit beside the KV pool" + (f" ({_gib(kv)})" if kv is not None else ""),
                 kind="failure", line=record.line, fix=fixes)


def _kv_after_lowering(new_util: float, util: float, total: float, kv: float | None, tokens: int | None,
                       max_len: int | None, model: ModelConfig | None, inputs: dict[str, Any]) -> str:
    """What a lower utilization leaves of the KV pool: kvscope's plan (engine/budget's one
    formula) at the new utilization when the model is known, else the log's own tokens per GiB."""
    if model is not None and inputs:
        try:
            lowered = plan_memory(
                model=model, total_bytes=int(inputs["total_gib"] * GiB), gpu_memory_utilization=new_util,
                max_model_len=inputs["max_model_len"], block_size=inputs["block_size"],
                kv_cache_dtype=inputs["kv_cache_dtype"], dtype=inputs["dtype"],
                tensor_parallel_size=inputs["tensor_parallel_size"],
                max_num_batched_tokens=inputs["max_num_batched_tokens"], max_num_seqs=inputs["max_num_seqs"],
                check_fits=False)
        except UserError:
            lowered = None
        if lowered is not None:
            return (f"; kvscope's plan of {model.name} at {new_util:.2f}: KV pool "
                    f"{_gib(lowered.kv_pool_bytes / GiB)}, {lowered.kv_cache_tokens:,} tokens, "
                    f"{lowered.max_concurrency:.2f}x at {lowered.max_model_len:,}")
    if kv is None or kv <= 0:
        return ""
    new_kv = kv - (util - new_util) * total
    out = f"; the KV pool shrinks from {_gib(kv)} to {_gib(max(new_kv, 0.0))}"
    if tokens:
        new_tokens = int(tokens * max(new_kv, 0.0) / kv)
        out += f" ({new_tokens:,} tokens at the log's {tokens / kv:,.0f} tokens per GiB"
        out += f", {new_tokens / max_len:.2f}x at {max_len:,})" if isinstance(max_len, int) and max_len else ")"
    return out


def _preemption(v0: int, v1: int, line: int | None, facts: dict[str, Any]) -> Check:
    count = max(v0, v1)
    tokens, max_len = facts.get("kv_cache_tokens"), facts.get("max_model_len")
    pool = f"the pool holds {tokens:,} tokens ({tokens / max_len:.2f}x max-model-len)" if tokens and max_len else \
        "the KV pool filled up"
    source = "V0 warning, logged for 1 in 50" if v0 >= v1 else "V1 stats 'Preemptions: N'"
    return Check("preemption", "requests preempted for KV space", False,
                 f"at least {count} preemption(s) ({source}); {pool}", kind="warning", line=line,
                 fix=[Fix("--gpu-memory-utilization", facts.get("gpu_memory_utilization"), None,
                          "raise it or --tensor-parallel-size for more KV blocks"),
                      Fix("--kv-cache-dtype", _kv_dtype(facts), "fp8", "doubles the tokens that fit (from 16 bits)"),
                      Fix("--max-num-seqs", facts.get("max_num_seqs"), None,
                          "or lower it so fewer requests compete for the pool")])


# ------------------------------------------------------------------ kvscope recording
# The phase records' fields compared with vLLM's figures; which figure each one is, is
# FIGURE_NAMES' kvscope column (bytes there, GiB in the log).
_PROFILE_FIELDS: tuple[tuple[type[PhaseData], str], ...] = (
    (BudgetData, "total_bytes"),
    (BudgetData, "gpu_memory_utilization"),
    (BudgetData, "requested_bytes"),
    (LoadWeightsData, "weights_bytes"),
    (ProfileRunData, "activation_peak_bytes"),
    (ProfileRunData, "non_torch_bytes"),
    (KvCacheData, "kv_pool_bytes"),
    (KvCacheData, "num_blocks"),
    (KvCacheData, "kv_cache_tokens"),
    (KvCacheData, "max_concurrency"),
    (GraphsCompileData, "cuda_graph_bytes"),
)
_FIGURE_OF_FIELD = {name.kvscope: key for key, name in FIGURE_NAMES.items() if name.kvscope}
_VLLM_DURATIONS = {"C": ("load_model_s", "load_weights_s"), "D": ("profile_s",), "F": ("graph_capture_s", "init_engine_s")}


def read_profile(path: str) -> Recording:
    from engine.events import read_events

    try:
        return read_events(path)
    except (OSError, ValueError) as exc:
        raise UserError(f"--profile {path}: {exc}") from exc


def compare_profile(recording: Recording | str, facts: dict[str, Any]) -> list[dict[str, Any]]:
    """Phase-by-phase rows: a kvscope recording's StartupPhase numbers beside vLLM's."""
    from engine.events import StartupPhase

    if isinstance(recording, str):
        recording = read_profile(recording)
    phases: dict[str, StartupPhase] = {}
    for event in recording.events:
        if isinstance(event, StartupPhase) and event.status in ("end", "skipped", "failed"):
            phases[event.phase] = event
    rows: list[dict[str, Any]] = []
    for letter in STARTUP_PHASES:
        last = phases.get(letter)
        if last is None:
            continue
        vllm_s = next((facts[k] for k in _VLLM_DURATIONS.get(letter, ()) if k in facts), None)
        rows.append({"phase": letter, "item": "duration_s", "kvscope": last.duration_s, "vllm": vllm_s,
                     "status": last.status})
        record = phase_record(last)
        for kind, key in _PROFILE_FIELDS:
            if isinstance(record, kind) and key in record.reported:
                value = getattr(record, key)
                if key.endswith("_bytes") and isinstance(value, int | float):
                    value = value / GiB
                figure = _FIGURE_OF_FIELD[key]
                rows.append({"phase": letter, "item": figure, "kvscope": value, "vllm": facts.get(figure)})
    return rows


def _model_keys(name: str) -> set[str]:
    """The spellings a model goes by: the preset a name resolves to (an HF id such as
    Qwen/Qwen2.5-0.5B-Instruct) and its last path part, lower-cased (a local folder named
    after the model); two names are the same model when their spellings meet."""
    last = name.strip().rstrip("/").rsplit("/", 1)[-1].lower()
    preset = resolve_preset_name(name)
    return {last} if preset is None else {last, preset}


def recording_models(recording: Recording) -> dict[str, str]:
    """The models a recording names: its engine.config event's ``config.model`` and
    ``model.name`` (the header's config.model when the event is missing)."""
    from engine.events import EngineConfigEvent

    event = next((e for e in recording.events if isinstance(e, EngineConfigEvent)), None)
    config = event.config if event is not None else recording.config
    found = {"config.model": config.get("model"), "model.name": (event.model if event is not None else {}).get("name")}
    return {where: value for where, value in found.items() if isinstance(value, str) and value}


def profile_model_check(recording: Recording, facts: dict[str, Any], lines: dict[str, int]) -> Check | None:
    """A warning when the log's model is not the one the --profile recording ran."""
    ran = recording_models(recording)
    logged = facts.get("model")
    if not ran:
        return None
    if len(set(ran.values())) == 1:
        ran_text = f"{next(iter(ran.values()))!r}"
    else:
        ran_text = ", ".join(f"{where} {value!r}" for where, value in ran.items())
    if not logged:
        return Check("profile_model", "the log names no model to compare with the recording's", None,
                     f"the recording ran {ran_text}; the log does not say which model vLLM served", kind="warning")
    if any(_model_keys(str(logged)) & _model_keys(n) for n in ran.values()):
        return None
    return Check("profile_model", "the recording's model is not the log's", False,
                 f"vLLM served {str(logged)!r}, the --profile recording ran {ran_text}: "
                 "the phase-by-phase rows compare two different models",
                 kind="warning", line=lines.get("model"),
                 fix=[Fix("--profile", None, None, f"record a kvscope run of {logged} (engine serve --model "
                          f"{logged} --events events.jsonl) and pass that to --profile")])
