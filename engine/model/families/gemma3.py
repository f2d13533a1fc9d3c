"""Gemma 3 (text) in plain torch, on the same paged KV cache and attention backends as Llama.

What differs from :mod:`engine.model.families.llama`, each as transformers' ``Gemma3ForCausalLM``
computes it:

* layers alternate by ``config.layer_types``: ``sliding_attention`` layers attend to the
  last ``sliding_window`` positions only and rotate with their own rope base
  (``rope_local_base_freq``, 10,000); ``full_attention`` layers see everything and use
  ``rope_theta`` (1e6);
* Q and K are RMS-normed per head before the rotation (QK-norm), and the attention scale
  is ``query_pre_attn_scalar ** -0.5``;
* four RMSNorms per layer: before and after attention, before and after the MLP, each
  output norm applied before its residual add;
* the MLP's gate is GELU with the tanh approximation;
* embeddings are multiplied by ``sqrt(hidden_size)`` (in the weights' dtype), and the LM
  head is the embedding (tied).

Gemma's RMSNorm multiplies by ``(1 + w)``. llama.cpp's converter stores ``1 + w`` in the
GGUF (transformers subtracts the 1 when it reads the file and adds it back in the norm);
the norm weights here hold the file's ``1 + w`` as they are, so every norm is the plain
RMSNorm kernel, with no add per step.

A layer's ``kv_cache_group`` says which KV cache group's metadata (block tables, slot
mapping) it reads: :meth:`Gemma3ForCausalLM.forward` takes one metadata per group (the
hybrid KV cache the engine runs, vLLM's layout: ``ModelRunner.set_kv_cache_groups``
sets the indices and hands layer ``l`` the KV tensor it shares with the layers at the same
position of the other groups), or one metadata for every layer (one full-attention table,
``disable_hybrid_kv_cache_manager``), where a sliding layer masks what left its window.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.attention.base import AttentionBackend, AttentionMetadata
from engine.model.families.llama import (
    DecoderLayer,
    LlamaForCausalLM,
    RotaryEmbedding,
    qk_normed_qkv,
)
from engine.model.kernels.cpu_norm import rms_norm
from engine.model.loading.hf_layout import HfLayout
from engine.modelspec.config import ModelConfig

# Per-layer tensors beyond Llama's (HF names under model.layers.N.).
_EXTRA_LAYER_TENSORS = ("pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight",
                        "self_attn.q_norm.weight", "self_attn.k_norm.weight")


class Gemma3DecoderLayer(DecoderLayer):
    """One Gemma 3 layer. Parameter names follow transformers' (``post_attention_layernorm``
    is the norm of the attention output here, not Llama's pre-MLP norm)."""

    fused_entry = "decode_layer_gemma3"  # its pure-decode call in engine/model/kernels/cpu_layer.py
    # The block kernels round a projection's input to int8 per 32 values; on one-row steps the down
    # projection's (GELU(gate) * up, the heaviest outliers) has its remainder rounded and multiplied
    # again: teacher-forced top-1 against transformers' fp32 185 -> 189/192 for ~1-2 % of a
    # single-stream decode step (tests/model/test_gemma3_reference.py has the measurements).
    inputs_rounded_twice = frozenset({"down_proj"})

    def __init__(self, config: ModelConfig, index: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__(config, dtype, device)
        h = config.hidden_size

        def empty(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)

        self.pre_feedforward_layernorm = empty(h)
        self.post_feedforward_layernorm = empty(h)
        self.q_norm = empty(self.head_dim)
        self.k_norm = empty(self.head_dim)
        self.is_sliding = config.layer_is_sliding(index)
        self.sliding_window = config.sliding_window if self.is_sliding else None
        self.kv_cache_group = 0  # which KV cache group's block table and slots this layer reads (the runner sets it)
        self.scale = (config.query_pre_attn_scalar or self.head_dim) ** -0.5

    def forward(  # type: ignore[override]
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        tokens = hidden.shape[0]
        q, k, v = qk_normed_qkv(self, rms_norm(hidden, self.input_layernorm, self.eps), cos, sin)
        backend.write_kv(k, v, kv_cache, meta.slot_mapping)
        attn = backend.forward(q, kv_cache, meta, self.scale, sliding_window=self.sliding_window)
        attn_out = self.projections["o_proj"](attn.reshape(tokens, self.q_size))
        hidden = hidden + rms_norm(attn_out, self.post_attention_layernorm, self.eps)
        return self.mlp_block(hidden)

    def mlp_block(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-norm, gate/up, GELU(tanh)-and-multiply, down, post-norm, residual."""
        x = rms_norm(hidden, self.pre_feedforward_layernorm, self.eps)
        gate, up = self.projections["gate_up_proj"](x).split(self.intermediate_size, dim=-1)
        down = self.projections["down_proj"](F.gelu(gate, approximate="tanh") * up)
        return hidden + rms_norm(down, self.post_feedforward_layernorm, self.eps)

    def fused_decode_args(self) -> tuple[tuple[object, ...], tuple[object, ...]] | None:
        """The fixed arguments of :func:`engine.model.kernels.cpu_layer` ``decode_layer_gemma3`` for
        this layer (before and after the per-step ones; a sliding layer's window in ``after``), or
        None when a projection has no quantized copy with a kernel or the weights are not float32."""
        projections = self.fused_projections()
        if projections is None:
            return None
        qkv, o, gate_up, down = projections
        before = (self.input_layernorm, self.post_attention_layernorm, self.pre_feedforward_layernorm,
                  self.post_feedforward_layernorm, self.q_norm, self.k_norm, *qkv, *o, *gate_up, *down)
        after = (self.num_heads, self.num_kv_heads, self.eps, self.scale, self.sliding_window or 0)
        return before, after


class Gemma3Layout(HfLayout):
    """Llama's checkpoint layout plus each layer's extra norms; the projections have no bias."""

    extra_layer_tensors = _EXTRA_LAYER_TENSORS
    projection_bias = False


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3's text model. Loading, quantized copies (the tied head's Q8_0 blocks), the
    startup cache and the runner are Llama's; the layers, the embedding scale and the
    two rotary bases are Gemma's."""

    layout_class = Gemma3Layout

    def __init__(self, config: ModelConfig, backend: AttentionBackend, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cpu") -> None:
        if config.layer_types is None or len(config.layer_types) != config.num_layers:
            raise ValueError(f"{config.name}: Gemma 3 needs layer_types for its {config.num_layers} layers")
        super().__init__(config, backend, dtype, device)
        self.rotary_local = RotaryEmbedding(config.head_dim, config.rope_local_base_freq or config.rope_theta)
        # sqrt(hidden) rounded to the weights' dtype first, as transformers' scaled embedding does.
        self.embed_scale = float(torch.tensor(math.sqrt(config.hidden_size), dtype=dtype))

    def _make_layer(self, index: int, config: ModelConfig, dtype: torch.dtype,
                    device: torch.device | str) -> nn.Module:
        return Gemma3DecoderLayer(config, index, dtype, device)

    @property
    def kv_cache_groups(self) -> list[int]:
        """Each layer's KV cache group (all 0 on one full-attention table)."""
        return [layer.kv_cache_group for layer in cast("list[Gemma3DecoderLayer]", list(self.layers))]

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata | Sequence[AttentionMetadata],
    ) -> torch.Tensor:
        """``meta``: one metadata for every layer, or one per KV cache group (a layer reads
        ``meta[layer.kv_cache_group]``)."""
        self.routing.bind_pending()
        hidden = self.embed(input_ids)
        first = meta if isinstance(meta, AttentionMetadata) else meta[0]
        layer_kernel = self.routing.layer_kernel_for(first, kv_caches)
        if layer_kernel is not None:
            hidden = self.fused_decoder_layers(layer_kernel, hidden, positions, kv_caches, meta)
        else:
            hidden = self.decoder_layers(hidden, positions, kv_caches, meta)
        return rms_norm(hidden, self.norm, self.config.rms_norm_eps)

    def fused_decoder_layers(self, layer_kernel: Any, hidden: torch.Tensor, positions: torch.Tensor,
                             kv_caches: Sequence[torch.Tensor],
                             meta: AttentionMetadata | Sequence[AttentionMetadata]) -> torch.Tensor:
        """A pure-decode step's layers, each one C++ call (engine/model/kernels/cpu_layer.py) with its
        rope (the local base for sliding layers) and its KV cache group's slots, block table and seq lens."""
        rows = hidden.shape[0]
        cos_sin = {sliding: tuple(t.view(rows, -1) for t in rotary.cos_sin(positions, self.dtype))
                   for sliding, rotary in ((False, self.rotary), (True, self.rotary_local))}
        per_group: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        for layer, (before, after), kv_cache in zip(self.layers, self.routing.fused_layers, kv_caches, strict=True):
            group = layer.kv_cache_group
            if group not in per_group:  # each group's int64 slots once a step
                m = meta if isinstance(meta, AttentionMetadata) else meta[group]
                per_group[group] = (m.slot_mapping.to(torch.int64), m.block_tables, m.seq_lens)
            hidden = layer_kernel.decode_layer_gemma3(hidden, *before, *cos_sin[layer.is_sliding], kv_cache,
                                                      *per_group[group], *after)
        return hidden

    def decoder_layers(self, hidden: torch.Tensor, positions: torch.Tensor, kv_caches: Sequence[torch.Tensor],
                       meta: AttentionMetadata | Sequence[AttentionMetadata]) -> torch.Tensor:
        """Llama's layer loop with each layer's rope: the local base for sliding layers."""
        cos_sin = {False: self.rotary.cos_sin(positions, self.dtype),
                   True: self.rotary_local.cos_sin(positions, self.dtype)}
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            layer_meta = meta if isinstance(meta, AttentionMetadata) else meta[layer.kv_cache_group]
            cos, sin = cos_sin[layer.is_sliding]
            hidden = layer(hidden, cos, sin, kv_cache, layer_meta, self.backend)
        return hidden

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids) * self.embed_scale
