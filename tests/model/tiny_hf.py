"""Tiny random-weight HF checkpoints of a model family, built at test time with transformers
(a family config class, ``AutoModelForCausalLM.from_config``, seeded, ``save_pretrained``
as safetensors): nothing is downloaded. transformers initialises biases to 0 and norms to 1,
which would leave the Q/K/V biases and the QK-norm weights untested, so every parameter is
redrawn (norms 1 + N(0, 0.2), biases and weights N(0, 0.1)) before saving."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# 2 layers, hidden 64, 4 heads over 2 KV heads of dim 16, vocab 320, MLP 128.
TINY_SHAPES: dict[str, Any] = {
    "vocab_size": 320, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2,
}
# variant -> (config class name, tie_word_embeddings, rope base)
VARIANTS: dict[str, tuple[str, bool, float]] = {
    "qwen2-tied": ("Qwen2Config", True, 1_000_000.0),
    "qwen2-untied": ("Qwen2Config", False, 10_000.0),
    "qwen3-tied": ("Qwen3Config", True, 1_000_000.0),
    "qwen3-untied": ("Qwen3Config", False, 10_000.0),
}


def build_tiny_model(variant: str, seed: int = 0) -> Any:
    import transformers

    class_name, tied, theta = VARIANTS[variant]
    config = getattr(transformers, class_name)(**TINY_SHAPES, tie_word_embeddings=tied, rope_theta=theta)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if param.dim() == 1 and "norm" in name:
                param.copy_(1.0 + 0.2 * noise)
            else:
                param.copy_(0.1 * noise)
    return model.eval()


def save_tiny_checkpoint(variant: str, folder: Path, seed: int = 0) -> Any:
    """Write ``folder`` (config.json + model.safetensors) and return the transformers model."""
    model = build_tiny_model(variant, seed)
    model.save_pretrained(str(folder))
    return model
