"""Tiny random-weight Qwen3-MoE checkpoints, built at test time with transformers (nothing
downloaded): tests/model/tiny_hf.py's dense shapes (2 layers, hidden 64, 4 heads over 2 KV
heads of dim 16, vocab 320) with 8 experts of intermediate 32, top-2. Every parameter is
redrawn as tiny_hf.py does (the router included, so routing is not a tie between zeros)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from tests.model.tiny_hf import (
    _GGUF_GLOBAL_NAMES,
    _GGUF_LAYER_NAMES,
    TINY_SHAPES,
    redrawn,
    save_with_tokenizer,
    untied_arrays,
    write_gguf,
)

MOE_SHAPES: dict[str, Any] = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
# variant -> Qwen3MoeConfig settings beyond the shapes
MOE_VARIANTS: dict[str, dict[str, Any]] = {
    # every layer sparse, top-2 renormalised (Qwen3-30B-A3B's norm_topk_prob)
    "qwen3moe": {"norm_topk_prob": True, "tie_word_embeddings": False, "rope_theta": 1_000_000.0},
    # layer 1 dense (mlp_only_layers), top-2 probabilities not renormalised, tied head
    "qwen3moe-mixed": {"norm_topk_prob": False, "mlp_only_layers": [1], "tie_word_embeddings": True},
}
VARIANT_NAMES = (*MOE_VARIANTS, "mixtral", "qwen2moe")
# transformers' reference experts: its plain loop over active experts (the default, grouped_mm,
# takes ~0.6 s a forward on this CPU: 30 s of reference logits per checkpoint instead of ~1 s)
EAGER: dict[str, Any] = {"experts_implementation": "eager"}


def build_tiny_moe(variant: str, seed: int = 0) -> Any:
    import transformers

    if variant == "mixtral":
        return build_tiny_mixtral(seed)
    if variant == "qwen2moe":
        return build_tiny_qwen2_moe(seed)
    config = transformers.Qwen3MoeConfig(**TINY_SHAPES, **MOE_SHAPES, **MOE_VARIANTS[variant])
    torch.manual_seed(seed)
    return redrawn(transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, **EAGER), seed)


def save_tiny_moe(variant: str, folder: Path, seed: int = 0) -> Any:
    """Write ``folder`` (config.json, model.safetensors with per-expert tensors as the Hub's
    checkpoints hold them, a tiny tokenizer) and return the transformers model."""
    return save_with_tokenizer(build_tiny_moe(variant, seed), folder)


def build_tiny_mixtral(seed: int = 0) -> Any:
    """Mixtral of the same shapes: 8 experts of intermediate 32 (Mixtral's experts are
    ``intermediate_size`` wide), top-2 always renormalised, full attention."""
    import transformers

    shapes = {**TINY_SHAPES, "intermediate_size": MOE_SHAPES["moe_intermediate_size"]}
    config = transformers.MixtralConfig(**shapes, num_local_experts=MOE_SHAPES["num_experts"],
                                        num_experts_per_tok=MOE_SHAPES["num_experts_per_tok"], sliding_window=None)
    return redrawn(transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, **EAGER), seed)


def build_tiny_qwen2_moe(seed: int = 0) -> Any:
    """Qwen2-MoE of the same shapes: Q/K/V bias, 8 experts of 32, top-2 not renormalised
    (Qwen1.5-MoE's norm_topk_prob false), a shared expert of 48 behind its sigmoid gate."""
    import transformers

    shapes = {k: v for k, v in TINY_SHAPES.items() if k != "head_dim"}  # Qwen2-MoE: hidden / heads (16)
    config = transformers.Qwen2MoeConfig(**shapes, **MOE_SHAPES, shared_expert_intermediate_size=48,
                                         norm_topk_prob=False, tie_word_embeddings=False)
    return redrawn(transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, **EAGER), seed)


def write_tiny_moe_gguf(model: Any, path: Path) -> Path:
    """A Qwen3-MoE checkpoint as llama.cpp's converter writes it (F32, architecture qwen3moe):
    the router as ``ffn_gate_inp``, each layer's experts stacked per projection into
    ``ffn_{gate,up,down}_exps`` ``[experts, out, in]``, the expert counts and width as keys."""
    config = model.config

    def expert_keys(writer: Any) -> None:
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        writer.add_expert_weights_norm(bool(config.norm_topk_prob))

    return write_gguf(path, "qwen3moe", config, _moe_gguf_tensors(model), expert_keys)


def _moe_gguf_tensors(model: Any) -> Iterator[tuple[str, Any]]:
    width = model.config.moe_intermediate_size
    for name, array in untied_arrays(model):
        if not name.startswith("model.layers."):
            yield _GGUF_GLOBAL_NAMES[name], array
            continue
        index, rest = name[len("model.layers."):].split(".", 1)
        if rest == "mlp.experts.gate_up_proj":  # transformers holds gate then up rows per expert
            yield f"blk.{index}.ffn_gate_exps.weight", array[:, :width].copy()
            yield f"blk.{index}.ffn_up_exps.weight", array[:, width:].copy()
        else:
            gguf_name = {"mlp.experts.down_proj": "ffn_down_exps.weight",
                         "mlp.gate.weight": "ffn_gate_inp.weight"}.get(rest) or _GGUF_LAYER_NAMES[rest]
            yield f"blk.{index}.{gguf_name}", array
