"""The rules in the order ``engine doctor`` and the monitor's Diagnosis panel run them, and
``diagnose``: every rule over the run and over each data-parallel rank's own steps.
"""

from __future__ import annotations

from doctor.facts import RunFacts
from doctor.rules.finding import SEVERITY_ORDER, Finding, Rule
from doctor.rules.kv_pool import max_num_seqs_binds, pool_binds, prefix_cache_low
from doctor.rules.latency import decode_starved, long_prompt_spikes, ttft_token_budget
from doctor.rules.parallelism import dp_imbalance, hot_expert, pipeline_bubble, tp_scaling
from doctor.rules.requests import (
    prefix_miss_causes,
    request_thrashing,
    seqs_held_by_deferred,
    session_context_lost,
    stuck_engine,
)
from doctor.rules.stall import engine_stalled
from doctor.rules.startup import startup_oom, startup_refused

REQUEST_RULES: tuple[Rule, ...] = (stuck_engine, seqs_held_by_deferred, prefix_miss_causes, request_thrashing,
                                   session_context_lost)


RULES: tuple[Rule, ...] = (startup_refused, startup_oom, pool_binds, max_num_seqs_binds, long_prompt_spikes,
                           decode_starved, ttft_token_budget, prefix_cache_low, tp_scaling, hot_expert, pipeline_bubble)

# Rules over every data-parallel rank at once (the others judge one engine's steps).
FLEET_RULES: tuple[Rule, ...] = (dp_imbalance, engine_stalled)


def diagnose(facts: RunFacts) -> list[Finding]:
    """Every rule's findings, critical first, then by the step they started. The per-engine
    rules judge each data-parallel rank's own steps; a finding on rank R > 0 says so."""
    found = [finding for rule in (*RULES, *REQUEST_RULES, *FLEET_RULES) for finding in rule(facts)]
    for rank, rank_facts in sorted(facts.ranks.items()):
        for rule in (*RULES, *REQUEST_RULES):
            for finding in rule(rank_facts):
                if finding.first_step is None:
                    continue  # startup is the run's, already judged once
                finding.title = f"DP rank {rank}: {finding.title}"
                finding.numbers["dp_rank"] = rank
                found.append(finding)
    return sorted(found, key=lambda f: (-SEVERITY_ORDER[f.severity], f.first_step if f.first_step is not None else -1))
