"""The fixes that grow the KV pool, computed through the budget formula
(:mod:`doctor.budget`): an fp8 KV cache and a higher ``--gpu-memory-utilization``; and the
mean request the pool is sized in.
"""

from __future__ import annotations

import math
import statistics

from doctor.budget import replan
from doctor.facts import RunFacts
from engine.budget.fixes import Fix
from engine.budget.memory import GiB, required_utilization

MAX_UTILIZATION_ADVISED = 0.95  # above this, graph capture and other processes run out of room


def mean_request_tokens(facts: RunFacts) -> float:
    done = [r.total_tokens for r in facts.requests.values() if r.total_tokens > 0]
    return statistics.fmean(done) if done else 0.0


def fp8_fix(facts: RunFacts, need_tokens: int) -> Fix | None:
    if str(facts.flag("kv_cache_dtype", "auto")).startswith("fp8"):
        return None
    now, plan = replan(facts), replan(facts, kv_cache_dtype="fp8")
    if now is None or plan is None:
        return None
    holds = "holds" if plan.kv_cache_tokens >= need_tokens else "still short of"
    return Fix("--kv-cache-dtype", facts.flag("kv_cache_dtype", "auto"), "fp8",
               f"{plan.bytes_per_token / 1024:,.1f} KiB per token instead of {now.bytes_per_token / 1024:,.1f}: "
               f"the same pool holds {plan.kv_cache_tokens:,} tokens, {holds} the {need_tokens:,} needed "
               "(measure accuracy on your evaluation set)",
               numbers={"kv_cache_tokens": plan.kv_cache_tokens})


def utilization_fix(facts: RunFacts, need_tokens: int) -> Fix | None:
    plan = replan(facts)
    if plan is None or plan.kv_pool_overridden:
        return None
    need_util = required_utilization(plan, need_tokens * plan.bytes_per_token)
    current = plan.gpu_memory_utilization
    if need_util <= current:
        return None
    if need_util > MAX_UTILIZATION_ADVISED:
        return Fix("--gpu-memory-utilization", current, None,
                   f"would need {need_util:.2f} for {need_tokens:,} tokens (non-KV "
                   f"{(plan.total_bytes * current - plan.kv_pool_bytes) / GiB:.2f} GiB plus "
                   f"{need_tokens * plan.bytes_per_token / GiB:.2f} GiB of KV on {plan.total_bytes / GiB:.2f} GiB): "
                   "beyond a safe cap, so a bigger GPU or --tensor-parallel-size 2",
                   numbers={"required_utilization": need_util})
    proposed = math.ceil(need_util * 100) / 100
    return Fix("--gpu-memory-utilization", current, f"{proposed:.2f}",
               f"the pool grows to {need_tokens:,} tokens ({need_tokens * plan.bytes_per_token / GiB:.2f} GiB of KV)",
               numbers={"required_utilization": need_util})
