"""From records to an explanation: ledger, budget, timeline, checks, failures with
fixes, and kvscope's own plan (and optionally a real kvscope run) beside vLLM's.

All budget arithmetic on kvscope's side comes from :mod:`engine.budget.memory`; this
module only reads vLLM's printed numbers and compares. The pieces, each in its module:
the fold of the records (``fold``), vLLM's budget (``vllm_budget``), kvscope's plan
(``kvscope_plan``), the derived checks (``derived_checks``, ``hybrid_checks``), the
failures (``failures``) and a kvscope recording beside the log (``kvscope_recording``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.budget.memory import MemoryPlan
from engine.modelspec.config import ModelConfig
from logparse.check import Check, unit
from logparse.completeness import Cut
from logparse.coverage import Coverage
from logparse.derived_checks import derived_checks
from logparse.failed_start import StartupFailure, kv_below_check, startup_outcome
from logparse.failures import failure_check, preemption_check
from logparse.fastscan import BulkRun, iter_summary
from logparse.fold import PhaseSpan, RecordFold
from logparse.kvscope_plan import identify_model, kvscope_plan
from logparse.kvscope_recording import compare_profile, profile_model_check, read_profile
from logparse.options import Options
from logparse.parser import Record, iter_records
from logparse.patterns import LEDGER_KEYS
from logparse.reconcile import block_size, graph_in_pool
from logparse.startup_phases import StartupTimes
from logparse.vllm_budget import remainder_tolerance, vllm_budget


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


def explain(source: str | Path | Iterable[bytes | str], options: Options | None = None,
            keep_records: bool = True) -> Explanation:
    """Fold a log's records into an explanation. Without ``keep_records`` a file is read by
    the fast summary (logparse/fastscan.py), which counts runs of stats and access lines
    instead of reading each; both fold the same records."""
    options = options or Options()
    fold = _fold(source, keep_records)
    facts, printed, fact_lines = fold.facts, fold.printed, fold.fact_lines
    timeline = sorted(fold.spans.values(), key=lambda s: s.first_line)
    _learn_block_size(facts)
    model, model_note = identify_model(options, facts)
    budget = vllm_budget(facts, printed, options)
    graph = graph_in_pool(budget, facts, remainder_tolerance(printed) + unit(printed.get("cuda_graph_gib")))
    kv_plan, plan_json = kvscope_plan(facts, budget, model, model_note, graph)
    checks = derived_checks(facts, printed, fact_lines, budget, model)
    _add_failures(checks, fold, budget, model, kv_plan, plan_json.get("inputs"))
    kv_below = kv_below_check(facts, fact_lines, budget, checks)
    if kv_below is not None:
        checks.append(kv_below)
    startup = startup_outcome(fold.watch, fold.failures, fold.last_phase, fold.last_line, checks)
    cuts = fold.complete.cuts(facts, fold.watch.in_traceback, fold.watch.ready_line is not None,
                              startup is not None and not startup.runtime, fold.last_line)
    if fold.preemptions_v0 or fold.preemptions_v1:
        checks.append(preemption_check(fold.preemptions_v0, fold.preemptions_v1, fold.preemption_line, facts))
    if options.profile:
        _compare_with_profile(options.profile, facts, fact_lines, plan_json, checks)
    return Explanation(
        path=str(source) if isinstance(source, str | Path) else "<stream>",
        records=fold.records,
        record_count=fold.coverage.records,
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


def _fold(source: str | Path | Iterable[bytes | str], keep_records: bool) -> RecordFold:
    """Every record of the log through one fold: read one by one, or by the fast summary's
    runs when the records need not be kept."""
    fold = RecordFold(keep_records)
    items: Iterable[Record | BulkRun] = (
        iter_summary(source) if not keep_records and isinstance(source, str | Path) else iter_records(source))
    for item in items:
        if isinstance(item, BulkRun):
            fold.add_run(item)
        else:
            fold.add(item)
    return fold


def _learn_block_size(facts: dict[str, Any]) -> None:
    """The log's tokens over its blocks (logparse/reconcile.py), not an assumed 16."""
    if "block_size" not in facts:
        size, size_source = block_size(facts)
        if size_source != "vLLM's default":
            facts["block_size"], facts["block_size_source"] = size, size_source


def _add_failures(checks: list[Check], fold: RecordFold, budget: dict[str, Any], model: ModelConfig | None,
                  kv_plan: MemoryPlan | None, plan_inputs: dict[str, Any] | None) -> None:
    """Each failure the fold saw as a check with its fixes, placed by its traceback's frames."""
    for record, phase in fold.failures:
        check = failure_check(record, phase, fold.facts, budget, model, kv_plan, fold.tracebacks.place_of(record),
                              plan_inputs)
        if check.id == "no_cache_blocks" and any(c.id == check.id for c in checks):
            continue  # '# GPU blocks: 0' and the ValueError after it report one failure
        checks.append(check)


def _compare_with_profile(path: str, facts: dict[str, Any], fact_lines: dict[str, int], plan_json: dict[str, Any],
                          checks: list[Check]) -> None:
    """The --profile recording phase by phase beside the log, and a warning if it ran another model."""
    recording = read_profile(path)
    plan_json["profile"] = compare_profile(recording, facts)
    model_check = profile_model_check(recording, facts, fact_lines)
    if model_check is not None:
        checks.append(model_check)
