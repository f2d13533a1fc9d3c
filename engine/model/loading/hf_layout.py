"""Where each HF tensor of a checkpoint lands in a decoder model's fused parameters.

Every weight source is read under HF names (``model.layers.0.self_attn.q_proj.weight``,
:mod:`engine.model.loading.loader`); the model holds Q/K/V and gate/up fused, one matrix
each. A :class:`HfLayout` is that mapping for one model: each HF name's ``(parameter, row
offset, rows)``, the names the model needs, a tensor copied into its rows, what a
checkpoint lacks, and dummy weights in place. A family whose layers hold more tensors
(Qwen3's and Gemma 3's QK-norms, the experts of a MoE layer, one rank's slices) has its
own layout, set as its model class's ``layout_class``.
"""

from __future__ import annotations

from typing import Any

import torch

# The tensors of a Llama layer under model.layers.N., in the order a checkpoint lists them.
LAYER_TENSORS = (
    "input_layernorm.weight", "post_attention_layernorm.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
    "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
)
QKV_BIASES = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")


def dummy_fill(name: str, param: torch.Tensor, generator: torch.Generator) -> None:
    """A dummy weight in place: norms 1, everything else uniform in +-0.02."""
    if param.dim() == 1 and "bias" not in name:
        param.fill_(1.0)
    else:
        param.uniform_(-0.02, 0.02, generator=generator)


class HfLayout:
    """The HF names of ``model`` (a :class:`~engine.model.families.llama.LlamaForCausalLM`)
    and where each lands. ``extra_layer_tensors``: a family's per-layer tensors beyond
    Llama's, each a layer attribute of its name's stem (``self_attn.q_norm.weight`` ->
    ``layer.q_norm``); ``projection_bias``: False where the family's projections have none."""

    extra_layer_tensors: tuple[str, ...] = ()
    projection_bias = True

    def __init__(self, model: Any) -> None:
        self.model = model

    def target(self, hf_name: str) -> tuple[torch.Tensor, int, int] | None:
        """``(parameter, row offset, rows)`` that an HF tensor fills, or None if unknown."""
        model = self.model
        whole = {"model.embed_tokens.weight": model.embed_tokens, "model.norm.weight": model.norm,
                 "lm_head.weight": model.lm_head}  # a tied head is None: some checkpoints still carry a copy
        if hf_name in whole:
            param = whole[hf_name]
            return None if param is None else (param, 0, param.shape[0])
        if not hf_name.startswith("model.layers."):
            return None
        index_str, rest = hf_name[len("model.layers.") :].split(".", 1)
        index = int(index_str)
        if index >= len(model.layers):
            return None  # dummy/reduced-layer configs reading a bigger file
        return self.layer_target(model.layers[index], rest)

    def layer_target(self, layer: Any, rest: str) -> tuple[torch.Tensor, int, int] | None:
        """Where ``rest`` (a name under ``model.layers.N.``) lands in ``layer``."""
        if rest in self.extra_layer_tensors:
            param = getattr(layer, rest.removeprefix("self_attn.").removesuffix(".weight"))
            return param, 0, param.shape[0]
        if rest.endswith(".bias") and not self.projection_bias:
            return None
        q, kv, inter = layer.q_size, layer.kv_size, layer.intermediate_size
        table: dict[str, tuple[torch.Tensor | None, int, int]] = {
            "input_layernorm.weight": (layer.input_layernorm, 0, layer.input_layernorm.shape[0]),
            "post_attention_layernorm.weight": (layer.post_attention_layernorm, 0, layer.post_attention_layernorm.shape[0]),
            "self_attn.q_proj.weight": (layer.qkv_proj, 0, q),
            "self_attn.k_proj.weight": (layer.qkv_proj, q, kv),
            "self_attn.v_proj.weight": (layer.qkv_proj, q + kv, kv),
            "self_attn.q_proj.bias": (layer.qkv_bias, 0, q),
            "self_attn.k_proj.bias": (layer.qkv_bias, q, kv),
            "self_attn.v_proj.bias": (layer.qkv_bias, q + kv, kv),
            "self_attn.o_proj.weight": (layer.o_proj, 0, layer.o_proj.shape[0]),
            "mlp.gate_proj.weight": (layer.gate_up_proj, 0, inter),
            "mlp.up_proj.weight": (layer.gate_up_proj, inter, inter),
            "mlp.down_proj.weight": (layer.down_proj, 0, layer.down_proj.shape[0]),
        }
        entry = table.get(rest)
        if entry is None or entry[0] is None:
            return None
        return entry[0], entry[1], entry[2]

    def names(self) -> list[str]:
        """Every HF tensor name this model needs."""
        model = self.model
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if model.lm_head is not None:
            names.append("lm_head.weight")
        per_layer = list(LAYER_TENSORS) + (list(QKV_BIASES) if model.config.attention_bias else [])
        for i in range(len(model.layers)):
            names.extend(f"model.layers.{i}.{n}" for n in per_layer)
        for i in range(len(model.layers)):
            names.extend(f"model.layers.{i}.{n}" for n in self.extra_layer_tensors)
        return names

    def missing(self, seen: set[str]) -> set[str]:
        """The names this model needs that ``seen`` (what a checkpoint held) lacks."""
        return set(self.names()) - seen

    @torch.no_grad()
    def load(self, hf_name: str, tensor: torch.Tensor) -> None:
        """Copy ``tensor`` into its rows (an unknown name fills nothing)."""
        target = self.target(hf_name)
        if target is None:
            return
        param, offset, rows = target
        if tensor.shape[0] != rows or tuple(tensor.shape[1:]) != tuple(param.shape[1:]):
            raise ValueError(f"{hf_name}: shape {tuple(tensor.shape)} does not fit {(rows, *param.shape[1:])}")
        param[offset : offset + rows].copy_(tensor)

    @torch.no_grad()
    def init_dummy(self, seed: int = 0) -> int:
        """Small random weights in place (no second copy); norms are 1. Returns the tensor count."""
        generator = torch.Generator(device="cpu").manual_seed(seed)
        count = 0
        for name, param in self.model.named_parameters():
            dummy_fill(name, param, generator)
            count += 1
        return count
