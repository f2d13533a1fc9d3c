"""Which model class runs a model, and what a GGUF file must hold for kvscope to run it.

A model family is one module (``llama.py``, ``gemma3.py``) chosen by the architecture
(a GGUF's ``general.architecture``, an HF config's ``model_type``). Issue 32 grows this
into a full registry; today it is one dict.

:func:`check_gguf_supported` reads only the header (milliseconds, engine/model/gguf_header.py)
and refuses, before any weights load, a file whose architecture, tokenizer type or
tensor types kvscope cannot run, naming what is missing and what is supported.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from engine.errors import UserError

if TYPE_CHECKING:
    from engine.budget.config import ModelConfig
    from engine.model.llama import LlamaForCausalLM

# GGUF general.architecture -> (family module, the tokenizer types it is run with).
# Llama's class serves Llama, SmolLM and Mistral files (llama.cpp names them "llama")
# and Qwen2 (Q/K/V biases); Gemma 3 has its own module.
GGUF_ARCHITECTURES: dict[str, tuple[str, tuple[str, ...]]] = {
    "llama": ("llama", ("gpt2",)),
    "qwen2": ("llama", ("gpt2",)),
    "gemma3": ("gemma3", ("llama",)),
}
# tokenizer.ggml.model -> what it is (for the refusal's wording).
TOKENIZER_KINDS = {"gpt2": "byte-level BPE", "llama": "SentencePiece (BPE with byte fallback)"}
# ggml tensor types the loader dequantizes (with the gguf package) and has checked.
SUPPORTED_GGML_TYPES = {0: "F32", 1: "F16", 30: "BF16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0",
                        10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}


def family_of(architecture: str) -> str:
    """The family module's name; every architecture not listed runs as Llama (HF folders
    and shape presets have always done so)."""
    entry = GGUF_ARCHITECTURES.get(architecture) or GGUF_ARCHITECTURES.get(architecture.removesuffix("_text"))
    return entry[0] if entry is not None else "llama"


def model_class_for(config: ModelConfig) -> type[LlamaForCausalLM]:
    if family_of(config.architecture) == "gemma3":
        from engine.model.gemma3 import Gemma3ForCausalLM

        return Gemma3ForCausalLM
    from engine.model.llama import LlamaForCausalLM

    return LlamaForCausalLM


def _ggml_type_name(kind: int) -> str:
    try:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(kind).name
    except (ImportError, ValueError):
        return f"type {kind}"


def check_gguf_supported(path: Path) -> None:
    """Raise a UserError naming every unsupported part of the GGUF at ``path``: its
    architecture, its tokenizer type for that architecture, its tensors' ggml types."""
    from engine.model.gguf_header import read_gguf_header

    header = read_gguf_header(path)
    meta = header.metadata
    architecture = meta.get("general.architecture")
    supported_arches = ", ".join(sorted(GGUF_ARCHITECTURES))
    if architecture not in GGUF_ARCHITECTURES:
        raise UserError(f"{path}: architecture {architecture!r} is not supported; kvscope runs GGUF architectures "
                        f"{supported_arches}")
    assert isinstance(architecture, str)
    problems: list[str] = []
    tokenizer = meta.get("tokenizer.ggml.model")
    allowed = GGUF_ARCHITECTURES[architecture][1]
    if tokenizer not in allowed:
        kinds = " or ".join(f"{t!r} ({TOKENIZER_KINDS[t]})" for t in allowed)
        problems.append(f"tokenizer type {tokenizer!r} is not supported for {architecture}; it needs {kinds}")
    unsupported: dict[int, list[str]] = {}
    for tensor in header.tensors:
        if tensor.ggml_type not in SUPPORTED_GGML_TYPES:
            unsupported.setdefault(tensor.ggml_type, []).append(tensor.name)
    for kind, names in sorted(unsupported.items()):
        problems.append(f"{len(names)} tensor(s) of ggml type {_ggml_type_name(kind)} (e.g. {names[0]}), "
                        f"which kvscope does not dequantize")
    if problems:
        raise UserError(f"{path}: " + "; ".join(problems) + f". Supported tensor types: "
                        f"{', '.join(SUPPORTED_GGML_TYPES.values())}; architectures: {supported_arches}")


def check_config_supported(config: ModelConfig, tensor_parallel_size: int) -> None:
    """Flags a family cannot run (refused before phase A, with the weights unread)."""
    if family_of(config.architecture) == "gemma3" and tensor_parallel_size > 1:
        raise UserError(f"--tensor-parallel-size {tensor_parallel_size} with {config.name}: tensor parallelism "
                        "serves Llama-family models; run Gemma 3 on one rank")
