"""``engine doctor SOURCE``: what ``engine/cli/commands/doctor.py`` calls through the
``kvscope.doctor`` entry point (the engine never imports this package)."""

from __future__ import annotations

import argparse
import sys

from doctor.inputs import (
    LIVE_URL,
    RECORDING,
    VLLM_METRICS,
    facts_from_recording,
    facts_from_server,
    kind_of,
    live_kind,
    sample_vllm_metrics,
)
from doctor.remedies import add_effects
from doctor.report import render_json, render_text
from doctor.rules.finding import Finding, exit_status
from doctor.rules.registry import diagnose
from doctor.vllm_dp import dp_imbalance_finding
from doctor.vllm_log import diagnose_log
from doctor.vllm_stall import stall_findings


def examine(source: str, *, duration_s: float = 10.0, api_key: str | None = None,
            simulate: bool = True) -> tuple[str, list[Finding], list[str]]:
    """(kind, findings, notes) for ``source``: the one path of the CLI, reused by tests."""
    kind = kind_of(source)
    notes: list[str] = []
    if kind == LIVE_URL:
        kind = live_kind(source, api_key)
    if kind == VLLM_METRICS:
        fleet = sample_vllm_metrics(source, duration_s, api_key)
        engines = sorted({e for r in fleet.rounds for e in r.readings})
        notes.append(f"a vLLM server (no /events): {len(fleet.rounds)} scrapes of /metrics over {duration_s:g} s, "
                     f"the queues of {len(engines)} engine{'' if len(engines) == 1 else 's'} judged for balance")
        finding = dp_imbalance_finding(fleet)
        return kind, ([finding] if finding is not None else []) + stall_findings(fleet, duration_s), notes
    if kind in (RECORDING, LIVE_URL):
        facts = facts_from_recording(source) if kind == RECORDING else facts_from_server(source, duration_s, api_key)
        if not facts.steps and facts.failed_phase is None:
            notes.append("no steps in the events: the run served no requests, so only startup was judged")
        if kind == LIVE_URL:
            notes.append(f"live: {len(facts.steps)} steps over {duration_s:g} s plus the server's recent events")
        findings = diagnose(facts)
        if simulate:
            add_effects(facts, findings)
    else:
        findings = diagnose_log(source, notes)
        notes.append("a vLLM log has no per-request events: evidence is its lines and printed figures")
    return kind, findings, notes


def run(args: argparse.Namespace) -> int:
    kind, findings, notes = examine(args.source, duration_s=args.duration, api_key=args.api_key,
                                    simulate=not args.no_simulate)
    if args.json:
        print(render_json(args.source, kind, findings, notes))
    elif sys.stdout.isatty():
        from rich.console import Console

        Console(highlight=False, soft_wrap=True).print(render_text(args.source, kind, findings, notes))
    else:
        print(render_text(args.source, kind, findings, notes, markup=False))
    return exit_status(findings)
