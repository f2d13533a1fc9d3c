"""A log's failures explained with fixes in its own numbers: free memory below the request,
max-model-len beyond the KV pool, no KV blocks, out of memory (in the sampler, in profiling,
in CUDA-graph capture), memory profiling errors, and preemptions."""

from __future__ import annotations

import math
from typing import Any

from engine.budget.fixes import Fix
from engine.budget.memory import GiB, MemoryPlan, plan_memory
from engine.errors import UserError
from engine.modelspec.config import ModelConfig
from logparse.check import Check
from logparse.kvscope_plan import kv_bytes_per_token, kv_dtype
from logparse.parser import Record
from logparse.tracebacks import PLACE_PHASES


def _gib(x: float) -> str:
    return f"{x:.2f} GiB"


def _note(text: str) -> Fix:
    """Advice that is no single flag change (a figure to know, memory to free)."""
    return Fix("", None, None, text)


def _fp8_and_tp_fixes(facts: dict[str, Any], model: ModelConfig | None, pool_gib: float | None,
                      need_gib: float | None) -> list[Fix]:
    fixes = []
    if kv_dtype(facts) != "fp8" and pool_gib is not None and need_gib is not None:
        fits = pool_gib >= need_gib / 2
        fixes.append(Fix("--kv-cache-dtype", kv_dtype(facts), "fp8",
                         f"halves bytes per token: one request would need {_gib(need_gib / 2)} "
                         f"against {_gib(pool_gib)} available ({'fits' if fits else 'still short'})",
                         numbers={"request_gib": need_gib / 2, "pool_gib": pool_gib}))
    tp = int(facts.get("tensor_parallel_size", 1))
    if model is not None and model.num_kv_heads >= 2 * tp and need_gib is not None:
        fixes.append(Fix("--tensor-parallel-size", tp, 2 * tp, f"splits KV heads over twice the GPUs: per-GPU need "
                         f"{_gib(need_gib / 2)} per request, and the weights per GPU halve too"))
    return fixes


def failure_check(record: Record, phase: str, facts: dict[str, Any], budget: dict[str, Any],
                  model: ModelConfig | None, plan: MemoryPlan | None, place: str | None = None,
                  plan_inputs: dict[str, Any] | None = None) -> Check:
    """A failure line as a check with its fixes, by the kind of failure its pattern names and the
    place its traceback's frames give (``place``), else the startup phase before it."""
    kind = record.pattern.failure if record.pattern else None
    if kind == "free_below_request":
        return _free_below_request(record, plan)
    if kind == "max_seq_len_exceeds_kv":
        return _max_len_beyond_kv(record, facts, budget, model)
    if kind == "no_cache_blocks":
        return _no_cache_blocks(record, facts, budget, model, plan)
    if kind == "oom" and place == "graph_capture":
        return _oom_graph_capture(record, facts, budget, model if plan is not None else None, plan_inputs or {})
    if kind in ("oom", "oom_sampler"):
        return _oom(record, PLACE_PHASES.get(place or "", phase), facts, budget["total_gib"])
    return Check(kind or "error", "memory profiling error", False,
                 "free memory grew while vLLM profiled: another process released GPU memory", kind="failure",
                 line=record.line, fix=[_note("run vLLM alone on the GPU (or in its own container) so the profile is stable")])


def _free_below_request(record: Record, plan: MemoryPlan | None) -> Check:
    """Less free at startup than utilization x total asks: the utilization that fits what is free."""
    f = record.fields
    free, tot, u, req = f["free_gib"], f["total_gib"], f["gpu_memory_utilization"], f["requested_gib"]
    fit = math.floor(free / tot * 100) / 100 if tot else 0.0
    fixes = [Fix("--gpu-memory-utilization", u, f"{fit:.2f}", f"fits the {free} GiB free now ({free} / {tot})"),
             _note(f"or free {req - free:.2f} GiB held by other processes (requested {req} GiB = {tot} x {u})")]
    if plan is not None:
        non_kv = (plan.weights_bytes + plan.activation_peak_bytes + plan.non_torch_bytes) / GiB
        kv_left = tot * fit - non_kv
        fixes.append(_note(f"at {fit:.2f} kvscope's plan leaves a KV pool of {kv_left:.2f} GiB "
                           f"({max(0, int(kv_left * GiB / plan.bytes_per_token)):,} tokens)"))
    return Check("free_below_request", "free memory below the request", False,
                 f"only {free} of {tot} GiB free at startup, but {u} x {tot} = {req} GiB requested",
                 kind="failure", line=record.line, fix=fixes)


def _max_len_beyond_kv(record: Record, facts: dict[str, Any], budget: dict[str, Any],
                       model: ModelConfig | None) -> Check:
    """One max-model-len request does not fit the KV pool: the length that fits, the utilization
    that adds what is missing, fp8 KV and more tensor parallelism."""
    f = record.fields
    max_len = int(f["max_model_len"])
    per_token = kv_bytes_per_token(facts, model)
    need: float | None
    avail: float | None
    if "kv_needed_gib" in f:
        need, avail = float(f["kv_needed_gib"]), float(f["kv_cache_gib"])
        fit_len = f.get("estimated_max_model_len") or int(max_len * avail / need) // 16 * 16
    else:
        tokens = int(f["kv_cache_tokens"])
        fit_len = tokens
        need = max_len * per_token / GiB if per_token else None
        avail = tokens * per_token / GiB if per_token else None
    fixes = [Fix("--max-model-len", max_len, int(fit_len), "fits the current pool"),
             _missing_kv_utilization_fix(need, avail, budget, fit_len, max_len)]
    fixes += _fp8_and_tp_fixes(facts, model, avail, need)
    return Check("max_seq_len_exceeds_kv", "max model length beyond the KV cache", False,
                 f"one {max_len:,}-token request does not fit the KV pool"
                 + (f" ({_gib(need)} needed, {_gib(avail)} available)" if need is not None and avail is not None else ""),
                 kind="failure", line=record.line, fix=fixes)


def _missing_kv_utilization_fix(need: float | None, avail: float | None, budget: dict[str, Any], fit_len: int,
                                max_len: int) -> Fix:
    """The utilization that adds the KV memory one request lacks, as exact as the figures known allow."""
    total, util = budget["total_gib"], budget["gpu_memory_utilization"]
    if need is None or avail is None:
        return Fix("--gpu-memory-utilization", util, None,
                   f"the pool holds {fit_len:,} of the {max_len:,} tokens needed: raise it so the pool grows "
                   f"by {max_len / max(fit_len, 1):.2f}x (pass --model to get GiB)")
    extra = need - avail
    if total and util is not None:
        return Fix("--gpu-memory-utilization", util, f"{util + extra / total:.3f}",
                   f"adds the missing {_gib(extra)}"
                   + (" (beyond 1.0: not possible on this device)" if util + extra / total > 1 else ""))
    if total:
        return Fix("--gpu-memory-utilization", None, None,
                   f"raise it by {extra / total:.3f} ({_gib(extra)} of {total} GiB)")
    return Fix("--gpu-memory-utilization", None, None, f"raise it by {_gib(extra)} / total device memory")


SWAP_SPACE_DEFAULT_GIB = 4  # vLLM V0's --swap-space default: the CPU pool the '# CPU blocks' count divides


def _one_request_kv(facts: dict[str, Any], model: ModelConfig | None) -> tuple[str, float | None] | None:
    """What one max-model-len request needs of the KV pool: a sentence with its blocks (and
    GiB where the block size in bytes is known: from the model, else from the CPU pool)."""
    max_len = facts.get("max_model_len")
    if not isinstance(max_len, int) or max_len <= 0:
        return None
    block = int(facts.get("block_size", 16))
    blocks = -(-max_len // block)
    per_token = kv_bytes_per_token(facts, model)
    cpu_blocks = facts.get("cpu_blocks")
    if per_token:
        block_bytes: float = block * per_token
        how = f"{model.name if model else 'the model'}: {per_token / 1024:g} KiB per token"
    elif isinstance(cpu_blocks, int) and cpu_blocks > 0:
        block_bytes = SWAP_SPACE_DEFAULT_GIB * GiB / cpu_blocks
        how = (f"if --swap-space is vLLM's default {SWAP_SPACE_DEFAULT_GIB} GiB, its {cpu_blocks:,} CPU blocks make "
               f"a block {block_bytes / 2**20:.2f} MiB; pass --model for the exact size")
    else:
        return (f"one {max_len:,}-token request needs {blocks:,} blocks of {block} tokens (pass --model for their "
                "size in GiB)"), None
    need = blocks * block_bytes / GiB
    return (f"one {max_len:,}-token request needs {blocks:,} blocks of {block} tokens = {_gib(need)} of KV memory "
            f"({how})"), need


def _no_cache_blocks(record: Record, facts: dict[str, Any], budget: dict[str, Any], model: ModelConfig | None,
                     plan: MemoryPlan | None) -> Check:
    fixes = []
    non_kv, req = budget["non_kv_gib"], budget["requested_gib"]
    total, util = budget["total_gib"], budget["gpu_memory_utilization"]
    request = _one_request_kv(facts, model)
    need = request[1] if request else None
    if request:
        fixes.append(_note(request[0]))
    beyond = " (beyond 1.0: more GPUs or a smaller model)"
    if plan is not None:
        need_util = (plan.weights_bytes + plan.activation_peak_bytes + plan.non_torch_bytes
                     + plan.max_model_len * plan.bytes_per_token) / plan.total_bytes
        if util is not None and need_util <= util:
            fixes.append(_note(f"kvscope's plan needs only --gpu-memory-utilization {need_util:.3f} for non-KV plus one "
                               f"{plan.max_model_len:,}-token request, yet vLLM found no room at {util:g}: the device "
                               "had less free than its total (another process?) or the model is not "
                               f"{model.name if model else 'the one planned'}, so that figure is a floor, not a fix"))
        else:
            fixes.append(Fix("--gpu-memory-utilization", util, f"{need_util:.3f}", "kvscope's plan: fits non-KV plus one "
                             f"{plan.max_model_len:,}-token request" + (beyond if need_util > 1 else "")))
    elif need is not None and total and non_kv is not None:
        need_util = (non_kv + need) / total
        fixes.append(Fix("--gpu-memory-utilization", util, f"{need_util:.3f}", f"fits vLLM's non-KV {_gib(non_kv)} plus "
                         f"that request on {total} GiB" + (beyond if need_util > 1 else "")))
    elif non_kv is not None and req is not None:
        fixes.append(Fix("--gpu-memory-utilization", util, None, f"non-KV {_gib(non_kv)} exceeds the requested "
                         f"{_gib(req)}: raise it by at least {_gib(non_kv - req)} / total"))
    elif need is not None and total and util is not None:
        need_util = util + need / total
        fixes.append(Fix("--gpu-memory-utilization", util, f"{need_util:.3f}", f"at least: the budget needs those "
                         f"{_gib(need)} more" + (beyond if need_util > 1 else "")))
    elif need is not None and total:
        fixes.append(Fix("--gpu-memory-utilization", None, None,
                         f"raise it by at least {need / total:.3f} ({_gib(need)} of {total} GiB)"))
    elif need is not None:
        fixes.append(Fix("--gpu-memory-utilization", None, None, f"raise it by at least {_gib(need)} / the device's "
                         "total (pass --gpu or --gpu-memory for the figure)"))
    fixes.append(Fix("--max-num-batched-tokens", facts.get("max_num_batched_tokens"), None,
                     "lower it or --max-num-seqs to shrink the profiled activation peak, or quantise / add "
                     "--tensor-parallel-size to shrink weights per GPU"))
    used_up = "weights + activation peak + non-torch used up the whole requested budget"
    if record.pattern is not None and record.pattern.id == "zero_gpu_blocks":
        cpu = record.fields.get("cpu_blocks")
        detail = ("vLLM sized the KV pool at 0 GPU blocks" + (f" ({cpu:,} CPU blocks)" if isinstance(cpu, int) else "")
                  + f": {used_up}")
    else:
        detail = used_up
    return Check("no_cache_blocks", "no memory left for the KV cache", False, detail, kind="failure",
                 line=record.line, fix=fixes)


def _oom(record: Record, phase: str, facts: dict[str, Any], total: float | None) -> Check:
    f = record.fields
    if record.pattern and record.pattern.failure == "oom_sampler":
        n = f.get("num_dummy_requests")
        return Check("oom_sampler", "out of memory in the sampler warm-up", False,
                     f"sampling for {n} dummy requests (max-num-seqs) did not fit after the KV pool was allocated",
                     kind="failure", line=record.line,
                     fix=[Fix("--max-num-seqs", n, max(1, int(n or 256) // 2), "halves the sampler's logits buffer"),
                          Fix("--gpu-memory-utilization", facts.get("gpu_memory_utilization"), None,
                              "or lower it by a few hundredths to leave room outside the pool")])
    scale = {"GiB": 1.0, "MiB": 1 / 1024, "KiB": 1 / 1024**2}
    tried = f.get("oom_tried")
    tried_gib = tried * scale.get(f.get("oom_unit", "GiB"), 1.0) if tried is not None else None
    free_gib = f["oom_free"] * scale.get(f.get("oom_free_unit", "GiB"), 1.0) if "oom_free" in f else None
    where = {"D": "profiling (the dummy worst-case step)", "F": "CUDA-graph capture",
             "E": "KV-cache allocation", "C": "weight loading"}.get(phase, f"phase {phase}")
    fixes = []
    short = (tried_gib - (free_gib or 0.0)) if tried_gib is not None else None
    device_total = f.get("oom_total_gib") or total
    if phase == "D":
        fixes.append(Fix("--max-num-batched-tokens", facts.get("max_num_batched_tokens", "default"), None,
                         "lower it or --max-num-seqs: the profiling step allocates activations for them"))
    if phase == "F":
        fixes.append(Fix("--enforce-eager", None, None, "skips CUDA-graph capture"))
    if short is not None and device_total:
        util = facts.get("gpu_memory_utilization")
        target = f"{util - short / device_total:.3f}" if util is not None else f"{short / device_total:.3f} lower"
        fixes.append(Fix("--gpu-memory-utilization", util, target,
                         f"leaves the {short:.2f} GiB that were missing outside the budget"))
    return Check("oom", f"CUDA out of memory during {where}", False,
                 f"tried to allocate {tried_gib:.2f} GiB" if tried_gib is not None else "allocation failed",
                 kind="failure", line=record.line, fix=fixes)


DEFAULT_MAX_CAPTURE_SIZE = 512  # vLLM's largest CUDA-graph batch when --max-cudagraph-capture-size is not given


def _oom_graph_capture(record: Record, facts: dict[str, Any], budget: dict[str, Any], model: ModelConfig | None,
                       plan_inputs: dict[str, Any]) -> Check:
    """Out of memory while CUDA graphs were captured (the frames say so): the graph pool did
    not fit beside the KV pool. The fixes in the log's own numbers: the utilization that
    leaves the pool outside the budget (and the KV pool that remains, through
    engine/budget's formula when the model is known), --enforce-eager, fewer capture sizes."""
    total, util = budget["total_gib"], budget["gpu_memory_utilization"]
    kv, tokens, max_len = facts.get("kv_cache_gib"), facts.get("kv_cache_tokens"), facts.get("max_model_len")
    need, need_src = facts.get("cuda_graph_gib"), "the CUDA-graph estimate the log printed"
    f = record.fields
    if "oom_tried" in f:
        scale = {"GiB": 1.0, "MiB": 1 / 1024, "KiB": 1 / 1024**2}
        tried = f["oom_tried"] * scale.get(f.get("oom_unit", "GiB"), 1.0)
        free = f.get("oom_free", 0.0) * scale.get(f.get("oom_free_unit", "GiB"), 1.0)
        if need is None or tried - free > need:
            need, need_src = tried - free, "the allocation that failed less what was free"
    fixes: list[Fix] = []
    if need is not None and total and util is not None:
        new_util = math.floor((util - need / total) * 100) / 100
        why = (f"leaves {_gib(util * total - new_util * total)} of {total:g} GiB outside the budget for the graph pool "
               f"({_gib(need)}: {need_src})")
        why += _kv_after_lowering(new_util, util, total, kv, tokens, max_len, model, plan_inputs)
        fixes.append(Fix("--gpu-memory-utilization", util, f"{new_util:.2f}", why, numbers={"graph_pool_gib": need}))
    elif need is not None:
        fixes.append(Fix("--gpu-memory-utilization", None, None, f"lower it by {_gib(need)} / the device's total "
                         f"({need_src}; pass --gpu or --gpu-memory for the figure)"))
    else:
        fixes.append(Fix("--gpu-memory-utilization", None, None, "lower it by the graph pool's size (the log prints "
                         "no estimate; vLLM 0.21+ prints 'Estimated CUDA graph memory')"))
    fixes.append(Fix("--enforce-eager", None, None, "captures no graphs"
                     + (f" and frees the whole {_gib(need)} pool" if need else "")
                     + "; decode steps of small batches get slower (one kernel launch per op)"))
    largest = facts.get("max_cudagraph_capture_size") or facts.get("capture_size_capped")
    largest_src = "the log" if largest else f"vLLM's default {DEFAULT_MAX_CAPTURE_SIZE}"
    largest = int(largest or DEFAULT_MAX_CAPTURE_SIZE)
    fixes.append(Fix("--max-cudagraph-capture-size", largest, max(1, largest // 2), f"(largest from {largest_src}) "
                     "the pool grows with the largest captured batch, so about half of it; larger batches run eager"))
    return Check("oom_graph_capture", "CUDA out of memory during CUDA-graph capture", False,
                 "the traceback's frames are CUDA-graph capture (capture_model / torch.cuda.graph): the graph pool "
                 "did not fit beside the KV pool" + (f" ({_gib(kv)})" if kv is not None else ""),
                 kind="failure", line=record.line, fix=fixes)


def _kv_after_lowering(new_util: float, util: float, total: float, kv: float | None, tokens: int | None,
                       max_len: int | None, model: ModelConfig | None, inputs: dict[str, Any]) -> str:
    """What a lower utilization leaves of the KV pool: kvscope's plan (engine/budget's one
    formula) at the new utilization when the model is known, else the log's own tokens per GiB."""
    if model is not None and inputs:
        try:
            lowered = plan_memory(
                model=model, total_bytes=int(inputs["total_gib"] * GiB), gpu_memory_utilization=new_util,
                max_model_len=inputs["max_model_len"], block_size=inputs["block_size"],
                kv_cache_dtype=inputs["kv_cache_dtype"], dtype=inputs["dtype"],
                tensor_parallel_size=inputs["tensor_parallel_size"],
                max_num_batched_tokens=inputs["max_num_batched_tokens"], max_num_seqs=inputs["max_num_seqs"],
                check_fits=False)
        except UserError:
            lowered = None
        if lowered is not None:
            return (f"; kvscope's plan of {model.name} at {new_util:.2f}: KV pool "
                    f"{_gib(lowered.kv_pool_bytes / GiB)}, {lowered.kv_cache_tokens:,} tokens, "
                    f"{lowered.max_concurrency:.2f}x at {lowered.max_model_len:,}")
    if kv is None or kv <= 0:
        return ""
    new_kv = kv - (util - new_util) * total
    out = f"; the KV pool shrinks from {_gib(kv)} to {_gib(max(new_kv, 0.0))}"
    if tokens:
        new_tokens = int(tokens * max(new_kv, 0.0) / kv)
        out += f" ({new_tokens:,} tokens at the log's {tokens / kv:,.0f} tokens per GiB"
        out += f", {new_tokens / max_len:.2f}x at {max_len:,})" if isinstance(max_len, int) and max_len else ")"
    return out


def preemption_check(v0: int, v1: int, line: int | None, facts: dict[str, Any]) -> Check:
    count = max(v0, v1)
    tokens, max_len = facts.get("kv_cache_tokens"), facts.get("max_model_len")
    pool = f"the pool holds {tokens:,} tokens ({tokens / max_len:.2f}x max-model-len)" if tokens and max_len else \
        "the KV pool filled up"
    source = "V0 warning, logged for 1 in 50" if v0 >= v1 else "V1 stats 'Preemptions: N'"
    return Check("preemption", "requests preempted for KV space", False,
                 f"at least {count} preemption(s) ({source}); {pool}", kind="warning", line=line,
                 fix=[Fix("--gpu-memory-utilization", facts.get("gpu_memory_utilization"), None,
                          "raise it or --tensor-parallel-size for more KV blocks"),
                      Fix("--kv-cache-dtype", kv_dtype(facts), "fp8", "doubles the tokens that fit (from 16 bits)"),
                      Fix("--max-num-seqs", facts.get("max_num_seqs"), None,
                          "or lower it so fewer requests compete for the pool")])
