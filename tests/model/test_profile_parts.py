"""Phase D in parts (engine/model/memory/profile_parts.py): the forward measured at two step sizes and
kept as a line in the step's tokens, the sampler at two row counts scaled to --max-num-seqs; the peak is the whole step's, and a profile stored at one budget is reused,
evaluated, at another."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine.model.memory import profile_cache, profile_parts
from engine.model.memory.device import measure_peak
from engine.model.memory.profile_parts import Line, PeakFunction
from engine.model.runner import ModelRunner


def test_lines_and_the_peak_function() -> None:
    line = Line((128, 256), (1_000, 2_000))
    assert (line.at(128), line.at(256), line.at(2048), line.at(0)) == (1_000, 2_000, 16_000, 0)
    assert Line((4, 4), (10, 12)).at(99) == 12  # one point: flat
    peak = PeakFunction(forward=line, head_base=Line((128, 256), (100, 200)), head_bytes=5_000,
                        sampler_base=Line((128, 256), (10, 20)), sampler_bytes=9_000, rows=(8, 16), seqs=(4, 8))
    assert peak.at(256) == 9_020  # the sampler's phase: over 256 rows of a big vocabulary
    assert peak.at(2048) == 16_000  # the layers' at a larger step
    assert PeakFunction.from_json(peak.to_json()) == peak
    assert "128 and 256 tokens (4 and 8 sequences)" in peak.describe(256) and "LM head over 256 rows" in peak.describe(256)


def test_the_points_cover_the_budgets_a_plan_can_choose() -> None:
    # an explicit budget: sequences of the step's own length (8 here), the line exact at it
    assert profile_parts.forward_points(2048, 256) == ((128, 16), (256, 32))
    # a budget a kernel plan may raise to 8,192: the longest sequences it gives (32), the same points at any budget
    assert profile_parts.forward_points(2048, 256, cover=8192) == ((128, 4), (256, 8))
    assert profile_parts.forward_points(4096, 256, cover=8192) == ((128, 4), (256, 8))
    assert profile_parts.forward_points(2048, 4) == ((512, 1), (1024, 2))  # 512-token sequences, as the step's
    assert profile_parts.forward_points(256, 256) is None  # a small step: measured whole
    assert profile_parts.forward_points(2048, 4, cover=8192) is None  # parts dearer than the step: whole
    assert profile_parts.row_points(256) == (8, 16) and profile_parts.row_points(4) == (2, 4)


@pytest.fixture(scope="module")
def small_runner(smollm_config) -> ModelRunner:
    """Two layers of SmolLM2's shapes, random weights, a 16,384-token vocabulary (the sampler's
    [rows, vocab] tensors matter at 64 rows)."""
    config = dataclasses.replace(smollm_config, num_layers=2, vocab_size=16384)
    runner = ModelRunner(config, dtype="float32", load_format="dummy")
    runner.load_weights()
    return runner


def _whole(runner: ModelRunner, tokens: int, seqs: int) -> int:
    return measure_peak(torch.device("cpu"), lambda: runner.profile_run(tokens, seqs))[1].activation_peak_bytes


@pytest.mark.parametrize(("tokens", "seqs", "vocab"), [(512, 64, 16384), (512, 64, 1024)])
def test_the_parts_give_the_whole_steps_peak(small_runner: ModelRunner, tokens: int, seqs: int, vocab: int) -> None:
    """At the budget measured the line is the whole step's peak: the sampler's phase (a large
    vocabulary) or the layers' (a small one), within the step's inputs it keeps live while sampling."""
    runner = small_runner
    if vocab != runner.model_config.vocab_size:  # the layers' phase decides: a small vocabulary
        runner = ModelRunner(dataclasses.replace(runner.model_config, vocab_size=vocab), dtype="float32",
                             load_format="dummy")
        runner.load_weights()
    points = profile_parts.forward_points(tokens, seqs)
    assert points is not None
    parts = profile_parts.measure(runner, points, seqs).peak
    whole = _whole(runner, tokens, seqs)
    assert whole <= parts.at(tokens) <= whole * 1.002, (whole, parts)
    assert not runner.kv_caches  # the one block it made is dropped
    # measured on sequences of 64 (a plan's budget up to 4,096 over 64): an upper bound at this budget
    covered = profile_parts.forward_points(tokens, seqs, cover=4096)
    assert covered is not None and covered[0][0] // covered[0][1] == 64
    upper = profile_parts.measure(runner, covered, seqs).peak
    assert whole <= upper.at(tokens) <= whole * 1.05


def test_a_profile_stored_at_one_budget_is_reused_at_another(small_runner: ModelRunner, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A budget a kernel plan chose (covered up to 2,048 here) reads back the stored line at a new
    budget: the same measurement, evaluated there; phase D says which steps it measured."""
    from engine.startup.profile_run import measure_profile

    monkeypatch.setenv(profile_cache.PROFILE_CACHE_ENV, str(tmp_path))
    config = SimpleNamespace(dtype="float32", quantization=None, kv_cache_dtype="auto", attention_backend="torch",
                             block_size=16, load_format="dummy", max_num_batched_tokens=512, max_num_seqs=64)
    model, cpu, log = small_runner.model_config, torch.device("cpu"), logging.getLogger("test")
    first = measure_profile(small_runner, config, model, cpu, log, cover=2048)
    assert not first.cached and first.tokens == 512 and first.profiled_tokens == (128, 256)
    assert first.method.startswith(profile_parts.METHOD) and "128 and 256 tokens" in first.method
    config.max_num_batched_tokens = 1024
    again = measure_profile(small_runner, config, model, cpu, log, cover=2048)
    assert again.cached and again.measured_at == first.measured_at and again.tokens == 1024
    line = PeakFunction.from_json(first.peak_function or {})
    assert again.activation_peak_bytes == line.at(1024) >= first.activation_peak_bytes
    assert len(list(tmp_path.glob("*.json"))) == 1
    # an explicit budget (nothing can change it) is measured for itself
    explicit = measure_profile(small_runner, config, model, cpu, log)
    assert not explicit.cached and explicit.profiled_tokens == (128, 256)
    assert explicit.activation_peak_bytes <= again.activation_peak_bytes  # shorter sequences than the cover's
