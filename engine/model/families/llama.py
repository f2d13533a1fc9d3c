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
from engine.model.layers.quantized_linear import QuantizedLinear
from engine.model.layers.rope_scaling import llama3_scaled_inv_freq
from engine.model.loading import weight_blocks
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
# Token rows (a step's tokens) up to which the GEMV kernel beats torch's float32 GEMM, per
# kernel ISA: per format for the projections, and for the LM head (49152 x 576, where float
# GEMM is slowest per row). AVX2 (Zen 3, 1 thread, shared machine, bench/bench_gemv.py, µs
# fp32 -> q4_1): 8 rows qkv 966 -> 275, down 1320 -> 719, head 70738 -> 15217; 16 rows
# qkv 1010 -> 608, gate_up 3104 -> 1862 but down 618 -> 1281 (the kernel's FMAs grow with
# rows, GEMM's do not), head 72022 -> 31841. q4_1x8 (int8 activations, 32 products per
# maddubs) beats float GEMM at every step size: AVX2, 2 threads, weights streamed from
# memory, fp32 -> q4_1x8 µs: gate_up 8 rows 1458 -> 165, 64 rows 2652 -> 1075, 512 rows
# 14822 -> 9483; down 512 rows 6020 -> 4283. AVX-512 is not measured yet: AVX2's limits.
_EVERY_STEP = 1 << 30
GEMV_MAX_ROWS: dict[str, dict[str, int]] = {
    "avx2": {"q8_0": 8, "q4_1": 8, "q4_1x8": _EVERY_STEP, "head": 16},
    "avx512": {"q8_0": 8, "q4_1": 8, "q4_1x8": _EVERY_STEP, "head": 16},
    "scalar": {"q8_0": 1, "q4_1": 1, "q4_1x8": 1, "head": 1},
}
# The kernel plan's group of each projection (engine/model/plan/kernel_plan.py GROUP_ATTRS), and back.
_GROUP_OF = {"qkv_proj": "qkv", "o_proj": "o", "gate_up_proj": "gate_up", "down_proj": "down"}
_GROUP_ATTRS = {**{group: name for name, group in _GROUP_OF.items()}, "head": "head"}

# Phase F's ``precision`` of prefill attention where the kernel plan gave every chunk size to the
# paged prefill kernel (engine/model/attention/cpu_decode.py).
PAGED_PREFILL = "the paged prefill kernel over the cache in place, float32 sums (the kernel plan)"
PAGED_PREFILL_BF16 = ("the paged prefill kernel over the cache in place, bf16 products (q and the softmax weights "
                      "rounded to bf16), float32 sums (the kernel plan)")


def linear_maybe_quantized(module: nn.Module, x: torch.Tensor, name: str, weight: torch.Tensor,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)``: by the kernel plan's route for ``name`` and this step's
    rows when there is one (engine/model/plan/); else (the plan off) through the
    quantized copy when the step is decode-sized by ``GEMV_MAX_ROWS``, or the float weight."""
    route = module.kernel_routes.get(name)
    if route is not None:
        out = route(x)
        return out if bias is None else out + bias
    q = module.quantized.get(name)
    if q is None or x.shape[0] > q.max_rows:
        return F.linear(x, weight, bias)
    out = q.gemv(x)
    return out if bias is None else out + bias


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


def dummy_fill(name: str, param: torch.Tensor, generator: torch.Generator) -> None:
    """A dummy weight in place: norms 1, everything else uniform in +-0.02."""
    if param.dim() == 1 and "bias" not in name:
        param.fill_(1.0)
    else:
        param.uniform_(-0.02, 0.02, generator=generator)


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
        self.quantized: dict[str, QuantizedLinear] = {}  # the LM head's, as "head"
        # The embedding's GGUF blocks where its float copy is not held (engine/model/loading/gguf_blocks.py).
        self._embed_blocks: QuantizedLinear | None = None
        self.kernel_routes: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}  # the head's, by the plan
        self.kernel_plan: Any = None  # engine/model/plan/kernel_plan.KernelPlan once installed; None: the constants
        self._fused_max_rows = 1 << 30  # the plan's limit for fused pure-decode steps (cpu_layer.MAX_ROWS caps it)
        self.quantization_fallback: str | None = None  # why the quantized copies are not used
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
        if isinstance(meta, AttentionMetadata) and (layer_kernel := self._layer_kernel_for(meta, kv_caches)) is not None:
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
        blocks = self.embed_blocks()
        if blocks is not None:  # the file's blocks: only the rows this step reads are dequantized
            return blocks.dequantize_rows(input_ids).to(self.dtype)
        return F.embedding(input_ids, self.embed_tokens)

    def _layer_kernel_for(self, meta: AttentionMetadata, kv_caches: list[torch.Tensor]) -> Any:
        """The fused-layer kernel module when this step can use it: a pure decode of at
        most ``cpu_layer.MAX_ROWS`` sequences, the paged-decode kernel switched on (phase F),
        a float32 or int8 cache, and the kernel built (else None: the op-by-op path)."""
        from engine.model.kernels import cpu_layer

        rows = meta.slot_mapping.shape[0]
        if not self._fused_layers or not meta.is_pure_decode or rows > cpu_layer.MAX_ROWS or rows > self._fused_max_rows:
            return None
        if getattr(self.backend, "decode_kernel", None) is None or kv_caches[0].dtype not in cpu_layer.KV_DTYPES:
            return None
        return cpu_layer.load_kernel()

    def fused_decode_status(self, kv_cache_dtype: torch.dtype) -> str:
        """Whether pure-decode steps run each layer as one C++ call, for phase F's event:
        ``"enabled for pure-decode steps of <= N rows"`` or why not."""
        from engine.model.kernels import cpu_layer

        if self._gemv_pending:
            self.resolve_gemv()
        if not self._fused_layers:
            if not self.quantized_linears():
                return "off: no quantized projections (--quantization int8/int4 or a Q4_1/Q8_0 GGUF)"
            if self.quantization_fallback is not None:
                return "off: the CPU GEMV kernel is unavailable"
            return f"off: {self.dtype} weights (the fused layer serves float32)"
        if kv_cache_dtype not in cpu_layer.KV_DTYPES:
            return f"off: {kv_cache_dtype} KV cache (the fused layer serves float32, bfloat16 and int8)"
        if getattr(self.backend, "decode_kernel", None) is None:
            return "off: the paged-decode kernel is not in use"
        if cpu_layer.load_kernel() is None:
            return f"off: {cpu_layer.KERNEL.unavailable_reason or 'the kernel could not be built'}"
        if self.kernel_plan is not None:
            if not self._fused_max_rows:
                return "off: the kernel plan measured the op-by-op layer faster"
            return (f"enabled for pure-decode steps of <= {min(self._fused_max_rows, cpu_layer.MAX_ROWS)} sequences "
                    "(the kernel plan's measurement)")
        gemv_rows = min(q.max_rows for q in self.quantized_linears() if q is not self.quantized.get("head"))
        return (f"enabled for pure-decode steps of <= {cpu_layer.MAX_ROWS} sequences "
                + ("(GEMV at every batch size)" if gemv_rows >= cpu_layer.MAX_ROWS
                   else f"(GEMV up to {gemv_rows} rows, float GEMM above)"))

    def precision_report(self, kv_cache_dtype: torch.dtype) -> dict[str, str]:
        """Which parts of a CPU step run in bf16 and which in float32 (phase F's ``precision``):
        the activations' dtype, or under a float32 model the kernel plan's bf16 choices."""
        from engine.model.plan.kernel_plan import ATTENTION, STEP_CLASSES

        if self._gemv_pending:
            self.resolve_gemv()
        plan, name = self.kernel_plan, str(self.dtype).removeprefix("torch.")
        bf16_model = self.dtype == torch.bfloat16

        def picked(groups: Sequence[str], candidate: str = "bf16") -> str:
            """``group classes`` the plan runs by ``candidate``, e.g. "gate_up 33-64,65+"."""
            if plan is None:
                return ""
            parts = []
            for group in groups:
                steps = [sc.name for sc in STEP_CLASSES if (c := plan.cell(group, sc.name)) and c.chosen == candidate]
                if steps:
                    parts.append(f"{group} {','.join(steps)}")
            return "; ".join(parts)

        projections = picked(("qkv", "o", "gate_up", "down"))
        attention = picked((ATTENTION,))
        paged = picked((ATTENTION,), "paged")
        paged_bf16 = picked((ATTENTION,), "paged_bf16")
        every_class = f"{ATTENTION} " + ",".join(sc.name for sc in STEP_CLASSES if sc.lo > 1)
        sdpa = ("torch SDPA in bfloat16" if bf16_model else
                f"torch SDPA in float32; bf16 for chunks of {attention.split(' ', 1)[1]} rows (the kernel plan)"
                if attention else f"torch SDPA in {name}")
        report = {
            "activations": name,
            "rms_norm": f"{name} in and out, float32 sums",
            "projections": ("bfloat16 weights and activations (bf16 GEMM; the GEMV over GGUF blocks sums in float32)"
                            if bf16_model else f"float32; bf16 GEMM (the kernel plan) for {projections}"
                            if projections else name),
            "prefill_attention": (
                PAGED_PREFILL if paged == every_class else PAGED_PREFILL_BF16 if paged_bf16 == every_class
                else sdpa + (f"; the paged prefill kernel, float32 sums, for chunks of {paged.split(' ', 1)[1]} rows "
                             "(the kernel plan)" if paged else "")
                + (f"; the paged prefill kernel with bf16 products, float32 sums, for chunks of "
                   f"{paged_bf16.split(' ', 1)[1]} rows (the kernel plan)" if paged_bf16 else "")),
            "decode_attention": f"{name} queries over a {str(kv_cache_dtype).removeprefix('torch.')} cache, "
                                "float32 sums",
            "lm_head": "float32 sums, float32 logits (bf16 weights widened exactly)" if bf16_model
                       else "float32 sums, float32 logits",
        }
        if self._fused_layers:
            report["fused_decode_layer"] = "float32 activations, the GEMV over the GGUF blocks"
        return report

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
        route = self.kernel_routes.get("head")
        if route is not None:
            return route(x)
        q = self.quantized.get("head")
        if q is not None and q.gemv is not None and x.shape[0] <= q.max_rows:
            return q.gemv(x)  # the GEMV sums in float32 and returns float32 rows for float32 rows
        return fp32_linear(x, self.head_weight)

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

    def embed_blocks(self) -> QuantizedLinear | None:
        """The embedding's blocks when its float copy is not held (a GGUF read as blocks)."""
        return self._embed_blocks if _holds_nothing(self.embed_tokens) else None

    def resolve_gemv(self) -> str | None:
        """Point every quantized entry at its kernel, or record (and log) why some run their
        float weights: no compiler, a kernel switched off, not on CPU. Returns that reason,
        or None when the kernels are in use."""
        from engine.model.kernels import cpu_gemv

        self._gemv_pending = False
        self._fused_layers = []
        entries = self.quantized_linears()
        if not entries:
            if self.kernel_plan is not None:
                self._route_by_plan(None)
            return None
        self.quantization_fallback = weight_blocks.bind(self)
        if self.quantization_fallback is not None:
            from engine.logs import get_logger

            get_logger("kvscope.quantization").warning(self.quantization_fallback)
        gemv_kernel = cpu_gemv.load_kernel() if self.embed_tokens.device.type == "cpu" else None
        isa = gemv_kernel.isa() if gemv_kernel is not None else "scalar"
        limits = GEMV_MAX_ROWS.get(isa, GEMV_MAX_ROWS["scalar"])
        for module, name, q in weight_blocks.entries_of(self):
            if q.gemv is None:
                continue
            held = not _holds_nothing(getattr(module, weight_blocks.float_attr(self, module, name)))
            # A weight read as blocks has no float copy for torch past the limit: its kernel runs every step.
            q.max_rows = limits["head" if name == "head" else q.fmt] if held and q.fmt in limits else _EVERY_STEP
        if self.kernel_plan is not None:
            self._route_by_plan(gemv_kernel)
        self._fused_layers = self._fused_args()
        if self.kernel_plan is not None and self._drop_unused_float_weights():
            self._fused_layers = self._fused_args()  # the args held the dropped parameters
        return self.quantization_fallback

    def _fused_args(self) -> list[tuple[tuple[object, ...], tuple[object, ...]]]:
        fused = [layer.fused_decode_args() for layer in decoder_layers(self.layers)]
        return [f for f in fused if f is not None] if fused and all(f is not None for f in fused) else []

    # ------------------------------------------------------------------ weights the plan never multiplies by
    def _float_weight_unused(self, layer: DecoderLayer, name: str) -> bool:
        """True when no step the kernel plan routes multiplies by ``layer``'s float ``name``:
        the GEMV (or a bf16/int8 copy) at every step size, and the fused layer (if on) never
        past its GEMV limit on the float weight. Only a GGUF's own blocks: their values are the
        float weights exactly, so :meth:`restore_float_weights` can make them again."""
        from engine.model.kernels.cpu_layer import MAX_ROWS

        q = layer.quantized.get(name)
        if q is None or q.gemv is None or q.source != "gguf":
            return False
        if any(c == "torch" for _, c in self.kernel_plan.choices(_GROUP_OF[name])):
            return False
        fused_rows = min(self._fused_max_rows, MAX_ROWS) if self._fused_layers else 0
        return fused_rows <= q.max_rows

    def _drop_unused_float_weights(self) -> int:
        """Replace each layer projection's float weight that the plan never multiplies by with a
        placeholder of its shape that holds one element (``weights_bytes`` counts nothing for
        it; phase C's ``kernel_plan_bytes`` goes down by it). Returns the bytes dropped."""
        dropped = 0
        for layer in decoder_layers(self.layers):
            for name in _PROJECTIONS:
                weight = getattr(layer, name)
                if _holds_nothing(weight) or not self._float_weight_unused(layer, name):
                    continue
                dropped += weight.numel() * weight.element_size()
                placeholder = torch.zeros(1, 1, dtype=weight.dtype, device=weight.device).expand(weight.shape)
                setattr(layer, name, nn.Parameter(placeholder, requires_grad=False))
        return dropped + self._drop_unused_head_weight()

    def _drop_unused_head_weight(self) -> int:
        """The LM head's float weight when no step multiplies by it (the plan routes every step size
        to the GEMV or to a copy of its own) and its GGUF blocks make it again. A tied head is the
        embedding: dropped only where the embedding reads its rows from the blocks too (Gemma 3
        270M's 262,144 x 640 head: 640 MiB, held beside its 640 MiB fp32pack copy before)."""
        q = self.quantized.get("head")
        attr = weight_blocks.head_attr(self)
        weight = getattr(self, attr)
        if (q is None or q.gemv is None or q.source != "gguf" or _holds_nothing(weight)
                or any(c == "torch" for _, c in self.kernel_plan.choices("head"))
                or (self.lm_head is None and self._embed_blocks is None)):
            return 0
        setattr(self, attr, weight_blocks.placeholder(weight))
        return weight.numel() * weight.element_size()

    def dropped_float_bytes(self) -> int:
        """Bytes of the float weights the kernel plan dropped (phase C's ``kernel_plan_dropped_bytes``)."""
        head = getattr(self, weight_blocks.head_attr(self))
        return (sum(w.numel() * w.element_size() for layer in self.layers for name in _PROJECTIONS
                    if _holds_nothing(w := getattr(layer, name)))
                + (head.numel() * head.element_size() if _holds_nothing(head) else 0))

    def restore_float_weights(self) -> int:
        """Make the float weights not held again from their blocks (a plan that uses them, a
        re-measurement). Returns how many were restored."""
        return weight_blocks.restore_float_weights(self)

    def fallback_candidate(self, group: str, rows: int) -> str:
        """What the constants (``GEMV_MAX_ROWS``) run for ``group`` (a kernel plan group) at
        ``rows``: the kernel plan's choice for cells it did not measure."""
        if self._gemv_pending:
            self.resolve_gemv()
        module = self if group == "head" else self.layers[0]
        q = module.quantized.get(_GROUP_ATTRS[group])
        return "gemv" if q is not None and q.gemv is not None and rows <= q.max_rows else "torch"

    def install_kernel_plan(self, plan: Any) -> None:
        """Run by ``plan`` (engine/model/plan/): each projection's route by step size,
        the copies it uses (bf16, int8; buffers, so ``weights_bytes`` counts them) made now,
        the fused layer's GEMV limits and row limit from the plan."""
        from engine.model.plan.kernel_plan import ATTENTION

        self.kernel_plan = plan
        if hasattr(self.backend, "prefill_attention"):
            self.backend.prefill_attention = tuple(plan.choices(ATTENTION))
        self.resolve_gemv()

    def _route_by_plan(self, kernel: Any) -> None:
        from engine.model.kernels.cpu_layer import MAX_ROWS
        from engine.model.plan.candidates import BLOCK_CANDIDATES, PLAN_COPY_SUFFIXES
        from engine.model.plan.routes import build_route

        plan = self.kernel_plan
        for prefix, module in weight_blocks.quantized_modules(self).items():
            for name in ("head",) if prefix == "" else _PROJECTIONS:
                group = "head" if name == "head" else _GROUP_OF[name]
                q = module.quantized.get(name)
                usable = q is not None and q.gemv is not None
                choices = [(hi, "torch" if c == "gemv" and not usable else c) for hi, c in plan.choices(group)]
                weight = self.head_weight if name == "head" else getattr(module, name)
                if _holds_nothing(weight) and any(c not in BLOCK_CANDIDATES for _, c in choices):
                    # not held (read as blocks, or an earlier plan dropped it); this plan multiplies by it
                    weight = weight_blocks.restore_float(self, module, name)
                route, extra = build_route(choices, weight, q, kernel, group)
                module.kernel_routes[name] = route
                for suffix in PLAN_COPY_SUFFIXES:  # an earlier plan's copies
                    module._buffers.pop(f"{name}_{suffix}", None)
                for suffix, tensor in extra.items():
                    module.register_buffer(f"{name}_{suffix}", tensor, persistent=False)
                if q is not None:
                    # The fused decode layer (pure decodes up to the plan's fused_max_rows, which the plan
                    # times against these routes at every class) runs its GEMV at every size it serves:
                    # its only other path is a dense at::linear, which reorders a bf16 weight on every
                    # call (Zen 4: 16-row decode steps took 80 ms on it against ~25 ms on the GEMV).
                    q.max_rows = (MAX_ROWS if name != "head" else plan.gemv_limit(group)) if usable else 0
        self._fused_max_rows = plan.fused_max_rows

    def weights_bytes(self) -> int:
        """Bytes the weights really hold: parameters plus any quantized copies (a float weight
        the kernel plan dropped holds nothing)."""
        tensors = [*self.parameters(), *self.buffers()]
        return int(sum(t.numel() * t.element_size() for t in tensors if not _holds_nothing(t)))

    # ------------------------------------------------------------------ weights
    def _fused_target(self, hf_name: str) -> tuple[torch.Tensor, int, int] | None:
        """``(parameter, row offset, rows)`` that an HF tensor fills, or None if unknown."""
        if hf_name == "model.embed_tokens.weight":
            return self.embed_tokens, 0, self.embed_tokens.shape[0]
        if hf_name == "model.norm.weight":
            return self.norm, 0, self.norm.shape[0]
        if hf_name == "lm_head.weight":
            if self.lm_head is None:
                return None  # tied: some checkpoints still carry a copy
            return self.lm_head, 0, self.lm_head.shape[0]
        if not hf_name.startswith("model.layers."):
            return None
        index_str, rest = hf_name[len("model.layers.") :].split(".", 1)
        index = int(index_str)
        if index >= len(self.layers):
            return None  # dummy/reduced-layer configs reading a bigger file
        layer = decoder_layers(self.layers)[index]
        q, kv, inter = layer.q_size, layer.kv_size, layer.intermediate_size
        table: dict[str, tuple[torch.Tensor | None, int, int]] = {
            "input_layernorm.weight": (layer.input_layernorm, 0, layer.input_layernorm.shape[0]),
            "post_attention_layernorm.weight": (layer.post_attention_layernorm, 0, layer.post_attention_layernorm.shape[0]),
            "self_attn.q_proj.weight": (layer.qkv_proj, 0, q),
            "self_attn.k_proj.weight": (layer.qkv_proj, q, kv),
            "self_attn.v_proj.weight": (layer.qkv_proj, q + kv, kv),
            "self_attn.q_proj.bias": (layer.qkv_bias, 0, q),
            "self_attn.k_proj.bias": (layer.qkv_bias, q, kv),
            "self_attn.v_proj.bias": (layer.qkv_bias, q + kv, kv),
            "self_attn.o_proj.weight": (layer.o_proj, 0, layer.o_proj.shape[0]),
            "mlp.gate_proj.weight": (layer.gate_up_proj, 0, inter),
            "mlp.up_proj.weight": (layer.gate_up_proj, inter, inter),
            "mlp.down_proj.weight": (layer.down_proj, 0, layer.down_proj.shape[0]),
        }
        entry = table.get(rest)
        if entry is None or entry[0] is None:
            return None
        return entry[0], entry[1], entry[2]

    def hf_names(self) -> list[str]:
        """Every HF tensor name this model needs."""
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if self.lm_head is not None:
            names.append("lm_head.weight")
        per_layer = [
            "input_layernorm.weight", "post_attention_layernorm.weight",
            "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
            "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
        ]
        if self.config.attention_bias:
            per_layer += ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]
        for i in range(len(self.layers)):
            names.extend(f"model.layers.{i}.{n}" for n in per_layer)
        return names

    def missing_hf_names(self, seen: set[str]) -> set[str]:
        return set(self.hf_names()) - seen

    @torch.no_grad()
    def load_hf_tensor(self, hf_name: str, tensor: torch.Tensor) -> None:
        target = self._fused_target(hf_name)
        if target is None:
            return
        param, offset, rows = target
        if tensor.shape[0] != rows or tuple(tensor.shape[1:]) != tuple(param.shape[1:]):
            raise ValueError(f"{hf_name}: shape {tuple(tensor.shape)} does not fit {(rows, *param.shape[1:])}")
        param[offset : offset + rows].copy_(tensor)

    @torch.no_grad()
    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Unfused HF-named tensors (views into the fused parameters)."""
        out = {}
        for name in self.hf_names():
            target = self._fused_target(name)
            assert target is not None
            param, offset, rows = target
            out[name] = param[offset : offset + rows]
        return out

    @torch.no_grad()
    def init_dummy_weights(self, seed: int = 0) -> int:
        """Small random weights in place (no second copy); norms are 1. Returns the tensor count."""
        generator = torch.Generator(device="cpu").manual_seed(seed)
        count = 0
        for name, param in self.named_parameters():
            dummy_fill(name, param, generator)
            count += 1
        return count
