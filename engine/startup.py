"""Startup in phases A–G, each measured and emitted as ``startup.phase`` events.

A init (device, versions, memory snapshot) → B budget (requested = total ×
utilization; refuse if less is free) → C load weights → D profile run (one
dummy step at the worst-case shape; the activation peak is measured) → E KV
cache (pool = requested − weights − peak − non-torch, through engine.budget.memory) →
F graphs / compile → G ready.

Each phase emits a ``begin`` and an ``end`` (or ``skipped`` / ``failed``) event
with its duration and device memory before and after, plus a log line. Its
numbers are the phase's record from engine/events/phase_data.py, published as
``record.to_dict()``. ``prepare_startup`` does everything before phase A (the
device, the model, ``resolve_config``); ``start_engine`` runs one function per phase.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch

from engine import startup_eta
from engine.budget.fixes import BudgetRefused, recorded_fixes
from engine.budget.memory import (
    GiB,
    MemoryPlan,
    blocks_per_request,
    bytes_per_kv_token,
    bytes_per_kv_token_per_layer,
    check_plan_fits,
    fixed_pool_fixes,
    free_memory_fixes,
    kv_cache_size_line,
    longest_fitting_len,
    max_concurrency_line,
    plan_memory,
    weights_bytes,
    weights_fixes,
)
from engine.budget.stages import stage_kv_cache_groups, stage_model, stage_weights_bytes
from engine.config import EngineConfig
from engine.core.kv_cache_groups import KVCacheGroup, config_groups, groups_to_config, kv_cache_groups
from engine.core.scheduler import SchedulerConfig
from engine.errors import UserError
from engine.events import PHASES, EngineConfigEvent, EventBus, StartupPhase, StartupProgress
from engine.events.phase_data import (
    BudgetData,
    GraphsCompileData,
    InitData,
    LoadWeightsData,
    PhaseData,
    ProfileRunData,
    ReadyData,
)
from engine.gc_policy import restore_collections
from engine.logs import get_logger
from engine.model.cpu_caps import CpuCapabilities, DtypeChoice, choose_cpu_dtype, detect
from engine.model.cuda_graphs import DecodeGraphs, graphs_supported
from engine.model.kernels.background import KernelBuilds
from engine.model.loading.loader import LoadInfo
from engine.model.loading.tokenizer import Tokenizer
from engine.model.memory import profile_cache, profile_parts
from engine.model.memory.device import (
    MemoryReading,
    device_word,
    measure_peak,
    read_memory,
    resolve_device,
    versions,
)
from engine.model.memory.host_allocator import tune_for_steps
from engine.model.parallel import RankLayout, TensorParallel, check_shardable, replica_free_bytes
from engine.model.plan.resolve import stored_for_start
from engine.model.plan.setting import AUTO_DTYPE, AUTO_DTYPE_REASON, PLAN_ENV, plan_enabled
from engine.model.plan.store import plan_key
from engine.model.plan.token_budget import BUDGET_MAX, derived_batch_budget
from engine.model.runner import ModelRunner
from engine.modelspec.config import ModelConfig
from engine.modelspec.readers import load_model_config

# vLLM's CPU backend sizes its pool from VLLM_CPU_KVCACHE_SPACE (4 GiB by
# default) rather than from all of RAM; kvscope does the same when the user
# gave neither --device-memory nor --kv-cache-memory-bytes.
CPU_DEFAULT_KV_SPACE_GIB = 4.0
# The profile run on 2 CPU cores at vLLM's GPU default of 8,192 tokens takes
# ~20 s; 2,048 keeps startup short and still lets a long prompt prefill in chunks.
GPU_DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
CPU_DEFAULT_MAX_NUM_BATCHED_TOKENS = 512  # without a kernel plan (KVSCOPE_KERNEL_PLAN=off, tensor or pipeline parallel)
# The least a step takes on CPU with the kernel plan on, from the first start (before a plan is
# stored: the budget must not change between the first start and the next): vLLM's CPU server default, so
# kvscope's steps are composed as vLLM-CPU's (decodes first, then up to this many prompt tokens)
# and, each token being faster, a workload's slowed gaps between tokens are as many as under
# vLLM-CPU and shorter. A tighter bound on the steps that carry decodes (a one-second one, 1,088 tokens
# on 2 Zen 3 cores) prefills the same prompts in more steps, each stalling every running decode:
# on AVX2 Zen 3 batch-16 then had 20 slow gaps of its ~2,450 against 7 at 2,048, which crossed
# the 1 % that ITL p99 counts (580 ms against vLLM-CPU's 240 in `make bench`; 71-88 ms at
# 2,048). It also prefills a 500-token prompt in one 0.53 s step instead of four 128-token ones
# (0.60-0.70 s; Zen 4, AVX-512 BF16). --max-decode-step-tokens bounds the steps with decodes
# where the largest gap between tokens matters more than the p99.
CPU_PROMPT_STEP_TOKENS = 2048


@dataclass(slots=True)
class PhaseHandle:
    """What a phase body fills in: its numbers (engine/events/phase_data.py), or a skip reason.
    A phase that fails publishes the record it had set by then."""

    record: PhaseData | None = None
    skipped: str | None = None

    def data(self) -> dict[str, Any]:
        return self.record.to_dict() if self.record is not None else {}


@dataclass(slots=True)
class StartupResult:
    config: EngineConfig
    model_config: ModelConfig
    device: torch.device
    runner: ModelRunner
    tokenizer: Tokenizer
    plan: MemoryPlan
    scheduler_config: SchedulerConfig
    phase_seconds: dict[str, float]
    parallel: TensorParallel | None = None  # this rank's group under --tensor-parallel-size > 1

    @property
    def startup_seconds(self) -> float:
        return sum(self.phase_seconds.values())


class PhaseRecorder:
    """Emits the begin/end events of each phase with memory readings around it."""

    def __init__(self, bus: EventBus, device: torch.device, device_memory_gib: float | None, log: Any,
                 rank: int | None = None, pp_rank: int | None = None, tp_rank: int | None = None) -> None:
        self.bus = bus
        # under tensor or pipeline parallelism every event says whose phase it is (every rank runs A-G);
        # a pipeline stage's also say which stage and which rank within it; None: one rank
        self.rank = rank
        self.pp_rank = pp_rank
        self.tp_rank = tp_rank
        self.device = device
        self.device_memory_gib = device_memory_gib
        self.log = log
        self.seconds: dict[str, float] = {}

    def reading(self) -> MemoryReading:
        return read_memory(self.device, self.device_memory_gib)

    @contextmanager
    def phase(self, letter: str) -> Iterator[PhaseHandle]:
        name = PHASES[letter]
        before = self.reading().to_dict()
        self.bus.publish(StartupPhase(phase=letter, name=name, status="begin", memory_before=before, rank=self.rank,
                                      pp_rank=self.pp_rank, tp_rank=self.tp_rank))
        handle = PhaseHandle()
        start = time.perf_counter()
        try:
            yield handle
        except Exception as exc:
            duration = time.perf_counter() - start
            self.seconds[letter] = duration
            reason = str(exc) if isinstance(exc, UserError) else f"{type(exc).__name__}: {exc}"
            self.bus.publish(StartupPhase(phase=letter, name=name, status="failed", duration_s=duration,
                                          memory_before=before, memory_after=self.reading().to_dict(),
                                          data=handle.data(), reason=reason, fixes=recorded_fixes(exc),
                                          rank=self.rank, pp_rank=self.pp_rank, tp_rank=self.tp_rank))
            self.log.error(f"phase {letter} ({name}) failed", reason=reason)
            raise
        duration = time.perf_counter() - start
        self.seconds[letter] = duration
        status = "skipped" if handle.skipped else "end"
        self.bus.publish(StartupPhase(phase=letter, name=name, status=status, duration_s=duration,
                                      memory_before=before, memory_after=self.reading().to_dict(),
                                      data=handle.data(), reason=handle.skipped, rank=self.rank,
                                      pp_rank=self.pp_rank, tp_rank=self.tp_rank))
        self.log.info(f"phase {letter} {name} {'skipped' if handle.skipped else 'done'} in {duration:.2f} s",
                      **({"reason": handle.skipped} if handle.skipped else {}))


def _multi_rank(config: EngineConfig) -> bool:
    """Tensor or pipeline parallel: the ranks run one layout, so no rank-local kernel plan."""
    return config.tensor_parallel_size > 1 or (config.pipeline_parallel_size or 1) > 1


def _cpu_pool_capped(config: EngineConfig, device: torch.device) -> bool:
    """On CPU with neither ``--kv-cache-memory-bytes`` nor ``--device-memory``, phase E caps the
    pool at ``CPU_DEFAULT_KV_SPACE_GIB`` (vLLM's VLLM_CPU_KVCACHE_SPACE default), and phase B
    needs only the weights and that pool free."""
    return device.type == "cpu" and config.kv_cache_memory_bytes is None and config.device_memory_gib is None


def _plan_picks_auto_dtype(config: EngineConfig, model: ModelConfig, device: torch.device) -> bool:
    """``--dtype auto`` on one CPU rank with the kernel plan on and no family rule: float32
    activations, each projection's weights by the plan's measurement."""
    return (config.dtype == "auto" and device.type == "cpu" and model.family.cpu_dtype is None
            and not _multi_rank(config) and plan_enabled())


def resolve_dtype(config: EngineConfig, model: ModelConfig, device: torch.device,
                  caps: CpuCapabilities | None = None) -> DtypeChoice:
    """``--dtype`` as given, or for ``auto`` the fastest correct dtype here: on CPU by
    ISA (bf16 only where it is native, see engine/model/cpu_caps.py); on CUDA the
    checkpoint's half type."""
    if config.dtype != "auto":
        return DtypeChoice(config.dtype, "--dtype " + config.dtype)
    if device.type == "cpu" and model.family.cpu_dtype is not None:  # the family's own rule (the registry)
        return DtypeChoice(*model.family.cpu_dtype)
    if _plan_picks_auto_dtype(config, model, device):
        return DtypeChoice(AUTO_DTYPE, AUTO_DTYPE_REASON)
    if device.type == "cpu":
        return choose_cpu_dtype(caps or detect())
    half = model.dtype if model.dtype in ("bfloat16", "float16") else "bfloat16"
    return DtypeChoice(half, f"CUDA: the checkpoint's {model.dtype}" if half == model.dtype else "CUDA: bf16")


@dataclass(frozen=True, slots=True)
class ResolvedConfig:
    """The flags with every ``auto`` filled in, and why each choice was made."""

    config: EngineConfig
    dtype_reason: str
    quantization_reason: str
    batched_tokens_reason: str = "--max-num-batched-tokens"
    decode_step_tokens_reason: str = ""  # why --max-decode-step-tokens is what it is ("" = not set)
    dtype_auto: bool = False  # --dtype auto: the kernel plan may round weights to bf16/int8 where that wins
    kv_cache_dtype_reason: str = "--kv-cache-dtype"
    # The CPU default budget: vLLM-CPU's 2,048 or more, from the kernel plan stored at the time (a
    # later start's may differ), so phase D's stored profile holds up to BUDGET_MAX tokens.
    budget_from_plan: bool = False


# Why --kv-cache-dtype auto stores bf16 on a CPU with native bf16 under --dtype auto (phase A's log line).
CPU_BF16_KV_REASON = ("auto on a CPU with native bf16 under --dtype auto: K and V stored in bf16, half of float32's "
                      "bytes; decode attention reads the whole context every step and is bound by memory there "
                      "(Zen 4, 44 sequences of 600 tokens: 4.3 ms a layer over float32, 1.8 over bf16), and the pool "
                      "holds twice the tokens; --kv-cache-dtype float32 keeps float32")


def resolve_kv_cache_dtype(config: EngineConfig, device: torch.device, caps: CpuCapabilities | None,
                           dtype_auto_by_plan: bool) -> tuple[str, str]:
    """``--kv-cache-dtype`` as given, or for ``auto`` under the CPU kernel plan's ``--dtype auto``
    (float32 activations) bf16 where the CPU multiplies bf16 natively, as vLLM stores its bf16
    model's cache; else ``auto`` (the model dtype's storage)."""
    if config.kv_cache_dtype != "auto":
        return config.kv_cache_dtype, "--kv-cache-dtype " + config.kv_cache_dtype
    if device.type == "cpu" and dtype_auto_by_plan and (caps or detect()).native_bf16:
        return "bfloat16", CPU_BF16_KV_REASON
    return "auto", "auto: the model dtype's"


def resolve_config(config: EngineConfig, model: ModelConfig, device: torch.device,
                   caps: CpuCapabilities | None = None) -> ResolvedConfig:
    """A new config: ``config`` with every ``auto`` and device default filled in (one
    ``dataclasses.replace``; the caller's object is never changed), each choice made
    once with its reason. Raises UserError for flag values that no machine could run,
    before anything slow (the GGUF tensor table ``--quantization auto`` reads)."""
    dtype_choice = resolve_dtype(config, model, device, caps)
    max_model_len = model.max_position_embeddings if config.max_model_len is None else config.max_model_len
    if max_model_len > model.max_position_embeddings:
        raise UserError(f"--max-model-len {max_model_len:,} is beyond the model's maximum "
                        f"({model.max_position_embeddings:,} positions); lower it to "
                        f"{model.max_position_embeddings:,} or less")
    if not 0 < config.gpu_memory_utilization <= 1:
        raise UserError(f"--gpu-memory-utilization {config.gpu_memory_utilization}: must be in (0, 1]")
    check_shardable(model, config.tensor_parallel_size)
    if device.type == "cuda" and config.tensor_parallel_size > torch.cuda.device_count():
        raise UserError(f"--tensor-parallel-size {config.tensor_parallel_size}: one GPU per rank, and torch sees "
                        f"{torch.cuda.device_count()}; lower it or make more GPUs visible (CUDA_VISIBLE_DEVICES)")
    if config.tensor_parallel_size > 1 and config.compile:
        raise UserError("--compile with --tensor-parallel-size > 1: the compiled MLP block would hold the "
                        "all-reduce; drop --compile or run one rank")
    quantization, quantization_reason = resolve_quantization(config, model, device)
    batched, batched_reason = config.max_num_batched_tokens, "--max-num-batched-tokens"
    if device.type != "cpu" and batched == GPU_DEFAULT_MAX_NUM_BATCHED_TOKENS:
        batched_reason = "the GPU default (vLLM's)"
    decode_step = config.max_decode_step_tokens
    decode_reason = "--max-decode-step-tokens" if decode_step is not None else ""
    # before the budget: the stored plan is keyed by the cache dtype its prefill kernels read
    kv_cache_dtype, kv_reason = resolve_kv_cache_dtype(config, device, caps,
                                                       _plan_picks_auto_dtype(config, model, device))
    budget_from_plan = False  # the budget a stored kernel plan may change from one start to the next
    if device.type == "cpu" and batched == GPU_DEFAULT_MAX_NUM_BATCHED_TOKENS:  # flag left at its GPU default
        batched, batched_reason, derived = cpu_batch_budget(config, model, quantization, dtype_choice.dtype, caps,
                                                            config.dtype == "auto", kv_cache_dtype)
        budget_from_plan = derived
        if derived and decode_step is not None:
            if decode_step < batched:  # the flag bounds the steps with decodes, below the others'
                batched_reason += f"; a step with decodes takes at most --max-decode-step-tokens {decode_step:,}"
            else:  # more than the CPU default: every step's budget (the decode bound is then off, below)
                batched, batched_reason = decode_step, (f"--max-decode-step-tokens {decode_step:,}, above the CPU "
                                                        "default: every step's budget")
                budget_from_plan = False
    if decode_step is not None and decode_step >= batched:
        decode_step, decode_reason = None, ""  # no tighter than every step's budget: off
    backend = config.attention_backend
    if backend == "auto":
        backend = "triton" if device.type == "cuda" else "torch"
    resolved = dataclasses.replace(
        config, device=device.type, max_num_batched_tokens=batched, max_decode_step_tokens=decode_step,
        dtype=dtype_choice.dtype,
        max_model_len=max_model_len, attention_backend=backend, quantization=quantization,
        cuda_graph_sizes=list(config.cuda_graph_sizes), kv_cache_dtype=kv_cache_dtype,
    )
    return ResolvedConfig(resolved, dtype_choice.reason, quantization_reason, batched_reason, decode_reason,
                          config.dtype == "auto", kv_reason, budget_from_plan)


def kernel_plan_key(config: EngineConfig, model: ModelConfig, quantization: str | None, dtype: str,
                    caps: CpuCapabilities | None, dtype_auto: bool, kv_cache_dtype: str) -> str:
    """The stored kernel plan's key: the weights' content, their formats (quantization, the
    q4_1x8 layout), dtype (and whether it was auto), load format, KV cache dtype (which prefill
    kernels can read it), the CPU's kernel ISA and flags, torch, threads."""
    from engine.model.kernels import cpu_gemv

    return plan_key({
        "weights": profile_cache.weights_identity(model.path, _model_facts(model)), "quantization": quantization,
        "x8": cpu_gemv.int8_activations_enabled(), "dtype": dtype, "dtype_auto": dtype_auto, "load_format": config.load_format,
        "kv_cache_dtype": kv_cache_dtype,
        "cpu": (caps or detect()).kernel_key, "torch": torch.__version__, "threads": torch.get_num_threads(),
    })


def cpu_batch_budget(config: EngineConfig, model: ModelConfig, quantization: str | None, dtype: str,
                     caps: CpuCapabilities | None, dtype_auto: bool, kv_cache_dtype: str) -> tuple[int, str, bool]:
    """The CPU default token budget, why, and whether it is the kernel plan's: vLLM-CPU's
    ``CPU_PROMPT_STEP_TOKENS``, raised where the stored plan's prefill speed fits more in one step
    near ``STEP_TARGET_S``. The first start (no plan stored yet) runs the budget a later
    one does unless its plan measures a CPU that fast; without a plan, the fixed default."""
    fixed, floor = CPU_DEFAULT_MAX_NUM_BATCHED_TOKENS, CPU_PROMPT_STEP_TOKENS
    if _multi_rank(config) or not plan_enabled():
        return fixed, (f"the CPU default {fixed} (no kernel plan: {PLAN_ENV}=off, tensor or pipeline "
                       "parallel)"), False
    key = kernel_plan_key(config, model, quantization, dtype, caps, dtype_auto, kv_cache_dtype)
    plan = stored_for_start(key, model.name, (caps or detect()).isa)
    default = f"the CPU default {floor:,} (vLLM's CPU server default): steps composed as vLLM-CPU's, each faster"
    if plan is None:
        return floor, (f"{default}; no kernel plan stored for these weights on this CPU yet (this start measures one; "
                       "a plan only raises the budget, where its prefill speed fits more tokens in a step)"), True
    derived = derived_batch_budget(plan, model.num_layers)
    if derived is None:
        return floor, (f"{default}; the stored kernel plan has no prefill-sized timings (its measuring reached the "
                       f"time bound first; {PLAN_ENV}=measure measures again)"), True
    if derived[0] < floor:  # never fewer tokens a step than vLLM-CPU takes
        return floor, (f"{default}; the plan's one-second budget here would be {derived[0]:,}, and a tighter "
                       "bound slows more gaps between tokens (ITL p99) than it shortens"), True
    return (*derived, True)


def resolve_quantization(config: EngineConfig, model: ModelConfig, device: torch.device) -> tuple[str | None, str]:
    """``--quantization`` as given (``none``: float weights), or for ``auto``: on CPU the
    GGUF's own block format when the kernels read it as it is (a Q4_1 file decodes
    through its 4-bit blocks, as llama.cpp does: the same weights, a quarter of the
    bytes), else float weights."""
    if config.quantization in (None, "none"):
        return None, "--quantization none"
    if config.tensor_parallel_size > 1:
        if config.quantization != "auto":
            raise UserError(f"--quantization {config.quantization} with --tensor-parallel-size "
                            f"{config.tensor_parallel_size}: the GEMV kernels' 32-weight blocks are not sharded "
                            "yet; tensor parallelism runs float weights (--quantization none)")
        return None, (f"auto: --tensor-parallel-size {config.tensor_parallel_size} runs float weights "
                      "(the GEMV kernels' blocks are not sharded yet)")
    if config.quantization != "auto":
        return config.quantization, f"--quantization {config.quantization}"
    if device.type != "cpu":
        return None, "auto: the GEMV kernels are CPU kernels"
    from engine.model.loading.gguf_blocks import native_quantization

    method, reason = native_quantization(model, config.load_format)
    return method, f"auto: {reason}"


def _model_summary(model: ModelConfig, dtype: str, bytes_per_token: int) -> dict[str, Any]:
    summary = model.summary()
    summary["dtype"] = dtype
    summary["bytes_per_kv_token"] = bytes_per_token
    return summary


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


@dataclass(frozen=True, slots=True)
class StartupInputs:
    """What the phases start from: the resolved flags, the model, the device and its CPU facts."""

    resolution: ResolvedConfig
    model: ModelConfig
    device: torch.device
    caps: CpuCapabilities | None
    bytes_per_token: int
    log: Any
    # The hybrid KV cache's groups (engine/core/kv_cache_groups.py) from the model's
    # layer_types and sliding_window; () for one full-attention table (every Llama).
    kv_cache_groups: tuple[KVCacheGroup, ...] = ()
    # A pipeline stage's layers [start, end) (engine/pipeline.py); None: every layer
    stage_layers: tuple[int, int] | None = None

    @property
    def budget_model(self) -> ModelConfig:
        """The shapes this rank's budget holds: a pipeline stage's layers only."""
        return self.model if self.stage_layers is None else stage_model(self.model, self.stage_layers)

    @property
    def budget_groups(self) -> tuple[KVCacheGroup, ...]:
        """The KV cache groups of this rank's pool: a stage's groups hold its own layers."""
        if self.stage_layers is None or not self.kv_cache_groups:
            return self.kv_cache_groups
        return stage_kv_cache_groups(self.kv_cache_groups, self.stage_layers)

    @property
    def config(self) -> EngineConfig:
        """The resolved flags: no ``auto`` left (a new object, not the caller's)."""
        return self.resolution.config

    @property
    def max_model_len(self) -> int:
        assert self.config.max_model_len is not None  # resolve_config fills it
        return self.config.max_model_len


def prepare_startup(config: EngineConfig, log: Any, stage: Any = None) -> StartupInputs:
    """Before phase A: the device (and ``--num-threads``), the model's shapes, the resolved
    flags and the KV cache groups. Raises UserError for flags no machine could run.
    ``stage``: a pipeline stage's StageLayout (engine/pipeline.py)."""
    device = resolve_device(config.device)
    if stage is not None and device.type != "cpu":
        raise UserError(f"--pipeline-parallel-size {stage.stages} on {device.type}: the stages exchange activations "
                        "over gloo, on CPU tensors only (NCCL is not wired yet); run with --device cpu or one stage")
    ranks_here = stage.ranks_on_host if stage is not None else config.tensor_parallel_size
    if device.type == "cpu" and config.num_threads:
        torch.set_num_threads(config.num_threads)
    elif device.type == "cpu" and ranks_here > 1:
        # The ranks share the host's cores: N ranks of all-core thread pools would spin against each other.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks_here))
    model = load_model_config(config.model)
    check_model_supported(model, config)
    caps = detect() if device.type == "cpu" else None
    resolution = resolve_config(config, model, device, caps)
    resolved = resolution.config
    per_token = bytes_per_kv_token(model, resolved.kv_cache_dtype, resolved.tensor_parallel_size, resolved.dtype)
    groups = () if config.disable_hybrid_kv_cache_manager else model_kv_cache_groups(model)
    layers = stage.layers(model.num_layers) if stage is not None else None
    return StartupInputs(resolution, model, device, caps, per_token, log, groups, layers)


def model_kv_cache_groups(model: ModelConfig) -> tuple[KVCacheGroup, ...]:
    """The model's KV cache groups as vLLM groups them (one block table per group over one
    pool); () when every layer attends fully, so a Llama model keeps its one table."""
    try:
        groups = kv_cache_groups(model.layer_types, model.sliding_window, model.num_layers)
    except ValueError as exc:
        raise UserError(f"{model.name}: {exc}") from None
    return config_groups(groups)


def resolved_config_dict(s: StartupInputs) -> dict[str, Any]:
    """``engine.config``'s flags: the resolved EngineConfig, plus ``kv_cache_groups`` for a
    hybrid KV cache (what ``engine replay`` and the KV events read; absent otherwise, so
    full-attention recordings are what they were)."""
    flags = s.config.to_dict()
    if s.kv_cache_groups:
        flags["kv_cache_groups"] = groups_to_config(s.kv_cache_groups)
    return flags


def check_model_supported(model: ModelConfig, config: EngineConfig) -> None:
    """Refuse a GGUF kvscope cannot run from its header alone (architecture, tokenizer type,
    every tensor's ggml type: milliseconds), and flags the model's family cannot serve,
    before phase A: never 20 s into phase C."""
    from pathlib import Path

    from engine.modelspec.families import check_config_supported, check_gguf_supported

    if model.source == "gguf" and model.path and config.load_format in ("auto", "gguf") and Path(model.path).is_file():
        check_gguf_supported(Path(model.path))
    check_config_supported(model, config.tensor_parallel_size)


def start_engine(config: EngineConfig, bus: EventBus, progress: Callable[[int, int], None] | None = None,
                 rank: RankLayout | None = None, stage: Any = None) -> StartupResult:
    """Resolve the flags (``config`` itself is not changed), then run phases A–G.
    ``rank``: this process's place in a tensor-parallel replica (engine/workers.py
    starts the others); phase A joins the replica's group, B and E agree across ranks.
    ``stage``: this process's pipeline stage (engine/pipeline.py's StageLayout): phase A
    joins the stages (rank 0 hands them its flags), C keeps the stage's layers, B and E
    budget the stage's weights and KV pool and E takes the fewest blocks of any stage.
    Raises UserError (after a ``failed`` phase event) when the budget does not fit,
    with the numbers and the flags that would fix it; everything the flags alone
    decide is refused in phase B, before weights load. A model with sliding-window layers
    runs vLLM's hybrid KV cache (one block table per group) unless
    ``--disable-hybrid-kv-cache-manager`` (vLLM's flag) keeps every layer on one
    full-attention table."""
    log = get_logger("kvscope.startup")
    s = prepare_startup(config, log, stage)
    bus.publish(EngineConfigEvent(config=resolved_config_dict(s),
                                  model=_model_summary(s.model, s.config.dtype, s.bytes_per_token)))
    if stage is not None:
        phases = PhaseRecorder(bus, s.device, s.config.device_memory_gib, log, rank=stage.rank,
                               pp_rank=stage.pp_rank, tp_rank=stage.tp_rank)
    else:
        phases = PhaseRecorder(bus, s.device, s.config.device_memory_gib, log, rank=rank.rank if rank else None)
    eta = _eta_session(s, bus, lead=(rank is None or rank.rank == 0) and (stage is None or stage.rank == 0))
    try:
        result = _phases_a_to_g(config, s, phases, bus, progress, log, rank, stage)
        if eta is not None:
            eta.record(result.phase_seconds)
        return result
    finally:
        if eta is not None:
            eta.close()


def _eta_session(s: StartupInputs, bus: EventBus, lead: bool) -> startup_eta.EtaSession | None:
    """The lead rank's prediction of this start, published before phase A (engine/startup_eta.py)."""
    if not lead:
        return None
    key = startup_eta.start_key(s.config.to_dict(), s.model.path, s.model.name)
    return startup_eta.EtaSession(bus, s.log, key, startup_eta.model_bytes_of(s.model.path),
                                  startup_eta.history_path()).open()


def _phases_a_to_g(config: EngineConfig, s: StartupInputs, phases: PhaseRecorder, bus: EventBus,
                   progress: Callable[[int, int], None] | None, log: Any, rank: RankLayout | None,
                   stage: Any) -> StartupResult:
    """Phases A-G of :func:`start_engine`."""
    parallel: TensorParallel | None = None
    with phases.phase("A") as a:
        if rank is not None:
            parallel = TensorParallel.join(rank, s.device)
        if stage is not None:
            if not torch.distributed.is_initialized():  # rank 0 (a stage process joined first)
                stage.join(config)
            parallel = stage.tensor_parallel(s.device)  # T x P: this stage's ranks
        reading = phases.reading()
        kernels = _phase_init(a, s, reading)
    try:
        return _phases_b_to_g(s, phases, reading, kernels, parallel, bus, progress, log, stage)
    except BaseException:
        if kernels is not None:
            kernels.settle()
        raise


def _phases_b_to_g(s: StartupInputs, phases: PhaseRecorder, reading: MemoryReading, kernels: KernelBuilds | None,
                   parallel: TensorParallel | None, bus: EventBus, progress: Callable[[int, int], None] | None,
                   log: Any, stage: Any = None) -> StartupResult:
    """Phases B-G of :func:`start_engine` (A has started the kernel builds it settles on failure)."""
    with phases.phase("B") as b:
        if parallel is not None:  # the replica has what its emptiest rank has
            reading = dataclasses.replace(reading, free=replica_free_bytes(parallel.all_gather(reading.free)))
        _phase_budget(b, s, reading)
    with phases.phase("C") as c:
        runner, tokenizer, info = _phase_load_weights(c, s, _progress_events(bus, "C", "weights", "tensors", progress),
                                                      parallel)
    with phases.phase("D") as d:
        bus.publish(StartupProgress(phase="D", what="profile run", done=0, total=1, unit="steps"))
        profile = _profile_run(runner, s.config, s.model, s.device, log,
                               shared=parallel is not None or stage is not None,
                               cover=BUDGET_MAX if s.resolution.budget_from_plan else None)
        bus.publish(StartupProgress(phase="D", what="profile run", done=1, total=1, unit="steps"))
        d.record = ProfileRunData(
            activation_peak_bytes=profile.activation_peak_bytes, non_torch_bytes=profile.non_torch_bytes,
            method=profile.method, max_num_batched_tokens=s.config.max_num_batched_tokens,
            max_num_seqs=s.config.max_num_seqs, estimated=(), forward_s=profile.forward_s,
            sample_s=profile.sample_s, cached=profile.cached, measured_at=profile.measured_at,
            profiled_tokens=profile.profiled_tokens or (s.config.max_num_batched_tokens,))
    with phases.phase("E") as e:
        plan = _phase_kv_cache(e, s, reading, info.weights_bytes, profile, runner, parallel, stage)
    with phases.phase("F") as f:
        if s.device.type == "cuda":
            _cuda_phase_f(f, s, runner)
        else:
            _cpu_phase_f(f, s, runner, kernels, bus)
    with phases.phase("G") as g:
        g.record = ReadyData(startup_seconds=sum(phases.seconds.values()), pid=os.getpid())
    restore_collections()  # the objects startup made are made: collect at the usual rate again
    scheduler_config = SchedulerConfig.from_flags(resolved_config_dict(s), num_blocks=plan.num_blocks,
                                                  max_model_len=s.max_model_len)
    return StartupResult(s.config, s.model, s.device, runner, tokenizer, plan, scheduler_config,
                         dict(phases.seconds), parallel)


def _phase_init(a: PhaseHandle, s: StartupInputs, reading: MemoryReading) -> KernelBuilds | None:
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


def _phase_budget(b: PhaseHandle, s: StartupInputs, reading: MemoryReading) -> None:
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
    if _cpu_pool_capped(config, device) and capped_need <= reading.free < requested:
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


def _phase_load_weights(c: PhaseHandle, s: StartupInputs, progress: Callable[[int, int], None] | None,
                        parallel: TensorParallel | None = None) -> tuple[ModelRunner, Tokenizer, LoadInfo]:
    """Phase C: build the runner (this rank's slice under tensor parallelism), load the weights and the tokenizer."""
    config, model, log = s.config, s.model, s.log
    runner = ModelRunner(model, dtype=config.dtype, block_size=config.block_size, device=str(s.device),
                         attention_backend=config.attention_backend, load_format=config.load_format,
                         seed=config.seed, quantization=config.quantization,
                         kv_cache_dtype=config.kv_cache_dtype, parallel=parallel,
                         kv_cache_groups=s.kv_cache_groups)
    info = runner.load_weights(progress)
    if s.stage_layers is not None:  # a pipeline stage keeps its layers (engine/pipeline.py)
        from engine.pipeline import carve_stage

        carve_stage(runner, s.stage_layers)
        info.weights_bytes = runner.model.weights_bytes()
    plan_bytes, dropped = None, 0
    if s.device.type == "cpu" and parallel is None and not _multi_rank(config) and plan_enabled():
        # measured (or read back) here, not in phase F: phase D profiles, and phase E sizes, what it runs
        before = runner.model.weights_bytes()
        key = kernel_plan_key(config, model, config.quantization, config.dtype, s.caps, s.resolution.dtype_auto,
                              config.kv_cache_dtype)
        runner.resolve_kernel_plan(key, s.caps or detect(), log, approximate=s.resolution.dtype_auto)
        info.weights_bytes = runner.model.weights_bytes()
        # float weights no step multiplies by under the plan are not kept (engine/model/families/llama.py)
        dropped = getattr(runner.model, "dropped_float_bytes", lambda: 0)()
        plan_bytes = info.weights_bytes - before + dropped
    tokenizer = _tokenizer_for(model) if config.load_format != "dummy" else _dummy_tokenizer(model)
    quantization_reason = s.resolution.quantization_reason
    c.record = LoadWeightsData(weights_bytes=info.weights_bytes, load_seconds=info.load_seconds,
                               load_format=info.load_format, source=info.source, num_tensors=info.num_tensors,
                               weights_cache=info.cache, quantization=config.quantization,
                               quantization_reason=quantization_reason, file_tensor_bytes=info.file_tensor_bytes,
                               block_bytes=info.block_bytes)
    if plan_bytes is not None:
        c.record = dataclasses.replace(c.record, kernel_plan_bytes=plan_bytes, kernel_plan_dropped_bytes=dropped)
        if dropped:
            log.info(f"kernel plan: {dropped / GiB:.4f} GiB of float weights dropped (every step size runs their "
                     "GGUF blocks or a bf16/int8 copy)")
    log.info(f"Model loading took {info.weights_bytes / GiB:.4f} GiB and {info.load_seconds:.2f} seconds"
             + (f" (weights cache {info.cache})" if info.cache not in ("none", "mapped") else ""))
    if info.file_tensor_bytes:
        log.info(f"weights read as the GGUF's blocks, mapped: {(info.block_bytes or 0) / GiB:.4f} GiB of blocks for "
                 f"{info.file_tensor_bytes / GiB:.4f} GiB of tensors in the file"
                 + (f"; the kernel plan's float copies {plan_bytes / GiB:.4f} GiB" if plan_bytes else ""))
    log.info(f"quantization {config.quantization or 'none'} ({quantization_reason})")
    return runner, tokenizer, info


SLIDING_LAYER = "sliding_attention"  # transformers' layer type (ModelConfig.layer_types)


def _phase_kv_cache(e: PhaseHandle, s: StartupInputs, reading: MemoryReading, weights: int,
                    profile: profile_cache.ProfileResult, runner: ModelRunner,
                    parallel: TensorParallel | None = None, stage: Any = None) -> MemoryPlan:
    """Phase E: the pool from the budget formula (on CPU capped at the default unless
    sized by a flag), refused when it cannot hold one request, then allocated. A pipeline
    stage's pool holds its own layers (its bytes per token, its groups' pages) and every
    stage takes the fewest blocks of any (vLLM's minimum ``num_gpu_blocks``)."""
    config, device, log = s.config, s.device, s.log
    kv_bytes = config.kv_cache_memory_bytes
    capped = False
    plan_kwargs: dict[str, Any] = dict(
        model=s.budget_model, total_bytes=reading.total, gpu_memory_utilization=config.gpu_memory_utilization,
        max_model_len=s.max_model_len, block_size=config.block_size,
        kv_cache_dtype=config.kv_cache_dtype, dtype=config.dtype, tensor_parallel_size=config.tensor_parallel_size,
        weights=weights, activation_peak=profile.activation_peak_bytes,
        non_torch=profile.non_torch_bytes, max_num_batched_tokens=config.max_num_batched_tokens,
        max_num_seqs=config.max_num_seqs,
    )
    # A model with sliding layers: the hybrid layout when the runner's groups name several
    # tables (ModelRunner.kv_cache_groups, () for one full-attention group: under
    # --disable-hybrid-kv-cache-manager every layer holds full attention's blocks and the event says so).
    runner_groups = tuple(getattr(runner, "kv_cache_groups", None) or ())
    runs_hybrid = bool(runner_groups)
    plan_kwargs["disable_hybrid_kv_cache_manager"] = not runs_hybrid
    plan_kwargs["kv_cache_groups"] = runner_groups if runs_hybrid else None
    plan = plan_memory(kv_cache_memory_bytes=kv_bytes, check_fits=False, **plan_kwargs)
    if _cpu_pool_capped(config, device) and plan.kv_pool_bytes > CPU_DEFAULT_KV_SPACE_GIB * GiB:
        plan = plan_memory(kv_cache_memory_bytes=int(CPU_DEFAULT_KV_SPACE_GIB * GiB), check_fits=False,
                           **plan_kwargs)
        capped = True
    group = stage if stage is not None else parallel  # every stage's every rank under pipeline parallelism
    if group is not None:
        # One block table serves every rank: each pool holds the blocks of the rank with the fewest.
        fewest = min(group.all_gather(plan.num_blocks))
        if fewest < plan.num_blocks:
            plan = plan_memory(kv_cache_memory_bytes=fewest * plan.block_bytes, check_fits=False, **plan_kwargs)
    e.record = dataclasses.replace(plan.kv_cache_data(), cpu_default_cap=capped)
    if device.type == "cpu":
        e.record = dataclasses.replace(e.record, max_num_batched_tokens=config.max_num_batched_tokens,
                                       max_num_batched_tokens_reason=s.resolution.batched_tokens_reason)
        log.info(f"--max-num-batched-tokens {config.max_num_batched_tokens:,} ({s.resolution.batched_tokens_reason})")
    if config.max_decode_step_tokens is not None:
        e.record = dataclasses.replace(e.record, max_decode_step_tokens=config.max_decode_step_tokens,
                                       max_decode_step_tokens_reason=s.resolution.decode_step_tokens_reason)
        log.info(f"--max-decode-step-tokens {config.max_decode_step_tokens:,} "
                 f"({s.resolution.decode_step_tokens_reason})")
    if s.model.layer_types and SLIDING_LAYER in s.model.layer_types:
        # the same pool under the other layout: phase E's event names both, and which the engine used
        other = plan_memory(**{**plan_kwargs, "disable_hybrid_kv_cache_manager": runs_hybrid},
                            kv_cache_memory_bytes=plan.kv_pool_bytes, check_fits=False)
        e.record = dataclasses.replace(e.record, kv_cache_layout=plan.kv_cache_layout,
                                       other_layout=other.layout_summary())
        if not plan.is_hybrid:
            log.info(f"{s.model.name} has sliding-window layers; this engine keeps every layer's KV in one "
                     f"full-attention table: vLLM's hybrid layout would hold {other.kv_cache_tokens:,} tokens, "
                     f"{other.max_concurrency:.2f}x concurrency, in the same pool")
    check_plan_fits(plan)
    runner.allocate_kv_cache(plan.num_blocks)
    word = device_word(device)
    if capped:
        log.info(f"CPU KV pool capped at the default {CPU_DEFAULT_KV_SPACE_GIB:g} GiB "
                 "(give --device-memory or --kv-cache-memory-bytes to size it)")
    log.info(f"{word} KV cache pool: {plan.kv_pool_bytes / GiB:.2f} GiB, {plan.num_blocks:,} blocks of "
             f"{plan.block_size}")
    log.info(kv_cache_size_line(word, plan.kv_cache_tokens))
    log.info(max_concurrency_line(plan.max_model_len, plan.max_concurrency))
    return plan


def _cuda_phase_f(f: PhaseHandle, s: StartupInputs, runner: ModelRunner) -> None:
    """CUDA phase F: capture the decode graphs (or say why not)."""
    config = s.config
    reason = graphs_supported(s.device, config.enforce_eager)
    if reason is None and runner.hybrid_kv_cache:
        reason = "the hybrid KV cache's per-group block tables are not captured in the decode graphs yet"
    if reason is None and getattr(runner.model, "expert_counter", None) is not None:
        # the grouped experts slice by each step's per-expert counts, read on the host (engine/model/layers/moe.py)
        reason = "a mixture-of-experts model's grouped experts size their matmuls per step: not capturable"
    if reason is not None:
        f.skipped = reason
        return
    graphs = DecodeGraphs(runner.model, runner.kv_caches, config.block_size, s.max_model_len, s.device)
    sizes = [size for size in config.cuda_graph_sizes if size <= config.max_num_seqs]
    report = graphs.capture(sizes)
    runner.decode_graphs = graphs
    f.record = GraphsCompileData(cuda_graph_bytes=report.graph_bytes, batch_sizes=tuple(report.batch_sizes),
                                 capture_seconds=report.seconds)
    s.log.info(f"Graph capturing finished in {report.seconds:.0f} secs, took {report.graph_bytes / GiB:.2f} GiB")


def _model_facts(model: ModelConfig) -> dict[str, Any]:
    """The model's fields for the profile key; the family fields only when set, so a Llama
    model's key (and its stored profile) is what it was before they existed."""
    return {k: v for k, v in asdict(model).items() if k not in ModelConfig.FAMILY_FIELDS or v is not None}


def _profile_key(config: EngineConfig, model: ModelConfig, groups: tuple[KVCacheGroup, ...] = (),
                 points: profile_parts.Points | None = None) -> str:
    # the hybrid layout only when there is one, so a full-attention model's key is what it was;
    # measured in parts, the step sizes profiled instead of the budget (the line holds at any)
    layout = {"kv_cache_groups": groups_to_config(groups)} if groups else {}
    step = {"max_num_batched_tokens": config.max_num_batched_tokens} if points is None else {"profile_points": points}
    return profile_cache.profile_key({**layout, **step,
        "weights": profile_cache.weights_identity(model.path, _model_facts(model)), "dtype": config.dtype,
        "quantization": config.quantization, "kv_cache_dtype": config.kv_cache_dtype,
        "attention_backend": config.attention_backend, "block_size": config.block_size,
        "load_format": config.load_format,
        "max_num_seqs": config.max_num_seqs, "threads": torch.get_num_threads(), "torch": torch.__version__,
        "isa": torch.backends.cpu.get_cpu_capability(),
    })


def _profile_run(runner: ModelRunner, config: EngineConfig, model: ModelConfig, device: torch.device,
                 log: Any, shared: bool = False, cover: int | None = None) -> profile_cache.ProfileResult:
    """Phase D's measurement: on CPU the worst-case step's peak measured in parts, as a function of
    its tokens that holds up to ``cover`` (engine/model/memory/profile_parts.py), or its stored result
    (engine/model/memory/profile_cache.py) evaluated at this budget; else the whole step under the peak
    tracker. ``shared`` (tensor or pipeline parallelism): the forward is collective, so every rank
    measures the whole step (one rank reusing a stored result would leave the others waiting)."""
    tokens, seqs = config.max_num_batched_tokens, config.max_num_seqs
    local = device.type == "cpu" and not shared
    points = profile_parts.forward_points(tokens, seqs, cover) if local and profile_parts.applies(runner) else None
    key = _profile_key(config, model, runner.kv_cache_groups, points) if local else None
    stored = profile_cache.load(key) if key is not None else None
    if stored is not None:
        stored = stored.at_tokens(tokens)
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(stored.measured_at))
        log.info(f"profile run: reused the measurement of {when} for these weights, flags and sources: "
                 f"activation peak {stored.activation_peak_bytes / GiB:.3f} GiB at {tokens:,} tokens, "
                 f"non-torch {stored.non_torch_bytes / GiB:.3f} GiB ({profile_cache.PROFILE_CACHE_ENV}=0 measures again)")
        return stored
    if points is not None:
        log.info(f"profile run in parts: the forward at {points[0][0]:,} and {points[1][0]:,} tokens, the LM head "
                 f"over {seqs} rows, the sampler on a few rows, scaled to a {tokens:,}-token step")
        result = profile_parts.profile(runner, points, tokens, seqs)
    else:
        log.info(f"profile run: one forward of {tokens:,} tokens over {min(seqs, tokens)} sequences (the "
                 f"worst-case step) and a sampler pass over {seqs} rows")
        timings, peak = measure_peak(device, lambda: runner.profile_run(tokens, seqs))
        result = profile_cache.ProfileResult(peak.activation_peak_bytes, peak.non_torch_bytes, peak.method,
                                             timings.forward_s, timings.sample_s, time.time(), tokens=tokens)
    log.info(f"profile run: {tokens} tokens over {seqs} sequences; activation peak "
             f"{result.activation_peak_bytes / GiB:.3f} GiB, non-torch {result.non_torch_bytes / GiB:.3f} GiB "
             f"({result.method}); forward {result.forward_s:.2f} s, sampler {result.sample_s:.2f} s")
    if key is not None:
        profile_cache.store(key, result)
    return result


def _progress_events(bus: EventBus, phase: str, what: str, unit: str,
                     chained: Callable[[int, int], None] | None = None) -> Callable[[int, int], None]:
    """A (done, total) callback that publishes ``startup.progress`` at most every 2 % (and
    at the end), and calls ``chained`` too."""
    last = [-1.0]

    def report(done: int, total: int) -> None:
        if chained is not None:
            chained(done, total)
        if done >= total or total <= 0 or (done - last[0]) / total >= 0.02:
            last[0] = done
            bus.publish(StartupProgress(phase=phase, what=what, done=done, total=total or None, unit=unit))

    return report


def _cpu_phase_f(f: PhaseHandle, s: StartupInputs, runner: ModelRunner, kernels: KernelBuilds | None,
                 bus: EventBus) -> None:
    """CPU phase F: join the kernel builds started in phase A, route decode
    attention through the kernel, ``--compile`` if asked, then warm every step
    shape class the runner uses so the first real step runs at speed."""
    config, log = s.config, s.log
    building = kernels is not None and not kernels.done()
    if building:
        bus.publish(StartupProgress(phase="F", what="kernel builds", done=0, total=1, unit="waits"))
    waited = kernels.join() if kernels is not None else 0.0
    if building:
        bus.publish(StartupProgress(phase="F", what="kernel builds", done=1, total=1, unit="waits"))
    reports = kernels.reports() if kernels is not None else []
    unavailable = runner.enable_cpu_decode_kernel()
    f.record = GraphsCompileData(cpu_decode_kernel=unavailable or "enabled", kernel_seconds=waited,
                                 kernels=tuple(r.to_dict() for r in reports))
    for r in reports:
        log.info(f"CPU kernel {r.name}: {r.status} ({r.seconds:.2f} s"
                 + (f", waited {r.waited_s:.1f} s for another builder" if r.waited_s > 0.5 else "")
                 + (f"; {r.reason}" if r.reason else "") + ")")
    log.info(f"CPU paged-decode kernel: {unavailable or 'enabled'} (phase F waited {waited:.2f} s for builds)")
    layers = runner.model.fused_decode_status(runner.kv_cache_dtype)
    f.record = dataclasses.replace(f.record, cpu_decode_layers=layers)
    plan = runner.kernel_plan
    if plan is not None:
        f.record = dataclasses.replace(f.record, kernel_plan=plan.to_json())
        for line in plan.table_lines():
            log.info(line)
    else:
        log.info(f"kernel plan off ({PLAN_ENV}=off, tensor parallel or not on CPU): the fallback "
                 "constants (GEMV_MAX_ROWS) route the projections")
    log.info(f"CPU fused decode layers: {layers}")
    report = getattr(runner.model, "precision_report", None)  # the Llama family's (MoE and TP ranks included)
    if report is not None:
        precision = report(runner.kv_cache_dtype)
        f.record = dataclasses.replace(f.record, precision=precision)
        log.info("precision: " + "; ".join(f"{part} {how}" for part, how in precision.items()))
    if config.compile:
        start = time.perf_counter()
        runner.compile()
        compile_seconds = time.perf_counter() - start
        f.record = dataclasses.replace(f.record, compile_seconds=compile_seconds)
        log.info(f"torch.compile of the decode step took {compile_seconds:.2f} s")
    warm = runner.warm_up(config.max_num_seqs, _progress_events(bus, "F", "warm-up", "step shapes"))
    f.record = dataclasses.replace(f.record, warmup_seconds=warm)
    log.info(f"warmed decode and mixed step shapes in {warm:.2f} s")


def _tokenizer_for(model: ModelConfig) -> Tokenizer:
    """A GGUF file's tokenizer comes from the startup cache (building its BPE takes seconds)."""
    from pathlib import Path

    from engine.model.loading.startup_cache import cached_tokenizer
    from engine.modelspec.readers import resolve_model_file

    location = Path(model.path) if model.path else resolve_model_file(model.name)
    if location is not None and location.is_file():
        return cached_tokenizer(location)
    return Tokenizer.for_model(model)


def _dummy_tokenizer(model: ModelConfig) -> Tokenizer:
    """Dummy weights of a preset have no tokenizer file: use the bundled one
    when the vocabulary fits, so text in/out still works for benchmarks."""
    from engine.modelspec.presets import BUNDLED_MODEL_NAME

    bundled = load_model_config(BUNDLED_MODEL_NAME)
    return _tokenizer_for(bundled)
