"""Phases A and B: the device's versions and first memory reading (the CPU kernel builds start
here), then the budget: requested = total x utilization, refused when the flags or the free
memory cannot hold it."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from engine.budget.fixes import BudgetRefused
from engine.budget.memory import (
    GiB,
    blocks_per_request,
    bytes_per_kv_token,
    bytes_per_kv_token_per_layer,
    fixed_pool_fixes,
    free_memory_fixes,
    longest_fitting_len,
    weights_bytes,
    weights_fixes,
)
from engine.budget.stages import stage_weights_bytes
from engine.config import EngineConfig
from engine.core.kv_cache_groups import KVCacheGroup
from engine.events.phase_data import BudgetData, InitData
from engine.model.kernels.background import KernelBuilds
from engine.model.memory.device import MemoryReading, versions
from engine.model.memory.host_allocator import tune_for_steps
from engine.startup.inputs import StartupInputs
from engine.startup.recorder import PhaseHandle

# vLLM's CPU backend sizes its pool from VLLM_CPU_KVCACHE_SPACE (4 GiB by
# default) rather than from all of RAM; kvscope does the same when the user
# gave neither --device-memory nor --kv-cache-memory-bytes.
CPU_DEFAULT_KV_SPACE_GIB = 4.0


def cpu_pool_capped(config: EngineConfig, device: torch.device) -> bool:
    """On CPU with neither ``--kv-cache-memory-bytes`` nor ``--device-memory``, phase E caps the
    pool at ``CPU_DEFAULT_KV_SPACE_GIB`` (vLLM's VLLM_CPU_KVCACHE_SPACE default), and phase B
    needs only the weights and that pool free."""
    return device.type == "cpu" and config.kv_cache_memory_bytes is None and config.device_memory_gib is None


def check_fixed_pool(config: EngineConfig, bytes_per_token: int, groups: Sequence[KVCacheGroup] = (),
                     bytes_per_token_per_layer: int = 0) -> None:
    """``--kv-cache-memory-bytes`` fixes the pool before anything is measured: refuse
    at once (phase B) when it cannot hold one ``--max-model-len`` request, naming
    only the two flags that change that outcome. A hybrid KV cache (``groups``) is
    sized as phase E sizes it: pages of one layer's block, ``G`` of them a block, and
    one request's blocks summed over every group (a window holds only its own)."""
    pool = config.kv_cache_memory_bytes
    if pool is None:
        return
    assert config.max_model_len is not None
    if groups:
        _check_fixed_hybrid_pool(config, pool, groups, bytes_per_token_per_layer)
        return
    block_bytes = config.block_size * bytes_per_token
    tokens = (pool // block_bytes) * config.block_size
    if tokens >= config.max_model_len:
        return
    needed = -(-config.max_model_len // config.block_size) * block_bytes
    raise BudgetRefused(
        f"--kv-cache-memory-bytes {pool:,} holds {tokens:,} tokens ({pool // block_bytes:,} blocks of "
        f"{config.block_size} x {bytes_per_token:,} bytes per token), fewer than one request of "
        f"--max-model-len {config.max_model_len:,}",
        fixed_pool_fixes(pool, needed, config.max_model_len, tokens if tokens >= config.block_size else 0))


def _check_fixed_hybrid_pool(config: EngineConfig, pool: int, groups: Sequence[KVCacheGroup],
                             bytes_per_token_per_layer: int) -> None:
    assert config.max_model_len is not None
    block_bytes = config.block_size * bytes_per_token_per_layer * max(len(g.layers) for g in groups)
    blocks = pool // block_bytes
    needed = sum(blocks_per_request(g.spec.sliding_window, config.max_model_len, config.block_size,
                                    config.max_num_batched_tokens) for g in groups)
    if blocks >= needed:
        return
    fits_len = longest_fitting_len([g.spec.sliding_window for g in groups], blocks, config.block_size,
                                   config.max_num_batched_tokens, config.max_model_len)
    raise BudgetRefused(
        f"--kv-cache-memory-bytes {pool:,} holds {blocks:,} blocks of {block_bytes:,} bytes (a page of "
        f"{config.block_size} tokens for each of a group's layers), fewer than the {needed:,} one request of "
        f"--max-model-len {config.max_model_len:,} holds across its {len(groups)} KV cache groups",
        fixed_pool_fixes(pool, needed * block_bytes, config.max_model_len, fits_len))


def phase_init(a: PhaseHandle, s: StartupInputs, reading: MemoryReading) -> KernelBuilds | None:
    """Phase A: versions, the first memory reading and the dtype; on CPU the kernel
    builds start here, to overlap weight loading and the profile run."""
    config, log = s.config, s.log
    a.record = InitData(**versions(s.device), memory_source=reading.source, total_bytes=reading.total,
                        free_bytes=reading.free, dtype=config.dtype, dtype_reason=s.resolution.dtype_reason)
    log.info(f"device {s.device} ({reading.source}): {reading.total / GiB:.2f} GiB total, "
             f"{reading.free / GiB:.2f} GiB free; torch {torch.__version__}, {torch.get_num_threads()} threads")
    kernels: KernelBuilds | None = None
    if s.caps is not None:
        a.record = dataclasses.replace(a.record, cpu=s.caps.summary(), allocator=tune_for_steps())
        log.info(f"CPU: {s.caps.line()}; allocator: {a.record.allocator}")
        # Compiling the CPU kernels (seconds to a minute, once per CPU type and
        # torch version) overlaps weight loading and the profile run.
        kernels = KernelBuilds.start(log)
    log.info(f"dtype {config.dtype} ({s.resolution.dtype_reason}); KV cache dtype {config.kv_cache_dtype} "
             f"({s.resolution.kv_cache_dtype_reason})")
    return kernels


def phase_budget(b: PhaseHandle, s: StartupInputs, reading: MemoryReading) -> None:
    """Phase B: requested = total × utilization; refuse a fixed pool too small for one
    request, less free memory than requested, or weights beyond the request."""
    config, device = s.config, s.device
    requested = reading.total * config.gpu_memory_utilization
    b.record = BudgetData(total_bytes=reading.total, gpu_memory_utilization=config.gpu_memory_utilization,
                          requested_bytes=int(requested), free_bytes=reading.free, memory_source=reading.source)
    model = s.budget_model  # a pipeline stage budgets its own layers
    check_fixed_pool(config, bytes_per_kv_token(model, config.kv_cache_dtype, config.tensor_parallel_size,
                                                config.dtype),
                     s.budget_groups, bytes_per_kv_token_per_layer(
        model, config.kv_cache_dtype, config.tensor_parallel_size, config.dtype) if s.kv_cache_groups else 0)
    needed_weights = weights_bytes(s.model, config.dtype, config.tensor_parallel_size)
    if s.stage_layers is not None:
        stages = config.pipeline_parallel_size or 1
        needed_weights = stage_weights_bytes(s.model, s.stage_layers, s.stage_layers[0] == 0,
                                             s.stage_layers[1] == s.model.num_layers, config.dtype,
                                             config.tensor_parallel_size)
        s.log.info(f"pipeline stage of {stages}: layers {s.stage_layers[0]}-{s.stage_layers[1] - 1}")
    # On CPU with neither memory flag, phase E caps the pool at vLLM's VLLM_CPU_KVCACHE_SPACE
    # default: this start needs the weights and that pool, not 0.9 of the host's memory, so a
    # host whose other processes hold a few GiB still starts (as vLLM's CPU build does).
    capped_need = needed_weights + CPU_DEFAULT_KV_SPACE_GIB * GiB
    if cpu_pool_capped(config, device) and capped_need <= reading.free < requested:
        s.log.info(f"free memory {reading.free / GiB:.2f} GiB is below the requested {requested / GiB:.2f} GiB; the "
                   f"CPU pool is capped at {CPU_DEFAULT_KV_SPACE_GIB:g} GiB, so this start needs about "
                   f"{capped_need / GiB:.2f} GiB with the weights: going on")
    elif config.kv_cache_memory_bytes is None and reading.free < requested:
        raise BudgetRefused(
            f"free memory on device ({reading.free / GiB:.2f}/{reading.total / GiB:.2f} GiB) is less than "
            f"desired memory utilization ({config.gpu_memory_utilization}, {requested / GiB:.2f} GiB)",
            free_memory_fixes(reading.free, reading.total, config.gpu_memory_utilization,
                              device.type == "cpu"))
    if config.kv_cache_memory_bytes is None and needed_weights > requested:
        raise BudgetRefused(
            f"the weights ({needed_weights / GiB:.2f} GiB in {config.dtype}) do not fit the requested "
            f"{requested / GiB:.2f} GiB ({reading.total / GiB:.2f} GiB x {config.gpu_memory_utilization})",
            weights_fixes(needed_weights, reading.total, config.gpu_memory_utilization, device.type == "cpu"))
    s.log.info(f"budget: requested {requested / GiB:.2f} GiB = {reading.total / GiB:.2f} GiB x "
               f"{config.gpu_memory_utilization}")
