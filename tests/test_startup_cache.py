"""Startup cache: dequantized GGUF weights and the built tokenizer, read back identical."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.model.startup_cache import CACHE_ENV, cached_tokenizer, weights_path
from engine.runner import ModelRunner


def test_weights_cache_miss_then_hit_gives_identical_parameters(smollm_config, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    cold = ModelRunner(smollm_config, dtype="bfloat16")
    cold_info = cold.load_weights()
    assert cold_info.cache == "miss"
    entry = weights_path(Path(smollm_config.path), torch.bfloat16)
    assert entry is not None and entry.is_file()
    assert not list(tmp_path.glob(".*.tmp"))  # written atomically: no leftovers

    calls: list[tuple[int, int]] = []
    warm = ModelRunner(smollm_config, dtype="bfloat16")
    warm_info = warm.load_weights(progress=lambda done, total: calls.append((done, total)))
    assert warm_info.cache == "hit"
    assert warm_info.num_tensors == cold_info.num_tensors and calls[-1] == (272, 272)
    assert warm_info.weights_bytes == cold_info.weights_bytes
    for (name, a), (_, b) in zip(cold.model.named_parameters(), warm.model.named_parameters(), strict=True):
        assert torch.equal(a, b), name

    # A corrupt entry is a miss that rewrites it, never a failed start.
    entry.write_bytes(b"not safetensors")
    again = ModelRunner(smollm_config, dtype="bfloat16")
    assert again.load_weights().cache == "miss"
    assert torch.equal(again.model.layers[3].qkv_proj, cold.model.layers[3].qkv_proj)


def test_cache_off_reads_the_file(smollm_config, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, "off")
    assert weights_path(Path(smollm_config.path), torch.float32) is None


def test_cached_tokenizer_matches_the_gguf_build(smollm_config, smollm_tokenizer, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    first = cached_tokenizer(Path(smollm_config.path))  # builds and writes
    assert list(tmp_path.glob("*.tokenizer.json"))
    second = cached_tokenizer(Path(smollm_config.path))  # reads back
    text = "Hello <|im_start|>user\n12345 naïve café 🙂<|im_end|>"
    for tok in (first, second):
        assert tok.encode(text) == smollm_tokenizer.encode(text)
        assert tok.stop_token_ids == smollm_tokenizer.stop_token_ids
        assert tok.bos_token_id == smollm_tokenizer.bos_token_id
        assert tok.chat_template == smollm_tokenizer.chat_template
        assert tok.special_token_ids == smollm_tokenizer.special_token_ids
    ids = smollm_tokenizer.encode(text)
    assert second.decode(ids) == smollm_tokenizer.decode(ids)
