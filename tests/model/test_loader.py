"""Weight loading: GGUF names and the rotary un-permutation, dummy weights, bad files."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.errors import UserError
from engine.model.loading.loader import gguf_to_hf_name, permute_rotary_rows, unpermute_rotary_rows
from engine.model.runner import ModelRunner, ScheduledSeq
from engine.modelspec.presets import MODEL_PRESETS
from engine.modelspec.readers import load_model_config


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    weight = np.arange(12 * 5, dtype=np.float32).reshape(12, 5)
    assert np.array_equal(unpermute_rotary_rows(permute_rotary_rows(weight, 3), 3), weight)
    # One head of 4 rows: llama.cpp interleaves halves [0,1 | 2,3] -> [0,2,1,3].
    assert permute_rotary_rows(np.arange(4.0)[:, None], 1)[:, 0].tolist() == [0, 2, 1, 3]


def test_gguf_names_map_to_hf() -> None:
    assert gguf_to_hf_name("blk.7.attn_q.weight") == "model.layers.7.self_attn.q_proj.weight"
    assert gguf_to_hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_to_hf_name("rope_freqs.weight") is None


def test_gguf_load_reports_bytes_time_and_progress(smollm_config) -> None:
    calls: list[tuple[int, int]] = []
    runner = ModelRunner(smollm_config, dtype="bfloat16")
    info = runner.load_weights(progress=lambda done, total: calls.append((done, total)))
    assert info.load_format == "gguf"
    assert info.num_tensors == 272
    assert info.weights_bytes == smollm_config.num_parameters * 2
    assert info.load_seconds > 0
    assert calls[-1] == (272, 272)
    # Tied head: logits come from the embedding matrix.
    assert runner.model.lm_head is None


def test_dummy_weights_for_reduced_qwen_preset_run_a_step() -> None:
    config = dataclasses.replace(
        MODEL_PRESETS["qwen2.5-7b"], num_layers=2, hidden_size=128, intermediate_size=256, vocab_size=500,
        num_attention_heads=4, num_kv_heads=2, head_dim=32,
    )
    runner = ModelRunner(config, dtype="bfloat16", load_format="dummy")
    info = runner.load_weights()
    assert info.load_format == "dummy"
    assert info.weights_bytes == config.num_parameters * 2  # includes the q/k/v biases
    runner.allocate_kv_cache(4)
    out = runner.execute([ScheduledSeq("x", [1, 2, 3], 0, [0])])
    assert 0 <= out["x"] < 500


def test_dummy_is_the_default_for_presets_without_files() -> None:
    config = dataclasses.replace(MODEL_PRESETS["llama-3.1-8b"], num_layers=1, hidden_size=64,
                                 intermediate_size=128, vocab_size=100, num_attention_heads=2, num_kv_heads=1, head_dim=32)
    assert ModelRunner(config, dtype="float32").load_weights().load_format == "dummy"


def test_corrupt_gguf_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(UserError, match=r"broken\.gguf"):
        load_model_config(str(bad))


def test_truncated_gguf_names_the_file(tmp_path: Path, smollm_config) -> None:
    from engine.modelspec.gguf_header import read_gguf_header

    # Cut 1 MiB into the tensor data: the header reads, the first tensors' bytes are missing
    # (a cut further in only makes the test slower: every tensor before it is dequantized).
    keep = read_gguf_header(Path(smollm_config.path)).data_start + (1 << 20)
    bad = tmp_path / "truncated.gguf"
    with open(smollm_config.path, "rb") as source:
        bad.write_bytes(source.read(keep))
    config = dataclasses.replace(smollm_config, path=str(bad))
    with pytest.raises(UserError, match=r"truncated\.gguf: cut short: .* copy or download the file again"):
        ModelRunner(config, dtype="float32").load_weights()


def test_unknown_model_lists_what_was_looked_for() -> None:
    with pytest.raises(UserError, match=r"unknown model .*preset.*\.gguf.*config\.json"):
        load_model_config("no-such-model-anywhere")


def test_weights_are_loaded_in_the_requested_dtype(smollm_runner_fp32) -> None:
    assert all(p.dtype == torch.float32 for p in smollm_runner_fp32.model.parameters())
