"""A tiny random-weight Gemma 3 text model (tests/model/tiny_hf.py's shapes) and the same weights
as llama.cpp's converter writes a Gemma 3 GGUF: what the export and chat-template tests share."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.model.tiny_hf import TINY_SHAPES, redrawn, save_with_tokenizer, untied_arrays


def build_tiny_gemma3(folder: Path) -> Any:
    """A sliding layer (window 8) then a full one with Gemma 3 4B+'s linear rope scaling;
    query_pre_attn_scalar 256 (not head_dim's 16) and the local base are transformers' defaults."""
    import transformers

    config = transformers.Gemma3TextConfig(**TINY_SHAPES, tie_word_embeddings=True, sliding_window=8,
                                           layer_types=["sliding_attention", "full_attention"], rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
    torch.manual_seed(0)
    return save_with_tokenizer(redrawn(transformers.AutoModelForCausalLM.from_config(config), 0), folder)


# llama.cpp's Gemma 3 names (convert_hf_to_gguf.py's tensor map), written out here rather than
# inverted from the engine's table, so a wrong entry there is not mirrored.
_GEMMA3_GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight", "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
}


def write_gemma3_gguf(model: Any, path: Path, chat_template: str | None = None) -> Path:
    """The checkpoint as llama.cpp's converter writes Gemma 3 (F32, every norm stored as 1 + w,
    a SentencePiece vocabulary, ``chat_template`` if one is given), with the keys kvscope reads for what the
    converter leaves at Gemma 3's defaults (the layer pattern, the attention scalar)."""
    import gguf

    config = model.config
    rope = config.rope_parameters
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    writer.add_sliding_window(config.sliding_window)
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(rope["full_attention"]["factor"])
    writer.add_uint32("gemma3.attention.sliding_window_pattern", 2)
    writer.add_float32("gemma3.attention.query_pre_attn_scalar", float(config.query_pre_attn_scalar))
    writer.add_float32("gemma3.rope.local_freq_base", rope["sliding_attention"]["rope_theta"])
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<pad>", "<eos>", "<bos>", "<unk>", *(f"t{i}" for i in range(4, config.vocab_size))])
    writer.add_token_types([3, 3, 3, 2, *([1] * (config.vocab_size - 4))])  # control x3, unknown, normal
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    for name, array in untied_arrays(model):
        if name.startswith("model.layers."):
            index, rest = name[len("model.layers."):].split(".", 1)
            gguf_name = f"blk.{index}.{_GEMMA3_GGUF_NAMES[rest]}"
        else:
            gguf_name = _GEMMA3_GGUF_NAMES[name]
        writer.add_tensor(gguf_name, array + 1.0 if name.endswith("norm.weight") else array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
