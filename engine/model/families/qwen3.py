"""Qwen3 (dense) in plain torch, on the same paged KV cache and attention backends as Llama.

What differs from :mod:`engine.model.families.llama`, as transformers' ``Qwen3ForCausalLM`` computes
it: Q and K are RMS-normed per head (a ``head_dim`` weight each, ``rms_norm_eps``) after the
projection and before the rotation (QK-norm), and the projections carry no bias unless
config.json sets ``attention_bias``. ``head_dim`` is its own number (128 for every size),
not ``hidden_size / heads``. Norms, MLP, rope and the (tied or untied) LM head are Llama's.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.model.families.llama import DecoderLayer, LlamaForCausalLM, qk_normed_qkv
from engine.model.loading.hf_layout import HfLayout
from engine.modelspec.config import ModelConfig

# Per-layer tensors beyond Llama's (HF names under model.layers.N.).
_EXTRA_LAYER_TENSORS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")


class Qwen3DecoderLayer(DecoderLayer):
    """Llama's layer with QK-norm: only how Q, K and V are made differs."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__(config, dtype, device)
        self.q_norm = nn.Parameter(torch.empty(self.head_dim, dtype=dtype, device=device), requires_grad=False)
        self.k_norm = nn.Parameter(torch.empty(self.head_dim, dtype=dtype, device=device), requires_grad=False)

    def attention_qkv(self, x: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return qk_normed_qkv(self, x, cos, sin, self.qkv_bias)

    def fused_decode_args(self) -> None:
        """The fused C++ decode layer is Llama's shape (no QK-norm): never here."""
        return None


class Qwen3Layout(HfLayout):
    """Llama's checkpoint layout plus each layer's ``q_norm`` and ``k_norm``."""

    extra_layer_tensors = _EXTRA_LAYER_TENSORS


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3's dense model: Llama's loading, quantized copies, startup cache and runner;
    Qwen3's layers."""

    layout_class = Qwen3Layout
    fused_layer_refusal = "the fused C++ layer is Llama's shape (Qwen3 runs its layers op by op)"

    def _make_layer(self, index: int, config: ModelConfig, dtype: torch.dtype,
                    device: torch.device | str) -> nn.Module:
        return Qwen3DecoderLayer(config, dtype, device)
