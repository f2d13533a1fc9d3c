"""Qwen2-MoE (``Qwen2MoeForCausalLM``, config.json ``model_type`` qwen2_moe) in plain torch.

Attention is Qwen2's (Q/K/V bias, ``qkv_bias``). A sparse layer's MLP is the routed experts
(:mod:`engine.model.moe`: top ``num_experts_per_tok`` of ``num_experts``, renormalised when
``norm_topk_prob``) plus a shared expert every token runs (a SwiGLU of
``shared_expert_intermediate_size``) scaled by ``sigmoid(x @ shared_expert_gate.T)``; dense layers
(``mlp_only_layers``, ``decoder_sparse_step``) run Llama's MLP. HF names: ``mlp.gate.weight``,
``mlp.experts.<e>.*_proj.weight``, ``mlp.shared_expert.*_proj.weight``, ``mlp.shared_expert_gate.weight``.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.model.attention.base import AttentionBackend
from engine.model.llama import DecoderLayer, LlamaForCausalLM
from engine.model.moe import QWEN2_MOE_NAMES, SparseLayerMixin, SparseModelMixin
from engine.modelspec.config import ModelConfig


class Qwen2MoeDecoderLayer(SparseLayerMixin, DecoderLayer):
    def __init__(self, config: ModelConfig, index: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__(config, dtype, device)
        self.make_sparse(config, index, QWEN2_MOE_NAMES, dtype, device)


class Qwen2MoeForCausalLM(SparseModelMixin, LlamaForCausalLM):
    """Qwen2's attention (Llama's class with biases), loading and runner; sparse MLPs with a
    gated shared expert that count their routed experts' tokens."""

    family_label = "Qwen2-MoE"

    def __init__(self, config: ModelConfig, backend: AttentionBackend, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cpu") -> None:
        super().__init__(config, backend, dtype, device)
        self.attach_expert_counter(int(config.num_experts or 0))

    def _make_layer(self, index: int, config: ModelConfig, dtype: torch.dtype,
                    device: torch.device | str) -> nn.Module:
        return Qwen2MoeDecoderLayer(config, index, dtype, device)
