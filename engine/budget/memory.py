"""The memory budget: one formula, one place (docs/architecture.md).

    bytes per KV token = 2 (K and V) x layers x (KV heads / TP) x (head dim x KV dtype bytes
                         + scale bytes: 4 for int8's per-(token, head) fp32 scale, else 0)
    requested          = total x --gpu-memory-utilization
    KV pool            = requested - weights - activation peak - non-torch
                         (or --kv-cache-memory-bytes, which overrides it)
    blocks             = pool // (block size x bytes per token)
    tokens             = blocks x block size
    max concurrency    = tokens / max-model-len

A model with sliding-window layers (Gemma 2/3) gets vLLM V1's hybrid layout
(``kv_cache_utils.get_kv_cache_config_from_groups`` / ``_report_kv_cache_config`` /
``get_max_concurrency_for_kv_cache_config``) unless ``disable_hybrid_kv_cache_manager``
(vLLM's flag; kvscope's runner until it reads per-group tables) makes every layer full:

    groups             = vLLM's uniform-page-size grouping (engine/core/kv_cache_groups.py),
                         G = the largest group's layer count
    page               = block size x one layer's bytes per token
    blocks             = pool // page // G          (a block id: one page in each of G tensors)
    tokens             = blocks // number of groups x block size
    blocks per request = sum over groups: ceil(max-model-len / block size) for full attention,
                         ceil(min(W - 1 + max-num-batched-tokens, max-model-len) / block size) + 1
                         for a window W
    max concurrency    = blocks / blocks per request

One group of full attention is the first formula exactly.

A vision-language model (engine/budget/vision.py) adds its vision weights to the
weights and its encoder to the activation peak (``max(encoder activations,
encoder cache + LLM activations)``, or the LLM's alone with ``--skip-mm-profiling``);
the formula itself does not change.

The engine's startup calls :func:`plan_memory` with measured inputs; ``engine
plan`` and ``logparse`` call it with given or estimated ones. GiB is 2**30, as
vLLM prints.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from engine.budget.fixes import BudgetRefused, Fix
from engine.budget.vision import MultimodalBudget
from engine.core.kv_cache_groups import KVCacheGroup, is_hybrid, kv_cache_groups
from engine.errors import UserError
from engine.events.ledger import BY_NAME as LEDGER_ITEM
from engine.events.phase_data import BudgetData, KvCacheData, LoadWeightsData, PhaseData, ProfileRunData
from engine.modelspec.config import (
    DTYPE_BYTES,
    GiB,
    KiB,
    MiB,
    ModelConfig,
)
from engine.modelspec.kv_cache_dtypes import KV_CACHE_DTYPES, check_kv_cache_dtype, resolve_kv_cache_dtype

# The ledger quantities ``engine plan --json`` reports, in its order (under their report keys).
PLAN_JSON_LEDGER = ("total_bytes", "gpu_memory_utilization", "requested_bytes", "weights_bytes", "activation_peak_bytes",
                    "non_torch_bytes", "kv_pool_bytes", "num_blocks", "block_size", "kv_cache_tokens", "max_model_len",
                    "max_concurrency", "bytes_per_token")

@dataclass(frozen=True, slots=True)
class GpuPreset:
    name: str
    total_gib: float  # as torch.cuda.mem_get_info reports it
    bandwidth_tbs: float  # peak memory bandwidth, TB/s (10^12 bytes/s)
    bf16_tflops: float  # dense BF16 tensor-core peak, TFLOP/s
    description: str = ""


GPU_PRESETS: dict[str, GpuPreset] = {
    p.name: p
    for p in (
        GpuPreset("h100-80gb", 79.22, 3.35, 989.0, "NVIDIA H100 SXM 80 GB"),  # as vLLM logs it: total_gpu_memory (79.22GiB)
        GpuPreset("h200", 139.8, 4.8, 989.0, "NVIDIA H200 141 GB"),
        GpuPreset("a100-80gb", 79.2, 2.039, 312.0, "NVIDIA A100 SXM 80 GB"),
        GpuPreset("a100-40gb", 39.4, 1.555, 312.0, "NVIDIA A100 40 GB"),
        GpuPreset("l40s", 44.4, 0.864, 362.0, "NVIDIA L40S 48 GB"),
        GpuPreset("l4", 22.0, 0.300, 121.0, "NVIDIA L4 24 GB"),
        GpuPreset("rtx-4090", 23.6, 1.008, 165.0, "NVIDIA GeForce RTX 4090 24 GB"),
        GpuPreset("rtx-3090", 23.6, 0.936, 71.0, "NVIDIA GeForce RTX 3090 24 GB"),
    )
}
GPU_ALIASES = {"h100": "h100-80gb", "h100-sxm": "h100-80gb", "a100": "a100-80gb", "4090": "rtx-4090", "3090": "rtx-3090"}


def gpu_preset(name: str) -> GpuPreset:
    key = name.strip().lower()
    key = GPU_ALIASES.get(key, key)
    if key not in GPU_PRESETS:
        raise UserError(f"--gpu {name!r}: unknown GPU preset; use one of {', '.join(GPU_PRESETS)} or --gpu-memory GiB")
    return GPU_PRESETS[key]


def parse_kv_cache_dtype(value: str, flag: str = "--kv-cache-dtype") -> str:
    """The lower-cased name, or a UserError naming the valid choices (engine/modelspec/kv_cache_dtypes.py)."""
    return check_kv_cache_dtype(value, flag)


def kv_dtype_bytes(kv_cache_dtype: str, model_dtype: str) -> float:
    """Bytes per stored K/V element (``auto`` = the model dtype's), without scales."""
    return resolve_kv_cache_dtype(kv_cache_dtype, model_dtype).element_bytes


def kv_scale_bytes(kv_cache_dtype: str) -> int:
    """Scale bytes stored per (token, KV head) for each of K and V."""
    key = check_kv_cache_dtype(kv_cache_dtype)
    return 0 if key == "auto" else KV_CACHE_DTYPES[key].scale_bytes


def bytes_per_kv_token(model: ModelConfig, kv_cache_dtype: str = "auto", tensor_parallel_size: int = 1,
                       model_dtype: str | None = None) -> int:
    """Exactly what the allocation holds per token (elements and, for int8, scales),
    so the plan's token count and the real cache agree."""
    if tensor_parallel_size < 1:
        raise UserError(f"--tensor-parallel-size {tensor_parallel_size}: must be at least 1")
    kv_heads_per_rank = max(1, model.num_kv_heads // tensor_parallel_size)
    per_row = model.head_dim * kv_dtype_bytes(kv_cache_dtype, model_dtype or model.dtype)
    per = 2 * model.num_layers * kv_heads_per_rank * (per_row + kv_scale_bytes(kv_cache_dtype))
    return int(per)


def bytes_per_kv_token_per_layer(model: ModelConfig, kv_cache_dtype: str = "auto", tensor_parallel_size: int = 1,
                                  model_dtype: str | None = None) -> int:
    """One layer's K and V per token on one rank (vLLM's ``page_size_bytes / block_size``)."""
    return bytes_per_kv_token(replace(model, num_layers=1, layer_types=None), kv_cache_dtype, tensor_parallel_size,
                              model_dtype)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def blocks_per_request(sliding_window: int | None, max_model_len: int, block_size: int,
                       max_num_batched_tokens: int) -> int:
    """The most blocks one ``max_model_len`` request holds in a group of this spec (vLLM's
    ``max_memory_usage_bytes`` / page): every block for full attention; for a window W the
    last W - 1 tokens plus the largest chunk, capped at the request, and one more block for a
    window that does not start on a block boundary."""
    if sliding_window is None:
        return _cdiv(max_model_len, block_size)
    tokens = min(sliding_window - 1 + max_num_batched_tokens, max_model_len)
    return _cdiv(tokens, block_size) + 1


@dataclass(frozen=True, slots=True)
class KvGroupBudget:
    """One KV cache group of a hybrid pool: its spec, its layers, what its layers hold per
    token, and the blocks one ``max_model_len`` request holds in it at most."""

    kind: str  # full_attention | sliding_window (vLLM's kv_cache_spec_kind)
    sliding_window: int | None
    layers: tuple[int, ...]
    bytes_per_token: int  # K and V of this group's layers per token (padding layers hold none)
    blocks_per_request: int

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "sliding_window": self.sliding_window, "layers": list(self.layers),
                "num_layers": len(self.layers), "bytes_per_token": self.bytes_per_token,
                "blocks_per_request": self.blocks_per_request}


def weights_bytes(model: ModelConfig, dtype: str | None = None, tensor_parallel_size: int = 1) -> int:
    per_param = DTYPE_BYTES[(dtype or model.dtype).lower()]
    return int(model.num_parameters * per_param / tensor_parallel_size)


def estimate_activation_peak_bytes(model: ModelConfig, max_num_batched_tokens: int, max_num_seqs: int,
                                   dtype: str | None = None, tensor_parallel_size: int = 1) -> int:
    """A shape-based guess at phase D's spike (background part 3.1), used only
    where nothing was measured: the larger of the forward's live tensors
    (a few hidden-state copies plus the gate/up intermediate) and the sampler's
    fp32 logits with temporaries."""
    b = DTYPE_BYTES[(dtype or model.dtype).lower()]
    tokens = max_num_batched_tokens
    hidden = 4 * tokens * model.hidden_size * b
    mlp = 3 * tokens * (model.intermediate_size / tensor_parallel_size) * b
    qkv = tokens * (model.num_attention_heads + 2 * model.num_kv_heads) * model.head_dim * b / tensor_parallel_size
    forward = hidden + mlp + qkv
    sampler = 3 * max_num_seqs * model.vocab_size * 4
    return int(max(forward, sampler))


def estimate_non_torch_bytes(tensor_parallel_size: int = 1) -> int:
    """CUDA context leftovers, cuBLAS/attention workspaces, NCCL when TP > 1."""
    return int((0.3 if tensor_parallel_size == 1 else 0.7) * GiB)


@dataclass(slots=True)
class MemoryPlan:
    total_bytes: int
    gpu_memory_utilization: float
    requested_bytes: int
    weights_bytes: int
    activation_peak_bytes: int
    non_torch_bytes: int
    kv_pool_bytes: int
    bytes_per_token: int
    block_size: int
    num_blocks: int
    kv_cache_tokens: int
    max_model_len: int
    max_concurrency: float
    kv_pool_overridden: bool = False
    estimated: list[str] = field(default_factory=list)  # which inputs were estimated
    cuda_graph_bytes: int = 0
    multimodal: MultimodalBudget | None = None  # a vision-language model's encoder budget
    llm_activation_peak_bytes: int = 0  # the text step's share of activation_peak_bytes
    # The hybrid layout (a model with sliding-window layers under vLLM's hybrid manager);
    # empty/0 for one full-attention table, and then bytes_per_token is every layer's.
    # In a hybrid plan bytes_per_token is one block's bytes per token slot (page x G / block size).
    kv_cache_groups: tuple[KvGroupBudget, ...] = ()
    page_size_bytes: int = 0  # one layer's block: block size x one layer's bytes per token
    layers_per_group: int = 0  # G: padding layers included, so every group's block is one size
    blocks_per_request: int = 0  # sum over groups of KvGroupBudget.blocks_per_request
    full_attention_bytes_per_token: int = 0  # every layer's, what the pool would cost without windows
    kv_max_num_batched_tokens: int = 0  # the largest chunk a window group holds beside its window

    @property
    def is_hybrid(self) -> bool:
        return bool(self.kv_cache_groups)

    @property
    def kv_cache_layout(self) -> str:
        """``hybrid`` (one block table per group) or ``full_attention`` (one table)."""
        return "hybrid" if self.kv_cache_groups else "full_attention"

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.bytes_per_token

    def with_num_blocks(self, num_blocks: int) -> MemoryPlan:
        """The plan with a pool of ``num_blocks`` blocks (vLLM's ``--num-gpu-blocks-override``),
        tokens and concurrency recomputed by the same formula."""
        tokens, concurrency = _tokens_and_concurrency(num_blocks, self.block_size, self.max_model_len,
                                                      len(self.kv_cache_groups), self.blocks_per_request)
        return replace(self, num_blocks=num_blocks, kv_cache_tokens=tokens, max_concurrency=concurrency,
                       kv_pool_bytes=num_blocks * self.block_bytes, kv_pool_overridden=True)

    def layout_summary(self) -> dict[str, Any]:
        """What this layout makes of the pool: blocks, tokens, concurrency (phase E's event
        names the layout the engine did not run with this)."""
        return {"kv_cache_layout": self.kv_cache_layout, "num_blocks": self.num_blocks,
                "kv_cache_tokens": self.kv_cache_tokens, "max_concurrency": self.max_concurrency,
                "bytes_per_token": self.bytes_per_token}

    def gib(self, name: str) -> float:
        return getattr(self, name) / GiB

    def to_json(self) -> dict[str, Any]:
        """The stable JSON shape of ``engine plan --json``: the ledger's quantities under their
        report keys (``peak_activation_gib``, ``kv_cache_gib``: the keys logparse's comparison
        rows use), then the plan's own."""
        return {
            # the ledger's quantities under the one report key set (engine/events/ledger.py)
            **{LEDGER_ITEM[name].report_key: LEDGER_ITEM[name].report_value(getattr(self, name))
               for name in PLAN_JSON_LEDGER},
            "kv_pool_overridden": self.kv_pool_overridden,
            "estimated": list(self.estimated),
            **({"multimodal": {**self.multimodal.to_json(), "llm_activation_peak_bytes": self.llm_activation_peak_bytes}}
               if self.multimodal is not None else {}),
            **(self.hybrid_json() if self.kv_cache_groups else {}),
        }

    def hybrid_json(self) -> dict[str, Any]:
        return {"kv_cache_layout": self.kv_cache_layout, "page_size_bytes": self.page_size_bytes,
                "layers_per_group": self.layers_per_group, "blocks_per_request": self.blocks_per_request,
                "full_attention_bytes_per_token": self.full_attention_bytes_per_token,
                "kv_cache_groups": [g.to_json() for g in self.kv_cache_groups]}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def phase_data(self) -> dict[str, dict[str, Any]]:
        """The JSON ``data`` of the phases the plan knows (B, C, D, E): ``phase_records()``
        as dicts, for producers that publish plain dicts (engine simulate)."""
        return {letter: record.to_dict() for letter, record in self.phase_records().items()}

    def phase_records(self) -> dict[str, PhaseData]:
        """What ``engine plan`` and ``engine simulate`` report for phases B–E, as the
        records of engine/events/phase_data.py (a real start reports more in each)."""
        return {"B": self.budget_data(), "C": self.load_weights_data(),
                "D": self.profile_run_data(), "E": self.kv_cache_data()}

    def load_weights_data(self) -> LoadWeightsData:
        mm = self.multimodal
        if mm is None:
            return LoadWeightsData(weights_bytes=self.weights_bytes)
        return LoadWeightsData(weights_bytes=self.weights_bytes, vision_weights_bytes=mm.vision_weights_bytes)

    def budget_data(self) -> BudgetData:
        return BudgetData(total_bytes=self.total_bytes, gpu_memory_utilization=self.gpu_memory_utilization,
                          requested_bytes=self.requested_bytes)

    def profile_run_data(self) -> ProfileRunData:
        mm = self.multimodal
        if mm is None:
            return ProfileRunData(activation_peak_bytes=self.activation_peak_bytes, non_torch_bytes=self.non_torch_bytes,
                                  estimated=tuple(self.estimated))
        return ProfileRunData(activation_peak_bytes=self.activation_peak_bytes, non_torch_bytes=self.non_torch_bytes,
                              estimated=tuple(self.estimated),
                              encoder_activation_peak_bytes=mm.encoder_activation_peak_bytes,
                              encoder_cache_tokens=mm.encoder_budget_tokens, encoder_cache_bytes=mm.encoder_cache_bytes,
                              mm_items_profiled=mm.items_profiled, mm_modality=mm.modality,
                              skip_mm_profiling=mm.skip_profiling)

    def kv_cache_data(self) -> KvCacheData:
        """Phase E's numbers; a real start adds ``cpu_default_cap``. A hybrid plan adds its
        layout, page size, groups and blocks per request."""
        record = KvCacheData(kv_pool_bytes=self.kv_pool_bytes, bytes_per_token=self.bytes_per_token,
                             block_size=self.block_size, num_blocks=self.num_blocks,
                             kv_cache_tokens=self.kv_cache_tokens, max_model_len=self.max_model_len,
                             max_concurrency=self.max_concurrency, kv_pool_overridden=self.kv_pool_overridden)
        if not self.kv_cache_groups:
            return record
        return replace(record, kv_cache_layout=self.kv_cache_layout, page_size_bytes=self.page_size_bytes,
                       layers_per_group=self.layers_per_group, blocks_per_request=self.blocks_per_request,
                       kv_cache_groups=tuple(g.to_json() for g in self.kv_cache_groups))


def required_utilization(plan: MemoryPlan, target_pool_bytes: int) -> float:
    """The --gpu-memory-utilization that would give a pool of ``target_pool_bytes``."""
    non_kv = plan.weights_bytes + plan.activation_peak_bytes + plan.non_torch_bytes
    return (non_kv + target_pool_bytes) / plan.total_bytes


def plan_memory(
    *,
    model: ModelConfig,
    total_bytes: int,
    gpu_memory_utilization: float,
    max_model_len: int,
    block_size: int = 16,
    kv_cache_dtype: str = "auto",
    dtype: str | None = None,
    tensor_parallel_size: int = 1,
    weights: int | None = None,
    activation_peak: int | None = None,
    non_torch: int | None = None,
    kv_cache_memory_bytes: int | None = None,
    max_num_batched_tokens: int = 8192,
    max_num_seqs: int = 256,
    check_fits: bool = True,
    multimodal: MultimodalBudget | None = None,
    kv_cache_groups: Sequence[KVCacheGroup] | None = None,
    disable_hybrid_kv_cache_manager: bool = False,
) -> MemoryPlan:
    """Compute the budget. Any of weights / activation_peak / non_torch left as
    None is estimated from the shapes and listed in ``estimated``; ``multimodal``
    (a VL model's :func:`~engine.budget.vision.plan_multimodal`) adds the vision
    weights and the encoder's share of the profile to those estimates (a given or
    measured figure already holds them). Raises
    :class:`~engine.budget.fixes.BudgetRefused` (the numbers, and the fixes as data) when
    the pool is negative or cannot hold one ``max_model_len`` request.

    The KV layout: ``kv_cache_groups`` (default: the model's own, from its ``layer_types``
    and ``sliding_window``); any sliding-window group makes the pool hybrid (the module
    docstring's second formula), unless ``disable_hybrid_kv_cache_manager`` (vLLM's flag:
    every layer takes full attention's blocks)."""
    _check_plan_flags(gpu_memory_utilization, block_size, max_model_len)
    model_dtype = dtype or model.dtype
    non_kv = _non_kv_memory(model, model_dtype, tensor_parallel_size, max_num_batched_tokens, max_num_seqs,
                            multimodal, weights, activation_peak, non_torch)
    requested = total_bytes * gpu_memory_utilization
    pool = (float(kv_cache_memory_bytes) if kv_cache_memory_bytes is not None
            else requested - non_kv.weights - non_kv.activation_peak - non_kv.non_torch)
    groups = () if disable_hybrid_kv_cache_manager else _hybrid_groups(model, kv_cache_groups)
    per_token, num_blocks, hybrid = _kv_layout(model, groups, pool, kv_cache_dtype, tensor_parallel_size, model_dtype,
                                               block_size, max_model_len, max_num_batched_tokens)
    tokens, concurrency = _tokens_and_concurrency(num_blocks, block_size, max_model_len, len(groups),
                                                  hybrid.get("blocks_per_request", 0))
    plan = MemoryPlan(
        total_bytes=int(total_bytes), gpu_memory_utilization=gpu_memory_utilization, requested_bytes=int(requested),
        weights_bytes=int(non_kv.weights), activation_peak_bytes=int(non_kv.activation_peak),
        non_torch_bytes=int(non_kv.non_torch), kv_pool_bytes=int(pool), bytes_per_token=per_token,
        block_size=block_size, num_blocks=num_blocks, kv_cache_tokens=tokens, max_model_len=max_model_len,
        max_concurrency=concurrency, kv_pool_overridden=kv_cache_memory_bytes is not None,
        estimated=non_kv.estimated, multimodal=multimodal, llm_activation_peak_bytes=int(non_kv.llm_peak), **hybrid,
    )
    if check_fits:
        check_plan_fits(plan)
    return plan


def _check_plan_flags(gpu_memory_utilization: float, block_size: int, max_model_len: int) -> None:
    """Refuse the flag values no budget can be computed for."""
    if not 0 < gpu_memory_utilization <= 1:
        raise UserError(f"--gpu-memory-utilization {gpu_memory_utilization}: must be in (0, 1]")
    if block_size <= 0 or block_size & (block_size - 1):
        raise UserError(f"--block-size {block_size}: must be a positive power of two (vLLM uses 16)")
    if max_model_len <= 0:
        raise UserError(f"--max-model-len {max_model_len}: must be positive")


@dataclass(frozen=True, slots=True)
class _NonKvMemory:
    """What the pool leaves room for, each given (measured) or estimated from the shapes."""

    weights: int
    activation_peak: int
    non_torch: int
    llm_peak: int  # the language model's own estimated peak (0 when the peak was given)
    estimated: list[str]  # the figures estimated, in ledger order


def _non_kv_memory(model: ModelConfig, model_dtype: str, tensor_parallel_size: int, max_num_batched_tokens: int,
                   max_num_seqs: int, multimodal: MultimodalBudget | None, weights: int | None,
                   activation_peak: int | None, non_torch: int | None) -> _NonKvMemory:
    """The weights, activation peak and non-torch memory: each given, or estimated (a VL model's
    estimates hold the vision weights and the encoder's share of the profile)."""
    estimated: list[str] = []
    if weights is None:
        weights = weights_bytes(model, model_dtype, tensor_parallel_size)
        if multimodal is not None:
            weights += multimodal.vision_weights_bytes
    llm_peak = 0
    if activation_peak is None:
        llm_peak = estimate_activation_peak_bytes(
            model, max_num_batched_tokens, max_num_seqs, model_dtype, tensor_parallel_size
        )
        activation_peak = llm_peak if multimodal is None else multimodal.profile_peak_bytes(llm_peak)
        estimated.append("activation_peak")
    if non_torch is None:
        non_torch = estimate_non_torch_bytes(tensor_parallel_size)
        estimated.append("non_torch")
    return _NonKvMemory(weights, activation_peak, non_torch, llm_peak, estimated)


def _kv_layout(model: ModelConfig, groups: tuple[KVCacheGroup, ...], pool: float, kv_cache_dtype: str,
               tensor_parallel_size: int, model_dtype: str, block_size: int, max_model_len: int,
               max_num_batched_tokens: int) -> tuple[int, int, dict[str, Any]]:
    """The pool's bytes per token slot, its blocks, and for a hybrid pool (``groups``) its MemoryPlan
    fields: each group's budget, the page (one layer's block), the layers a block spans (the
    largest group's) and the blocks one request holds across groups."""
    per_token = bytes_per_kv_token(model, kv_cache_dtype, tensor_parallel_size, model_dtype)
    if not groups:
        return per_token, max(0, math.floor(pool / (block_size * per_token))) if pool > 0 else 0, {}
    per_layer = bytes_per_kv_token_per_layer(model, kv_cache_dtype, tensor_parallel_size, model_dtype)
    size = max(len(g.layers) for g in groups)
    budgets = tuple(KvGroupBudget(g.spec.kind, g.spec.sliding_window, g.layers, per_layer * len(g.layers),
                                  blocks_per_request(g.spec.sliding_window, max_model_len, block_size,
                                                     max_num_batched_tokens))
                    for g in groups)
    page = block_size * per_layer
    hybrid: dict[str, Any] = dict(kv_cache_groups=budgets, page_size_bytes=page, layers_per_group=size,
                                  blocks_per_request=sum(g.blocks_per_request for g in budgets),
                                  full_attention_bytes_per_token=per_token,
                                  kv_max_num_batched_tokens=max_num_batched_tokens)
    num_blocks = int(pool) // page // size if pool > 0 else 0
    return per_layer * size, num_blocks, hybrid  # one block (a page in each of G tensors) per token slot


def _hybrid_groups(model: ModelConfig, given: Sequence[KVCacheGroup] | None) -> tuple[KVCacheGroup, ...]:
    """The groups of a hybrid pool, or () when the model's layers all attend fully."""
    if given is not None:
        groups = tuple(given)
    else:
        try:
            groups = kv_cache_groups(model.layer_types, model.sliding_window, model.num_layers)
        except ValueError as exc:
            raise UserError(f"{model.name}: {exc}") from None
    return groups if groups and is_hybrid(groups) else ()


def _tokens_and_concurrency(num_blocks: int, block_size: int, max_model_len: int, num_groups: int,
                            per_request_blocks: int) -> tuple[int, float]:
    """vLLM's "KV cache size" tokens and "Maximum concurrency": one full-attention table holds
    ``blocks x block size`` tokens and ``tokens / max-model-len`` requests; a hybrid pool's
    tokens are ``blocks // groups x block size`` and its concurrency ``blocks / blocks per request``."""
    if not num_groups:
        tokens = num_blocks * block_size
        return tokens, tokens / max_model_len
    return num_blocks // num_groups * block_size, num_blocks / per_request_blocks


def check_plan_fits(plan: MemoryPlan) -> None:
    """Refuse a plan whose pool holds no block or less than one ``--max-model-len``
    request, with :class:`BudgetRefused`'s fixes. They name only flags that change the
    outcome, with values that work: when the pool size is fixed (``--kv-cache-memory-bytes``,
    or the CPU default cap) utilization does not matter; a utilization above 1 is never advised."""
    fixed_pool = plan.kv_pool_overridden
    need_pool = -(-plan.max_model_len // plan.block_size) * plan.block_bytes
    if plan.kv_cache_groups:
        need_pool = plan.blocks_per_request * plan.block_bytes  # vLLM's _max_memory_usage_bytes_from_groups
    if plan.kv_pool_bytes <= 0 and not fixed_pool:
        _refuse_no_pool(plan, need_pool)
    if plan.kv_cache_groups and plan.num_blocks < plan.blocks_per_request:
        _refuse_hybrid(plan, need_pool, fixed_pool)
    if not plan.kv_cache_groups and plan.kv_cache_tokens < plan.max_model_len:
        fits_len = plan.kv_cache_tokens
        fixes = _fit_fixes(plan, need_pool, fixed_pool, fits_len if fits_len >= plan.block_size else 0)
        raise BudgetRefused(
            f"the model's max seq len ({plan.max_model_len:,}) is larger than the maximum number of tokens "
            f"that can be stored in KV cache ({plan.kv_cache_tokens:,})", fixes)


def at_least(fraction: float) -> float:
    """``fraction`` rounded up to the 2 decimals a flag is given with, so the advised value
    suffices (0.693 -> 0.70, not 0.69); the 1e-9 keeps an exact 0.70 from becoming 0.71."""
    return math.ceil(fraction * 100 - 1e-9) / 100


def _refuse_no_pool(plan: MemoryPlan, need_pool: int) -> None:
    non_kv = plan.weights_bytes + plan.activation_peak_bytes + plan.non_torch_bytes
    need_util = required_utilization(plan, need_pool)
    fixes = [Fix("--gpu-memory-utilization", plan.gpu_memory_utilization, at_least(need_util),
                 f"needs {(non_kv + need_pool) / GiB:.2f} GiB with one request's KV cache")
             if need_util <= 1 else
             Fix("", None, None, "it cannot fit at any --gpu-memory-utilization: use a smaller model, --dtype, "
                 "--quantization or --tensor-parallel-size"),
             Fix("--max-num-batched-tokens", None, None,
                 "lower --max-num-batched-tokens / --max-num-seqs: the activation peak shrinks with them",
                 numbers={"activation_peak_bytes": plan.activation_peak_bytes})]
    raise BudgetRefused(
        f"no memory left for the KV cache: requested {plan.requested_bytes / GiB:.2f} GiB "
        f"({plan.total_bytes / GiB:.2f} GiB x {plan.gpu_memory_utilization}) but weights "
        f"{plan.weights_bytes / GiB:.2f} + activation peak {plan.activation_peak_bytes / GiB:.2f} + "
        f"non-torch {plan.non_torch_bytes / GiB:.2f} = {non_kv / GiB:.2f} GiB", fixes)


def longest_fitting_len(windows: Sequence[int | None], num_blocks: int, block_size: int,
                        max_num_batched_tokens: int, upper: int) -> int:
    """The longest --max-model-len up to ``upper`` whose one request fits ``num_blocks`` in KV
    cache groups of these sliding windows (None: full attention); 0 when none does (vLLM's
    ``_estimate_max_model_len_from_groups``: a binary search over the same sum)."""
    def need(length: int) -> int:
        return sum(blocks_per_request(w, length, block_size, max_num_batched_tokens) for w in windows)

    lo, hi, best = 1, upper, 0
    while lo <= hi:
        mid = (lo + hi) // 2
        if need(mid) <= num_blocks:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best


def _fit_fixes(plan: MemoryPlan, need_pool: int, fixed_pool: bool, fits_len: int) -> list[Fix]:
    """The flags that make one max-model-len request fit, for both layouts' refusals: a
    bigger fixed pool or utilization, then ``fits_len`` as --max-model-len (0: none fits)."""
    if fixed_pool:
        return fixed_pool_fixes(plan.kv_pool_bytes, need_pool, plan.max_model_len, fits_len)
    fixes = []
    need_util = required_utilization(plan, need_pool)
    if need_util <= 1:
        fixes.append(Fix("--gpu-memory-utilization", plan.gpu_memory_utilization, at_least(need_util),
                         f"{_request_needs(plan.max_model_len, need_pool)}, the pool has "
                         f"{plan.kv_pool_bytes / GiB:.2f}"))
    return _with_length_fix(fixes, plan.max_model_len, fits_len)


def _request_needs(max_model_len: int, need_pool: int) -> str:
    return f"one request of --max-model-len {max_model_len:,} needs {need_pool / GiB:.3f} GiB of KV cache"


def _with_length_fix(fixes: list[Fix], max_model_len: int, fits_len: int) -> list[Fix]:
    if fits_len > 0:
        fixes.append(Fix("--max-model-len", max_model_len, fits_len, "the longest request the pool holds"))
    if not fixes:
        fixes.append(Fix("", None, None, "a smaller model, --quantization or a larger device"))
    return fixes


def fixed_pool_fixes(pool: int, need_pool: int, max_model_len: int, fits_len: int) -> list[Fix]:
    """A fixed pool (``--kv-cache-memory-bytes``) too small for one request: a pool of
    ``need_pool`` bytes, or ``fits_len`` as --max-model-len (0: no length fits)."""
    return _with_length_fix([Fix("--kv-cache-memory-bytes", pool, need_pool, _request_needs(max_model_len, need_pool))],
                            max_model_len, fits_len)


def at_most(fraction: float) -> float:
    """``fraction`` rounded down to 2 decimals, so the advised value is within the bound."""
    return math.floor(fraction * 100 + 1e-9) / 100


def free_memory_fixes(free: int, total: int, utilization: float, cpu: bool) -> list[Fix]:
    """Less memory free than ``total x utilization`` requests: a lower utilization, or on CPU
    a smaller budget total (--device-memory), or on a GPU the memory other processes hold."""
    fixes = [Fix("--gpu-memory-utilization", utilization, at_most(free / total),
                 f"{free / GiB:.2f} of {total / GiB:.2f} GiB are free")]
    if cpu:
        fixes.append(Fix("--device-memory", round(total / GiB, 2), at_most(free / utilization / GiB),
                         f"the budget's total, of which {utilization} is requested"))
    else:
        fixes.append(Fix("", None, None, "free the device (other processes hold what is not free)"))
    return fixes


def weights_fixes(weights: int, total: int, utilization: float, cpu: bool) -> list[Fix]:
    """Weights larger than ``total x utilization``: a utilization that holds them, or on CPU
    a larger budget total (--device-memory, if the host has the memory)."""
    fixes = []
    if weights <= total:
        fixes.append(Fix("--gpu-memory-utilization", utilization, at_least(weights / total),
                         f"the weights need {weights / GiB:.2f} GiB"))
    if cpu:
        fixes.append(Fix("--device-memory", round(total / GiB, 2), at_least(weights / utilization / GiB),
                         "the budget's total, if the host has the memory"))
    return fixes or [Fix("", None, None, "a smaller model, --quantization or --tensor-parallel-size")]


def _refuse_hybrid(plan: MemoryPlan, need_pool: int, fixed_pool: bool) -> None:
    fits_len = longest_fitting_len([g.sliding_window for g in plan.kv_cache_groups], plan.num_blocks,
                                   plan.block_size, plan.kv_max_num_batched_tokens, plan.max_model_len)
    raise BudgetRefused(
        f"to serve at least one request with the model's max seq len ({plan.max_model_len:,}), "
        f"{need_pool / GiB:.2f} GiB of KV cache is needed ({plan.blocks_per_request:,} blocks over "
        f"{len(plan.kv_cache_groups)} KV cache groups), which is larger than the available KV cache memory "
        f"({plan.kv_pool_bytes / GiB:.2f} GiB, {plan.num_blocks:,} blocks)",
        _fit_fixes(plan, need_pool, fixed_pool, fits_len))


def parse_gib(value: str, flag: str) -> float:
    """Parse a GiB amount given on the command line ("14.957"). Units are
    refused on purpose: "12 GB" is ambiguous (10^9 or 2^30) and is the classic
    source of a 7% error."""
    text = str(value).strip()
    try:
        number = float(text)
    except ValueError:
        raise UserError(f"{flag} {value!r}: give a plain number of GiB (2^30 bytes), for example 14.957") from None
    if not math.isfinite(number) or number < 0:
        raise UserError(f"{flag} {value!r}: must be a non-negative number of GiB")
    return number


def parse_bytes(value: str, flag: str) -> int:
    """Parse a byte count: a plain integer or with a binary suffix (K/M/G/Ki/Mi/Gi, all 2^10 steps)."""
    text = str(value).strip().replace("_", "").replace(",", "")
    mult = 1
    for suffix, m in (("GIB", GiB), ("MIB", MiB), ("KIB", KiB), ("GI", GiB), ("MI", MiB), ("KI", KiB),
                      ("G", GiB), ("M", MiB), ("K", KiB)):
        if text.upper().endswith(suffix):
            text, mult = text[: -len(suffix)], m
            break
    try:
        number = float(text)
    except ValueError:
        raise UserError(f"{flag} {value!r}: give a byte count such as 53687091200 or 50GiB") from None
    if not math.isfinite(number) or number <= 0:
        raise UserError(f"{flag} {value!r}: must be a positive byte count")
    return int(number * mult)


def kv_cache_size_line(device_word: str, kv_cache_tokens: int) -> str:
    """vLLM 0.30+'s line, device word first ("GPU KV cache size: 442,160 tokens")."""
    return f"{device_word} KV cache size: {kv_cache_tokens:,} tokens"


def max_concurrency_line(max_model_len: int, max_concurrency: float) -> str:
    return f"Maximum concurrency for {max_model_len:,} tokens per request: {max_concurrency:.2f}x"
