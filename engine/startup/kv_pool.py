"""Phase E: the KV cache pool from the budget formula (engine/budget/memory.py), capped on CPU,
agreed across ranks and stages, refused when it cannot hold one request, then allocated."""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.budget.memory import (
    GiB,
    MemoryPlan,
    check_plan_fits,
    kv_cache_size_line,
    max_concurrency_line,
    plan_memory,
)
from engine.core.kv_cache_groups import KVCacheGroup
from engine.events.phase_data import KvCacheData
from engine.model.memory import profile_cache
from engine.model.memory.device import MemoryReading, device_word
from engine.model.parallel import TensorParallel
from engine.model.runner import ModelRunner
from engine.startup.device_budget import CPU_DEFAULT_KV_SPACE_GIB, cpu_pool_capped
from engine.startup.inputs import StartupInputs
from engine.startup.recorder import PhaseHandle

SLIDING_LAYER = "sliding_attention"  # transformers' layer type (ModelConfig.layer_types)


def phase_kv_cache(e: PhaseHandle, s: StartupInputs, reading: MemoryReading, weights: int,
                   profile: profile_cache.ProfileResult, runner: ModelRunner,
                   parallel: TensorParallel | None = None, stage: Any = None) -> MemoryPlan:
    """Phase E: the pool from the budget formula (on CPU capped at the default unless
    sized by a flag), refused when it cannot hold one request, then allocated. A pipeline
    stage's pool holds its own layers (its bytes per token, its groups' pages) and every
    stage takes the fewest blocks of any (vLLM's minimum ``num_gpu_blocks``)."""
    # A model with sliding layers: the hybrid layout when the runner's groups name several
    # tables (ModelRunner.kv_cache_groups, () for one full-attention group: under
    # --disable-hybrid-kv-cache-manager every layer holds full attention's blocks and the event says so).
    runner_groups = tuple(getattr(runner, "kv_cache_groups", None) or ())
    plan_inputs = _plan_inputs(s, reading, weights, profile, runner_groups)
    group = stage if stage is not None else parallel  # every stage's every rank under pipeline parallelism
    plan, capped = _size_pool(s, plan_inputs, group)
    e.record = _kv_cache_record(s, plan, capped)
    if s.model.layer_types and SLIDING_LAYER in s.model.layer_types:
        e.record = _with_other_layout(e.record, s, plan, plan_inputs, runs_hybrid=bool(runner_groups))
    check_plan_fits(plan)
    runner.allocate_kv_cache(plan.num_blocks)
    _log_pool(s, plan, capped)
    return plan


def _plan_inputs(s: StartupInputs, reading: MemoryReading, weights: int, profile: profile_cache.ProfileResult,
                 runner_groups: tuple[KVCacheGroup, ...]) -> dict[str, Any]:
    """``plan_memory``'s arguments but the pool's size: the flags, the measured weights and
    peaks, and the layout the runner runs (hybrid when it holds several groups)."""
    config = s.config
    return dict(
        model=s.budget_model, total_bytes=reading.total, gpu_memory_utilization=config.gpu_memory_utilization,
        max_model_len=s.max_model_len, block_size=config.block_size,
        kv_cache_dtype=config.kv_cache_dtype, dtype=config.dtype, tensor_parallel_size=config.tensor_parallel_size,
        weights=weights, activation_peak=profile.activation_peak_bytes,
        non_torch=profile.non_torch_bytes, max_num_batched_tokens=config.max_num_batched_tokens,
        max_num_seqs=config.max_num_seqs, disable_hybrid_kv_cache_manager=not runner_groups,
        kv_cache_groups=runner_groups or None,
    )


def _size_pool(s: StartupInputs, plan_inputs: dict[str, Any], group: Any) -> tuple[MemoryPlan, bool]:
    """The plan for the flags' pool (or the formula's), capped on CPU at the default, then cut to
    the fewest blocks of any rank in ``group``; and whether the CPU cap applied."""
    plan = plan_memory(kv_cache_memory_bytes=s.config.kv_cache_memory_bytes, check_fits=False, **plan_inputs)
    capped = False
    if cpu_pool_capped(s.config, s.device) and plan.kv_pool_bytes > CPU_DEFAULT_KV_SPACE_GIB * GiB:
        plan = plan_memory(kv_cache_memory_bytes=int(CPU_DEFAULT_KV_SPACE_GIB * GiB), check_fits=False,
                           **plan_inputs)
        capped = True
    if group is not None:
        # One block table serves every rank: each pool holds the blocks of the rank with the fewest.
        fewest = min(group.all_gather(plan.num_blocks))
        if fewest < plan.num_blocks:
            plan = plan_memory(kv_cache_memory_bytes=fewest * plan.block_bytes, check_fits=False, **plan_inputs)
    return plan, capped


def _kv_cache_record(s: StartupInputs, plan: MemoryPlan, capped: bool) -> KvCacheData:
    """Phase E's numbers: the plan's, and on CPU or under ``--max-decode-step-tokens`` the step
    budgets with their reasons (each logged)."""
    config, resolution, log = s.config, s.resolution, s.log
    record = dataclasses.replace(plan.kv_cache_data(), cpu_default_cap=capped)
    if s.device.type == "cpu":
        record = dataclasses.replace(record, max_num_batched_tokens=config.max_num_batched_tokens,
                                     max_num_batched_tokens_reason=resolution.batched_tokens_reason)
        log.info(f"--max-num-batched-tokens {config.max_num_batched_tokens:,} ({resolution.batched_tokens_reason})")
    if config.max_decode_step_tokens is not None:
        record = dataclasses.replace(record, max_decode_step_tokens=config.max_decode_step_tokens,
                                     max_decode_step_tokens_reason=resolution.decode_step_tokens_reason)
        log.info(f"--max-decode-step-tokens {config.max_decode_step_tokens:,} "
                 f"({resolution.decode_step_tokens_reason})")
    return record


def _with_other_layout(record: KvCacheData, s: StartupInputs, plan: MemoryPlan, plan_inputs: dict[str, Any],
                       runs_hybrid: bool) -> KvCacheData:
    """The same pool under the other layout: phase E's event names both, and which the engine used."""
    other = plan_memory(**{**plan_inputs, "disable_hybrid_kv_cache_manager": runs_hybrid},
                        kv_cache_memory_bytes=plan.kv_pool_bytes, check_fits=False)
    if not plan.is_hybrid:
        s.log.info(f"{s.model.name} has sliding-window layers; this engine keeps every layer's KV in one "
                   f"full-attention table: vLLM's hybrid layout would hold {other.kv_cache_tokens:,} tokens, "
                   f"{other.max_concurrency:.2f}x concurrency, in the same pool")
    return dataclasses.replace(record, kv_cache_layout=plan.kv_cache_layout, other_layout=other.layout_summary())


def _log_pool(s: StartupInputs, plan: MemoryPlan, capped: bool) -> None:
    """vLLM's pool lines: its size in GiB and blocks, the tokens it holds, the concurrency."""
    log, word = s.log, device_word(s.device)
    if capped:
        log.info(f"CPU KV pool capped at the default {CPU_DEFAULT_KV_SPACE_GIB:g} GiB "
                 "(give --device-memory or --kv-cache-memory-bytes to size it)")
    log.info(f"{word} KV cache pool: {plan.kv_pool_bytes / GiB:.2f} GiB, {plan.num_blocks:,} blocks of "
             f"{plan.block_size}")
    log.info(kv_cache_size_line(word, plan.kv_cache_tokens))
    log.info(max_concurrency_line(plan.max_model_len, plan.max_concurrency))
