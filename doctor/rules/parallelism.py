"""Parallelism: tensor parallelism whose collectives dominate the step, a hot MoE expert,
pipeline stages idling (the bubble) and data-parallel ranks loaded unevenly.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable

from doctor.budget import model_of, replan, replan_stages
from doctor.facts import RunFacts
from doctor.rules.finding import WARNING, Finding
from doctor.rules.steps import MIN_BINDING_STEPS, ms, step_range
from engine.budget.fixes import Fix
from engine.budget.memory import GiB
from engine.budget.stages import DEFAULT_MICRO_BATCHES, PipelinePlan, fill_drain_bubble, stage_layer_ranges
from engine.events.folds.dp_balance import DP_IMBALANCE_BOUND, DP_MIN_MEAN_LOAD

TP_COLLECTIVE_SHARE = 0.25  # collectives taking this share of step time: the split costs more than it saves
HOT_EXPERT_IMBALANCE = 2.0  # an expert given this many times its layer's mean routed tokens is hot
HOT_EXPERT_MIN_TOKENS = 32  # routed tokens per expert (the layer's mean) below which a share is noise
PIPELINE_BUBBLE_SHARE = 0.25  # a stage idle this share of the step time: a quarter of its device wasted
GPUS_PER_NODE = 8  # an HGX / DGX node: tensor parallelism inside it runs over NVLink
DP_SUSTAINED_STEPS = 10  # consecutive steps (of any rank) imbalanced: longer than a burst between two reports


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
    evidence = [f"{step_range(steps[0].index, steps[-1].index)}: collectives took {share:.0%} of step time at "
                f"--tensor-parallel-size {tp} (median {ms(median_collective)} of a {ms(median_step)} step, "
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
    evidence = [f"{step_range(steps[0].index, steps[-1].index)} ({len(steps)} steps): "
                + ", ".join(f"stage {i} idle {f:.0%}" for i, f in enumerate(fractions))
                + f" of the step time; the fill-drain floor for {stages} stages and {micro} micro-batches is {floor:.0%}",
                f"stage {worst} waited a median {ms(median_wait)} of a {ms(median_step)} step; a step ran a median "
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
