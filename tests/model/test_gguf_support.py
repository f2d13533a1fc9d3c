"""A GGUF kvscope cannot run is refused from its header, before any weights load (phase C),
in about a second, naming what is unsupported and what is supported."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from engine.errors import UserError
from engine.events import EventBus, StartupPhase
from engine.modelspec.families import check_gguf_supported


def write_tiny_gguf(path: Path, architecture: str, tokenizer: str = "gpt2", tensor_type: str = "F32") -> Path:
    """A real GGUF (gguf's GGUFWriter) with Llama-shaped keys, a tokenizer and two tensors."""
    import gguf

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(4)
    writer.add_context_length(128)
    writer.add_tokenizer_model(tokenizer)
    writer.add_token_list(["<s>", "</s>", "a", "b"])
    writer.add_tensor("token_embd.weight", np.zeros((4, 64), dtype=np.float32))
    if tensor_type == "F32":
        writer.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    else:  # raw bytes of another type (the header is all the check reads)
        kind = gguf.GGMLQuantizationType[tensor_type]
        block, size = gguf.GGML_QUANT_SIZES[kind]
        writer.add_tensor("output_norm.weight", np.zeros(64 // block * size, dtype=np.uint8), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unsupported_architecture_is_refused_before_phase_c(tmp_path: Path) -> None:
    from engine.config import EngineConfig
    from engine.startup.phases import start_engine

    path = write_tiny_gguf(tmp_path / "tiny-mamba.gguf", "mamba")
    bus = EventBus()
    phases: list[StartupPhase] = []
    bus.subscribe(lambda e: phases.append(e) if isinstance(e, StartupPhase) else None)
    start = time.perf_counter()
    with pytest.raises(UserError) as refused:
        start_engine(EngineConfig(model=str(path), device="cpu"), bus)
    elapsed = time.perf_counter() - start
    message = str(refused.value)
    assert "architecture 'mamba' is not supported" in message
    assert "gemma3" in message and "llama" in message  # what is supported
    assert not any(p.phase == "C" for p in phases)  # no weights were read
    assert elapsed < 2.0, elapsed


def test_tokenizer_type_and_tensor_types_are_named(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "odd.gguf", "llama", tokenizer="t5", tensor_type="IQ4_NL")
    with pytest.raises(UserError) as refused:
        check_gguf_supported(path)
    message = str(refused.value)
    assert "tokenizer type 't5' is not supported for llama" in message
    assert "ggml type IQ4_NL (e.g. output_norm.weight)" in message
    assert "Q4_K" in message  # the supported types are listed


def test_supported_files_pass(tmp_path: Path) -> None:
    check_gguf_supported(write_tiny_gguf(tmp_path / "ok.gguf", "llama", tensor_type="Q8_0"))
    from engine.modelspec.presets import bundled_gguf_path, gemma3_270m_path

    for real in (bundled_gguf_path(), gemma3_270m_path()):
        if real is not None:
            check_gguf_supported(real)
