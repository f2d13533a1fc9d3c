"""Mixtral (``MixtralForCausalLM``, config.json ``model_type`` mixtral) in plain torch.

Attention is Llama's (no bias, no QK-norm; a config with a ``sliding_window`` is refused by
the registry). Every layer's MLP is a sparse mixture of ``num_local_experts`` SwiGLU experts
of ``intermediate_size``, the router's top ``num_experts_per_tok`` probabilities always
renormalised (:mod:`engine.model.layers.moe`). HF names: ``block_sparse_moe.gate.weight`` (router),
``block_sparse_moe.experts.<e>.w1/w3/w2.weight`` (gate / up / down).
"""

from __future__ import annotations

from engine.model.families.llama import DecoderLayer, LlamaForCausalLM
from engine.model.layers.moe import MIXTRAL_NAMES, SparseLayerMixin, SparseModelMixin


class MixtralDecoderLayer(SparseLayerMixin, DecoderLayer):
    expert_names = MIXTRAL_NAMES


class MixtralForCausalLM(SparseModelMixin, LlamaForCausalLM):
    """Llama's attention, loading and runner; sparse MLPs that count their experts' tokens."""

    family_label = "Mixtral"
    layer_class = MixtralDecoderLayer
