"""The Llama-family decoder (Llama, SmolLM, Qwen2 with q/k/v bias) in plain torch.

It runs ONE flattened batch of tokens from many sequences (prefill chunks and
decodes mixed) and reads/writes the paged KV cache through an
:class:`~engine.model.attention.base.AttentionBackend`. Q/K/V and gate/up projections
are fused into one matrix each at load time: on CPU every matmul call has a
fixed cost, so 4 instead of 7 per layer matters at decode batch sizes.

``quantize_weights("int8" | "int4")`` adds weight-only copies of every projection and
of the LM head in ggml's 32-weight blocks (Q8_0 / Q4_1; a GGUF's own blocks when it has
them, so int4 on a Q4_1 GGUF adds no error): decode-sized steps multiply through the
CPU GEMV kernels of :mod:`engine.model.kernels.cpu_gemv`, which stream 1.06 / 0.63 bytes a
weight instead of 4; bigger steps keep the float weights, where torch's GEMM wins.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.attention.base import AttentionBackend, AttentionMetadata
from engine.model.kernels.cpu_act import silu_and_mul
from engine.model.kernels.cpu_norm import rms_norm
from engine.model.layers.kernel_routing import (
    KernelRouting,
    head_logits_on_cpu,
    linear_maybe_quantized,
    precision_report,
)
from engine.model.layers.quantized_linear import QuantizedLinear
from engine.model.layers.rope_scaling import llama3_scaled_inv_freq
from engine.model.loading import weight_blocks
from engine.model.loading.hf_layout import HfLayout
from engine.model.loading.weight_blocks import PROJECTIONS as _PROJECTIONS
from engine.model.loading.weight_blocks import holds_nothing as _holds_nothing
from engine.modelspec.config import ModelConfig, RopeScaling

QUANTIZATION_METHODS = ("int8", "int4", "native")
# method -> (GGUF block formats used as they are, the format float weights are packed into).
# int4 keeps a Q8_0 tensor (SmolLM2's tied embedding/LM head) as Q8_0: requantizing it
# to 4 bits would add error the GGUF does not have. native (chosen by --quantization auto
# for a file of mixed block types, a K-quant file): the GGUF's own blocks in every format a
# kernel reads (engine/model/layers/quantized_linear.py), nothing packed (other weights stay float).
_METHOD_FORMATS: dict[str, tuple[tuple[str, ...], str | None]] = {
    "int8": (("q8_0",), "q8_0"),
    "int4": (("q4_1", "q8_0"), "q4_1"),
    "native": (("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k"), None),
}
# fp32_linear multiplies a bf16/fp16 weight this many bytes of fp32 rows at a time: each
# slice is widened once into a buffer that stays in cache for its GEMM (widening the
# whole LM head per call cost ~50 ms at one row; Zen 4, indicative, loaded machine).
FP32_SLICE_BYTES = 2 << 20


def fp32_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x.float() @ weight.T`` summed and returned in float32 whatever ``weight``'s dtype: the
    LM head's logits in every dtype mode, so greedy decoding never picks among bf16-rounded
    ties (a bf16 GEMM rounds its output: "The" 25.375 vs "L" 25.375 where fp32 has 25.325
    vs 25.243). bf16 weights are widened exactly, a slice at a time; no fp32 copy is kept."""
    x = x.float()
    if weight.dtype == torch.float32:
        return F.linear(x, weight)
    rows = max(64, FP32_SLICE_BYTES // (4 * weight.shape[1]))
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32, device=x.device)
    for start in range(0, weight.shape[0], rows):
        out[:, start : start + rows] = F.linear(x, weight[start : start + rows].float())
    return out


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
        self.quantized: dict[str, QuantizedLinear] = {}
        self.kernel_routes: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}  # set by the kernel plan
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
        hidden = hidden + self.reduce_rows(
            linear_maybe_quantized(self, attn.reshape(tokens, self.q_size), "o_proj", self.o_proj))

        return self.mlp_block(hidden)

    def attention_qkv(self, x: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated Q and K, and V, of the normed ``x`` (``[tokens, heads, head_dim]``); a family
        that norms Q/K per head overrides this alone (Qwen3: :func:`qk_normed_qkv`)."""
        tokens = x.shape[0]
        qkv = linear_maybe_quantized(self, x, "qkv_proj", self.qkv_proj, self.qkv_bias)
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
        args = [projection_args(self.quantized.get(name), getattr(self, name)) for name in _PROJECTIONS]
        held = [a for a in args if a is not None]
        return held if len(held) == len(args) else None

    def mlp_block(self, hidden: torch.Tensor) -> torch.Tensor:
        """Norm, gate/up, SiLU-and-multiply, down, residual: the part ``torch.compile`` fuses."""
        x = rms_norm(hidden, self.post_attention_layernorm, self.eps)
        gate_route, down_route = self.kernel_routes.get("gate_up_proj"), self.kernel_routes.get("down_proj")
        if gate_route is None or down_route is None:
            gate_up = linear_maybe_quantized(self, x, "gate_up_proj", self.gate_up_proj)
            down = linear_maybe_quantized(self, silu_and_mul(gate_up, gate_up.dtype), "down_proj", self.down_proj)
            return hidden + self.reduce_rows(down)
        # By the kernel plan: a bf16 gate/up GEMM's output goes to SiLU-and-multiply as it is, and that
        # writes the dtype the down projection computes in (no float32 round trip between them).
        rows = x.shape[0]
        act = silu_and_mul(gate_route.native(x), down_route.computes_in(rows) or x.dtype)
        return hidden + self.reduce_rows(down_route(act).to(hidden.dtype))


def qk_normed_qkv(layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q, K and V of ``x`` for a layer with per-head QK-norm (Qwen3, Gemma 3): the fused
    projection, RMSNorm of each Q and K head with the layer's ``q_norm`` / ``k_norm``, then
    one rotary call for both. Shapes ``[tokens, heads, head_dim]``."""
    tokens = x.shape[0]
    qkv = linear_maybe_quantized(layer, x, "qkv_proj", layer.qkv_proj, bias)
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
    engine/model/loading/hf_layout.py) and its kernels and routes (:attr:`routing`,
    engine/model/layers/kernel_routing.py) are collaborators of their own; a family sets
    its layer kind (:meth:`_make_layer`) and its layout."""

    layout_class: type[HfLayout] = HfLayout

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
        self.quantized: dict[str, QuantizedLinear] = {}  # the LM head's, as "head"
        # The embedding's GGUF blocks where its float copy is not held (engine/model/loading/gguf_blocks.py).
        self._embed_blocks: QuantizedLinear | None = None
        self.kernel_routes: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}  # the head's, by the plan
        self.kernel_plan: Any = None  # engine/model/plan/kernel_plan.KernelPlan once installed; None: the constants
        self._gemv_pending = False  # quantized, kernel not resolved yet (first forward does it)
        # Pure-decode steps of at most cpu_layer.MAX_ROWS sequences run each layer as one C++
        # call (engine/model/kernels/cpu_layer.py) when every layer qualifies; set by resolve_gemv.
        self._fused_layers: list[tuple[tuple[object, ...], tuple[object, ...]]] = []

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
        if self._gemv_pending:
            self.resolve_gemv()
        hidden = self.embed(input_ids)
        if isinstance(meta, AttentionMetadata) and (layer_kernel := self.routing.layer_kernel_for(meta, kv_caches)) is not None:
            cos, sin = self.rotary.cos_sin(positions, self.dtype)
            tokens = hidden.shape[0]
            cos2, sin2 = cos.view(tokens, -1), sin.view(tokens, -1)
            slots = meta.slot_mapping.to(torch.int64)
            for (before, after), kv_cache in zip(self._fused_layers, kv_caches, strict=True):
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
        if self._embed_blocks is not None and _holds_nothing(self.embed_tokens):
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
        candidates and the fallback take float32 rows and return float32: :func:`fp32_linear`)."""
        if self._gemv_pending:
            self.resolve_gemv()
        if hidden.device.type != "cpu":
            return linear_maybe_quantized(self, hidden, "head", self.head_weight).float()
        x = hidden.float()
        logits = head_logits_on_cpu(self, x)
        return logits if logits is not None else fp32_linear(x, self.head_weight)

    def weights_bytes(self) -> int:
        """Bytes the weights really hold: parameters plus any quantized copies (a float weight
        the kernel plan dropped holds nothing)."""
        tensors = [*self.parameters(), *self.buffers()]
        return int(sum(t.numel() * t.element_size() for t in tensors if not _holds_nothing(t)))

    # ------------------------------------------------------------------ quantization (engine/model/loading/weight_blocks.py)
    def quantize_weights(self, method: str, gguf_blocks: Mapping[str, tuple[str, torch.Tensor]] | None = None,
                         pack: bool = True) -> dict[str, int]:
        """Install weight-only quantized entries of the projections and the LM head (after
        loading): a GGUF's own blocks (:func:`engine.model.loading.gguf_blocks.read_gguf_blocks`) where the
        method takes their format, other weights packed from the floats. The kernel is bound
        at the first forward. Returns counts per ``"<format> <source>"``."""
        if method not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization {method!r}: use one of {', '.join(QUANTIZATION_METHODS)}")
        exact, packed_fmt = _METHOD_FORMATS[method]
        return weight_blocks.quantize_weights(self, method, exact, packed_fmt if pack else None, gguf_blocks)

    def quantized_state(self, counts: Mapping[str, int]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        return weight_blocks.quantized_state(self, counts)

    def restore_quantized(self, tensors: Mapping[str, torch.Tensor], formats: Mapping[str, str]) -> dict[str, int] | None:
        return weight_blocks.restore_quantized(self, tensors, formats)

    def quantized_linears(self) -> list[QuantizedLinear]:
        return [q for _, _, q in weight_blocks.entries_of(self)]

    def restore_float_weights(self) -> int:
        """Make the float weights not held again from their blocks (a plan that uses them, a
        re-measurement). Returns how many were restored."""
        return weight_blocks.restore_float_weights(self)

    # ------------------------------------------------------------------ routes (layers/kernel_routing.py)
    def resolve_gemv(self) -> str | None:
        """Bind every quantized entry's kernel and the plan's routes (:meth:`KernelRouting.resolve`)."""
        return self.routing.resolve()

    def install_kernel_plan(self, plan: Any) -> None:
        self.routing.install_plan(plan)

    def fallback_candidate(self, group: str, rows: int) -> str:
        return self.routing.fallback_candidate(group, rows)

    def dropped_float_bytes(self) -> int:
        return self.routing.dropped_float_bytes()

    def fused_decode_status(self, kv_cache_dtype: torch.dtype) -> str:
        """A family whose layers the fused C++ layer does not serve says so here."""
        return self.routing.fused_decode_status(kv_cache_dtype)

    def precision_report(self, kv_cache_dtype: torch.dtype) -> dict[str, str]:
        return precision_report(self, kv_cache_dtype)
