"""Qwen2-MoE (``Qwen2MoeForCausalLM``, config.json ``model_type`` qwen2_moe) in plain torch.

Attention is Qwen2's (Q/K/V bias, ``qkv_bias``). A sparse layer's MLP is the routed experts
(:mod:`engine.model.layers.moe`: top ``num_experts_per_tok`` of ``num_experts``, renormalised when
``norm_topk_prob``) plus a shared expert every token runs (a SwiGLU of
``shared_expert_intermediate_size``) scaled by ``sigmoid(x @ shared_expert_gate.T)``; dense layers
(``mlp_only_layers``, ``decoder_sparse_step``) run Llama's MLP. HF names: ``mlp.gate.weight``,
``mlp.experts.<e>.*_proj.weight``, ``mlp.shared_expert.*_proj.weight``, ``mlp.shared_expert_gate.weight``.
"""

from __future__ import annotations

from engine.model.families.llama import DecoderLayer, LlamaForCausalLM
from engine.model.layers.moe import QWEN2_MOE_NAMES, SparseLayerMixin, SparseModelMixin


class Qwen2MoeDecoderLayer(SparseLayerMixin, DecoderLayer):
    expert_names = QWEN2_MOE_NAMES


class Qwen2MoeForCausalLM(SparseModelMixin, LlamaForCausalLM):
    """Qwen2's attention (Llama's class with biases), loading and runner; sparse MLPs with a
    gated shared expert that count their routed experts' tokens."""

    family_label = "Qwen2-MoE"
    layer_class = Qwen2MoeDecoderLayer
