"""Startup cache: dequantized GGUF weights and the built tokenizer, read back identical."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.model.loading.startup_cache import (
    CACHE_ENV,
    cache_key,
    cached_tokenizer,
    content_fingerprint,
    prune_cache,
    weights_path,
)
from engine.model.runner import ModelRunner


@pytest.mark.slow  # two cold weight loads: ~15 s on 2 cores (make test-slow)
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


@pytest.mark.slow  # a cold BPE build from the GGUF vocabulary, ~7 s; every start reads the cached one
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


def test_entries_are_keyed_by_content_not_path(tmp_path: Path) -> None:
    """Two checkouts (or venvs) holding the same file share one entry; any byte of the
    header or the tail, or the length, changes the key."""
    body = bytes(range(256)) * 20_000  # ~5 MB: head and tail spans do not overlap
    first, second = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf"
    for path in (first, second):
        path.parent.mkdir()
        path.write_bytes(body)
    assert cache_key(first, "torch.float32") == cache_key(second, "torch.float32")
    assert cache_key(first, "torch.float32") != cache_key(first, "torch.bfloat16")
    before = content_fingerprint(second)
    for offset in (10, len(body) - 10):
        changed = bytearray(body)
        changed[offset] ^= 0xFF
        second.write_bytes(bytes(changed))
        assert content_fingerprint(second) != before, offset
    second.write_bytes(body + b"x")
    assert content_fingerprint(second) != before


def test_prune_removes_least_recently_used_entries_first(tmp_path: Path) -> None:
    import os

    entries = []
    for age, name in enumerate(["new", "middle", "old"]):
        entry = tmp_path / f"{name}.safetensors"
        entry.write_bytes(b"x" * 1000)
        stamp = 1_700_000_000 - age * 100
        os.utime(entry, (stamp, stamp))
        entries.append(entry)
    (tmp_path / "kernels").mkdir()  # kernel builds are not the weights cache's to prune
    removed = prune_cache(limit_bytes=2000, root=tmp_path)
    assert removed == [tmp_path / "old.safetensors"]
    assert prune_cache(limit_bytes=2000, root=tmp_path) == []  # already within the limit
    removed = prune_cache(limit_bytes=0, root=tmp_path, keep=tmp_path / "new.safetensors")
    assert removed == [tmp_path / "middle.safetensors"]
    assert (tmp_path / "new.safetensors").is_file() and (tmp_path / "kernels").is_dir()


def test_mapped_safetensors_reads_every_tensor_without_copying(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from engine.model.loading.startup_cache import mapped_safetensors

    tensors = {"a": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(5, dtype=torch.bfloat16),
               "scalar": torch.tensor(2.5)}
    path = tmp_path / "w.safetensors"
    save_file(tensors, str(path), metadata={"layout": "x8"})
    mapped, metadata = mapped_safetensors(path)
    assert set(mapped) == set(tensors) and metadata == {"layout": "x8"}
    for name, tensor in tensors.items():
        assert mapped[name].dtype == tensor.dtype and torch.equal(mapped[name], tensor), name
    # One mapping of the whole file backs every tensor: the load copied nothing.
    storages = {t.untyped_storage().data_ptr() for t in mapped.values()}
    assert len(storages) == 1 and mapped["a"].untyped_storage().nbytes() == path.stat().st_size
