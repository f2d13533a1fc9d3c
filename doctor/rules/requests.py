"""Rules that name one request: a stuck engine (the head of the queue and why it cannot be
admitted), sequence slots held by requests given no tokens, prefix-cache misses by cause, one
request thrashing, and sessions whose context was evicted between turns.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from doctor.budget import replan
from doctor.facts import RunFacts
from doctor.rules.finding import CRITICAL, WARNING, Finding
from doctor.rules.kv_pool import STORM_REPEATS
from doctor.rules.pool_fixes import fp8_fix, mean_request_tokens, utilization_fix
from doctor.rules.steps import MIN_BINDING_STEPS, consecutive_runs, step_range
from engine.budget.fixes import Fix
from engine.budget.memory import GiB
from engine.events.folds.request_record import wait_reason_text
from engine.events.step_records import PREFIX_EVICTED, PREFIX_SHORT_PROMPT, PREFIX_WINDOW, WAIT_NEVER_FITS

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
    for fix in (fp8_fix(facts, needs * block), utilization_fix(facts, needs * block)):
        if fix is not None:
            fixes.append(fix)
    return fixes


def stuck_engine(facts: RunFacts) -> Iterable[Finding]:
    """Requests wait, nothing is admitted and nothing runs, step after step, while the
    engine stays healthy (vllm#39734, #45414, #53130): the head of the queue and exactly
    why it cannot be admitted, with the fix in numbers. A head that can never fit (more
    blocks than the pool has) is critical however long it waited."""
    runs = [r for r in consecutive_runs(facts.steps, lambda s: s.num_waiting > 0 and s.admitted == 0 and s.num_running == 0)
            if len(r) >= STUCK_STEPS]
    never = [s for s in facts.steps if s.head is not None and s.head[1][:1] == [WAIT_NEVER_FITS]]
    if not runs and not never:
        return
    steps = max(runs, key=len) if runs else never
    last = steps[-1]
    head = last.head or next((s.head for s in reversed(steps) if s.head is not None), None)
    seconds = last.t - steps[0].t
    evidence = [f"{len(steps)} steps ({step_range(steps[0].index, last.index)}, {seconds:,.1f} s) with "
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
    runs = [r for r in consecutive_runs(facts.steps, lambda s: bool(s.deferred)) if len(r) >= MIN_BINDING_STEPS]
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
                f"longest run {step_range(longest[0].index, longest[-1].index)}",
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
        for fix in (fp8_fix(facts, need * 2), utilization_fix(facts, need * 2)):
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
                f"{step_range(p[0].step, p[-1].step)} and recomputed {lost:,} tokens in all"]
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
    mean_tokens = mean_request_tokens(facts)
    fits = max(1, int(pool // mean_tokens)) if mean_tokens and pool else seqs
    if fits < seqs:
        fixes.append(Fix("--max-num-seqs", seqs, fits, f"the pool's {pool:,} tokens hold {fits} requests of the mean "
                         f"{mean_tokens:,.0f} tokens, so admitted requests are not preempted to make room"))
    for fix in (fp8_fix(facts, pool + need), utilization_fix(facts, pool + need)):
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
        fixes += [f for f in (utilization_fix(facts, needs * block),) if f is not None]
    yield Finding("session_context_lost", WARNING,
                  f"session context lost: {len(turns)} turns re-prefilled more than half their prefix", evidence,
                  "the previous turn's blocks were evicted by other requests' allocations before the next turn "
                  "arrived; the pool is too small for the gap between turns", fixes,
                  min(t.admitted_step or 0 for t in turns), max(t.admitted_step or 0 for t in turns),
                  {"turns": len(turns), "reprefill_tokens": reprefilled, "blocks_needed": needs, "pool_blocks": pool})
