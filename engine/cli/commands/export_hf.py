"""``engine export-hf MODEL OUT``: write an HF model folder (config.json,
model.safetensors, tokenizer files, generation_config.json) from a GGUF or HF
model, with llama.cpp's Q/K permutation undone, so transformers and vLLM load
exactly the weights this engine runs. Each family is written as its own transformers
class, config fields and tensor conventions (engine/modelspec/hf_export.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from engine.cli.program import Subparsers
from engine.errors import UserError
from engine.modelspec.hf_export import hf_config, hf_export_for, hf_tensors
from engine.modelspec.readers import load_model_config


def export_hf(model: str, out: Path, dtype: str = "float32") -> Path:
    """Write the HF folder; returns ``out``. float32 keeps dequantized GGUF weights exact."""
    from safetensors.torch import save_file

    config = load_model_config(model)
    if config.source not in ("gguf", "hf"):
        raise UserError(f"model {model!r} is a preset without weights; export needs a .gguf file or HF folder")
    if out.exists() and any(out.iterdir()):
        raise UserError(f"{out}: folder exists and is not empty; choose a new OUT folder")
    hf_export_for(config)  # a family with no transformers form is refused before the weights load
    from engine.model.loading.loader import (
        load_hf_state_dict,  # torch loads only once the arguments are checked
    )
    from engine.model.loading.tokenizer import Tokenizer
    from engine.model.runner import torch_dtype

    canonical = str(torch_dtype(dtype)).removeprefix("torch.")
    tokenizer = Tokenizer.for_model(config)
    config_json = hf_config(config, canonical, tokenizer.stop_token_ids)  # refuses a rope it cannot write
    state = hf_tensors(config, load_hf_state_dict(config, dtype=torch_dtype(dtype)))
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config_json, indent=2))
    generation = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.stop_token_ids if len(tokenizer.stop_token_ids) > 1 else tokenizer.eos_token_id,
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    tokenizer.save_hf(out, model_max_length=config.max_position_embeddings)
    return out


def register(subparsers: Subparsers) -> None:
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
