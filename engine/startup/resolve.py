"""Before phase A: the flags with every ``auto`` and device default filled in, each choice with its
reason (dtype, KV cache dtype, quantization, the CPU token budget from the stored kernel plan)."""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from typing import Any

import torch

from engine.config import EngineConfig
from engine.errors import UserError
from engine.model.cpu_caps import CpuCapabilities, DtypeChoice, choose_cpu_dtype, detect
from engine.model.memory import profile_cache
from engine.model.parallel import check_shardable
from engine.model.plan.resolve import stored_for_start
from engine.model.plan.setting import AUTO_DTYPE, AUTO_DTYPE_REASON, PLAN_ENV, plan_enabled
from engine.model.plan.store import plan_key
from engine.model.plan.token_budget import derived_batch_budget
from engine.modelspec.config import ModelConfig

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


def multi_rank(config: EngineConfig) -> bool:
    """Tensor or pipeline parallel: the ranks run one layout, so no rank-local kernel plan."""
    return config.tensor_parallel_size > 1 or (config.pipeline_parallel_size or 1) > 1


def _plan_picks_auto_dtype(config: EngineConfig, model: ModelConfig, device: torch.device) -> bool:
    """``--dtype auto`` on one CPU rank with the kernel plan on and no family rule: float32
    activations, each projection's weights by the plan's measurement."""
    return (config.dtype == "auto" and device.type == "cpu" and model.family.cpu_dtype is None
            and not multi_rank(config) and plan_enabled())


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
        "weights": profile_cache.weights_identity(model.path, model_facts(model)), "quantization": quantization,
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
    if multi_rank(config) or not plan_enabled():
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


def model_facts(model: ModelConfig) -> dict[str, Any]:
    """The model's fields for the profile key; the family fields only when set, so a Llama
    model's key (and its stored profile) is what it was before they existed."""
    return {k: v for k, v in asdict(model).items() if k not in ModelConfig.FAMILY_FIELDS or v is not None}
