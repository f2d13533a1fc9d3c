"""The presets of issue 32's families carry their config.json facts, and their exact parameter
counts equal transformers' own models built from the same config.json on the meta device
(no weights allocated, nothing downloaded).

Each config.json below is the public file's shape keys (huggingface.co/<repo>/blob/main/
config.json, the repo in the key's comment). Two checks per preset: kvscope's config.json
reader turns the dict into the preset's shapes, and transformers' model of the dict has
``num_parameters`` parameters. transformers builds a 36-layer 8B model on the meta device
in ~30 s on this 2-core machine (its per-layer init), so its count is taken at one and two
layers and extended by the per-layer difference (every layer of these dense families is the
same); kvscope's count is compared at two layers exactly too."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from engine.modelspec.config import ModelConfig
from engine.modelspec.presets import MODEL_PRESETS, resolve_preset_name
from engine.modelspec.readers import model_config_from_hf_dict

# The keys both public files of a family hold alike (the two sizes differ in their shapes only).
QWEN2_5_FILE: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "max_position_embeddings": 32768,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "bos_token_id": 151643, "eos_token_id": 151645,
    "use_sliding_window": False}
QWEN3_FILE: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 128, "vocab_size": 151936,
    "max_position_embeddings": 40960, "rope_theta": 1000000, "rms_norm_eps": 1e-06, "attention_bias": False,
    "bos_token_id": 151643, "eos_token_id": 151645, "sliding_window": None, "use_sliding_window": False}
CONFIG_JSON: dict[str, dict[str, Any]] = {
    # Qwen/Qwen2.5-0.5B-Instruct
    "qwen2.5-0.5b": {**QWEN2_5_FILE, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                     "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
                     "tie_word_embeddings": True, "sliding_window": 32768},
    # Qwen/Qwen2.5-7B-Instruct
    "qwen2.5-7b": {**QWEN2_5_FILE, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                   "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
                   "tie_word_embeddings": False, "sliding_window": 131072},
    # Qwen/Qwen3-0.6B
    "qwen3-0.6b": {**QWEN3_FILE, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "tie_word_embeddings": True},
    # Qwen/Qwen3-8B
    "qwen3-8b": {**QWEN3_FILE, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": False},
    # mistralai/Mistral-7B-v0.1
    "mistral-7b": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
                   "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                   "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 32768,
                   "rope_theta": 10000.0, "rms_norm_eps": 1e-05, "tie_word_embeddings": False,
                   "sliding_window": 4096, "bos_token_id": 1, "eos_token_id": 2},
    # microsoft/Phi-3-mini-4k-instruct
    "phi-3-mini": {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": 3072,
                   "intermediate_size": 8192, "num_hidden_layers": 32, "num_attention_heads": 32,
                   "num_key_value_heads": 32, "vocab_size": 32064, "max_position_embeddings": 4096,
                   "original_max_position_embeddings": 4096, "rope_theta": 10000.0, "rope_scaling": None,
                   "rms_norm_eps": 1e-05, "tie_word_embeddings": False, "sliding_window": 2047,
                   "bos_token_id": 1, "eos_token_id": 32000, "pad_token_id": 32000},
}
# The model cards' rounded totals, as a sanity check on the facts themselves.
CARD_BILLIONS = {"qwen2.5-0.5b": 0.49, "qwen2.5-7b": 7.61, "qwen3-0.6b": 0.6, "qwen3-8b": 8.2,
                 "mistral-7b": 7.24, "phi-3-mini": 3.8}
SHAPE_FIELDS = ("num_layers", "hidden_size", "intermediate_size", "vocab_size", "num_attention_heads",
                "num_kv_heads", "head_dim", "max_position_embeddings", "rope_theta", "rms_norm_eps",
                "tie_word_embeddings", "attention_bias", "architecture", "bos_token_id", "eos_token_id",
                "qk_norm", "layer_types", "sliding_window")


def transformers_count(cfg: dict[str, Any], layers: int) -> int:
    """transformers' parameter count of ``cfg`` cut to ``layers`` layers (meta device)."""
    import transformers

    config_class = transformers.AutoConfig.for_model(cfg["model_type"]).__class__
    keys = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
    config = config_class(**{**keys, "num_hidden_layers": layers})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())  # a tied head is one parameter


def with_layers(config: ModelConfig, layers: int) -> ModelConfig:
    types = None if config.layer_types is None else config.layer_types[:1] * layers
    return dataclasses.replace(config, num_layers=layers, layer_types=types)


@pytest.mark.parametrize("name", sorted(CONFIG_JSON))
def test_preset_is_its_config_json_and_counts_as_transformers_does(name: str) -> None:
    pytest.importorskip("transformers")
    preset = MODEL_PRESETS[name]
    parsed = model_config_from_hf_dict(CONFIG_JSON[name], name)
    for field in SHAPE_FIELDS:
        assert getattr(parsed, field) == getattr(preset, field), (name, field)
    one, two = (transformers_count(CONFIG_JSON[name], n) for n in (1, 2))
    assert with_layers(preset, 2).num_parameters == two
    expected = one + (preset.num_layers - 1) * (two - one)
    print(f"\n{name}: {preset.num_parameters:,} parameters (transformers: {expected:,})")
    assert preset.num_parameters == expected
    assert abs(preset.num_parameters / 1e9 - CARD_BILLIONS[name]) < 0.05 * CARD_BILLIONS[name]


def test_hub_names_resolve_to_the_presets() -> None:
    assert resolve_preset_name("Qwen/Qwen2.5-0.5B-Instruct") == "qwen2.5-0.5b"
    assert resolve_preset_name("Qwen/Qwen3-8B") == "qwen3-8b"
    assert resolve_preset_name("mistralai/Mistral-7B-Instruct-v0.1") == "mistral-7b"
    assert resolve_preset_name("microsoft/Phi-3-mini-4k-instruct") == "phi-3-mini"
