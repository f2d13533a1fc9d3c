"""``ModelConfig``: a model's shapes and its family's own fields (Llama, Qwen2/Qwen3, Gemma 3
with its sliding-window layers), the dtype names and sizes they are counted in, and its exact
parameter count. It comes from an HF folder's config.json, a GGUF header or a preset
(:mod:`engine.modelspec.readers`, :mod:`engine.modelspec.presets`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from engine.modelspec.families import Family

DTYPE_BYTES: dict[str, float] = {
    "float32": 4,
    "fp32": 4,
    "bfloat16": 2,
    "bf16": 2,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "int8": 1,
}

KV_CACHE_DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")
# int8 KV stores one fp32 scale per (token, KV head) for K and for V, in the cache
# itself (engine/model/attention/kv_quant.py); fp8 uses vLLM's default scale 1.0 (none stored).
INT8_KV_SCALE_BYTES = 4

GiB = 1024**3
MiB = 1024**2
KiB = 1024

CANONICAL_DTYPE = {
    "fp32": "float32",
    "float": "float32",
    "float32": "float32",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "float16": "float16",
}

# transformers' names for a layer's attention (Gemma3TextConfig.layer_types).
SLIDING_ATTENTION = "sliding_attention"
FULL_ATTENTION = "full_attention"
# Gemma 3 values llama.cpp and transformers fix for every size and a GGUF does not carry.
GEMMA3_SLIDING_WINDOW_PATTERN = 6  # five sliding layers, then one full
GEMMA3_ROPE_LOCAL_BASE_FREQ = 10_000.0


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Rope frequency scaling (config.json ``rope_scaling`` / transformers 5's ``rope_parameters``).
    ``llama3`` (Llama 3.1/3.2): wavelengths longer than ``original_max_position_embeddings /
    low_freq_factor`` are stretched by ``factor``, those shorter than ``... / high_freq_factor``
    kept, the ones between blended (transformers' ``_compute_llama3_parameters``). A GGUF holds
    the result instead, one divisor per rotary frequency (llama.cpp's ``rope_freqs`` tensor):
    ``rope_type`` "freq_factors" with ``freq_factors``. ``linear`` (Gemma 3 4B/12B/27B's global
    layers, factor 8): every frequency divided by ``factor`` (positions interpolated)."""

    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 1.0
    original_max_position_embeddings: int = 0
    rope_type: str = "llama3"  # llama3 | freq_factors | linear
    freq_factors: tuple[float, ...] | None = None


@dataclass(frozen=True, slots=True)
class ModelConfig:
    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    dtype: str = "bfloat16"
    architecture: str = "llama"
    source: str = "preset"  # preset | hf | gguf
    path: str | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # Model families beyond Llama (Gemma 3). None on a Llama config, and then left out of
    # summary(), so a Llama run's recorded config is what it was before these existed.
    layer_types: tuple[str, ...] | None = None  # per layer: "sliding_attention" | "full_attention"
    sliding_window: int | None = None  # keys a sliding layer's query sees, itself included
    rope_local_base_freq: float | None = None  # the sliding layers' rope base (rope_theta: the full ones')
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power (else head_dim's)
    hidden_activation: str | None = None  # "gelu_pytorch_tanh" (Gemma); None: SiLU
    qk_norm: bool | None = None  # Qwen3: Q and K RMS-normed per head (a head_dim weight each) before the rotation
    rope_scaling: RopeScaling | None = None  # Llama 3.1/3.2's llama3 frequency scaling; None: plain rope
    # Mixture of experts (Qwen3-MoE, Mixtral; engine/model/layers/moe.py). None on a dense model.
    num_experts: int | None = None  # experts per MoE layer
    num_experts_per_tok: int | None = None  # the router's top-k
    moe_intermediate_size: int | None = None  # one expert's SwiGLU width
    norm_topk_prob: bool | None = None  # the top-k probabilities renormalised to sum 1
    mlp_only_layers: tuple[int, ...] | None = None  # layers with a dense MLP (intermediate_size) instead
    decoder_sparse_step: int | None = None  # layer i is sparse when (i + 1) % step == 0 (None: 1)
    shared_expert_intermediate_size: int | None = None  # Qwen2-MoE: a gated shared expert every token runs

    FAMILY_FIELDS: ClassVar[tuple[str, ...]] = ("layer_types", "sliding_window", "rope_local_base_freq", "rope_scaling",
                                                "query_pre_attn_scalar", "hidden_activation", "qk_norm",
                                                "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                                "norm_topk_prob", "mlp_only_layers", "decoder_sparse_step",
                                                "shared_expert_intermediate_size")

    @property
    def family(self) -> Family:
        """The registry's family of this architecture (engine/modelspec/families.py)."""
        from engine.modelspec.families import family_for_architecture  # it imports this module

        return family_for_architecture(self.architecture)

    def layer_is_sliding(self, index: int) -> bool:
        return self.layer_types is not None and self.layer_types[index] == SLIDING_ATTENTION

    @property
    def is_moe(self) -> bool:
        return bool(self.num_experts)

    def is_moe_layer(self, index: int) -> bool:
        """transformers' rule (Qwen3MoeDecoderLayer): sparse unless in ``mlp_only_layers`` or
        ``index + 1`` is not a multiple of ``decoder_sparse_step``."""
        if not self.num_experts or (self.mlp_only_layers and index in self.mlp_only_layers):
            return False
        return (index + 1) % (self.decoder_sparse_step or 1) == 0

    @property
    def num_moe_layers(self) -> int:
        return sum(1 for i in range(self.num_layers) if self.is_moe_layer(i))

    @property
    def expert_parameters(self) -> int:
        """Every routed expert's weights (gate, up, down) over every MoE layer (a shared expert, which
        every token runs, is not among them); 0 for a dense model."""
        if not self.num_experts or not self.moe_intermediate_size:
            return 0
        return self.num_moe_layers * self.num_experts * 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def num_active_parameters(self) -> int:
        """Parameters one token's forward uses: all but the experts the router did not pick
        (top-k of each MoE layer's experts; the embedding and LM head count whole, as the
        model cards' "activated" figures do: Qwen3-30B-A3B 3.3B, Mixtral 8x7B 12.9B)."""
        if not self.num_experts or not self.num_experts_per_tok:
            return self.num_parameters
        idle = self.num_experts - self.num_experts_per_tok
        return self.num_parameters - self.expert_parameters * idle // self.num_experts

    @property
    def num_parameters(self) -> int:
        """Exact parameter count from the shapes; a tied LM head counts once."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h
        if self.attention_bias:
            attn += q + 2 * kv
        mlp = 3 * h * i
        per_layer = attn + mlp + 2 * h  # two RMSNorm weights
        family = self.family
        per_layer += family.extra_layer_norms * h  # Gemma 3: norms after attention and after the MLP
        if self.qk_norm or family.qk_norm:  # Qwen3, Gemma 3: the Q and K norms
            per_layer += 2 * self.head_dim
        embed = v * h
        head = 0 if self.tie_word_embeddings else v * h
        # a MoE layer's router and experts in place of the dense MLP
        # (and a shared expert with its one-row sigmoid gate, Qwen2-MoE's)
        shared = 3 * h * self.shared_expert_intermediate_size + h if self.shared_expert_intermediate_size else 0
        sparse = self.num_moe_layers * ((self.num_experts or 0) * h + shared - mlp) + self.expert_parameters
        return embed + head + self.num_layers * per_layer + h + sparse

    def summary(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for name in self.FAMILY_FIELDS:
            if out[name] is None:
                del out[name]
        if out.get("layer_types") is not None:
            out["layer_types"] = list(out["layer_types"])
        if out.get("mlp_only_layers") is not None:
            out["mlp_only_layers"] = list(out["mlp_only_layers"])
        out["num_parameters"] = self.num_parameters
        if self.is_moe:
            out["num_active_parameters"] = self.num_active_parameters
            out["expert_parameters"] = self.expert_parameters
        return out
