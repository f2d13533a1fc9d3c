"""The KV pool and ``--max-num-seqs``: which limit binds (KV usage near 1.0 with
preemptions, or the queue growing with low KV usage), and a shared prefix evicted from a
pool too full to keep it.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable

from doctor.facts import RunFacts
from doctor.rules.finding import CRITICAL, WARNING, Finding
from doctor.rules.pool_fixes import fp8_fix, mean_request_tokens, utilization_fix
from doctor.rules.steps import MIN_BINDING_STEPS, consecutive_runs, step_range
from engine.budget.fixes import Fix

KV_LOW = 0.80  # KV usage below this while requests wait: the pool is not what binds
KV_FULL = 0.95  # at or above this usage the pool, not the token budget, is what holds prompts back
STORM_REPEATS = 3  # one request preempted this often is a storm (critical)


def pool_binds(facts: RunFacts) -> Iterable[Finding]:
    """KV usage near 1.0 with preemptions: the pool is what binds (preemption storms)."""
    at = [s for s in facts.steps if s.preempted]
    if not at:
        return
    preempted = sorted((r for r in facts.requests.values() if r.preempted_at),
                       key=lambda r: (-len(r.preempted_at), r.preempted_at[0]))
    total = sum(len(s.preempted) for s in at)
    usage = [s.kv_usage for s in at]
    worst = preempted[0]
    storm = len(worst.preempted_at) >= STORM_REPEATS or total >= 0.2 * max(1, len(facts.requests))
    evidence = [f"{total} preemptions of {len(preempted)} requests at {step_range(at[0].index, at[-1].index)}, "
                f"KV usage {min(usage) * 100:.0f}–{max(usage) * 100:.0f} % when they happened"]
    for req in preempted[:3]:
        times = "once" if len(req.preempted_at) == 1 else f"{len(req.preempted_at)} times"
        evidence.append(f"request {req.request_id} was preempted {times} at "
                        f"{step_range(req.preempted_at[0], req.preempted_at[-1])}"
                        + (f" ({req.tokens_lost:,} computed tokens recomputed)" if req.tokens_lost else ""))
    lost = sum(r.tokens_lost for r in preempted)
    pool = facts.pool_tokens
    mean_tokens = mean_request_tokens(facts)
    peak_running = max(s.num_running for s in facts.steps)
    need = int(peak_running * mean_tokens)
    seqs = int(facts.flag("max_num_seqs", 256))
    fits = max(1, int(pool // mean_tokens)) if mean_tokens else seqs
    numbers = {"preemptions": total, "requests_preempted": len(preempted), "worst_request": worst.request_id,
               "worst_preemptions": len(worst.preempted_at), "tokens_recomputed": lost,
               "pool_tokens": pool, "peak_running": peak_running, "mean_request_tokens": round(mean_tokens),
               "need_ratio": need / pool if pool else 0.0}
    cause = (f"too many long requests admitted at once: {peak_running} running requests of {mean_tokens:,.0f} "
             f"tokens on average need {need:,} tokens, {need / pool:.1f}x the pool's {pool:,}" if pool else
             "the running set outgrew the KV pool")
    fixes = []
    if fits < min(seqs, peak_running):
        fixes.append(Fix("--max-num-seqs", seqs, fits,
                         f"the pool's {pool:,} tokens hold {fits} requests of the mean {mean_tokens:,.0f} tokens; "
                         "put admission control in front so overload becomes fast rejections",
                         numbers={"fits": fits}))
    for fix in (fp8_fix(facts, need), utilization_fix(facts, need)):
        if fix is not None:
            fixes.append(fix)
    yield Finding("pool_binds", CRITICAL if storm else WARNING,
                  "preemption storm: the KV pool binds" if storm else "the KV pool binds: requests were preempted",
                  evidence, cause, fixes, at[0].index, at[-1].index, numbers)


def max_num_seqs_binds(facts: RunFacts) -> Iterable[Finding]:
    """The queue grows while KV usage stays low: ``--max-num-seqs`` is the limit."""
    seqs = int(facts.flag("max_num_seqs", 256))
    # a step's running count is taken after its finished requests left: they held a slot during it
    runs = [r for r in consecutive_runs(facts.steps, lambda s: s.num_waiting > 0 and s.num_running + s.num_finished >= seqs
                             and s.kv_usage < KV_LOW) if len(r) >= MIN_BINDING_STEPS]
    if not runs:
        return
    longest = max(runs, key=len)
    held = sum(len(r) for r in runs)
    peak = max(longest, key=lambda s: s.num_waiting)
    usage = max(s.kv_usage for r in runs for s in r)
    queued = [r for r in facts.requests.values() if r.queue_time_s]
    slowest = max(queued, key=lambda r: r.queue_time_s or 0.0, default=None)
    evidence = [f"{held} steps with requests waiting while all {seqs} sequence slots were busy, the longest run "
                f"{step_range(longest[0].index, longest[-1].index)}; the queue peaked at {peak.num_waiting} at step "
                f"{peak.index}", f"KV usage stayed at or below {usage * 100:.0f} % meanwhile"]
    if slowest is not None and slowest.queue_time_s:
        evidence.append(f"request {slowest.request_id} waited {slowest.queue_time_s:,.2f} s in the queue")
    pool = facts.pool_tokens
    mean_tokens = mean_request_tokens(facts)
    fits = int(pool // mean_tokens) if mean_tokens else 0
    demand = max(s.num_running + s.num_finished + s.num_waiting for r in runs for s in r)
    proposed = min(fits, demand)
    fixes = []
    if proposed > seqs:
        fixes.append(Fix("--max-num-seqs", seqs, proposed,
                         f"room for the peak demand of {demand} requests (running and waiting); the pool's {pool:,} "
                         f"tokens hold {fits:,} requests of the mean {mean_tokens:,.0f} tokens "
                         f"(KV usage peaked at {usage * 100:.0f} %)", numbers={"fits": fits, "demand": demand}))
    yield Finding("max_num_seqs_binds", WARNING, "--max-num-seqs binds: the queue grows with KV to spare", evidence,
                  f"requests are short: {seqs} sequences use at most {usage * 100:.0f} % of the pool, so the sequence "
                  "limit, not memory, keeps the rest waiting", fixes, longest[0].index, longest[-1].index,
                  {"steps_bound": held, "peak_waiting": peak.num_waiting, "max_kv_usage": usage,
                   "max_num_seqs": seqs, "fits": fits})


def prefix_cache_low(facts: RunFacts) -> Iterable[Finding]:
    """A shared prefix exists (requests hit it) but its blocks were evicted, so later requests recompute it."""
    if not facts.flag("enable_prefix_caching", True) or not facts.prefix_blocks:
        return
    block = facts.block_size
    hits = [r for r in facts.requests.values() if r.prefix_hit_tokens >= block]
    evictions = [(s, [b for b in s.evicted if b in facts.prefix_blocks]) for s in facts.steps]
    evictions = [(s, blocks) for s, blocks in evictions if blocks]
    prompt_tokens = sum(r.prompt_tokens for r in facts.requests.values() if r.arrival_step is not None)
    hit_tokens = sum(r.prefix_hit_tokens for r in facts.requests.values())
    if len(hits) < 2 or not evictions or not prompt_tokens:
        return
    rate = hit_tokens / prompt_tokens
    shared = statistics.median(r.prefix_hit_tokens for r in hits)
    first_evict = evictions[0][0].index
    after = [r for r in facts.requests.values()
             if r.arrival_step is not None and r.arrival_step > first_evict and r.prefix_hit_tokens < block]
    evicted_blocks = sum(len(b) for _, b in evictions)
    usage = max(s.kv_usage for s, _ in evictions)
    evidence = [f"{len(hits)} requests reused a shared prefix of about {shared:,.0f} tokens, yet the hit rate is "
                f"{rate * 100:.0f} % of {prompt_tokens:,} prompt tokens",
                f"{evicted_blocks} blocks that had served prefix hits were evicted at "
                f"{step_range(first_evict, evictions[-1][0].index)} (KV usage up to {usage * 100:.0f} %)",
                f"{len(after)} requests that arrived after the first eviction hit nothing"]
    fixes = []
    peak = max(s.kv_blocks_used for s in facts.steps) * block
    need = peak + int(shared)
    for fix in (fp8_fix(facts, need), utilization_fix(facts, need)):
        if fix is not None:
            fixes.append(fix)
    seqs = int(facts.flag("max_num_seqs", 256))
    mean_tokens = mean_request_tokens(facts)
    pool = facts.pool_tokens
    keeps = int((pool - shared) // mean_tokens) if mean_tokens else 0
    if 0 < keeps < min(seqs, max(s.num_running for s in facts.steps)):
        fixes.append(Fix("--max-num-seqs", seqs, keeps,
                         f"the pool's {pool:,} tokens hold the {shared:,.0f}-token prefix plus {keeps} requests of the "
                         f"mean {mean_tokens:,.0f} tokens, so the prefix's blocks stay cached"))
    yield Finding("prefix_cache_low", WARNING, "low prefix-cache hit rate: the shared prefix is evicted", evidence,
                  "the pool is too full to keep the shared prefix's cached blocks, so they are reused for other "
                  "requests and recomputed later", fixes, first_evict, evictions[-1][0].index,
                  {"hit_rate": rate, "shared_prefix_tokens": shared, "evicted_prefix_blocks": evicted_blocks,
                   "missed_after_eviction": len(after)})
