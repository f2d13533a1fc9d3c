"""Latency: spikes when long prompts arrive, decode starved by prefill, and TTFT rising
while the token budget binds; the fixes shrink or grow the step's chunks from the cost per
prompt token the steps themselves measure.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from typing import Any

from doctor.budget import replan
from doctor.facts import RequestFacts, RunFacts, StepRow
from doctor.rules.finding import WARNING, Finding
from doctor.rules.kv_pool import KV_FULL
from doctor.rules.steps import MIN_BINDING_STEPS, ms, step_range
from engine.budget.fixes import Fix
from engine.budget.memory import GiB
from engine.events.step_records import step_token_budget

SPIKE_FACTOR = 3.0  # a step this many times the decode-only median is a latency spike
STARVED_SHARE = 0.10  # this share of decode tokens (ITL p90) in prefill-slowed steps: decode starved
STARVED_FACTOR = 2.0  # ... where a step is at least this many times the decode-only median
TTFT_RISE = 2.0  # last third's median TTFT over the first third's


def decode_baseline_s(facts: RunFacts) -> float | None:
    """Median duration of decode-only steps: what one token costs without prefill in the way."""
    durations = [s.duration_s for s in facts.steps if s.num_prefill_tokens == 0 and s.num_decode_tokens > 0]
    return statistics.median(durations) if durations else None


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
    return [Fix(flag, current, proposed, why.format(proposed=proposed, step=ms(baseline + proposed * per_token)),
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
                        f"its prefill chunks at {step_range(steps[0].index, steps[-1].index)} made "
                        f"{slowest.num_decode_tokens} decoding requests wait {ms(slowest.duration_s)} for a token "
                        f"(decode-only steps take {ms(baseline)})")
    if len(ranked) > 3:
        evidence.append(f"and {len(ranked) - 3} more long prompts")
    per_token = _chunk_cost_per_token(spikes, baseline)
    fixes = [*_smaller_chunks(facts, baseline, per_token,
                              f"a prompt chunk costs {per_token * 1e6:,.1f} µs per token here, so a {{proposed:,}}-token "
                              f"chunk keeps a step near {{step}} instead of {ms(worst.duration_s)}"),
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
                f"carrying prefill ({step_range(slowed[0].index, slowed[-1].index)}), whose median step took "
                f"{ms(typical)} against {ms(baseline)} for decode-only steps",
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
                f"({step_range(full[0].index, full[-1].index)})",
                f"median TTFT rose from {first_ttft:,.2f} s (first third of arrivals) to {last_ttft:,.2f} s (last third)"]
    fixes = [Fix(flag, budget, budget * 2, why)]
    fixes.append(Fix("or add a replica", None, None,
                     "where steps are compute-bound a bigger budget only makes them longer: the arrival rate then "
                     "exceeds what one engine prefills (the what-if above tells which)"))
    yield Finding("ttft_token_budget", WARNING, "TTFT rising: the token budget binds", evidence,
                  "prompts arrive faster than the step budget lets them in; they queue for a chunk",
                  fixes, full[0].index, full[-1].index, numbers)
