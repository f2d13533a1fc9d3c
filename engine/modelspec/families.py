"""The model registry: which family runs a model, how its config.json is read, and what a
GGUF file must hold for kvscope to run it.

A family is one entry of :data:`FAMILIES`: its model class (named ``"module:Class"`` and
imported only when a model is built, as vLLM's registry does, so reading a config loads no
torch), the HF ``architectures`` entries and config.json ``model_type`` values it serves,
the GGUF ``general.architecture`` values and tokenizer types it runs, and its config
parsing (:attr:`Family.hf_fields`: the :class:`~engine.modelspec.config.ModelConfig` fields
that are the family's own). An architecture in no entry is refused when its config is read
(:func:`family_for_hf_config`, called by ``engine.modelspec.readers``) and again before phase C
(:func:`check_config_supported`), naming the families.

:func:`check_gguf_supported` reads only the header (milliseconds, :mod:`engine.modelspec.gguf_header`)
and refuses, before any weights load, a file whose architecture, tokenizer type or
tensor types kvscope cannot run, naming what is missing and what is supported.

Add a family: docs/models.md, "Adding a model family".
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import UserError
from engine.modelspec.config import (
    FULL_ATTENTION,
    GEMMA3_ROPE_LOCAL_BASE_FREQ,
    GEMMA3_SLIDING_WINDOW_PATTERN,
    SLIDING_ATTENTION,
    ModelConfig,
    RopeScaling,
)
from engine.modelspec.gguf_header import read_gguf_header


def _llama_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return {"attention_bias": bool(cfg.get("attention_bias", False))}


def _no_sliding_window(cfg: Mapping[str, Any], family: str) -> None:
    if cfg.get("use_sliding_window"):
        raise UserError(f"config.json sets use_sliding_window: kvscope runs {family} with full attention in every "
                        "layer; sliding-window Qwen layers are not supported yet")


def _qwen2_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen2/Qwen2.5: Q/K/V projections always carry a bias (transformers' Qwen2Attention
    hard-codes it; config.json has no key for it)."""
    _no_sliding_window(cfg, "Qwen2")
    return {"attention_bias": True}


def _qwen3_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen3: Q and K RMS-normed per head before the rotation (QK-norm); no bias unless
    config.json asks for one."""
    _no_sliding_window(cfg, "Qwen3")
    return {"attention_bias": bool(cfg.get("attention_bias", False)), "qk_norm": True}


def _all_layers_sliding(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Mistral's and Phi-3's ``sliding_window``: every layer attends to its last W positions
    (transformers' sliding mask for the whole model); null: full attention. The hybrid KV
    cache manager then runs one sliding group, freeing blocks as they leave the window."""
    window = cfg.get("sliding_window")
    if not window:
        return {}
    layers = int(cfg["num_hidden_layers"])
    return {"layer_types": (SLIDING_ATTENTION,) * layers, "sliding_window": int(window)}


def _mistral_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Mistral: Llama's layers, every one sliding when config.json sets ``sliding_window``
    (v0.1: 4096; v0.2/v0.3: null). A per-layer pattern is Ministral's, not registered."""
    if cfg.get("layer_types"):
        raise UserError("config.json sets layer_types: alternating sliding and full Mistral layers (Ministral) are not "
                        "registered; kvscope's mistral family slides every layer or none")
    return {"attention_bias": False, **_all_layers_sliding(cfg)}


def _phi3_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Phi-3: Llama's layers with Q/K/V and gate/up stored fused (split at load,
    :func:`split_phi3_tensor`), no biases, sliding when ``sliding_window`` is set
    (Phi-3-mini-4k: 2047), plain rope (the 128k models' longrope is refused where rope is read)."""
    return {"attention_bias": False, **_all_layers_sliding(cfg)}


def split_phi3_tensor(name: str, config: ModelConfig) -> list[tuple[str, int, int]] | None:
    """Phi-3's fused ``qkv_proj`` / ``gate_up_proj`` as Llama's tensors: ``(name, first row,
    rows)`` of each part (transformers' Phi3 splits the outputs the same way: Q, K, V; gate, up)."""
    if name.endswith(".self_attn.qkv_proj.weight"):
        base = name.removesuffix("qkv_proj.weight")
        q, kv = config.num_attention_heads * config.head_dim, config.num_kv_heads * config.head_dim
        return [(base + "q_proj.weight", 0, q), (base + "k_proj.weight", q, kv), (base + "v_proj.weight", q + kv, kv)]
    if name.endswith(".mlp.gate_up_proj.weight"):
        base, inter = name.removesuffix("gate_up_proj.weight"), config.intermediate_size
        return [(base + "gate_proj.weight", 0, inter), (base + "up_proj.weight", inter, inter)]
    return None


def _moe_layers(cfg: Mapping[str, Any], family: str) -> dict[str, Any]:
    """The experts every MoE family names the same way (Mixtral's count is
    ``num_local_experts``; transformers 5 writes that name for Qwen3-MoE too)."""
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    top_k = cfg.get("num_experts_per_tok")
    if not experts or not top_k:
        raise UserError(f"config.json of a {family} model lacks num_experts (or num_local_experts) and "
                        "num_experts_per_tok")
    if not 0 < int(top_k) <= int(experts):
        raise UserError(f"config.json: num_experts_per_tok {top_k} must be between 1 and num_experts {experts}")
    return {"num_experts": int(experts), "num_experts_per_tok": int(top_k)}


def _qwen3_moe_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen3-MoE: Qwen3's attention; sparse layers by ``decoder_sparse_step`` and
    ``mlp_only_layers`` (the others run a dense MLP of ``intermediate_size``), experts of
    ``moe_intermediate_size``, top-k renormalised when ``norm_topk_prob``."""
    step = int(cfg.get("decoder_sparse_step") or 1)
    if step < 1:
        raise UserError(f"config.json: decoder_sparse_step {step} must be at least 1")
    layers = int(cfg["num_hidden_layers"])
    dense = tuple(sorted(int(i) for i in cfg.get("mlp_only_layers") or ()))
    if any(not 0 <= i < layers for i in dense):
        raise UserError(f"config.json: mlp_only_layers {list(dense)} name layers outside 0..{layers - 1}")
    return {**_qwen3_fields(cfg), **_moe_layers(cfg, "Qwen3-MoE"),
            "moe_intermediate_size": int(cfg["moe_intermediate_size"]),
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
            "mlp_only_layers": dense or None, "decoder_sparse_step": step if step != 1 else None}


def _qwen2_moe_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen2-MoE: Qwen2's attention (Q/K/V bias unless ``qkv_bias`` is false); sparse layers as
    Qwen3-MoE's, each with a shared expert of ``shared_expert_intermediate_size`` behind a sigmoid gate."""
    _no_sliding_window(cfg, "Qwen2-MoE")
    fields = {**_qwen3_moe_fields(cfg), "attention_bias": bool(cfg.get("qkv_bias", True)),
              "shared_expert_intermediate_size": int(cfg.get("shared_expert_intermediate_size") or 0) or None}
    del fields["qk_norm"]  # Qwen3's QK-norm is not Qwen2's
    return fields


def _mixtral_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Mixtral: Llama's attention; every layer sparse, experts of ``intermediate_size``, the
    top-k always renormalised. A sliding window (Mistral's) is refused: kvscope runs Mixtral
    with full attention."""
    if cfg.get("sliding_window"):
        raise UserError(f"config.json sets sliding_window {cfg['sliding_window']}: kvscope runs Mixtral with full "
                        "attention in every layer (set it to null to run it so)")
    return {**_moe_layers(cfg, "Mixtral"), "moe_intermediate_size": int(cfg["intermediate_size"]),
            "norm_topk_prob": True}


def linear_rope_scaling(params: Mapping[str, Any], where: str) -> RopeScaling:
    """config.json's ``{"rope_type": "linear", "factor": F}`` (vLLM's LinearScalingRotaryEmbedding)."""
    factor = params.get("factor")
    if not isinstance(factor, int | float) or isinstance(factor, bool) or factor <= 0:
        raise UserError(f"{where}: linear rope scaling needs a positive 'factor', not {factor!r}")
    return RopeScaling(rope_type="linear", factor=float(factor))


def _gemma3_global_rope_scaling(cfg: Mapping[str, Any], per_type: Mapping[str, Any]) -> RopeScaling | None:
    """The rope scaling of Gemma 3's full-attention layers (4B/12B/27B: linear, factor 8;
    the sliding layers keep their plain local base): transformers 5 nests it under
    ``rope_parameters["full_attention"]``, 4.x writes a top-level ``rope_scaling``."""
    params = per_type.get(FULL_ATTENTION) or cfg.get("rope_scaling")
    if not isinstance(params, Mapping):
        return None
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return None
    if kind != "linear":
        raise UserError(f"config.json: Gemma 3's rope scaling type {kind!r} is not supported (kvscope runs "
                        f"Gemma 3's linear scaling)")
    return linear_rope_scaling(params, "config.json")


def _gemma3_gguf_fields(meta: Mapping[str, Any], layers: int, head_dim: int) -> dict[str, Any]:
    """Gemma 3's own fields from its GGUF header, with transformers' Gemma3TextConfig
    defaults for what llama.cpp's converter leaves out (the 5:1 layer pattern, the local
    rope base, query_pre_attn_scalar = head_dim for the sizes up to 12B)."""
    pattern = meta.get("gemma3.attention.sliding_window_pattern", GEMMA3_SLIDING_WINDOW_PATTERN)
    pattern = pattern if isinstance(pattern, int) and pattern > 0 else GEMMA3_SLIDING_WINDOW_PATTERN
    window = meta.get("gemma3.attention.sliding_window")
    return {
        "layer_types": tuple(SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(layers)),
        "sliding_window": int(window) if isinstance(window, int) else 4096,
        "rope_local_base_freq": float(meta.get("gemma3.rope.local_freq_base", GEMMA3_ROPE_LOCAL_BASE_FREQ)),
        "query_pre_attn_scalar": float(meta.get("gemma3.attention.query_pre_attn_scalar", head_dim)),
        "hidden_activation": "gelu_pytorch_tanh",
        # llama.cpp's converter writes the 4B/12B/27B models' linear scaling (factor 8) under these keys
        "rope_scaling": (linear_rope_scaling({"factor": meta.get("gemma3.rope.scaling.factor")}, "GGUF")
                         if meta.get("gemma3.rope.scaling.type") == "linear" else None),
    }


def _qwen3_moe_gguf_fields(meta: Mapping[str, Any], layers: int, head_dim: int) -> dict[str, Any]:
    """llama.cpp's qwen3moe keys; its graph renormalises the top-k weights (as Qwen3-30B-A3B's
    norm_topk_prob) unless ``expert_weights_norm`` says otherwise, and runs every layer sparse."""
    experts, used = meta.get("qwen3moe.expert_count"), meta.get("qwen3moe.expert_used_count")
    width = meta.get("qwen3moe.expert_feed_forward_length")
    if not isinstance(experts, int) or not isinstance(used, int) or not isinstance(width, int):
        raise UserError("GGUF qwen3moe metadata lacks expert_count, expert_used_count or expert_feed_forward_length")
    return {"qk_norm": True, "num_experts": experts, "num_experts_per_tok": used, "moe_intermediate_size": width,
            "norm_topk_prob": bool(meta.get("qwen3moe.expert_weights_norm", True))}


def _qwen3_gguf_fields(meta: Mapping[str, Any], layers: int, head_dim: int) -> dict[str, Any]:
    return {"qk_norm": True}  # llama.cpp writes Qwen3's attn_q_norm/attn_k_norm; no key says so


# llama.cpp's per-layer GGUF tensor names -> HF's (under model.layers.N.), by family.
LLAMA_GGUF_LAYER_NAMES: dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
QWEN3_GGUF_LAYER_NAMES: dict[str, str] = {
    **LLAMA_GGUF_LAYER_NAMES,
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
# Qwen3-MoE: the router and each layer's experts stacked into one 3-D tensor per projection
# (``[experts, out, in]``), which the sparse layer splits (engine/model/layers/moe.py's STACKED_EXPERTS).
QWEN3_MOE_GGUF_LAYER_NAMES: dict[str, str] = {
    **{k: v for k, v in QWEN3_GGUF_LAYER_NAMES.items() if not k.startswith("ffn_") or k == "ffn_norm.weight"},
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj",
    "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
}
# Gemma 3 has four norms per layer and Q/K norms; llama.cpp's ffn_norm is its pre-MLP norm.
GEMMA3_GGUF_LAYER_NAMES: dict[str, str] = {
    **{k: v for k, v in QWEN3_GGUF_LAYER_NAMES.items() if not k.endswith(".bias")},
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
GGUF_GLOBAL_NAMES: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _gemma3_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Gemma 3's text model (``Gemma3ForCausalLM``, config.json ``model_type`` gemma3_text):
    its layer pattern, window, the two rope bases (transformers 5 nests them per layer type
    under ``rope_parameters``; 4.x writes ``rope_theta`` and ``rope_local_base_freq``), the
    attention scale's scalar and the GELU gate. Soft-capping (Gemma 2's) is refused."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None:
            raise UserError(f"config.json sets {key}: kvscope's Gemma 3 has no logit soft-capping")
    layers = int(cfg["num_hidden_layers"])
    layer_types = cfg.get("layer_types")
    if not layer_types:
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern")
                      or GEMMA3_SLIDING_WINDOW_PATTERN)
        layer_types = [SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(layers)]
    rope = cfg.get("rope_parameters")
    per_type = rope if isinstance(rope, dict) and FULL_ATTENTION in rope else {}
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))
    fields: dict[str, Any] = {
        "layer_types": tuple(str(t) for t in layer_types),
        "sliding_window": int(cfg.get("sliding_window") or 4096),
        "rope_local_base_freq": float(per_type.get(SLIDING_ATTENTION, {}).get(
            "rope_theta", cfg.get("rope_local_base_freq", GEMMA3_ROPE_LOCAL_BASE_FREQ))),
        "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar") or head_dim),
        "hidden_activation": str(cfg.get("hidden_activation") or "gelu_pytorch_tanh"),
    }
    if FULL_ATTENTION in per_type:
        fields["rope_theta"] = float(per_type[FULL_ATTENTION]["rope_theta"])
    fields["rope_scaling"] = _gemma3_global_rope_scaling(cfg, per_type)
    return fields


@dataclass(frozen=True, slots=True)
class Family:
    name: str
    model_class: str  # "module:Class", imported by model_class_for
    hf_architectures: tuple[str, ...] = ()  # config.json "architectures" entries it loads from an HF folder
    model_types: tuple[str, ...] = ()  # config.json "model_type" / ModelConfig.architecture values
    gguf_architectures: tuple[str, ...] = ()  # GGUF general.architecture values
    gguf_tokenizers: tuple[str, ...] = ()  # tokenizer.ggml.model values its GGUFs are run with
    hf_fields: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None  # its own ModelConfig fields
    tensor_parallel: bool = True
    # llama.cpp's converter interleaves the rotary halves of Q/K rows for its "llama"
    # architecture only (LlamaModel.permute); Qwen2/Qwen3/Gemma 3 GGUFs keep HF's order
    # (transformers' GGUF reader un-permutes "llama" alone, too).
    gguf_rotary_permuted: bool = False
    # What the rest of the engine asks of a family (through ModelConfig.family), kept here
    # rather than as special cases in the loader, startup and the parameter count:
    gguf_fields: Callable[[Mapping[str, Any], int, int], dict[str, Any]] | None = None  # (meta, layers, head_dim)
    gguf_layer_names: Mapping[str, str] = field(default_factory=lambda: LLAMA_GGUF_LAYER_NAMES)
    hf_norms_add_one: bool = False  # its HF norms hold w and the model 1 + w (as its GGUF does): Gemma
    extra_layer_norms: int = 0  # hidden-size RMSNorms per layer beyond Llama's two (Gemma 3: 2)
    qk_norm: bool = False  # a head_dim Q and a K norm per layer always (Gemma 3; Qwen3's config field says so)
    cpu_dtype: tuple[str, str] | None = None  # --dtype auto on CPU: (dtype, why); None: by the ISA
    gguf_head_only_native: bool = False  # --quantization auto reads the GGUF's LM head blocks only
    reads_own_rope: bool = False  # its hf_fields reads config.json's rope (Gemma 3's per-layer-type bases)
    # an HF tensor the family stores fused -> Llama's parts (name, first row, rows); None: as stored
    hf_split: Callable[[str, ModelConfig], list[tuple[str, int, int]] | None] | None = None
    hf_split_adds: int = 0  # tensors each layer gains by the split (the progress bar's total)


# Llama's class serves Llama, SmolLM and llama.cpp's "llama" GGUFs (Mistral files among them)
# and the shape presets' text parts (mllama); Qwen2 is Llama's class with Q/K/V biases;
# Qwen3 and Gemma 3 have their own modules. Gemma 3's HF folders are its text model
# (Gemma3ForCausalLM); the multimodal Gemma3ForConditionalGeneration (text_config nested,
# weights under model.language_model) is not registered yet.
FAMILIES: tuple[Family, ...] = (
    Family("llama", "engine.model.families.llama:LlamaForCausalLM", hf_architectures=("LlamaForCausalLM",),
           model_types=("llama", "mllama"), gguf_architectures=("llama",), gguf_tokenizers=("gpt2",),
           hf_fields=_llama_fields, gguf_rotary_permuted=True),
    Family("qwen2", "engine.model.families.llama:LlamaForCausalLM", hf_architectures=("Qwen2ForCausalLM",),
           model_types=("qwen2", "qwen2_5_vl"), gguf_architectures=("qwen2",), gguf_tokenizers=("gpt2",),
           hf_fields=_qwen2_fields),
    Family("qwen3", "engine.model.families.qwen3:Qwen3ForCausalLM", hf_architectures=("Qwen3ForCausalLM",),
           model_types=("qwen3",), gguf_architectures=("qwen3",), gguf_tokenizers=("gpt2",),
           hf_fields=_qwen3_fields, tensor_parallel=False, gguf_fields=_qwen3_gguf_fields,
           gguf_layer_names=QWEN3_GGUF_LAYER_NAMES),
    Family("gemma3", "engine.model.families.gemma3:Gemma3ForCausalLM", hf_architectures=("Gemma3ForCausalLM",),
           model_types=("gemma3", "gemma3_text"), gguf_architectures=("gemma3",), gguf_tokenizers=("llama",),
           hf_fields=_gemma3_fields, tensor_parallel=False, gguf_fields=_gemma3_gguf_fields,
           gguf_layer_names=GEMMA3_GGUF_LAYER_NAMES, hf_norms_add_one=True, extra_layer_norms=2, qk_norm=True,
           # its layers run op by op and its head is the GGUF's Q8_0 read by the fp32 GEMV kernel:
           # single stream, AVX-512 BF16 Zen 4, 2 threads: fp32 17.6 tok/s, bf16 6.6 tok/s
           cpu_dtype=("float32", "Gemma 3 on CPU: fp32 decodes 2.7x faster than bf16 (Q8_0 head kernel, "
                                 "op-by-op layers)"),
           gguf_head_only_native=True, reads_own_rope=True),
    # Mistral and Phi-3: Llama's class (sliding-window layers through the hybrid KV cache; tensor
    # parallelism through parallel_llama, TP=2 greedy equal to TP=1 on the tiny checkpoints);
    # llama.cpp writes Mistral GGUFs as "llama" (served by that entry, window dropped as
    # llama.cpp drops it), Phi-3 GGUFs ("phi3", fused tensors) are not registered.
    Family("mistral", "engine.model.families.llama:LlamaForCausalLM", hf_architectures=("MistralForCausalLM",),
           model_types=("mistral",), hf_fields=_mistral_fields),
    Family("phi3", "engine.model.families.llama:LlamaForCausalLM", hf_architectures=("Phi3ForCausalLM",),
           model_types=("phi3",), hf_fields=_phi3_fields, hf_split=split_phi3_tensor, hf_split_adds=3),
    # Mixture of experts (engine/model/layers/moe.py): HF folders, and Qwen3-MoE GGUFs (llama.cpp stacks each
    # layer's experts into one 3-D tensor per projection; Qwen2-MoE's and Mixtral's GGUFs not yet).
    Family("qwen3_moe", "engine.model.families.qwen3_moe:Qwen3MoeForCausalLM", hf_architectures=("Qwen3MoeForCausalLM",),
           model_types=("qwen3_moe", "qwen3moe"), hf_fields=_qwen3_moe_fields, tensor_parallel=False,
           gguf_architectures=("qwen3moe",), gguf_tokenizers=("gpt2",), gguf_fields=_qwen3_moe_gguf_fields,
           gguf_layer_names=QWEN3_MOE_GGUF_LAYER_NAMES),
    Family("qwen2_moe", "engine.model.families.qwen2_moe:Qwen2MoeForCausalLM", hf_architectures=("Qwen2MoeForCausalLM",),
           model_types=("qwen2_moe",), hf_fields=_qwen2_moe_fields, tensor_parallel=False),
    Family("mixtral", "engine.model.families.mixtral:MixtralForCausalLM", hf_architectures=("MixtralForCausalLM",),
           model_types=("mixtral",), hf_fields=_mixtral_fields, tensor_parallel=False),
)
HF_ARCHITECTURES: dict[str, Family] = {a: f for f in FAMILIES for a in f.hf_architectures}
MODEL_TYPES: dict[str, Family] = {t: f for f in FAMILIES for t in f.model_types}
# GGUF general.architecture -> (family module, the tokenizer types it is run with).
GGUF_ARCHITECTURES: dict[str, tuple[str, tuple[str, ...]]] = {
    a: (f.name, f.gguf_tokenizers) for f in FAMILIES for a in f.gguf_architectures}
# tokenizer.ggml.model -> what it is (for the refusal's wording).
TOKENIZER_KINDS = {"gpt2": "byte-level BPE", "llama": "SentencePiece (BPE with byte fallback)"}
# ggml tensor types the loader dequantizes (with the gguf package) and has checked.
SUPPORTED_GGML_TYPES = {0: "F32", 1: "F16", 30: "BF16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0",
                        10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}
# Every ggml type's name (gguf's GGMLQuantizationType), for the refusal's wording without
# importing gguf here (config parsing imports this module and must stay light).
_GGML_TYPE_NAMES = {**SUPPORTED_GGML_TYPES, 9: "Q8_1", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS",
                    19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16",
                    26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4"}


def registry_listing() -> str:
    """The families and what names each, for refusals."""
    parts = []
    for f in FAMILIES:
        names = [*f.hf_architectures, *(f"GGUF {a}" for a in f.gguf_architectures)]
        parts.append(f"{f.name} ({', '.join(names)})")
    return "; ".join(parts)


def family_for_hf_config(cfg: Mapping[str, Any], where: str) -> Family:
    """The family an HF config.json names: its ``architectures`` entry, else (a config
    without one) its ``model_type``; a UserError naming the registry's families if neither
    is registered (a config with neither runs as Llama, as kvscope always has)."""
    architectures = cfg.get("architectures") or []
    if isinstance(architectures, str):
        architectures = [architectures]
    if architectures:
        for name in architectures:
            if name in HF_ARCHITECTURES:
                return HF_ARCHITECTURES[name]
        what = f"architectures {list(architectures)}"
    else:
        model_type = cfg.get("model_type")
        if model_type is None:
            return MODEL_TYPES["llama"]
        family = MODEL_TYPES.get(str(model_type))
        if family is not None and family.hf_fields is not None:
            return family
        what = f"model_type {model_type!r}"
    raise UserError(f"{where}: {what} is not in kvscope's model registry; it runs {registry_listing()}")


def family_for_architecture(architecture: str) -> Family:
    """The family of a ModelConfig's ``architecture`` (a config.json model_type or a GGUF
    general.architecture); architectures no family lists run as Llama (the shape presets'
    text parts; files with them are refused when read)."""
    family = MODEL_TYPES.get(architecture) or MODEL_TYPES.get(architecture.removesuffix("_text"))
    return family if family is not None else MODEL_TYPES["llama"]


def model_class_for(config: ModelConfig) -> type[Any]:
    """The family's model class (imported now: the first torch the model wing loads)."""
    module, _, name = family_for_architecture(config.architecture).model_class.partition(":")
    return getattr(importlib.import_module(module), name)


def _ggml_type_name(kind: int) -> str:
    return _GGML_TYPE_NAMES.get(kind, f"type {kind}")


def check_gguf_supported(path: Path) -> None:
    """Raise a UserError naming every unsupported part of the GGUF at ``path``: its
    architecture, its tokenizer type for that architecture, its tensors' ggml types."""
    header = read_gguf_header(path)
    meta = header.metadata
    architecture = meta.get("general.architecture")
    supported_arches = ", ".join(sorted(GGUF_ARCHITECTURES))
    if architecture not in GGUF_ARCHITECTURES:
        raise UserError(f"{path}: architecture {architecture!r} is not supported; kvscope runs GGUF architectures "
                        f"{supported_arches}")
    assert isinstance(architecture, str)
    problems: list[str] = []
    tokenizer = meta.get("tokenizer.ggml.model")
    allowed = GGUF_ARCHITECTURES[architecture][1]
    if tokenizer not in allowed:
        kinds = " or ".join(f"{t!r} ({TOKENIZER_KINDS[t]})" for t in allowed)
        problems.append(f"tokenizer type {tokenizer!r} is not supported for {architecture}; it needs {kinds}")
    unsupported: dict[int, list[str]] = {}
    for tensor in header.tensors:
        if tensor.ggml_type not in SUPPORTED_GGML_TYPES:
            unsupported.setdefault(tensor.ggml_type, []).append(tensor.name)
    for kind, names in sorted(unsupported.items()):
        problems.append(f"{len(names)} tensor(s) of ggml type {_ggml_type_name(kind)} (e.g. {names[0]}), "
                        f"which kvscope does not dequantize")
    if problems:
        raise UserError(f"{path}: " + "; ".join(problems) + f". Supported tensor types: "
                        f"{', '.join(SUPPORTED_GGML_TYPES.values())}; architectures: {supported_arches}")


def check_config_supported(config: ModelConfig, tensor_parallel_size: int) -> None:
    """Refuse, before phase A (weights unread), a model from a file whose architecture no
    family lists, and flags its family cannot run."""
    if config.source == "hf" and MODEL_TYPES.get(config.architecture) is None:
        raise UserError(f"{config.path or config.name}: architecture {config.architecture!r} is not in kvscope's "
                        f"model registry; it runs {registry_listing()}")
    family = family_for_architecture(config.architecture)
    if tensor_parallel_size > 1 and config.is_moe:
        raise UserError(f"--tensor-parallel-size {tensor_parallel_size} with {config.name}: kvscope does not shard "
                        "experts yet (vLLM splits every expert's intermediate dimension over the ranks and "
                        "all-reduces the layer's output); run this mixture-of-experts model on one rank")
    if tensor_parallel_size > 1 and not family.tensor_parallel:
        served = ", ".join(f.name for f in FAMILIES if f.tensor_parallel)
        raise UserError(f"--tensor-parallel-size {tensor_parallel_size} with {config.name}: tensor parallelism "
                        f"serves the {served} families; run {family.name} on one rank")
