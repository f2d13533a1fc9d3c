"""Qwen3-MoE (``Qwen3MoeForCausalLM``, config.json ``model_type`` qwen3_moe) in plain torch.

Attention is Qwen3's (QK-norm per head, no bias). A layer's MLP is a sparse mixture of
experts (:mod:`engine.model.layers.moe`: router -> softmax -> top ``num_experts_per_tok``,
renormalised when ``norm_topk_prob``; each expert a SwiGLU of ``moe_intermediate_size``)
unless transformers' rule makes it dense: a layer in ``mlp_only_layers``, or one whose
``index + 1`` is not a multiple of ``decoder_sparse_step``, runs Llama's dense MLP of
``intermediate_size`` (:meth:`~engine.modelspec.config.ModelConfig.is_moe_layer`).
HF names: ``mlp.gate.weight`` (router), ``mlp.experts.<e>.{gate,up,down}_proj.weight``.
"""

from __future__ import annotations

from engine.model.families.qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM, Qwen3Layout
from engine.model.layers.moe import QWEN_MOE_NAMES, SparseLayerMixin, SparseLayout, SparseModelMixin


class Qwen3MoeDecoderLayer(SparseLayerMixin, Qwen3DecoderLayer):
    expert_names = QWEN_MOE_NAMES


class Qwen3MoeLayout(SparseLayout, Qwen3Layout):
    """The sparse layers' experts and Qwen3's QK-norms."""


class Qwen3MoeForCausalLM(SparseModelMixin, Qwen3ForCausalLM):
    """Qwen3's attention, loading and runner; sparse MLPs that count their experts' tokens."""

    family_label = "Qwen3-MoE"
    layer_class = Qwen3MoeDecoderLayer
    layout_class = Qwen3MoeLayout
