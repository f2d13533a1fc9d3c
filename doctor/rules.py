"""The doctor's rules: each reads a :class:`~doctor.facts.RunFacts` and returns
the findings it sees, with the evidence (steps, requests, numbers from the
events), the likely cause and the fix computed through the budget formula
(:mod:`doctor.budget`). The monitor's Diagnosis panel runs these same rules on
its live fold; ``engine doctor`` adds the simulator's what-if to each fix
(:mod:`doctor.remedies`).

The rules follow the background's operations guide (failure modes and the five
metrics that cover most diagnoses): startup refused because the context does not
fit, out of memory at startup, the pool binds (KV usage near 1.0 with
preemptions), ``--max-num-seqs`` binds (queue grows with low KV usage), latency
spikes when long documents arrive, decode starved by prefill, TTFT rising while
the token budget binds, a low prefix-cache hit rate with a shared prefix, poor
scaling with tensor parallelism (collectives dominating the step), pipeline stages
idling (the bubble) and data-parallel ranks loaded unevenly.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from doctor.budget import model_of, replan, replan_stages
from doctor.facts import RequestFacts, RunFacts, StallFacts, StepRow
from engine.budget.fixes import Fix
from engine.budget.memory import GiB, required_utilization
from engine.budget.stages import DEFAULT_MICRO_BATCHES, PipelinePlan, fill_drain_bubble, stage_layer_ranges
from engine.events.folds.dp_balance import DP_IMBALANCE_BOUND, DP_MIN_MEAN_LOAD
from engine.events.folds.request_record import wait_reason_text
from engine.events.step_records import (
    PREFIX_EVICTED,
    PREFIX_SHORT_PROMPT,
    PREFIX_WINDOW,
    WAIT_NEVER_FITS,
    step_token_budget,
)

WARNING = "warning"
CRITICAL = "critical"
SEVERITY_ORDER = {WARNING: 1, CRITICAL: 2}

KV_LOW = 0.80  # KV usage below this while requests wait: the pool is not what binds
KV_FULL = 0.95  # at or above this usage the pool, not the token budget, is what holds prompts back
MIN_BINDING_STEPS = 5  # a limit must hold the queue back this many steps in a row to count
SPIKE_FACTOR = 3.0  # a step this many times the decode-only median is a latency spike
STARVED_SHARE = 0.10  # this share of decode tokens (ITL p90) in prefill-slowed steps: decode starved
STARVED_FACTOR = 2.0  # ... where a step is at least this many times the decode-only median
STORM_REPEATS = 3  # one request preempted this often is a storm (critical)
TTFT_RISE = 2.0  # last third's median TTFT over the first third's
MAX_UTILIZATION_ADVISED = 0.95  # above this, graph capture and other processes run out of room
TP_COLLECTIVE_SHARE = 0.25  # collectives taking this share of step time: the split costs more than it saves
HOT_EXPERT_IMBALANCE = 2.0  # an expert given this many times its layer's mean routed tokens is hot
HOT_EXPERT_MIN_TOKENS = 32  # routed tokens per expert (the layer's mean) below which a share is noise


@dataclass(slots=True)
class Finding:
    """One diagnosis. ``first_step``/``last_step`` are ``StepEvent.index`` values
    (None for startup findings); ``numbers`` holds the figures the evidence quotes."""

    rule: str
    severity: str
    title: str
    evidence: list[str]
    cause: str
    fixes: list[Fix] = field(default_factory=list)
    first_step: int | None = None
    last_step: int | None = None
    numbers: dict[str, Any] = field(default_factory=dict)
    place: str | None = None  # where, for a finding read from no steps (a vLLM log's lines, its /metrics)

    @property
    def where(self) -> str:
        if self.place is not None:
            return self.place
        if self.first_step is None:
            return "startup"
        if self.last_step is None or self.last_step == self.first_step:
            return f"step {self.first_step}"
        return f"steps {self.first_step}–{self.last_step}"

    def to_json(self) -> dict[str, Any]:
        return {"rule": self.rule, "severity": self.severity, "title": self.title, "where": self.where,
                "first_step": self.first_step, "last_step": self.last_step, "evidence": list(self.evidence),
                "cause": self.cause, "fixes": [f.to_json() for f in self.fixes], "numbers": dict(self.numbers)}


Rule = Callable[[RunFacts], Iterable[Finding]]


# ------------------------------------------------------------------ helpers
def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.0f} ms"


def _steps(first: int, last: int) -> str:
    return f"step {first}" if first == last else f"steps {first}–{last}"


def _runs(steps: list[StepRow], holds: Callable[[StepRow], bool]) -> list[list[StepRow]]:
    """Maximal runs of consecutive steps for which ``holds`` is true."""
    runs: list[list[StepRow]] = []
    current: list[StepRow] = []
    for step in steps:
        if holds(step):
            current.append(step)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return runs


def decode_baseline_s(facts: RunFacts) -> float | None:
    """Median duration of decode-only steps: what one token costs without prefill in the way."""
    durations = [s.duration_s for s in facts.steps if s.num_prefill_tokens == 0 and s.num_decode_tokens > 0]
    return statistics.median(durations) if durations else None


def _mean_request_tokens(facts: RunFacts) -> float:
    done = [r.total_tokens for r in facts.requests.values() if r.total_tokens > 0]
    return statistics.fmean(done) if done else 0.0


def _fp8_fix(facts: RunFacts, need_tokens: int) -> Fix | None:
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


def _utilization_fix(facts: RunFacts, need_tokens: int) -> Fix | None:
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


# ------------------------------------------------------------------ startup
def startup_refused(facts: RunFacts) -> Iterable[Finding]:
    """Startup refuses because the context does not fit (phase B/E's budget check). The
    fixes are the ones the check recorded on the failed phase (flag, current, proposed,
    why); a recording made before it recorded them has only the sentence."""
    failed = facts.failed_phase
    if failed is None or not failed.reason or "out of memory" in failed.reason.lower():
        return
    reason = failed.reason
    if not failed.fixes and failed.phase not in ("B", "E") and "kv cache" not in reason.lower():
        return
    fixes = [Fix.from_json(row) for row in failed.fixes] or fixes_from_old_sentence(reason)
    kv = facts.kv_cache
    numbers: dict[str, Any] = {"phase": failed.phase}
    if kv is not None and kv.kv_cache_tokens is not None:
        numbers["kv_cache_tokens"] = kv.kv_cache_tokens
    yield Finding("startup_refused", CRITICAL, "startup refused: the context does not fit the KV pool",
                  [f"phase {failed.phase} ({failed.name}) failed: {reason}"],
                  "the pool cannot hold one --max-model-len request: lower the context, raise the memory cap, "
                  "use an fp8 KV cache or add tensor parallelism", fixes, numbers=numbers)


# The fallback for recordings made before the budget check recorded its fixes (startup.phase
# ``fixes``, engine/budget/fixes.py): their refusal is a sentence, "...; try raise ... or lower
# ... to 16 or less" (or "...; raise ..."), split before each verb. Nothing else parses a fix.
_OPTION_SPLIT = re.compile(r" or (?=(?:raise|lower|increasing|decreasing|use|a smaller|add)\b)")


def fixes_from_old_sentence(reason: str) -> list[Fix]:
    """An old recording's refusal sentence as fixes: each option's first ``--flag`` and the
    option's words as its why, values unknown (the sentence does not separate them)."""
    _, _, advice = reason.partition("; try ")
    if not advice:
        _, _, advice = reason.rpartition("; ")
    fixes = []
    for option in filter(None, (part.strip() for part in _OPTION_SPLIT.split(advice))):
        flag = next((w for w in option.split() if w.startswith("--")), option)
        fixes.append(Fix(flag, None, None, option))
    return fixes


_OOM_WHERE = {"C": "while loading the weights", "D": "in the profile run (the worst-case step)",
              "E": "allocating the KV pool", "F": "at CUDA-graph capture", "G": "at the first large batch (warm-up)"}


def startup_oom(facts: RunFacts) -> Iterable[Finding]:
    """Out of memory at graph capture or the first large batch."""
    failed = facts.failed_phase
    if failed is None or not failed.reason or "out of memory" not in failed.reason.lower():
        return
    evidence = [f"phase {failed.phase} ({failed.name}) failed: {failed.reason}"]
    reading = failed.memory_before or {}
    numbers: dict[str, Any] = {"phase": failed.phase}
    total, free, reserved = reading.get("total"), reading.get("free"), reading.get("reserved")
    others = None
    if total and free is not None and reserved is not None:
        others = max(0, total - free - reserved)
        numbers["held_by_others_bytes"] = others
        evidence.append(f"before phase {failed.phase}: {free / GiB:.2f} of {total / GiB:.2f} GiB free, "
                        f"{reserved / GiB:.2f} GiB this engine's, {others / GiB:.2f} GiB held by other processes")
    util = float(facts.flag("gpu_memory_utilization", 0.9))
    fixes = []
    if failed.phase == "F":
        sizes = facts.flag("cuda_graph_sizes") or []
        fixes.append(Fix("--enforce-eager", None, None, "skips CUDA-graph capture and its memory (slower decode)"))
        if len(sizes) > 1:
            fixes.append(Fix("--cuda-graph-sizes", max(sizes), max(sizes) // 2,
                             f"capture {len(sizes) - 1} sizes instead of {len(sizes)}: the largest graph's buffers go"))
    if failed.phase == "D":
        tokens = int(facts.flag("max_num_batched_tokens", 8192))
        fixes.append(Fix("--max-num-batched-tokens", tokens, tokens // 2,
                         "halves the profile run's activations"))
    backed_off = max(0.05, util - 0.05 - (others / total if others and total else 0.0))
    fixes.append(Fix("--gpu-memory-utilization", util, f"{math.floor(backed_off * 100) / 100:.2f}",
                     "leaves room outside the budget" + (" and for the other processes' memory" if others else "")))
    yield Finding("startup_oom", CRITICAL, f"out of memory {_OOM_WHERE.get(failed.phase, 'at startup')}", evidence,
                  "another process holds device memory, or the cap is too close to 1.0: give the engine the device "
                  "to itself and back the cap off by a few points", fixes, numbers=numbers)


# ------------------------------------------------------------------ concurrency limits
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
    evidence = [f"{total} preemptions of {len(preempted)} requests at {_steps(at[0].index, at[-1].index)}, "
                f"KV usage {min(usage) * 100:.0f}–{max(usage) * 100:.0f} % when they happened"]
    for req in preempted[:3]:
        times = "once" if len(req.preempted_at) == 1 else f"{len(req.preempted_at)} times"
        evidence.append(f"request {req.request_id} was preempted {times} at "
                        f"{_steps(req.preempted_at[0], req.preempted_at[-1])}"
                        + (f" ({req.tokens_lost:,} computed tokens recomputed)" if req.tokens_lost else ""))
    lost = sum(r.tokens_lost for r in preempted)
    pool = facts.pool_tokens
    mean_tokens = _mean_request_tokens(facts)
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
    for fix in (_fp8_fix(facts, need), _utilization_fix(facts, need)):
        if fix is not None:
            fixes.append(fix)
    yield Finding("pool_binds", CRITICAL if storm else WARNING,
                  "preemption storm: the KV pool binds" if storm else "the KV pool binds: requests were preempted",
                  evidence, cause, fixes, at[0].index, at[-1].index, numbers)


def max_num_seqs_binds(facts: RunFacts) -> Iterable[Finding]:
    """The queue grows while KV usage stays low: ``--max-num-seqs`` is the limit."""
    seqs = int(facts.flag("max_num_seqs", 256))
    # a step's running count is taken after its finished requests left: they held a slot during it
    runs = [r for r in _runs(facts.steps, lambda s: s.num_waiting > 0 and s.num_running + s.num_finished >= seqs
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
                f"{_steps(longest[0].index, longest[-1].index)}; the queue peaked at {peak.num_waiting} at step "
                f"{peak.index}", f"KV usage stayed at or below {usage * 100:.0f} % meanwhile"]
    if slowest is not None and slowest.queue_time_s:
        evidence.append(f"request {slowest.request_id} waited {slowest.queue_time_s:,.2f} s in the queue")
    pool = facts.pool_tokens
    mean_tokens = _mean_request_tokens(facts)
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


# ------------------------------------------------------------------ latency
def _chunk_cost_per_token(steps: list[StepRow], baseline: float) -> float:
    """Seconds each prefill token adds to a step, from the steps themselves."""
    costs = [(s.duration_s - baseline) / s.num_prefill_tokens for s in steps
             if s.num_prefill_tokens > 0 and s.duration_s > baseline]
    return statistics.median(costs) if costs else 0.0


MIN_ADVISED_BUDGET = 512  # below this, prompts take too many steps to start answering


def _budget_for(baseline: float, per_token: float, current: int) -> int:
    """The largest power-of-two token budget whose chunk step stays under the spike
    threshold (``SPIKE_FACTOR`` x the decode-only step), from the measured cost per token."""
    if per_token <= 0:
        return max(MIN_ADVISED_BUDGET, current // 2)
    tokens = max(MIN_ADVISED_BUDGET, int((SPIKE_FACTOR * baseline - baseline) / per_token))
    return max(MIN_ADVISED_BUDGET, min(current // 2, 2 ** int(math.log2(tokens))))


def _decode_step_knob(facts: RunFacts) -> tuple[str, int]:
    """The flag that bounds a step carrying decodes, and its value: kvscope's
    ``--max-decode-step-tokens`` where the run set it below the step budget, else
    ``--max-num-batched-tokens`` (every step's, as in vLLM)."""
    budget = int(facts.flag("max_num_batched_tokens", 8192))
    bound = int(facts.flag("max_decode_step_tokens", 0))
    return ("--max-decode-step-tokens", bound) if 0 < bound < budget else ("--max-num-batched-tokens", budget)


def _step_budget(facts: RunFacts, step: StepRow) -> int:
    """The token budget ``step`` ran under, by the scheduler's own rule (its scheduled decodes
    stand for the requests that were decoding)."""
    return step_token_budget(int(facts.flag("max_num_batched_tokens", 8192)),
                             int(facts.flag("max_decode_step_tokens", 0)), step.num_decode_tokens)


def _smaller_chunks(facts: RunFacts, baseline: float, per_token: float, why: str) -> list[Fix]:
    """The fix that shrinks the chunks beside decodes: the knob that bounds those steps, when
    it is above the smallest budget worth advising."""
    flag, current = _decode_step_knob(facts)
    if current <= MIN_ADVISED_BUDGET:
        return []
    proposed = _budget_for(baseline, per_token, current)
    return [Fix(flag, current, proposed, why.format(proposed=proposed, step=_ms(baseline + proposed * per_token)),
                numbers={"per_token_s": per_token})]


def long_prompt_spikes(facts: RunFacts) -> Iterable[Finding]:
    """Latency spikes when long documents arrive: their prefill chunks make every decode wait."""
    baseline = decode_baseline_s(facts)
    if not baseline:
        return
    budget = int(facts.flag("max_num_batched_tokens", 8192))
    spikes = [s for s in facts.steps if s.num_decode_tokens > 0 and s.prefills
              and s.duration_s >= SPIKE_FACTOR * baseline]
    by_request: dict[str, list[StepRow]] = {}
    for step in spikes:
        rid, chunk = max(step.prefills.items(), key=lambda kv: kv[1])
        req = facts.requests.get(rid)
        if req is not None and req.prompt_tokens >= budget // 2 and chunk >= step.num_prefill_tokens // 2:
            by_request.setdefault(rid, []).append(step)
    if not by_request:
        return
    worst = max((s for steps in by_request.values() for s in steps), key=lambda s: s.duration_s)
    evidence = []
    ranked = sorted(by_request.items(), key=lambda kv: -max(s.duration_s for s in kv[1]))
    for rid, steps in ranked[:3]:
        req = facts.requests[rid]
        slowest = max(steps, key=lambda s: s.duration_s)
        evidence.append(f"request {rid} ({req.prompt_tokens:,}-token prompt) arrived at step {req.arrival_step}; "
                        f"its prefill chunks at {_steps(steps[0].index, steps[-1].index)} made "
                        f"{slowest.num_decode_tokens} decoding requests wait {_ms(slowest.duration_s)} for a token "
                        f"(decode-only steps take {_ms(baseline)})")
    if len(ranked) > 3:
        evidence.append(f"and {len(ranked) - 3} more long prompts")
    per_token = _chunk_cost_per_token(spikes, baseline)
    fixes = [*_smaller_chunks(facts, baseline, per_token,
                              f"a prompt chunk costs {per_token * 1e6:,.1f} µs per token here, so a {{proposed:,}}-token "
                              f"chunk keeps a step near {{step}} instead of {_ms(worst.duration_s)}"),
             Fix("route long-context traffic to its own replicas", None, None,
                 f"{len(ranked)} prompts of at least {budget // 2:,} tokens shared steps with streaming requests")]
    first = min(steps[0].index for steps in by_request.values())
    last = max(steps[-1].index for steps in by_request.values())
    yield Finding("long_prompt_spikes", WARNING, "latency spikes when long prompts arrive", evidence,
                  f"big prefill chunks (up to {budget:,} tokens a step) delay every decode in the same step", fixes,
                  first, last, {"worst_itl_s": worst.duration_s, "worst_step": worst.index, "baseline_itl_s": baseline,
                                "long_prompts": len(ranked), "max_num_batched_tokens": budget})


def decode_starved(facts: RunFacts) -> Iterable[Finding]:
    """Decode starved by prefill: a large share of tokens waited on prefill-heavy steps."""
    baseline = decode_baseline_s(facts)
    decode_total = sum(s.num_decode_tokens for s in facts.steps)
    if not baseline or not decode_total:
        return
    budget = int(facts.flag("max_num_batched_tokens", 8192))

    def long_prompt_in(step: StepRow) -> bool:  # those steps are long_prompt_spikes' finding
        return any(facts.requests[r].prompt_tokens >= budget // 2 for r in step.prefills if r in facts.requests)

    slowed = [s for s in facts.steps if s.num_decode_tokens > 0 and s.num_prefill_tokens > 0
              and s.duration_s >= STARVED_FACTOR * baseline and not long_prompt_in(s)]
    share = sum(s.num_decode_tokens for s in slowed) / decode_total
    if share < STARVED_SHARE or len(slowed) < MIN_BINDING_STEPS:
        return
    typical = statistics.median(s.duration_s for s in slowed)
    prefill_share = sum(s.num_prefill_tokens for s in slowed) / sum(s.num_tokens for s in slowed)
    per_token = _chunk_cost_per_token(slowed, baseline)
    evidence = [f"{share * 100:.0f} % of the {decode_total:,} decode tokens were produced in {len(slowed)} steps "
                f"carrying prefill ({_steps(slowed[0].index, slowed[-1].index)}), whose median step took "
                f"{_ms(typical)} against {_ms(baseline)} for decode-only steps",
                f"prefill was {prefill_share * 100:.0f} % of the tokens in those steps"]
    fixes = _smaller_chunks(facts, baseline, per_token,
                            f"smaller chunks: a step near {{step}} at {per_token * 1e6:,.1f} µs per prompt token")
    threshold = int(facts.flag("long_prefill_token_threshold", 0))
    if not threshold:
        cap = fixes[0].proposed if fixes else _decode_step_knob(facts)[1]
        fixes.append(Fix("--long-prefill-token-threshold", 0, int(cap) // 2,
                         "caps each prompt's chunk so several prompts share a step's budget"))
    yield Finding("decode_starved", WARNING, "decode starved by prefill", evidence,
                  "prompts keep the step budget full of prefill, so every streaming request's next token waits",
                  fixes, slowed[0].index, slowed[-1].index,
                  {"starved_share": share, "slowed_steps": len(slowed), "median_slowed_s": typical,
                   "baseline_itl_s": baseline})


def _thirds(requests: list[RequestFacts]) -> tuple[float, float] | None:
    ttfts = [r.ttft_s for r in sorted(requests, key=lambda r: r.arrival_t) if r.ttft_s is not None]
    if len(ttfts) < 9:
        return None
    third = len(ttfts) // 3
    return statistics.median(ttfts[:third]), statistics.median(ttfts[-third:])


def ttft_token_budget(facts: RunFacts) -> Iterable[Finding]:
    """TTFT rises while every step's token budget is full and prompts wait."""
    budget = int(facts.flag("max_num_batched_tokens", 8192))
    seqs = int(facts.flag("max_num_seqs", 256))
    full = [s for s in facts.steps if s.num_waiting > 0 and s.num_tokens >= _step_budget(facts, s) * 0.98
            and s.num_running < seqs and not s.preempted and s.kv_usage < KV_FULL]
    thirds = _thirds(list(facts.requests.values()))
    if len(full) < MIN_BINDING_STEPS or thirds is None or thirds[1] < TTFT_RISE * max(thirds[0], 1e-9):
        return
    first_ttft, last_ttft = thirds
    numbers: dict[str, Any] = {"full_steps": len(full), "ttft_first_third_s": first_ttft,
                               "ttft_last_third_s": last_ttft}
    flag, bound = _decode_step_knob(facts)
    by_decodes = sum(_step_budget(facts, s) < budget for s in full)  # steps bound by --max-decode-step-tokens
    if flag == "--max-decode-step-tokens" and 2 * by_decodes > len(full):
        budget = bound  # the profile run (and so the pool) does not depend on it
        why = ("a step with decodes admits twice the prompt tokens (each such step grows by that many tokens' "
               "compute, so the decodes beside it wait longer)")
    else:
        flag, why = "--max-num-batched-tokens", "each step admits twice the prompt tokens"
        plan_now, plan_new = replan(facts), replan(facts, max_num_batched_tokens=budget * 2)
        if plan_now is not None and plan_new is not None:
            grows = (plan_new.activation_peak_bytes - plan_now.activation_peak_bytes) / GiB
            why += (f"; the activation peak grows {grows:.2f} GiB, so the pool goes from {plan_now.kv_cache_tokens:,} "
                    f"to {plan_new.kv_cache_tokens:,} tokens" if plan_new.kv_cache_tokens != plan_now.kv_cache_tokens
                    else f"; the budget formula keeps the pool at {plan_now.kv_cache_tokens:,} tokens")
            numbers["pool_tokens_after"] = plan_new.kv_cache_tokens
    evidence = [f"the {budget:,}-token step budget was full on {len(full)} steps with prompts waiting "
                f"({_steps(full[0].index, full[-1].index)})",
                f"median TTFT rose from {first_ttft:,.2f} s (first third of arrivals) to {last_ttft:,.2f} s (last third)"]
    fixes = [Fix(flag, budget, budget * 2, why)]
    fixes.append(Fix("or add a replica", None, None,
                     "where steps are compute-bound a bigger budget only makes them longer: the arrival rate then "
                     "exceeds what one engine prefills (the what-if above tells which)"))
    yield Finding("ttft_token_budget", WARNING, "TTFT rising: the token budget binds", evidence,
                  "prompts arrive faster than the step budget lets them in; they queue for a chunk",
                  fixes, full[0].index, full[-1].index, numbers)


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
                f"{_steps(first_evict, evictions[-1][0].index)} (KV usage up to {usage * 100:.0f} %)",
                f"{len(after)} requests that arrived after the first eviction hit nothing"]
    fixes = []
    peak = max(s.kv_blocks_used for s in facts.steps) * block
    need = peak + int(shared)
    for fix in (_fp8_fix(facts, need), _utilization_fix(facts, need)):
        if fix is not None:
            fixes.append(fix)
    seqs = int(facts.flag("max_num_seqs", 256))
    mean_tokens = _mean_request_tokens(facts)
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


# ------------------------------------------------------------------ tensor parallelism
def _divisors_below(n: int) -> list[int]:
    return [k for k in range(1, n) if n % k == 0]


def tp_scaling(facts: RunFacts) -> Iterable[Finding]:
    """Poor scaling with tensor parallelism: the per-layer all-reduces take a large share
    of every step (a slow interconnect, or a model too small to split). The fix is the
    background's rule, the smallest tensor-parallel size that fits, found through the
    budget formula."""
    tp = int(facts.flag("tensor_parallel_size", 1) or 1)
    steps = [s for s in facts.steps if s.collective_s > 0 and s.duration_s > 0]
    if tp < 2 or len(steps) < MIN_BINDING_STEPS:
        return
    total = sum(s.duration_s for s in steps)
    share = sum(s.collective_s for s in steps) / total
    if share < TP_COLLECTIVE_SHARE:
        return
    median_collective = statistics.median(s.collective_s for s in steps)
    median_step = statistics.median(s.duration_s for s in steps)
    median_kib = statistics.median(s.collective_bytes for s in steps) / 1024
    evidence = [f"{_steps(steps[0].index, steps[-1].index)}: collectives took {share:.0%} of step time at "
                f"--tensor-parallel-size {tp} (median {_ms(median_collective)} of a {_ms(median_step)} step, "
                f"{median_kib:,.0f} KiB exchanged per step)"]
    fixes: list[Fix] = []
    for k in _divisors_below(tp):
        plan = replan(facts, tensor_parallel_size=k)
        if plan is None:
            break
        if plan.kv_cache_tokens >= max(plan.max_model_len, 1):
            fixes.append(Fix("--tensor-parallel-size", tp, k,
                             f"the smallest size that fits: {plan.weights_bytes / GiB:,.2f} GiB of weights per "
                             f"device (from the shapes) and a pool of {plan.kv_cache_tokens:,} tokens, "
                             f"{plan.max_concurrency:,.2f}x --max-model-len {plan.max_model_len:,}; run "
                             f"{tp // k} replicas of it (data parallel) instead of one split {tp} ways",
                             numbers={"kv_cache_tokens": plan.kv_cache_tokens, "weights_bytes": plan.weights_bytes}))
            break
    if not fixes:
        fixes.append(Fix("--tensor-parallel-size", tp, None,
                         "no smaller size holds one --max-model-len request here: keep the split and give it a "
                         "faster link between devices (NVLink rather than PCIe or host memory)"))
    yield Finding("tp_scaling", WARNING, "tensor parallelism scales poorly: collectives dominate the step",
                  evidence, "every layer ends in an all-reduce across the ranks; when the link is slow or each "
                  "rank's share of the work is small, the exchange costs more than the split saves",
                  fixes, steps[0].index, steps[-1].index,
                  {"collective_share": share, "tensor_parallel_size": tp, "median_collective_s": median_collective})


def hot_expert(facts: RunFacts) -> Iterable[Finding]:
    """A mixture-of-experts model whose router sends one expert far more than its share
    (the step events' per-expert counts, summed over the run): the layer's expert work
    waits on that expert's rows, and on devices that hold different experts, on that
    device. The numbers: its tokens against the even share, the imbalance (max / mean)
    and how many layers are as uneven."""
    load = facts.experts
    hot = load.hot_expert()
    if hot is None or hot.imbalance < HOT_EXPERT_IMBALANCE:
        return
    mean = hot.layer_tokens / hot.num_experts
    if mean < HOT_EXPERT_MIN_TOKENS:
        return
    uneven = sum(1 for layer in range(load.num_layers) if load.layer_imbalance(layer) >= HOT_EXPERT_IMBALANCE)
    steps = [s.index for s in facts.steps]
    evidence = [f"MoE layer {hot.layer}: expert {hot.expert} was routed {hot.tokens:,} of the layer's "
                f"{hot.layer_tokens:,} token slots over {load.steps_in_window:,} steps ({hot.share:.1%}; "
                f"{hot.even_share:.1%} each if even): {hot.imbalance:.2f}x the mean of {mean:,.0f}",
                f"{uneven} of {load.num_layers} MoE layers at or above {HOT_EXPERT_IMBALANCE:.1f}x"]
    cause = (f"the router's choice on this traffic, not a flag: the layer's experts run grouped, so its expert "
             f"matmuls wait on the busiest expert's {hot.tokens:,} rows where an even spread gives each "
             f"{mean:,.0f}; work split by expert (expert parallelism) runs up to {hot.imbalance:.2f}x slower "
             "on the device holding it")
    fixes = [Fix("--enable-expert-parallel --enable-eplb", None, None,
                 f"vLLM's expert-parallel load balancer gives a hot expert redundant copies on other devices, "
                 f"bringing layer {hot.layer}'s max/mean from {hot.imbalance:.2f} toward 1; tensor parallelism "
                 "(each rank a shard of every expert) is not affected by imbalance. On one device the cost is "
                 "only the uneven matmul sizes: nothing to change",
                 numbers={"imbalance": hot.imbalance, "expert_tokens": hot.tokens, "mean_tokens": mean})]
    yield Finding("hot_expert", WARNING, f"hot expert: expert {hot.expert} of MoE layer {hot.layer} takes "
                  f"{hot.share:.1%} of the layer's routed tokens ({hot.imbalance:.2f}x the mean)",
                  evidence, cause, fixes, steps[0] if steps else None, steps[-1] if steps else None,
                  {"layer": hot.layer, "expert": hot.expert, "imbalance": hot.imbalance, "share": hot.share,
                   "uneven_layers": uneven})


# ------------------------------------------------------------------ pipeline and data parallelism (issue 37)
PIPELINE_BUBBLE_SHARE = 0.25  # a stage idle this share of the step time: a quarter of its device wasted
GPUS_PER_NODE = 8  # an HGX / DGX node: tensor parallelism inside it runs over NVLink
DP_SUSTAINED_STEPS = 10  # consecutive steps (of any rank) imbalanced: longer than a burst between two reports


def _micro_batches(facts: RunFacts) -> int:
    """Micro-batches per step: the simulator records its own; the engine runs engine/pipeline.py's."""
    sim = facts.config.get("simulation") or {}
    return int(sim.get("pipeline_micro_batches") or DEFAULT_MICRO_BATCHES)


def _stage_words(plan: PipelinePlan) -> str:
    return "; ".join(f"stage {s.stage} layers {s.layers[0]}–{s.layers[1] - 1}: {s.plan.weights_bytes / GiB:,.2f} GiB "
                     f"of weights and {s.plan.kv_pool_bytes / GiB:,.2f} GiB of KV per GPU" for s in plan.stages)


def _fewer_stages_fix(facts: RunFacts, stages: int, tp: int, micro: int) -> Fix | None:
    """The fewest stages whose every GPU holds its layers and one --max-model-len request
    (the per-stage budget, engine plan -pp)."""
    for k in range(1, stages):
        plan = replan_stages(facts, k)
        if plan is None:
            return None
        if plan.num_blocks > 0 and plan.kv_cache_tokens >= plan.max_model_len:
            spare = f"; the {stages * tp} GPUs run {stages // k} such replicas (--data-parallel-size)" \
                if stages % k == 0 and k < stages else ""
            return Fix("--pipeline-parallel-size", stages, k,
                       f"{_stage_words(plan)}; the replica holds {plan.kv_cache_tokens:,} tokens "
                       f"({plan.max_concurrency:,.2f}x --max-model-len {plan.max_model_len:,}); fill-drain floor "
                       f"{fill_drain_bubble(k, micro):.0%} instead of {fill_drain_bubble(stages, micro):.0%}{spare}",
                       numbers={"plan": plan.to_dict()})
    return None


def _one_node_tp_fix(facts: RunFacts, stages: int, tp: int) -> Fix | None:
    """The same GPUs as one tensor-parallel group inside a node: no stage waits on another."""
    total = stages * tp
    model = model_of(facts)
    if model is None or total > GPUS_PER_NODE or model.num_attention_heads % total:
        return None
    plan = replan(facts, tensor_parallel_size=total)
    if plan is None or plan.kv_cache_tokens < max(plan.max_model_len, 1):
        return None
    return Fix("--tensor-parallel-size", tp, total,
               f"with --pipeline-parallel-size 1: the {total} GPUs of one node split every layer instead of "
               f"holding a stage each (no bubble; an all-reduce per layer over NVLink): "
               f"{plan.weights_bytes / GiB:,.2f} GiB of weights per GPU (from the shapes) and a pool of "
               f"{plan.kv_cache_tokens:,} tokens", numbers={"kv_cache_tokens": plan.kv_cache_tokens,
                                                          "weights_bytes": plan.weights_bytes})


def pipeline_bubble(facts: RunFacts) -> Iterable[Finding]:
    """Pipeline stages idle a large share of every step (the step events' per-stage
    ``pipeline_bubble_s``): the fill and drain of too few micro-batches over too many
    stages, or one slow stage the others wait on. The fixes go through the per-stage
    budget: fewer stages that still fit, the same GPUs as tensor parallelism inside one
    node, or more micro-batches per step."""
    steps = [s for s in facts.steps if s.pipeline_bubble_s and s.duration_s > 0]
    idle = facts.pipeline
    if len(steps) < MIN_BINDING_STEPS or not idle.stages:
        return
    fractions = idle.fractions
    worst = max(range(idle.stages), key=lambda i: fractions[i])
    if fractions[worst] < PIPELINE_BUBBLE_SHARE:
        return
    stages = idle.stages
    tp = int(facts.flag("tensor_parallel_size", 1) or 1)
    micro = _micro_batches(facts)
    floor = fill_drain_bubble(stages, micro)
    slowest = min(range(stages), key=lambda i: fractions[i])
    median_step = statistics.median(s.duration_s for s in steps)
    median_wait = statistics.median(s.pipeline_bubble_s[worst] for s in steps if len(s.pipeline_bubble_s) > worst)
    median_seqs = statistics.median(s.scheduled for s in steps)
    per_step = idle.bytes_per_step()
    evidence = [f"{_steps(steps[0].index, steps[-1].index)} ({len(steps)} steps): "
                + ", ".join(f"stage {i} idle {f:.0%}" for i, f in enumerate(fractions))
                + f" of the step time; the fill-drain floor for {stages} stages and {micro} micro-batches is {floor:.0%}",
                f"stage {worst} waited a median {_ms(median_wait)} of a {_ms(median_step)} step; a step ran a median "
                f"of {median_seqs:,.0f} sequences, {median_seqs / micro:,.1f} per micro-batch",
                "sent between stages per step: " + ", ".join(f"stage {i} {b / 2**20:,.2f} MiB"
                                                              for i, b in enumerate(per_step))]
    model = model_of(facts)
    uneven = fractions[worst] - fractions[slowest] > 0.05
    if uneven and model is not None and stages <= model.num_layers:
        first, end = stage_layer_ranges(model.num_layers, stages)[slowest]
        evidence.append(f"stage {slowest} idles least ({fractions[slowest]:.0%}): the others wait on its layers "
                        f"{first}–{end - 1}")
    fixes = [fix for fix in (_fewer_stages_fix(facts, stages, tp, micro), _one_node_tp_fix(facts, stages, tp))
             if fix is not None]
    if median_seqs >= micro * 2:  # every micro-batch still gets a sequence
        fixes.append(Fix("micro-batches per step", micro, micro * 2,
                         f"the fill-drain floor goes from {floor:.0%} to {fill_drain_bubble(stages, micro * 2):.0%}, "
                         f"each micro-batch then about {median_seqs / (micro * 2):,.1f} sequences (and each reads its "
                         "stage's weights again); kvscope: MICRO_BATCHES in engine/pipeline.py, engine simulate "
                         "--pipeline-micro-batches", numbers={"fill_drain_floor": fill_drain_bubble(stages, micro * 2)}))
    cause = (f"each step fills and drains the pipeline: with {micro} micro-batches over {stages} stages every stage "
             f"idles at least {floor:.0%} of the step, waiting for the stage before it or for the results"
             + (f", and stage {slowest} is slower than the rest" if uneven else ""))
    yield Finding("pipeline_bubble", WARNING, f"pipeline bubble: stage {worst} idles {fractions[worst]:.0%} of the "
                  f"step time over {stages} stages", evidence, cause, fixes, steps[0].index, steps[-1].index,
                  {"stages": stages, "bubble_fractions": fractions, "worst_stage": worst, "slowest_stage": slowest,
                   "fill_drain_floor": floor, "micro_batches": micro, "steps": len(steps),
                   "bytes_per_step": per_step})


def dp_imbalance(facts: RunFacts) -> Iterable[Finding]:
    """Requests pile onto some data-parallel ranks (vllm#36748, #40279): for a sustained
    run of steps the busiest rank's waiting + running is beyond ``DP_IMBALANCE_BOUND`` x
    the mean across ranks while it queues. Read from every rank's step and request events
    (a recording of all ranks: ``engine simulate --data-parallel-size``); the fix is the
    even share in numbers."""
    dp = facts.dp
    size = dp.size  # --data-parallel-size as recorded, or more ranks seen
    if size < 2 or (facts.flag("data_parallel_rank") is not None and len(dp.stepped_ranks) < 2):
        return  # one core's own recording: the other ranks' events are in their files
    runs = dp.imbalanced_runs(DP_IMBALANCE_BOUND, DP_MIN_MEAN_LOAD, DP_SUSTAINED_STEPS)
    if not runs:
        return
    longest = max(runs, key=len)
    held = sum(len(r) for r in runs)
    busiest = statistics.mode(s.busiest() for s in longest)
    peak = max(longest, key=lambda s: s.imbalance(size))
    loads = peak.padded(size)
    mean = peak.mean(size)
    ranks = [dp.rank(r) for r in range(size)]
    own = [s.step for s in longest if s.rank == busiest] or [s.step for s in longest]
    routed = [r.requests for r in ranks]
    even_routed = sum(routed) / size
    kv = peak.kv_usage + (0.0,) * (size - len(peak.kv_usage))
    evidence = [f"{held} of {len(dp.samples)} steps (all ranks) with rank {busiest} queueing while its waiting + "
                f"running was over {DP_IMBALANCE_BOUND:g}x the mean; the longest run {longest[0].t:,.2f}–"
                f"{longest[-1].t:,.2f} s ({len(longest)} steps)",
                f"at {peak.t:,.2f} s, waiting + running by rank: " + ", ".join(f"{r}: {n}" for r, n in enumerate(loads))
                + f" (max/mean {peak.imbalance(size):.2f}); KV usage " + ", ".join(f"{u:.0%}" for u in kv),
                "over the run, by rank: " + "; ".join(
                    f"{r.rank}: {r.requests:,} requests, {r.output_tokens:,} output tokens, {dp.mean_load(r.rank):,.1f} "
                    "waiting + running on average" for r in ranks)]
    by_count = dp.spread(routed) > DP_IMBALANCE_BOUND
    if by_count:
        cause = (f"rank {busiest} was sent {routed[busiest]:,} of {sum(routed):,} requests ({dp.spread(routed):.2f}x "
                 "an even share): the requests were not routed to the least loaded rank (an external router, "
                 "session or prefix affinity sending them together)")
    else:
        mean_prompt = [r.prompt_tokens / r.requests if r.requests else 0.0 for r in ranks]
        cause = (f"requests were spread evenly by count ({dp.spread(routed):.2f}x) but not by work: rank {busiest}'s "
                 f"prompts average {mean_prompt[busiest]:,.0f} tokens against "
                 f"{sum(r.prompt_tokens for r in ranks) / max(1, sum(routed)):,.0f} overall, so its requests stay "
                 "longer and its queue grows while the balancer counts requests, not tokens")
    fixes = [Fix("route to the least loaded rank (vLLM's DP load balancer: 4 x waiting + running)", None, None,
                 f"an even spread holds {mean:,.1f} requests in flight on each rank at {peak.t:,.2f} s instead of "
                 f"{loads[busiest]} on rank {busiest}, and {even_routed:,.0f} requests per rank over the run instead "
                 f"of {max(routed):,}", numbers={"even_load": mean, "busiest_load": loads[busiest],
                                                 "even_requests": even_routed})]
    yield Finding("dp_imbalance", WARNING, f"data-parallel imbalance: rank {busiest} queues at "
                  f"{peak.imbalance(size):.2f}x the mean load of {size} ranks", evidence, cause, fixes,
                  own[0], own[-1], {"size": size, "busiest_rank": busiest, "imbalanced_steps": held,
                                     "longest_run_steps": len(longest), "peak_imbalance": peak.imbalance(size),
                                     "loads_at_peak": list(loads), "requests_by_rank": routed,
                                     "requests_spread": dp.spread(routed), "bound": DP_IMBALANCE_BOUND})


# ------------------------------------------------------------------ one request named (issue 33)
STUCK_STEPS = 5  # steps in a row with requests waiting, none admitted and none running: the engine is stuck
MISS_CAUSE_SHARE = 0.25  # lookups that stopped for a fixable cause, this share of all: worth a finding
MIN_LOOKUPS = 3
MIN_BLOCK_SIZE = 8  # the smallest --block-size advised (vLLM's CUDA backends take 8, 16, 32, ...)


def _blocks_fixes(facts: RunFacts, needs: int, pool: int) -> list[Fix]:
    """A request needs ``needs`` blocks and the pool has ``pool``: lower --max-model-len to
    what the pool holds (such requests are then refused on arrival), or grow the pool."""
    block = facts.block_size
    fixes = [Fix("--max-model-len", facts.flag("max_model_len"), pool * block,
                 f"the pool's {pool:,} blocks of {block} hold {pool * block:,} tokens: a longer request is then "
                 "refused at once (HTTP 400) instead of blocking the queue"),
             Fix("--num-gpu-blocks-override", pool, needs,
                 f"a pool of {needs:,} blocks ({needs * block:,} tokens) admits it", numbers={"blocks": needs})]
    for fix in (_fp8_fix(facts, needs * block), _utilization_fix(facts, needs * block)):
        if fix is not None:
            fixes.append(fix)
    return fixes


def stuck_engine(facts: RunFacts) -> Iterable[Finding]:
    """Requests wait, nothing is admitted and nothing runs, step after step, while the
    engine stays healthy (vllm#39734, #45414, #53130): the head of the queue and exactly
    why it cannot be admitted, with the fix in numbers. A head that can never fit (more
    blocks than the pool has) is critical however long it waited."""
    runs = [r for r in _runs(facts.steps, lambda s: s.num_waiting > 0 and s.admitted == 0 and s.num_running == 0)
            if len(r) >= STUCK_STEPS]
    never = [s for s in facts.steps if s.head is not None and s.head[1][:1] == [WAIT_NEVER_FITS]]
    if not runs and not never:
        return
    steps = max(runs, key=len) if runs else never
    last = steps[-1]
    head = last.head or next((s.head for s in reversed(steps) if s.head is not None), None)
    seconds = last.t - steps[0].t
    evidence = [f"{len(steps)} steps ({_steps(steps[0].index, last.index)}, {seconds:,.1f} s) with "
                f"{last.num_waiting} requests waiting, none admitted"
                + (" and none running" if runs else "")]
    if head is None:
        evidence.append("the steps do not say why (a recording made before waiting reasons)")
        yield Finding("stuck_engine", CRITICAL, "stuck engine: requests wait and nothing is admitted", evidence,
                      "the head of the queue cannot be admitted and blocks everything behind it", [],
                      steps[0].index, last.index, {"steps": len(steps), "waiting": last.num_waiting})
        return
    rid, reason = head
    req = facts.requests.get(rid)
    waited = f" since step {req.arrival_step}" if req is not None and req.arrival_step is not None else ""
    evidence.append(f"the head of the queue is {rid}{waited}: {wait_reason_text(reason)}")
    behind = last.num_waiting - 1
    if behind > 0:
        evidence.append(f"{behind} requests wait behind it")
    numbers: dict[str, Any] = {"request": rid, "reason": reason[0], "steps": len(steps), "waiting": last.num_waiting}
    fixes: list[Fix] = []
    if reason[0] == WAIT_NEVER_FITS:
        needs, pool = int(reason[1]), int(reason[2])
        numbers |= {"blocks_needed": needs, "pool_blocks": pool}
        title = (f"stuck engine: {rid} needs {needs:,} blocks and the pool has {pool:,} in total: "
                 "it can never be admitted")
        cause = (f"{rid} fits --max-model-len but not the KV pool, and the queue is served in order, so it and "
                 "every request behind it wait forever; abort it, then refuse such requests up front")
        fixes = _blocks_fixes(facts, needs, pool)
    else:
        title = f"stuck engine: {rid} at the head of the queue cannot be admitted"
        cause = f"{rid} waits for: {wait_reason_text(reason)}; everything behind it waits too"
    yield Finding("stuck_engine", CRITICAL, title, evidence, cause, fixes, steps[0].index, last.index, numbers)


def seqs_held_by_deferred(facts: RunFacts) -> Iterable[Finding]:
    """``--max-num-seqs`` is reached while running requests get no token (the step's budget
    went to others): sequence slots held by requests that do no work keep the queue out
    (vllm#53130's deferred requests)."""
    seqs = int(facts.flag("max_num_seqs", 256))
    runs = [r for r in _runs(facts.steps, lambda s: bool(s.deferred)) if len(r) >= MIN_BINDING_STEPS]
    if not runs:
        return
    longest = max(runs, key=len)
    held = sum(len(r) for r in runs)
    counts: dict[str, int] = {}
    for run in runs:
        for step in run:
            for rid in step.deferred:
                counts[rid] = counts.get(rid, 0) + 1
    worst = sorted(counts.items(), key=lambda kv: -kv[1])[:3]
    head = next((s.head for s in longest if s.head is not None), None)
    evidence = [f"{held} steps at --max-num-seqs {seqs} in which running requests were given no token, the "
                f"longest run {_steps(longest[0].index, longest[-1].index)}",
                "held a slot and did no work: " + ", ".join(f"{rid} ({n} steps)" for rid, n in worst)]
    if head is not None:
        evidence.append(f"meanwhile {head[0]} waited at the head of the queue: {wait_reason_text(head[1])}")
    budget = int(facts.flag("max_num_batched_tokens", 8192))
    fixes = [Fix("--max-num-seqs", seqs, seqs + max(len(s.deferred) for r in runs for s in r),
                 "a slot for each request the budget cannot serve in a step, so the queue is not kept out"),
             Fix("--max-num-batched-tokens", budget, budget * 2,
                 "every running request gets its token each step, so none holds a slot idle")]
    yield Finding("seqs_held_by_deferred", WARNING, "--max-num-seqs held by requests that get no tokens", evidence,
                  "the step's token budget ran out before every running request was served; the ones left over "
                  "keep their sequence slots, so waiting requests cannot enter", fixes,
                  longest[0].index, longest[-1].index, {"steps": held, "max_num_seqs": seqs, "deferred": dict(worst)})


def prefix_miss_causes(facts: RunFacts) -> Iterable[Finding]:
    """Prefix-cache misses in aggregate, by where each lookup stopped (the step events'
    ``prefix_lookups``): a prompt shorter than one block (vllm#54607), blocks evicted before
    they were reused, a sliding window. Said when those causes are a large share."""
    lookups = [(life, lookup) for life in facts.lives.lives.values() for lookup in life.lookups]
    if len(lookups) < MIN_LOOKUPS:
        return
    by_cause: dict[str, list[tuple[Any, Any]]] = {}
    for life, lookup in lookups:
        by_cause.setdefault(lookup.cause, []).append((life, lookup))
    fixable = {c: v for c, v in by_cause.items() if c in (PREFIX_SHORT_PROMPT, PREFIX_EVICTED, PREFIX_WINDOW)}
    missed = sum(len(v) for v in fixable.values())
    if missed < MIN_LOOKUPS or missed < MISS_CAUSE_SHARE * len(lookups):
        return
    block = facts.block_size
    evidence = [f"{len(lookups)} prefix-cache lookups: " + ", ".join(
        f"{len(v)} {cause} ({len(v) / len(lookups):.0%})" for cause, v in sorted(by_cause.items(),
                                                                                 key=lambda kv: -len(kv[1])))]
    fixes: list[Fix] = []
    numbers: dict[str, Any] = {"lookups": len(lookups), **{c: len(v) for c, v in by_cause.items()}}
    short = fixable.get(PREFIX_SHORT_PROMPT, [])
    if short:
        longest = max(life.prompt_tokens for life, _ in short)
        shortest = min(life.prompt_tokens for life, _ in short)
        evidence.append(f"{len(short) / len(lookups):.0%} of lookups: the prompt ({shortest:,}–{longest:,} tokens) "
                        f"is shorter than one {block}-token block, so nothing of it can ever be cached, "
                        "whatever it shares with other prompts "
                        f"(e.g. {short[0][0].request_id})")
        smaller = 2 ** int(math.log2(shortest - 1)) if shortest > MIN_BLOCK_SIZE else 0
        if MIN_BLOCK_SIZE <= smaller < block:
            fixes.append(Fix("--block-size", block, smaller,
                             f"prompts of {shortest:,}+ tokens then fill at least one block, which can be reused"))
    evicted = fixable.get(PREFIX_EVICTED, [])
    if evicted:
        by = [lk.evicted_by for _, lk in evicted if lk.evicted_by]
        evidence.append(f"{len(evicted) / len(lookups):.0%} of lookups: the next block had been evicted, e.g. "
                        f"{evicted[0][0].request_id} at step {evicted[0][1].step} (evicted at step "
                        f"{evicted[0][1].details[0]}" + (f" for {by[0]})" if by else ")"))
        need = max(s.kv_blocks_used for s in facts.steps) * block if facts.steps else 0
        for fix in (_fp8_fix(facts, need * 2), _utilization_fix(facts, need * 2)):
            if fix is not None:
                fixes.append(fix)
    window = fixable.get(PREFIX_WINDOW, [])
    if window:
        lost = sum(int(lk.details[0]) - lk.hit_tokens for _, lk in window if lk.details)
        evidence.append(f"{len(window) / len(lookups):.0%} of lookups stopped at a sliding window: {lost:,} tokens "
                        "full attention alone had cached were recomputed")
    yield Finding("prefix_miss_causes", WARNING,
                  f"prefix-cache misses: {missed / len(lookups):.0%} of lookups stopped for a cause a flag can change",
                  evidence, "each admission's lookup says where its match stopped; these stops are not different "
                  "prompts but the block size, the pool or the window", fixes,
                  min(lk.step for _, lk in lookups), max(lk.step for _, lk in lookups), numbers)


def request_thrashing(facts: RunFacts) -> Iterable[Finding]:
    """One request preempted again and again: each time it gives up its blocks and later
    recomputes everything it had computed."""
    worst = max(facts.lives.lives.values(), key=lambda life: len(life.preemptions), default=None)
    if worst is None or len(worst.preemptions) < STORM_REPEATS:
        return
    p = worst.preemptions
    lost = sum(x.tokens_lost for x in p)
    others = sorted({x.for_request for x in p if x.for_request and x.for_request != worst.request_id})
    evidence = [f"{worst.request_id} ({worst.prompt_tokens:,}-token prompt) was preempted {len(p)} times at "
                f"{_steps(p[0].step, p[-1].step)} and recomputed {lost:,} tokens in all"]
    for x in p[:4]:
        whom = ("" if not x.for_request else " for itself" if x.for_request == worst.request_id  # "": an older recording
                else f" for {x.for_request}")
        evidence.append(f"step {x.step}: {x.reason}{whom}, holding {x.blocks_freed} blocks and "
                        f"{x.tokens_lost:,} computed tokens")
    waited = sum(w.last_step - w.first_step + 1 for w in worst.waits if w.first_step >= p[0].step)
    evidence.append(f"it waited {waited} steps after its first preemption")
    pool = facts.pool_tokens
    need = worst.prompt_tokens + worst.max_tokens
    fixes = []
    seqs = int(facts.flag("max_num_seqs", 256))
    mean_tokens = _mean_request_tokens(facts)
    fits = max(1, int(pool // mean_tokens)) if mean_tokens and pool else seqs
    if fits < seqs:
        fixes.append(Fix("--max-num-seqs", seqs, fits, f"the pool's {pool:,} tokens hold {fits} requests of the mean "
                         f"{mean_tokens:,.0f} tokens, so admitted requests are not preempted to make room"))
    for fix in (_fp8_fix(facts, pool + need), _utilization_fix(facts, pool + need)):
        if fix is not None:
            fixes.append(fix)
    yield Finding("request_thrashing", WARNING, f"{worst.request_id} thrashes: preempted {len(p)} times",
                  evidence, (f"the pool cannot hold it beside the requests admitted with it ({', '.join(others[:3])} "
                             "took its blocks)") if others else "the pool cannot hold it beside the others",
                  fixes, p[0].step, p[-1].step,
                  {"request": worst.request_id, "preemptions": len(p), "tokens_recomputed": lost})


def session_context_lost(facts: RunFacts) -> Iterable[Finding]:
    """Sessions whose turns re-prefill more than half their prefix: the previous turn's
    blocks were evicted before the next turn came (engine/events/folds/sessions.py names the
    requests whose allocations took them). The fix is the pool that keeps the context through
    the gap (the fold's ``pool_to_keep``)."""
    lost = facts.sessions.lost_turns()
    if not lost:
        return
    turns = [t for _, t in lost]
    reprefilled = sum(t.reprefill_tokens for t in turns)
    evidence = [f"{len(turns)} turns of {len({s.key for s, _ in lost})} sessions re-prefilled more than half their "
                f"prefix: {reprefilled:,} tokens computed again"]
    for session, turn in lost[:3]:
        takers = sorted({b.by_request for b in turn.lost if b.by_request})
        evidence.append(f"session {session.key} turn {turn.index} ({turn.request_id}): {turn.resident} of "
                        f"{turn.prev_blocks} blocks of {turn.previous} still resident, {turn.reprefill_tokens:,} of "
                        f"{turn.prefix_tokens:,} prefix tokens re-prefilled"
                        + (f"; evicted by {', '.join(takers[:3])}" if takers else ""))
    pool = max((s.kv_blocks_total for s in facts.steps), default=0)
    # at least the lost blocks more: a bigger pool admits more at once, so a run's own figure can fall short
    needs = max(max(t.pool_to_keep for t in turns), pool + max(len(t.lost) for t in turns))
    fixes: list[Fix] = []
    if pool:
        block = facts.block_size
        fixes.append(Fix("--num-gpu-blocks-override", pool, needs,
                         f"{needs:,} blocks ({needs * block:,} tokens): the blocks in use when a turn ended, its "
                         "context, and every fresh block handed out before the next turn, so the context is never "
                         "the least recently freed block when one is taken",
                         numbers={"blocks": needs}))
        plan = replan(facts)
        if plan is not None and plan.bytes_per_token:
            fixes.append(Fix("--kv-cache-memory-bytes", facts.flag("kv_cache_memory_bytes"),
                             needs * block * plan.bytes_per_token,
                             f"{needs * block * plan.bytes_per_token / GiB:.2f} GiB of KV: the same {needs:,} blocks"))
        fixes += [f for f in (_utilization_fix(facts, needs * block),) if f is not None]
    yield Finding("session_context_lost", WARNING,
                  f"session context lost: {len(turns)} turns re-prefilled more than half their prefix", evidence,
                  "the previous turn's blocks were evicted by other requests' allocations before the next turn "
                  "arrived; the pool is too small for the gap between turns", fixes,
                  min(t.admitted_step or 0 for t in turns), max(t.admitted_step or 0 for t in turns),
                  {"turns": len(turns), "reprefill_tokens": reprefilled, "blocks_needed": needs, "pool_blocks": pool})


# What a stalled core was doing, by its heartbeat's phase (engine/heartbeat.py), and where to look.
_STALL_CAUSES = {
    "forward": "the model's forward did not return: a kernel, a collective between ranks or the device hung "
               "(the dump's stack of the engine thread names the call)",
    "schedule": "the scheduler did not return (pure Python: the dump's stack names the loop)",
    "update": "updating the requests with the step's tokens or publishing its events did not return (a blocked "
              "event sink, such as a recording on a full or hung disk, is one way)",
    "detokenize": "detokenising or matching stop strings did not return",
    "idle": "the engine loop stopped turning between steps with requests waiting (a command it ran, such as a "
            "profiler start or stop, did not return)",
}


def _stall_finding(stall: StallFacts) -> Finding:
    lasted = (f"it stepped again after {stall.recovered_after_s:,.1f} s (engine.recovered)"
              if stall.recovered_after_s is not None else "it had not stepped again when the events end")
    after = f"after step {stall.last_step}" if stall.last_step is not None else "before its first step"
    evidence = [f"engine core {stall.rank} finished no step for {stall.stalled_s:,.1f} s (limit {stall.limit_s:,.1f} s)"
                f" with work pending, in its {stall.phase or '?'} phase, {after}", lasted]
    if stall.requests:
        shown = ", ".join(stall.requests[:5]) + (f" and {len(stall.requests) - 5} more" if len(stall.requests) > 5 else "")
        evidence.append(f"{len(stall.requests)} requests held: {shown}")
    if stall.dump:
        evidence.append(f"stacks of every thread, the last step and each request's blocks: {stall.dump}")
    return Finding("engine_stalled", CRITICAL, f"engine stalled: core {stall.rank} made no progress for "
                   f"{stall.stalled_s:,.0f} s in {stall.phase or '?'}", evidence,
                   _STALL_CAUSES.get(stall.phase, "the engine core made no progress"), [], stall.last_step,
                   stall.last_step, {"rank": stall.rank, "phase": stall.phase, "stalled_s": stall.stalled_s,
                                     "limit_s": stall.limit_s, "recovered_after_s": stall.recovered_after_s,
                                     "requests": len(stall.requests), "dump": stall.dump},
                   place=f"rank {stall.rank}, {after}")


def engine_stalled(facts: RunFacts) -> Iterable[Finding]:
    """An engine core had work and finished no step within the stall limit (``engine.stalled``,
    engine/serve/stall.py): alive, so no failure ended it, but making no progress (vllm#41725,
    PR#36451). One finding per stall: the rank, what the step was doing, how long, the
    requests it held and the dump that has its stacks."""
    for stall in facts.stalls:
        yield _stall_finding(stall)


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


def exit_status(findings: Iterable[Finding]) -> int:
    """0 healthy, 1 warnings, 2 critical (``engine doctor``'s exit status)."""
    return max((SEVERITY_ORDER[f.severity] for f in findings), default=0)
