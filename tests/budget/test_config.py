"""ModelConfig from presets, the bundled GGUF, and an HF folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.errors import UserError
from engine.modelspec.presets import MODEL_PRESETS, bundled_gguf_path
from engine.modelspec.readers import load_model_config


def test_bundled_gguf_located_without_importing_the_wheel() -> None:
    path = bundled_gguf_path()
    assert path is not None and path.suffix == ".gguf" and path.stat().st_size > 50_000_000


def test_gguf_metadata() -> None:
    cfg = load_model_config(str(bundled_gguf_path()))
    assert cfg.hidden_size == 576 and cfg.intermediate_size == 1536 and cfg.vocab_size == 49152
    assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0 and cfg.max_position_embeddings == 8192
    assert cfg.num_parameters == MODEL_PRESETS["smollm2-135m"].num_parameters == 134_515_008


def test_hf_folder(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000, "rope_theta": 5e5,
        "max_position_embeddings": 2048, "tie_word_embeddings": True, "torch_dtype": "float32",
    }))
    cfg = load_model_config(str(tmp_path))
    assert (cfg.num_layers, cfg.head_dim, cfg.num_kv_heads, cfg.dtype) == (2, 64, 2, "float32")
    assert cfg.source == "hf"


def test_folder_without_config_json(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"no config\.json"):
        load_model_config(str(tmp_path))


def test_file_that_is_not_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(UserError, match=r"model\.gguf"):
        load_model_config(str(bad))


def test_unknown_model_lists_what_was_looked_for() -> None:
    with pytest.raises(UserError, match="looked for a preset"):
        load_model_config("no-such-model-xyz")


def test_aliases() -> None:
    assert load_model_config("meta-llama/Llama-3.1-8B-Instruct").name == "llama-3.1-8b"


@pytest.mark.slow  # gguf.GGUFReader itself takes ~7 s on the vocabulary
def test_gguf_header_agrees_with_gguf_reader() -> None:
    """The fast header parser (startup reads shapes with it) against the gguf
    package's reader, key by key and tensor by tensor, on the bundled file."""
    from gguf import GGUFReader

    from engine.modelspec.gguf_header import ArrayValue, read_gguf_header

    path = bundled_gguf_path()
    assert path is not None
    reader, header = GGUFReader(str(path)), read_gguf_header(path)
    assert set(header.metadata) == set(reader.fields) - {k for k in reader.fields if k.startswith("GGUF.")}
    for key, value in header.metadata.items():
        field = reader.fields[key]
        if isinstance(value, ArrayValue):
            assert value.count == len(field.data), key
        else:
            assert value == pytest.approx(field.contents()) if isinstance(value, float) else value == field.contents()
    assert [(t.name, t.dims) for t in header.tensors] == [(t.name, tuple(int(d) for d in t.shape)) for t in reader.tensors]
    assert [header.data_start + t.offset for t in header.tensors] == [int(t.data_offset) for t in reader.tensors]


def test_truncated_gguf_header_names_the_file(tmp_path: Path) -> None:
    path = bundled_gguf_path()
    assert path is not None
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:100_000])  # inside the vocabulary array
    with pytest.raises(UserError, match=r"cut\.gguf"):
        load_model_config(str(cut))
