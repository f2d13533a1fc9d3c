"""Mixtral (``MixtralForCausalLM``, config.json ``model_type`` mixtral) in plain torch.

Attention is Llama's (no bias, no QK-norm; a config with a ``sliding_window`` is refused by
the registry). Every layer's MLP is a sparse mixture of ``num_local_experts`` SwiGLU experts
of ``intermediate_size``, the router's top ``num_experts_per_tok`` probabilities always
renormalised (:mod:`engine.model.moe`). HF names: ``block_sparse_moe.gate.weight`` (router),
``block_sparse_moe.experts.<e>.w1/w3/w2.weight`` (gate / up / down).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.model.attention.base import AttentionBackend
from engine.model.llama import DecoderLayer, LlamaForCausalLM
from engine.model.moe import MIXTRAL_NAMES, SparseLayerMixin, SparseModelMixin
from engine.modelspec.config import ModelConfig


class MixtralDecoderLayer(SparseLayerMixin, DecoderLayer):
    def __init__(self, config: ModelConfig, index: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__(config, dtype, device)
        self.make_sparse(config, index, MIXTRAL_NAMES, dtype, device)


class MixtralForCausalLM(SparseModelMixin, LlamaForCausalLM):
    """Llama's attention, loading and runner; sparse MLPs that count their experts' tokens."""

    family_label = "Mixtral"

    def __init__(self, config: ModelConfig, backend: AttentionBackend, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cpu") -> None:
        super().__init__(config, backend, dtype, device)
        self.attach_expert_counter(int(config.num_experts or 0))

    def _make_layer(self, index: int, config: ModelConfig, dtype: torch.dtype,
                    device: torch.device | str) -> nn.Module:
        return MixtralDecoderLayer(config, index, dtype, device)
