"""A vLLM log as findings: logparse reads it (its patterns, its failures with the
fix in numbers) and this module words the result as the doctor's findings, so
``engine doctor vllm.log`` and ``engine doctor run.jsonl`` answer alike.

vLLM's log has no steps or request ids (a V1 log has the stats line at most),
so these findings carry line numbers and the figures vLLM printed instead. A
data-parallel server's log has one stats line per engine core each round
(``Engine 001: ... Running: 31 reqs, Waiting: 108 reqs, GPU KV cache usage: 98.6%``):
:func:`log_fleet` reads them, a second pass taken only when an engine beyond 000
printed one, and doctor/vllm_dp.py judges their balance as the events rule does.
"""

from __future__ import annotations

import dataclasses
import re
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from doctor.rules.finding import CRITICAL, WARNING, Finding
from doctor.vllm_dp import LOG_INTERVAL_S, EngineRound, VllmFleet, dp_imbalance_finding
from engine.events.bounded import open_binary
from logparse.check import Check
from logparse.explain import Explanation, explain
from logparse.parser import (
    MAX_LINE_BYTES,
    bounded_lines,
    decode_physical,
    learn_prefix,
    match_message,
    strip_prefix,
)
from logparse.patterns import BULK_MARKERS, FIGURE_NAMES

# logparse's check ids under the doctor's rule names (the same failure, read from a log).
RULE_OF_CHECK = {"max_seq_len_exceeds_kv": "startup_refused", "no_cache_blocks": "startup_refused",
                 "free_below_request": "startup_oom", "oom": "startup_oom", "oom_sampler": "startup_oom",
                 "oom_graph_capture": "startup_oom", "kv_below_max_model_len": "startup_refused",
                 "startup_failed": "startup_failed", "engine_died": "engine_died",
                 "preemption": "pool_binds"}
CAUSES = {"startup_refused": "the pool cannot hold one --max-model-len request: lower the context, raise the memory "
                             "cap, use an fp8 KV cache or add tensor parallelism",
          "startup_oom": "another process holds device memory, or the cap is too close to 1.0: give the engine "
                         "the device to itself and back the cap off by a few points",
          "pool_binds": "more work admitted than the KV pool holds: the same prefill is paid twice"}
# The printed figures quoted as evidence, in the order vLLM prints them.
EVIDENCE_FIGURES = ("total_gib", "gpu_memory_utilization", "weights_gib", "peak_activation_gib", "kv_cache_gib",
                    "kv_cache_tokens", "gpu_blocks", "max_model_len", "max_concurrency")


def _printed_figures(explanation: Explanation) -> str | None:
    parts = []
    for key in EVIDENCE_FIGURES:
        value = explanation.printed.get(key)
        if value is None and key in explanation.facts:
            value = str(explanation.facts[key])
        if value is not None:
            name = FIGURE_NAMES[key]
            parts.append(f"{name.vllm} {value}{' ' + name.unit if name.unit and name.unit != 'x' else name.unit}")
    return "vLLM printed: " + "; ".join(parts) if parts else None


def finding_of(check: Check, explanation: Explanation) -> Finding:
    rule = RULE_OF_CHECK.get(check.id, f"vllm_{check.id}")
    evidence = [f"line {check.line}: {check.detail}" if check.line else check.detail]
    numbers: dict[str, Any] = {"line": check.line, "check": check.id}
    startup = explanation.startup
    cause = CAUSES.get(rule, check.title)
    if startup is not None and check.kind == "failure":
        # every failure of a start names its cause and the last phase reached (logparse/failed_start.py)
        if check.id not in ("startup_failed", "engine_died"):
            evidence.append(f"{startup.headline()} (line {startup.line}; phase from {startup.phase_source})")
        else:
            cause = startup.cause_text()
        numbers.update(phase=startup.phase, phase_name=startup.phase_name, cause=startup.cause,
                       failed_start=not startup.runtime)
    figures = _printed_figures(explanation)
    if figures:
        evidence.append(figures)
    numbers.update({k: explanation.facts[k] for k in EVIDENCE_FIGURES if k in explanation.facts})
    return Finding(rule, CRITICAL if check.kind == "failure" else WARNING, check.title, evidence,
                   cause, [dataclasses.replace(fix) for fix in check.fix], numbers=numbers)


STATS_MARKER = BULK_MARKERS["stats"][0]  # every vLLM release's stats line holds it
# A stats line of an engine beyond 000: only a data-parallel server prints one.
_SECOND_ENGINE = re.compile(rb"Engine 0*[1-9]\d*: Avg prompt throughput: ")
SCAN_BYTES = 8 << 20
CLOCK_FORMATS = ("%m-%d %H:%M:%S", "%Y-%m-%d %H:%M:%S", "%Y-%m-%d %H:%M:%S,%f", "%Y-%m-%dT%H:%M:%S")


def _has_second_engine(path: Path) -> bool:
    """Whether any engine beyond 000 printed a stats line: a byte search, so a one-engine
    log's millions of stats lines are never parsed for the balance."""
    overlap = b""
    with open_binary(path, tolerant=True) as fh:
        while chunk := fh.read(SCAN_BYTES):
            if _SECOND_ENGINE.search(overlap + chunk):
                return True
            overlap = chunk[-128:]
    return False


def _clock_seconds(clock: str | None) -> float | None:
    """vLLM's printed time ("12-01 07:31:02", no year) as seconds on one axis, or None."""
    if not clock:
        return None
    for fmt in CLOCK_FORMATS:
        try:
            when = datetime.strptime(clock if "%Y" in fmt else f"{clock}", fmt)
        except ValueError:
            continue
        if "%Y" not in fmt:
            when = when.replace(year=2000)  # a leap year, so 02-29 parses
        return (when - datetime(2000, 1, 1)).total_seconds()
    return None


def log_fleet(path: str | Path, facts: dict[str, Any] | None = None) -> VllmFleet | None:
    """The engines' stats lines as rounds (None: one engine printed them). A round ends when an
    engine prints again (vLLM prints every engine's line in one pass, rank order); an engine
    idle for two intervals prints at DEBUG, so a round may lack it and it keeps its last
    reading. A clock that runs back by half a year is the new year."""
    path = Path(path)
    if not _has_second_engine(path):
        return None
    facts = facts or {}
    learned = learn_prefix(path)  # the log's own line prefix, as logparse reads it
    rounds: list[EngineRound] = []
    current: EngineRound | None = None
    year_s = 0.0
    last_clock_s: float | None = None
    with open_binary(path, tolerant=True) as fh:
        for number, raw in enumerate(bounded_lines(fh), 1):  # an over-long line keeps its first MiB
            if STATS_MARKER not in raw:
                continue
            for _, text in decode_physical(number, raw[:MAX_LINE_BYTES]):
                prefix = strip_prefix(text, learned)
                pattern, fields, _ = match_message(prefix.text)
                if pattern is None or pattern.id != "stats" or "engine" not in fields:
                    continue  # "N Engines Aggregated:" or a V0 line: no engine's own queue
                engine = int(fields["engine"])
                if current is None or engine in current.readings:
                    clock_s = _clock_seconds(prefix.time)
                    if clock_s is not None and last_clock_s is not None and clock_s + year_s < last_clock_s - 1.6e7:
                        year_s += timedelta(days=366).total_seconds()
                    if clock_s is not None:
                        t = clock_s + year_s
                        last_clock_s = t
                    else:
                        t = rounds[-1].t + LOG_INTERVAL_S if rounds else 0.0
                    current = EngineRound(t, {}, number, prefix.time)
                    rounds.append(current)
                current.readings[engine] = (int(fields["waiting"]), int(fields["running"]),
                                            float(fields.get("kv_usage_pct", 0.0)) / 100.0)
                current.generation_tps[engine] = float(fields["generation_tps"])
    if rounds:
        first_t = rounds[0].t
        for round_ in rounds:
            round_.t -= first_t
    return VllmFleet("log", rounds, int(facts.get("data_parallel_size") or 0),
                     facts.get("api_server_count"), facts.get("max_num_seqs"))


def diagnose_log(path: str | Path, notes: list[str] | None = None) -> list[Finding]:
    """The log's failures and warnings as findings (a log of a healthy start gives none),
    and the engines' balance where a data-parallel server's stats lines are in it;
    ``notes`` (optional) gets what was read of them."""
    explanation = explain(path, keep_records=False)
    findings = [finding_of(c, explanation) for c in explanation.checks
                if c.ok is False and c.kind in ("failure", "warning")]
    if notes is not None:
        notes += [cut.sentence() for cut in explanation.cuts]
    fleet = log_fleet(path, explanation.facts)
    if fleet is not None:
        engines = sorted({e for r in fleet.rounds for e in r.readings})
        if notes is not None:
            notes.append(f"data parallel: {len(fleet.rounds)} stats rounds of {len(engines)} engines "
                         f"({', '.join(f'{e:03d}' for e in engines)}) judged for balance")
        finding = dp_imbalance_finding(fleet)
        if finding is not None:
            findings.append(finding)
    return findings
