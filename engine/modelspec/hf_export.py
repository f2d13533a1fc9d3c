"""What ``engine export-hf`` writes for each registered family (engine/modelspec/families.py):
transformers' ``config.json`` (``architectures``, ``model_type`` and every field that family's
config class reads to rebuild the model kvscope runs) and the tensors under transformers' names
and conventions. A family with no entry in :data:`HF_EXPORTS` cannot be exported (a test checks
that every family has one).

Tensors arrive as :func:`engine.model.loading.loader.load_hf_state_dict` yields them (HF names, the
engine's conventions) and leave as transformers stores them:

* Gemma 3: the engine holds each RMSNorm weight as ``1 + w`` (the GGUF's value; the HF loader
  adds the 1); transformers' Gemma3RMSNorm computes ``x * (1 + w)`` and so gets ``w``, the
  1 taken off as transformers' own GGUF reader does (``Gemma2TensorProcessor``);
* Phi-3: Q/K/V and gate/up fused again (the loader splits them);
* Qwen3-MoE from a GGUF: each projection's ``[experts, out, in]`` stack as one tensor per expert
  (the Hub checkpoints' names, which transformers and vLLM both read).

Rope: transformers 5's ``rope_parameters`` and 4.x's top-level ``rope_theta`` / ``rope_scaling``
both, so either version rebuilds the same frequencies. A GGUF's ``rope_freqs`` divisors (Llama
3.1/3.2) have no transformers form; they are written as the ``llama3`` scaling that reproduces
them, or refused when none does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.errors import UserError
from engine.modelspec.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig, RopeScaling

if TYPE_CHECKING:
    import torch

StateDict = dict[str, "torch.Tensor"]


def _same(config: ModelConfig, state: StateDict) -> StateDict:
    return state


@dataclass(frozen=True, slots=True)
class HFExport:
    architecture: str  # config.json "architectures"[0]: the transformers class
    model_type: str  # its config class's model_type
    fields: Callable[[ModelConfig], dict[str, Any]]  # the family's own config.json keys
    tensors: Callable[[ModelConfig, StateDict], StateDict] = _same  # engine tensors -> transformers'
    silu: bool = True  # config.json hidden_act "silu" (Gemma names its GELU hidden_activation)


# ---------------------------------------------------------------- rope


def llama3_divisors(theta: float, head_dim: int, s: RopeScaling) -> list[float]:
    """transformers' ``_compute_llama3_parameters`` as one divisor per rotary frequency."""
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    out = []
    for i in range(head_dim // 2):
        wavelen = 2 * math.pi * theta ** (2 * i / head_dim)
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(s.factor)
        else:
            smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor)
            out.append(1.0 / ((1 - smooth) / s.factor + smooth))
    return out


def _solve_llama3(theta: float, head_dim: int, divisors: tuple[float, ...]) -> RopeScaling:
    """The llama3 parameters through two blended frequencies (low_freq_factor 1, as Llama's:
    only the ratios to ``original_max_position_embeddings`` matter); with fewer, Llama 3.1's
    published ones (low 1, high 4, original 8192) at the file's factor."""
    factor = max(divisors)
    blended = []
    for i, d in enumerate(divisors):
        if 1.0 + 1e-4 < d < factor * (1 - 1e-4):
            smooth = (1 / d - 1 / factor) / (1 - 1 / factor)
            blended.append((1 / (2 * math.pi * theta ** (2 * i / head_dim)), smooth))  # s = a / wavelen + b
    if len(blended) < 2:
        return RopeScaling(factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,
                           original_max_position_embeddings=8192)
    (x1, s1), (x2, s2) = blended[0], blended[-1]
    a = (s1 - s2) / (x1 - x2)
    b = s1 - a * x1
    return RopeScaling(factor=factor, low_freq_factor=1.0, high_freq_factor=round(1 - 1 / b, 6),
                       original_max_position_embeddings=round(-a / b))


def _llama3_from_divisors(config: ModelConfig, divisors: tuple[float, ...]) -> RopeScaling:
    scaling = _solve_llama3(config.rope_theta, config.head_dim, divisors)
    again = llama3_divisors(config.rope_theta, config.head_dim, scaling)
    if len(again) != len(divisors) or any(abs(x - y) > 1e-4 * y for x, y in zip(again, divisors, strict=True)):
        raise UserError(f"{config.path or config.name}: its rope_freqs divisors are no llama3 rope scaling, and "
                        "transformers has no other form for them; export the model's HF folder instead")
    return scaling


def _scaling_dict(config: ModelConfig, scaling: RopeScaling) -> dict[str, Any]:
    if scaling.rope_type == "linear":
        return {"rope_type": "linear", "factor": scaling.factor}
    if scaling.rope_type == "freq_factors":
        assert scaling.freq_factors is not None
        scaling = _llama3_from_divisors(config, scaling.freq_factors)
    return {"rope_type": "llama3", "factor": scaling.factor, "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings}


def _rope_fields(config: ModelConfig) -> dict[str, Any]:
    """One rope for every layer: transformers 5's ``rope_parameters``, 4.x's keys beside it."""
    scaling = _scaling_dict(config, config.rope_scaling) if config.rope_scaling is not None else None
    params = {**(scaling or {"rope_type": "default"}), "rope_theta": config.rope_theta}
    return {"rope_theta": config.rope_theta, "rope_parameters": params, "rope_scaling": scaling and params}


def _gemma3_rope_fields(config: ModelConfig) -> dict[str, Any]:
    """Gemma 3's two bases (full layers: rope_theta and its scaling; sliding: the local base),
    per layer type as transformers 5 nests them, and 4.x's flat keys."""
    scaling = _scaling_dict(config, config.rope_scaling) if config.rope_scaling is not None else None
    local = config.rope_local_base_freq
    return {"rope_theta": config.rope_theta, "rope_local_base_freq": local, "rope_scaling": scaling,
            "rope_parameters": {FULL_ATTENTION: {**(scaling or {"rope_type": "default"}),
                                                 "rope_theta": config.rope_theta},
                                SLIDING_ATTENTION: {"rope_type": "default", "rope_theta": local}}}


# ---------------------------------------------------------------- families' config.json fields


def _no_sliding(config: ModelConfig) -> dict[str, Any]:
    """Qwen's config: kvscope runs every layer with full attention (a window is refused at read)."""
    return {"use_sliding_window": False, "sliding_window": None}


def _window(config: ModelConfig) -> int | None:
    """Mistral's / Phi-3's ``sliding_window``: set when every layer slides (the engine's only form)."""
    return config.sliding_window if config.layer_types else None


def _llama_fields(config: ModelConfig) -> dict[str, Any]:
    return {"attention_bias": config.attention_bias, "mlp_bias": False}


def _qwen3_fields(config: ModelConfig) -> dict[str, Any]:
    return {"attention_bias": config.attention_bias, **_no_sliding(config)}


def _moe_fields(config: ModelConfig) -> dict[str, Any]:
    return {"num_experts": config.num_experts, "num_experts_per_tok": config.num_experts_per_tok,
            "moe_intermediate_size": config.moe_intermediate_size, "norm_topk_prob": bool(config.norm_topk_prob),
            "decoder_sparse_step": config.decoder_sparse_step or 1,
            "mlp_only_layers": list(config.mlp_only_layers or ()), "output_router_logits": False}


def _qwen3_moe_fields(config: ModelConfig) -> dict[str, Any]:
    return {**_qwen3_fields(config), **_moe_fields(config)}


def _qwen2_moe_fields(config: ModelConfig) -> dict[str, Any]:
    return {**_no_sliding(config), **_moe_fields(config), "qkv_bias": config.attention_bias,
            "shared_expert_intermediate_size": config.shared_expert_intermediate_size or 0}


def _mixtral_fields(config: ModelConfig) -> dict[str, Any]:
    return {"num_local_experts": config.num_experts, "num_experts_per_tok": config.num_experts_per_tok,
            "sliding_window": None, "router_jitter_noise": 0.0, "output_router_logits": False}


def _phi3_fields(config: ModelConfig) -> dict[str, Any]:
    # pad_token_id null: Phi3Config's default (32000) is an embedding padding row, not in every vocabulary
    return {"sliding_window": _window(config), "original_max_position_embeddings": config.max_position_embeddings,
            "pad_token_id": None}


def _int_if_whole(value: float | None) -> float | int | None:
    """transformers 5's strict Gemma3TextConfig types query_pre_attn_scalar as an int."""
    return int(value) if value is not None and float(value).is_integer() else value


def _gemma3_fields(config: ModelConfig) -> dict[str, Any]:
    layer_types = list(config.layer_types or ())
    pattern = layer_types.index(FULL_ATTENTION) + 1 if FULL_ATTENTION in layer_types else len(layer_types) + 1
    regular = layer_types == [SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION
                              for i in range(len(layer_types))]
    return {
        "layer_types": layer_types,
        # transformers 4.50-4.52 read the pattern, not layer_types
        **({"sliding_window_pattern": pattern} if regular else {}),
        "sliding_window": config.sliding_window,
        "query_pre_attn_scalar": _int_if_whole(config.query_pre_attn_scalar or config.head_dim),
        "hidden_activation": config.hidden_activation or "gelu_pytorch_tanh",
        "attention_bias": False,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        **_gemma3_rope_fields(config),
    }


# ---------------------------------------------------------------- families' tensors


def _gemma_norms(config: ModelConfig, state: StateDict) -> StateDict:
    return {k: v - 1.0 if k.endswith("norm.weight") else v for k, v in state.items()}


def _phi3_fused(config: ModelConfig, state: StateDict) -> StateDict:
    """Q, K, V rows -> ``qkv_proj``; gate, up rows -> ``gate_up_proj`` (transformers' Phi-3 order)."""
    import torch

    out = dict(state)
    fused = {"self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                           "self_attn.v_proj.weight"),
             "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight")}
    for layer in range(config.num_layers):
        prefix = f"model.layers.{layer}."
        for name, parts in fused.items():
            out[prefix + name] = torch.cat([out.pop(prefix + p) for p in parts])
    return out


# The GGUF's stacked experts (engine/modelspec/families.py QWEN3_MOE_GGUF_LAYER_NAMES) -> the Hub's per-expert name.
_STACKED = {"mlp.experts.gate_proj": "gate_proj", "mlp.experts.up_proj": "up_proj",
            "mlp.experts.down_proj": "down_proj"}


def _experts_unstacked(config: ModelConfig, state: StateDict) -> StateDict:
    out: StateDict = {}
    for name, tensor in state.items():
        head, _, rest = name.rpartition(".mlp.experts.")
        stacked = f"mlp.experts.{rest}" if head else ""
        if stacked not in _STACKED:
            out[name] = tensor
            continue
        for expert in range(tensor.shape[0]):
            # a copy: safetensors refuses tensors that share one storage
            out[f"{head}.mlp.experts.{expert}.{_STACKED[stacked]}.weight"] = tensor[expert].clone()
    return out


# family name (engine/modelspec/families.py) -> how it is exported
HF_EXPORTS: dict[str, HFExport] = {
    "llama": HFExport("LlamaForCausalLM", "llama", _llama_fields),
    "qwen2": HFExport("Qwen2ForCausalLM", "qwen2", _no_sliding),  # Q/K/V bias: hard-coded in transformers
    "qwen3": HFExport("Qwen3ForCausalLM", "qwen3", _qwen3_fields),
    "gemma3": HFExport("Gemma3ForCausalLM", "gemma3_text", _gemma3_fields, _gemma_norms, silu=False),
    "mistral": HFExport("MistralForCausalLM", "mistral", lambda c: {"sliding_window": _window(c)}),
    "phi3": HFExport("Phi3ForCausalLM", "phi3", _phi3_fields, _phi3_fused),
    "qwen3_moe": HFExport("Qwen3MoeForCausalLM", "qwen3_moe", _qwen3_moe_fields, _experts_unstacked),
    "qwen2_moe": HFExport("Qwen2MoeForCausalLM", "qwen2_moe", _qwen2_moe_fields),
    "mixtral": HFExport("MixtralForCausalLM", "mixtral", _mixtral_fields),
}


def hf_export_for(config: ModelConfig) -> HFExport:
    family = config.family.name
    if family not in HF_EXPORTS:
        raise UserError(f"{config.path or config.name}: export-hf has no transformers form for the {family} family "
                        f"yet; it exports {', '.join(HF_EXPORTS)}")
    return HF_EXPORTS[family]


def hf_config(config: ModelConfig, dtype: str, stop_token_ids: list[int]) -> dict[str, Any]:
    """config.json for transformers (and vLLM): the shapes every family shares, then the family's own."""
    export = hf_export_for(config)
    own = export.fields(config)
    rope = {} if "rope_parameters" in own else _rope_fields(config)  # Gemma 3 writes its two bases itself
    return {
        "architectures": [export.architecture],
        "model_type": export.model_type,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        **({"hidden_act": "silu"} if export.silu else {}),
        "tie_word_embeddings": config.tie_word_embeddings,
        "torch_dtype": dtype,
        "dtype": dtype,  # transformers 5's name for it
        "bos_token_id": config.bos_token_id,
        "eos_token_id": stop_token_ids[0] if len(stop_token_ids) == 1 else stop_token_ids,
        **rope,
        **own,
    }


def hf_tensors(config: ModelConfig, state: StateDict) -> StateDict:
    """The engine's HF-named tensors as transformers stores them (a tied head left out)."""
    out = hf_export_for(config).tensors(config, state)
    if config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out
