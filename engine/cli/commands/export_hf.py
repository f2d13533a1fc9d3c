"""``engine export-hf MODEL OUT``: write an HF model folder (config.json,
model.safetensors, tokenizer files, generation_config.json) from a GGUF or HF
model, with llama.cpp's Q/K permutation undone, so transformers and vLLM load
exactly the weights this engine runs."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from engine.errors import UserError
from engine.modelspec.config import ModelConfig
from engine.modelspec.readers import load_model_config

_HF_ARCHITECTURES = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2")}


def hf_config_dict(config: ModelConfig, dtype: str, stop_token_ids: list[int]) -> dict[str, Any]:
    architecture, model_type = _HF_ARCHITECTURES.get(config.architecture, _HF_ARCHITECTURES["llama"])
    out: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_theta": config.rope_theta,
        "rms_norm_eps": config.rms_norm_eps,
        "hidden_act": "silu",
        "tie_word_embeddings": config.tie_word_embeddings,
        "torch_dtype": dtype,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": stop_token_ids[0] if len(stop_token_ids) == 1 else stop_token_ids,
    }
    if model_type == "llama":
        out.update(attention_bias=config.attention_bias, mlp_bias=False)
    return out


def export_hf(model: str, out: Path, dtype: str = "float32") -> Path:
    """Write the HF folder; returns ``out``. float32 keeps dequantized GGUF weights exact."""
    from safetensors.torch import save_file

    config = load_model_config(model)
    if config.source not in ("gguf", "hf"):
        raise UserError(f"model {model!r} is a preset without weights; export needs a .gguf file or HF folder")
    if out.exists() and any(out.iterdir()):
        raise UserError(f"{out}: folder exists and is not empty; choose a new OUT folder")
    from engine.model.loader import load_hf_state_dict  # torch loads only once the arguments are checked
    from engine.model.runner import torch_dtype
    from engine.model.tokenizer import Tokenizer

    canonical = str(torch_dtype(dtype)).removeprefix("torch.")
    tokenizer = Tokenizer.for_model(config)
    state = load_hf_state_dict(config, dtype=torch_dtype(dtype))
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config_dict(config, canonical, tokenizer.stop_token_ids), indent=2))
    generation = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.stop_token_ids if len(tokenizer.stop_token_ids) > 1 else tokenizer.eos_token_id,
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    tokenizer.save_hf(out, model_max_length=config.max_position_embeddings)
    return out


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export-hf", help="write an HF model folder (safetensors + tokenizer) from a GGUF or HF model"
    )
    parser.add_argument("model", help="preset name, .gguf file or HF folder")
    parser.add_argument("out", type=Path, help="output folder (created; must be empty)")
    parser.add_argument("--dtype", default="float32", help="weights dtype in the file (float32 keeps GGUF values exact)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    out = export_hf(args.model, args.out, args.dtype)
    print(f"wrote {out} (config.json, model.safetensors, tokenizer.json, tokenizer_config.json, generation_config.json)")
    return 0
