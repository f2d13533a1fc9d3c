"""The simulator's what-if for each fix: the run's own requests (arrival times,
prompt and output lengths, prefix hits, all read from its events) through
``engine simulate``'s scheduler and cost model twice, with the recorded flags and
with the fix's flag, so the effect is a difference between two simulations of
the same traffic ("--max-num-batched-tokens 2048: worst ITL 410 → 120 ms, TTFT
p99 1.2 → 1.9 s").

The cost model is the recording's GPU preset when it was a simulation, else the
simulator's default GPU (the run's own hardware has no preset; the effect's
direction and size still follow the scheduler). A fix that changes the pool
(``--kv-cache-dtype``, ``--gpu-memory-utilization``, ``--max-num-batched-tokens``)
gets its block count from :func:`doctor.budget.replan`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from doctor.budget import model_of, replan, replan_stages
from doctor.facts import RunFacts
from doctor.rules.finding import Finding
from engine.budget.fixes import Fix
from engine.budget.stages import DEFAULT_MICRO_BATCHES
from engine.config import EngineConfig
from engine.errors import UserError
from engine.sim.simulate import (
    DEFAULT_EFFICIENCY,
    DEFAULT_GPU,
    DEFAULT_PIPELINE_LINK_GBS,
    SimResult,
    build_setup,
    simulate,
)
from engine.sim.workload import WorkloadRequest

# Flags the simulator can vary, with the type their proposed value takes.
SIMULATED_FLAGS = {"--max-num-seqs": int, "--max-num-batched-tokens": int, "--kv-cache-dtype": str,
                   "--gpu-memory-utilization": float, "--long-prefill-token-threshold": int,
                   "--pipeline-parallel-size": int}
POOL_FLAGS = ("--kv-cache-dtype", "--gpu-memory-utilization", "--max-num-batched-tokens")
MAX_SIM_STEPS = 200_000  # a what-if never runs longer than this (a pathological fix)

# What each rule's effect quotes: (summary key, label, unit); "s" values are shown in ms or s.
EFFECT_METRICS: dict[str, tuple[tuple[str, str, str], ...]] = {
    "pool_binds": (("preemptions", "preemptions", ""), ("ttft_p99_s", "TTFT p99", "s"),
                   ("output_tokens_per_s", "output", "tok/s")),
    "max_num_seqs_binds": (("ttft_p99_s", "TTFT p99", "s"), ("peak_waiting", "peak queue", ""),
                           ("output_tokens_per_s", "output", "tok/s")),
    "long_prompt_spikes": (("itl_max_s", "worst ITL", "s"), ("itl_p99_s", "ITL p99", "s"), ("ttft_p99_s", "TTFT p99", "s")),
    "decode_starved": (("itl_p90_s", "ITL p90", "s"), ("itl_max_s", "worst ITL", "s"), ("ttft_p99_s", "TTFT p99", "s")),
    "ttft_token_budget": (("ttft_p50_s", "TTFT p50", "s"), ("ttft_p99_s", "TTFT p99", "s"), ("itl_max_s", "worst ITL", "s")),
    "prefix_cache_low": (("prefix_hit_rate", "prefix hit rate", "%"), ("ttft_p50_s", "TTFT p50", "s"),
                         ("preemptions", "preemptions", "")),
    "pipeline_bubble": (("output_tokens_per_s", "output", "tok/s"), ("itl_p50_s", "ITL p50", "s"),
                        ("ttft_p99_s", "TTFT p99", "s")),
}


def workload_of(facts: RunFacts) -> list[WorkloadRequest]:
    """The run's requests as a workload: arrival time, prompt, output (as finished, else
    max_tokens) and the prefix it hit (the first request of a shared prefix hits nothing,
    so the simulation's hits are a floor)."""
    out = []
    for req in sorted(facts.requests.values(), key=lambda r: r.arrival_t):
        if req.prompt_tokens < 1:
            continue
        output = req.output_tokens or req.max_tokens or 1
        out.append(WorkloadRequest(req.request_id, req.prompt_tokens, max(1, output), arrival_time=req.arrival_t,
                                   shared_prefix_tokens=min(req.prefix_hit_tokens, req.prompt_tokens - 1)))
    return out


def _engine_config(facts: RunFacts, changes: dict[str, Any]) -> EngineConfig:
    known = {f.name for f in dataclasses.fields(EngineConfig)}
    flags = {k: v for k, v in facts.config.items() if k in known and v is not None}
    flags.update(changes)
    flags["events_path"] = None
    return EngineConfig(**flags)


class WhatIf:
    """Simulations of one run's traffic; the baseline (recorded flags) runs once."""

    def __init__(self, facts: RunFacts) -> None:
        self.facts = facts
        self.workload = workload_of(facts)
        sim = facts.config.get("simulation") or {}
        self.gpu = str(sim.get("gpu") or DEFAULT_GPU)
        self.efficiency = float(sim.get("efficiency") or DEFAULT_EFFICIENCY)
        self.simulated_run = bool(sim)
        self.micro_batches = int(sim.get("pipeline_micro_batches") or DEFAULT_MICRO_BATCHES)
        self.pipeline_link_gbs = float(sim.get("pipeline_link_gbs") or DEFAULT_PIPELINE_LINK_GBS)
        self._baseline: dict[str, Any] | None = None

    @property
    def possible(self) -> bool:
        return bool(self.workload) and model_of(self.facts) is not None and self.facts.kv_cache is not None

    def run(self, changes: dict[str, Any] | None = None, pool_changes: bool = False) -> dict[str, Any]:
        changes = dict(changes or {})
        model = model_of(self.facts)
        kv = self.facts.kv_cache
        assert model is not None and kv is not None
        blocks = kv.num_blocks
        if "pipeline_parallel_size" in changes:  # each stage's pool from the run's budget (engine plan -pp)
            stages = replan_stages(self.facts, changes["pipeline_parallel_size"])
            blocks = stages.num_blocks if stages is not None else blocks
            if changes["pipeline_parallel_size"] == 1:
                changes["pipeline_parallel_size"] = None
        elif pool_changes:
            plan = replan(self.facts, **changes)
            blocks = plan.num_blocks if plan is not None else blocks
        setup = build_setup(model, self.gpu, _engine_config(self.facts, changes), efficiency=self.efficiency,
                            num_gpu_blocks_override=max(1, int(blocks or 1)), micro_batches=self.micro_batches,
                            pipeline_link_gbs=self.pipeline_link_gbs)
        result: SimResult = simulate(setup, self.workload, startup=False, max_steps=MAX_SIM_STEPS)
        summary = result.summary()
        summary["prefix_hit_rate"] = (result.prefix_hit_tokens / result.prefix_query_tokens
                                      if result.prefix_query_tokens else 0.0)
        summary["num_blocks"] = setup.plan.num_blocks
        return summary

    def baseline(self) -> dict[str, Any]:
        if self._baseline is None:
            self._baseline = self.run()
        return self._baseline

    def effect(self, rule: str, fix: Fix) -> str | None:
        """The fix's effect in the rule's metrics, or None when the simulator cannot vary its flag."""
        kind = SIMULATED_FLAGS.get(fix.flag)
        if kind is None or fix.proposed is None or not self.possible:
            return None
        flag = fix.flag.removeprefix("--").replace("-", "_")
        try:
            value = kind(fix.proposed)
            after = self.run({flag: value}, pool_changes=fix.flag in POOL_FLAGS)
        except (UserError, ValueError) as exc:
            return f"not simulated: {exc}"
        before = self.baseline()
        metrics = EFFECT_METRICS.get(rule, EFFECT_METRICS["pool_binds"])
        parts = [f"{label} {_value(before[key], unit)} → {_value(after[key], unit)}" for key, label, unit in metrics]
        fix.numbers["simulated"] = {key: {"before": before[key], "after": after[key]} for key, _, _ in metrics}
        where = self.gpu if self.simulated_run else f"{self.gpu}'s cost model"
        return f"simulated on {where}, the same {len(self.workload)} requests: " + ", ".join(parts)


def _value(value: float, unit: str) -> str:
    if unit == "s":
        return f"{value * 1e3:,.0f} ms" if value < 1 else f"{value:,.2f} s"
    if unit == "%":
        return f"{value * 100:.0f} %"
    if unit:
        return f"{value:,.0f} {unit}"
    return f"{value:,.0f}"


def add_effects(facts: RunFacts, findings: Iterable[Finding]) -> None:
    """Fill each fix's ``effect`` with the simulator's what-if where its flag can be simulated
    (a data-parallel rank's finding on that rank's own requests)."""
    what_ifs: dict[int, WhatIf] = {}
    for finding in findings:
        rank = int(finding.numbers.get("dp_rank", 0)) if finding.rule != "dp_imbalance" else 0
        what_if = what_ifs.get(rank)
        if what_if is None:
            what_if = what_ifs[rank] = WhatIf(facts.rank(rank))
        if not what_if.possible:
            continue
        for fix in finding.fixes:
            fix.effect = what_if.effect(finding.rule, fix)
