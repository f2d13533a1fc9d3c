"""Tiny random-weight HF checkpoints of a model family, built at test time with transformers
(a family config class, ``AutoModelForCausalLM.from_config``, seeded, ``save_pretrained``
as safetensors): nothing is downloaded. transformers initialises biases to 0 and norms to 1,
which would leave the Q/K/V biases and the QK-norm weights untested, so every parameter is
redrawn (norms 1 + N(0, 0.2), biases and weights N(0, 0.1)) before saving."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

# 2 layers, hidden 64, 4 heads over 2 KV heads of dim 16, vocab 320, MLP 128.
TINY_SHAPES: dict[str, Any] = {
    "vocab_size": 320, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2,
}
# variant -> (config class name, tie_word_embeddings, the family's own settings)
VARIANTS: dict[str, tuple[str, bool, dict[str, Any]]] = {
    "qwen2-tied": ("Qwen2Config", True, {"rope_theta": 1_000_000.0}),
    "qwen2-untied": ("Qwen2Config", False, {"rope_theta": 10_000.0}),
    "qwen3-tied": ("Qwen3Config", True, {"rope_theta": 1_000_000.0}),
    "qwen3-untied": ("Qwen3Config", False, {"rope_theta": 10_000.0}),
    # one sliding layer (window 8: the prompts outgrow it) then one full; the attention scale's
    # scalar 256 (not head_dim's 16) and the two rope bases are transformers' defaults
    "gemma3-tied": ("Gemma3TextConfig", True, {"layer_types": ["sliding_attention", "full_attention"],
                                                 "sliding_window": 8}),
    # Gemma 3 4B/12B/27B's linear rope scaling (factor 8) on the full layer only; the sliding
    # layer keeps its plain local base
    "gemma3-linear": ("Gemma3TextConfig", True, {"layer_types": ["sliding_attention", "full_attention"],
                                                  "sliding_window": 8, "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}}),
    # Llama 3.1's llama3 rope scaling with the trained context cut to 32 positions, so that at
    # head_dim 16 one frequency is kept, one blended and six stretched by 8 within the prompts
    "llama3-scaled": ("LlamaConfig", False, {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}),
    # every layer sliding, window 8: the prompts (9, 23, 37 tokens) outgrow it
    "mistral-sliding": ("MistralConfig", False, {"sliding_window": 8}),
    # fused qkv_proj and gate_up_proj, window 12 (Phi-3-mini-4k slides too: 2047); pad id inside the vocabulary
    "phi3-sliding": ("Phi3Config", True, {"sliding_window": 12, "pad_token_id": 0}),
}


def tiny_config(variant: str) -> Any:
    """The variant's transformers config (no weights)."""
    import transformers

    class_name, tied, extra = VARIANTS[variant]
    return getattr(transformers, class_name)(**TINY_SHAPES, tie_word_embeddings=tied, **extra)


def build_tiny_model(variant: str, seed: int = 0) -> Any:
    import transformers

    config = tiny_config(variant)
    torch.manual_seed(seed)
    return redrawn(transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32), seed)


def redrawn(model: Any, seed: int) -> Any:
    """``model`` in eval mode with every parameter redrawn from ``seed``: norms 1 + N(0, 0.2),
    everything else N(0, 0.1)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.2 * noise if param.dim() == 1 and "norm" in name else 0.1 * noise)
    return model.eval()


def save_tiny_tokenizer(folder: Path) -> None:
    """A byte-level BPE tokenizer (the ``tokenizers`` library, trained here on two sentences:
    312 ids, under the tiny vocabulary's 320) with ``<pad>``, ``<s>``, ``</s>`` at ids 0-2, as
    tokenizer.json and tokenizer_config.json: what kvscope's HF-folder path reads."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_SHAPES["vocab_size"], special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20
                                  + ["hello world, how are you today?"] * 20, trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))


def save_tiny_checkpoint(variant: str, folder: Path, seed: int = 0) -> Any:
    """Write ``folder`` (config.json, model.safetensors, a tiny tokenizer) and return the
    transformers model."""
    return save_with_tokenizer(build_tiny_model(variant, seed), folder)


def save_with_tokenizer(model: Any, folder: Path) -> Any:
    """``model`` saved into ``folder`` (``save_pretrained``) beside the tiny tokenizer; returns it."""
    model.save_pretrained(str(folder))
    save_tiny_tokenizer(folder)
    return model


# HF per-layer name -> llama.cpp's GGUF name (convert_hf_to_gguf.py's tensor map).
_GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
}
_GGUF_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                      "lm_head.weight": "output.weight"}


def untied_arrays(model: Any) -> Iterator[tuple[str, Any]]:
    """``model``'s state dict as (HF name, float32 numpy array), a tied head once: llama.cpp
    writes no output.weight for it."""
    seen: set[int] = set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            yield name, tensor.detach().float().numpy().copy()


def write_gguf(path: Path, arch: str, config: Any, tensors: Iterable[tuple[str, Any]],
               family_keys: Callable[[Any], None] = lambda writer: None) -> Path:
    """A GGUF at ``path`` as llama.cpp's converter writes one of architecture ``arch``: the shape
    keys of the transformers ``config``, then ``family_keys(writer)``'s, then a byte-level BPE
    token list of the vocabulary's size, then ``tensors`` (GGUF name, array)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    family_keys(writer)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(config.vocab_size)])
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    for name, array in tensors:
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_tiny_gguf(model: Any, path: Path) -> Path:
    """The checkpoint as llama.cpp's converter writes it (F32), with a byte-level BPE token list
    of the vocabulary's size: Qwen2/Qwen3 with Q/K rows in HF's order, Llama with them permuted
    (its converter's ``LlamaModel.permute``) and a Llama 3.1 rope scaling as the ``rope_freqs``
    tensor, one divisor per rotary frequency (plain inv_freq / scaled inv_freq)."""
    config = model.config
    return write_gguf(path, config.model_type, config, _dense_gguf_tensors(model))


def _dense_gguf_tensors(model: Any) -> Iterator[tuple[str, Any]]:
    from engine.model.loading.loader import permute_rotary_rows

    config = model.config
    for name, array in untied_arrays(model):
        if name.startswith("model.layers."):
            index, rest = name[len("model.layers."):].split(".", 1)
            gguf_name = f"blk.{index}.{_GGUF_LAYER_NAMES[rest]}"
        else:
            gguf_name = _GGUF_GLOBAL_NAMES[name]
        if config.model_type == "llama" and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = config.num_attention_heads if gguf_name.endswith("attn_q.weight") else config.num_key_value_heads
            array = permute_rotary_rows(array, heads)
        yield gguf_name, array
    if config.rope_parameters.get("rope_type") == "llama3":
        theta, dim = config.rope_parameters["rope_theta"], config.head_dim
        plain = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        yield "rope_freqs.weight", (plain / model.model.rotary_emb.inv_freq.float()).numpy()
