"""The Llama-family decoder (Llama, SmolLM, Qwen2 with q/k/v bias) in plain torch.

It runs ONE flattened batch of tokens from many sequences (prefill chunks and
decodes mixed) and reads/writes the paged KV cache through an
:class:`~engine.model.attention.base.AttentionBackend`. Q/K/V and gate/up projections
are fused into one matrix each at load time: on CPU every matmul call has a
fixed cost, so 4 instead of 7 per layer matters at decode batch sizes.

Each projection (and the LM head) is a :class:`~engine.model.layers.projection_linear.ProjectionLinear`:
weight-only quantized blocks (engine/model/loading/weight_blocks.py ``quantize_weights``: ggml's
32-weight Q8_0 / Q4_1 blocks, or a GGUF's own) run through the CPU kernels, the kernel plan's
routes and the float weights as that type decides; the model's :attr:`~LlamaForCausalLM.routing`
(engine/model/layers/kernel_routing.py) binds the kernels and installs the plan.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.attention.base import AttentionBackend, AttentionMetadata
from engine.model.kernels.cpu_act import silu_and_mul
from engine.model.kernels.cpu_norm import rms_norm
from engine.model.layers.kernel_routing import KernelRouting
from engine.model.layers.projection_linear import ProjectionLinear, holds_nothing
from engine.model.layers.quantized_linear import QuantizedLinear
from engine.model.layers.rope_scaling import llama3_scaled_inv_freq
from engine.model.loading.hf_layout import HfLayout
from engine.model.loading.weight_blocks import PROJECTIONS
from engine.modelspec.config import ModelConfig, RopeScaling


class RotaryEmbedding:
    """cos/sin computed from positions each forward (no table to size for 128k contexts).

    HF's ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)``
    is computed as ``x * cos + roll(x, D/2) * sin_signed`` with
    ``sin_signed = cat(-sin, sin)``: 3 tensor ops instead of 7, once per layer
    for Q and K together (decode steps are dispatch-bound on CPU)."""

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None = None) -> None:
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        if scaling is not None:
            self.inv_freq = llama3_scaled_inv_freq(self.inv_freq, scaling)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin_signed)``, each ``[tokens, 1, head_dim]``."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq.to(positions.device)[None, :]
        sin = freqs.sin()
        cos = freqs.cos()
        return (torch.cat((cos, cos), dim=-1)[:, None, :].to(dtype),
                torch.cat((-sin, sin), dim=-1)[:, None, :].to(dtype))


def _unreduced(x: torch.Tensor) -> torch.Tensor:
    """One rank holds the whole projection: its output is already the sum."""
    return x


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [tokens, heads, head_dim]`` by its positions' angles (neox/HF half split)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin_signed)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        h = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.intermediate_size = config.intermediate_size
        self.eps = config.rms_norm_eps
        # x @ W.T of each projection: the kernel plan's route, the blocks' kernel or the float weight
        self.projections = {name: ProjectionLinear(self, name) for name in PROJECTIONS}
        # Sums the row-parallel O and down outputs over the tensor-parallel ranks
        # (engine/model/families/parallel_llama.py); one rank's are already whole.
        self.reduce_rows: Callable[[torch.Tensor], torch.Tensor] = _unreduced
        # A sliding-window layer (Mistral, Phi-3) sees its last sliding_window positions; it reads
        # KV cache group kv_cache_group's block table and slots (the runner sets it, hybrid cache).
        self.sliding_window: int | None = None
        self.kv_cache_group = 0

        def empty(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)

        self.input_layernorm = empty(h)
        self.post_attention_layernorm = empty(h)
        self.qkv_proj = empty(self.q_size + 2 * self.kv_size, h)
        self.qkv_bias = empty(self.q_size + 2 * self.kv_size) if config.attention_bias else None
        self.o_proj = empty(h, self.q_size)
        self.gate_up_proj = empty(2 * config.intermediate_size, h)
        self.down_proj = empty(h, config.intermediate_size)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        tokens = hidden.shape[0]
        q, k, v = self.attention_qkv(rms_norm(hidden, self.input_layernorm, self.eps), cos, sin)
        backend.write_kv(k, v, kv_cache, meta.slot_mapping)
        attn = backend.forward(q, kv_cache, meta, 1.0 / math.sqrt(self.head_dim), sliding_window=self.sliding_window)
        hidden = hidden + self.reduce_rows(self.projections["o_proj"](attn.reshape(tokens, self.q_size)))

        return self.mlp_block(hidden)

    def attention_qkv(self, x: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated Q and K, and V, of the normed ``x`` (``[tokens, heads, head_dim]``); a family
        that norms Q/K per head overrides this alone (Qwen3: :func:`qk_normed_qkv`)."""
        tokens = x.shape[0]
        qkv = self.projections["qkv_proj"](x, self.qkv_bias)
        # Q and K sit side by side in qkv: one rotary call for both heads' sets.
        qk_width = self.q_size + self.kv_size
        qk = apply_rotary(qkv[:, :qk_width].view(tokens, self.num_heads + self.num_kv_heads, self.head_dim),
                          cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, qk_width:].view(tokens, self.num_kv_heads, self.head_dim)
        return q, k, v

    def fused_decode_args(self) -> tuple[tuple[object, ...], tuple[object, ...]] | None:
        """The fixed arguments of :func:`engine.model.kernels.cpu_layer` ``decode_layer`` for this
        layer (before and after the per-step ones), or None when a projection has no
        quantized copy with a kernel or the weights are not float32."""
        projections = self.fused_projections()
        if projections is None:
            return None
        qkv, o, gate_up, down = projections
        bias = self.qkv_bias if self.qkv_bias is not None else torch.empty(0)
        before = (self.input_layernorm, self.post_attention_layernorm, *qkv, bias, *o, *gate_up, *down)
        after = (self.num_heads, self.num_kv_heads, self.eps, 1.0 / math.sqrt(self.head_dim), self.sliding_window or 0)
        return before, after

    def fused_projections(self) -> list[tuple[list[torch.Tensor], list[int], torch.Tensor, int]] | None:
        """Each projection's arguments to the fused layer (:func:`engine.model.kernels.cpu_layer.projection_args`:
        its block parts in any GGUF format, the float weight past its GEMV limit), or None when the
        weights are not float32 or a projection has no quantized copy with a kernel."""
        from engine.model.kernels.cpu_layer import projection_args

        if self.qkv_proj.dtype != torch.float32:
            return None
        args = [projection_args(p.blocks, p.weight) for p in self.projections.values()]
        held = [a for a in args if a is not None]
        return held if len(held) == len(args) else None

    def mlp_block(self, hidden: torch.Tensor) -> torch.Tensor:
        """Norm, gate/up, SiLU-and-multiply, down, residual: the part ``torch.compile`` fuses."""
        x = rms_norm(hidden, self.post_attention_layernorm, self.eps)
        gate_up, down = self.projections["gate_up_proj"], self.projections["down_proj"]
        if gate_up.route is None or down.route is None:
            out = gate_up(x)
            return hidden + self.reduce_rows(down(silu_and_mul(out, out.dtype)))
        # By the kernel plan: a bf16 gate/up GEMM's output goes to SiLU-and-multiply as it is, and that
        # writes the dtype the down projection computes in (no float32 round trip between them).
        act = silu_and_mul(gate_up.native(x), down.computes_in(x.shape[0]) or x.dtype)
        return hidden + self.reduce_rows(down(act).to(hidden.dtype))


def qk_normed_qkv(layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q, K and V of ``x`` for a layer with per-head QK-norm (Qwen3, Gemma 3): the fused
    projection, RMSNorm of each Q and K head with the layer's ``q_norm`` / ``k_norm``, then
    one rotary call for both. Shapes ``[tokens, heads, head_dim]``."""
    tokens = x.shape[0]
    qkv = layer.projections["qkv_proj"](x, bias)
    q_size, kv_size = layer.q_size, layer.kv_size
    q = rms_norm(qkv[:, :q_size].view(tokens, layer.num_heads, layer.head_dim), layer.q_norm, layer.eps)
    k = rms_norm(qkv[:, q_size : q_size + kv_size].view(tokens, layer.num_kv_heads, layer.head_dim),
                 layer.k_norm, layer.eps)
    v = qkv[:, q_size + kv_size :].view(tokens, layer.num_kv_heads, layer.head_dim)
    qk = apply_rotary(torch.cat((q, k), dim=1), cos, sin)
    q, k = qk.split([layer.num_heads, layer.num_kv_heads], dim=1)
    return q, k, v


def decoder_layers(layers: nn.ModuleList) -> list[DecoderLayer]:
    """A model's layers as their class (``nn.ModuleList`` types its items as any module)."""
    return cast("list[DecoderLayer]", list(layers))


class LlamaForCausalLM(nn.Module):
    """The decoder over one flattened batch. Its checkpoint layout (:attr:`layout_class`,
    engine/model/loading/hf_layout.py), its kernels and routes (:attr:`routing`,
    engine/model/layers/kernel_routing.py) and its weights as blocks (engine/model/loading/weight_blocks.py,
    functions over the model) are collaborators of their own; a family sets its layer kind
    (:meth:`_make_layer`) and its layout, and says why the fused decode layer or quantization does
    not serve it (``fused_layer_refusal``, ``quantization_refusal``)."""

    layout_class: type[HfLayout] = HfLayout
    fused_layer_refusal: str | None = None  # why pure-decode steps never run the fused C++ layer here
    quantization_refusal: str | None = None  # why --quantization cannot hold this family's weights as blocks

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.config = config
        self.backend = backend
        self.dtype = dtype
        self.embed_tokens = nn.Parameter(
            torch.empty(config.vocab_size, config.hidden_size, dtype=dtype, device=device), requires_grad=False
        )
        self.layers = nn.ModuleList(self._make_layer(index, config, dtype, device) for index in range(config.num_layers))
        self.norm = nn.Parameter(torch.empty(config.hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Parameter(
                torch.empty(config.vocab_size, config.hidden_size, dtype=dtype, device=device), requires_grad=False
            )
        )
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        self.hf_layout = self.layout_class(self)
        self.routing = KernelRouting(self)
        # The LM head as "head" (the embedding when tied): float32 sums on CPU in every dtype mode.
        head_attr = "embed_tokens" if self.lm_head is None else "lm_head"
        self.projections = {"head": ProjectionLinear(self, "head", head_attr, fp32_sums=True)}
        # The embedding's GGUF blocks where its float copy is not held (engine/model/loading/gguf_blocks.py).
        self._embed_blocks: QuantizedLinear | None = None

    def _make_layer(self, index: int, config: ModelConfig, dtype: torch.dtype,
                    device: torch.device | str) -> nn.Module:
        """Layer ``index`` (a model family's subclass builds its own kind)."""
        layer = DecoderLayer(config, dtype, device)
        layer.sliding_window = config.sliding_window if config.layer_is_sliding(index) else None
        return layer

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata | Sequence[AttentionMetadata],
    ) -> torch.Tensor:
        """``input_ids``/``positions`` ``[num_tokens]`` -> final-normed hidden ``[num_tokens, hidden]``.
        ``meta``: one metadata for every layer, or one per KV cache group (the hybrid KV cache of a
        sliding-window model: a layer reads ``meta[layer.kv_cache_group]``)."""
        self.routing.bind_pending()
        hidden = self.embed(input_ids)
        if isinstance(meta, AttentionMetadata) and (layer_kernel := self.routing.layer_kernel_for(meta, kv_caches)) is not None:
            cos, sin = self.rotary.cos_sin(positions, self.dtype)
            tokens = hidden.shape[0]
            cos2, sin2 = cos.view(tokens, -1), sin.view(tokens, -1)
            slots = meta.slot_mapping.to(torch.int64)
            for (before, after), kv_cache in zip(self.routing.fused_layers, kv_caches, strict=True):
                hidden = layer_kernel.decode_layer(hidden, *before, cos2, sin2, kv_cache, slots,
                                                   meta.block_tables, meta.seq_lens, *after)
            return rms_norm(hidden, self.norm, self.config.rms_norm_eps)
        return rms_norm(self.decoder_layers(hidden, positions, kv_caches, meta), self.norm, self.config.rms_norm_eps)

    def decoder_layers(self, hidden: torch.Tensor, positions: torch.Tensor, kv_caches: Sequence[torch.Tensor],
                       meta: AttentionMetadata | Sequence[AttentionMetadata]) -> torch.Tensor:
        """The layers op by op, between the embedding and the final norm: what ``forward`` runs
        when the fused layer does not, and all a pipeline stage runs of the model (engine/pipeline.py).
        ``meta``: one metadata, or one per KV cache group (a layer reads ``meta[layer.kv_cache_group]``)."""
        cos, sin = self.rotary.cos_sin(positions, self.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            layer_meta = meta if isinstance(meta, AttentionMetadata) else meta[layer.kv_cache_group]
            hidden = layer(hidden, cos, sin, kv_cache, layer_meta, self.backend)
        return hidden

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self._embed_blocks is not None and holds_nothing(self.embed_tokens):
            # the file's blocks (no float copy held): only the rows this step reads are dequantized
            return self._embed_blocks.dequantize_rows(input_ids).to(self.dtype)
        return F.embedding(input_ids, self.embed_tokens)

    @property
    def head_weight(self) -> torch.Tensor:
        """The LM head: the embedding itself when the model ties them."""
        return self.embed_tokens if self.lm_head is None else self.lm_head

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits, summed in float32 on CPU in every dtype mode (the plan's head
        candidates, the GEMV and the float weight take float32 rows and return float32)."""
        self.routing.bind_pending()
        x = hidden.float() if hidden.device.type == "cpu" else hidden
        return self.projections["head"](x).float()

    def weights_bytes(self) -> int:
        """Bytes the weights really hold: parameters plus any quantized copies (a float weight
        the kernel plan dropped holds nothing)."""
        tensors = [*self.parameters(), *self.buffers()]
        return int(sum(t.numel() * t.element_size() for t in tensors if not holds_nothing(t)))
