"""Qwen3-MoE (``Qwen3MoeForCausalLM``, config.json ``model_type`` qwen3_moe) in plain torch.

Attention is Qwen3's (QK-norm per head, no bias). A layer's MLP is a sparse mixture of
experts (:mod:`engine.model.moe`: router -> softmax -> top ``num_experts_per_tok``,
renormalised when ``norm_topk_prob``; each expert a SwiGLU of ``moe_intermediate_size``)
unless transformers' rule makes it dense: a layer in ``mlp_only_layers``, or one whose
``index + 1`` is not a multiple of ``decoder_sparse_step``, runs Llama's dense MLP of
``intermediate_size`` (:meth:`~engine.modelspec.config.ModelConfig.is_moe_layer`).
HF names: ``mlp.gate.weight`` (router), ``mlp.experts.<e>.{gate,up,down}_proj.weight``.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.model.attention.base import AttentionBackend
from engine.model.moe import QWEN_MOE_NAMES, SparseLayerMixin, SparseModelMixin
from engine.model.qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM
from engine.modelspec.config import ModelConfig


class Qwen3MoeDecoderLayer(SparseLayerMixin, Qwen3DecoderLayer):
    def __init__(self, config: ModelConfig, index: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__(config, dtype, device)
        self.make_sparse(config, index, QWEN_MOE_NAMES, dtype, device)


class Qwen3MoeForCausalLM(SparseModelMixin, Qwen3ForCausalLM):
    """Qwen3's attention, loading and runner; sparse MLPs that count their experts' tokens."""

    family_label = "Qwen3-MoE"

    def __init__(self, config: ModelConfig, backend: AttentionBackend, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cpu") -> None:
        super().__init__(config, backend, dtype, device)
        self.attach_expert_counter(int(config.num_experts or 0))

    def _make_layer(self, index: int, config: ModelConfig, dtype: torch.dtype,
                    device: torch.device | str) -> nn.Module:
        return Qwen3MoeDecoderLayer(config, index, dtype, device)
