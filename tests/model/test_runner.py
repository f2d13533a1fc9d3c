"""ModelRunner: the step contract (who gets a sample), input checks, profile run, timings."""

from __future__ import annotations

import dataclasses

import pytest

from engine.core.sampling_params import SamplingParams
from engine.errors import UserError
from engine.model.runner import ModelRunner, ScheduledSeq
from engine.modelspec.presets import MODEL_PRESETS

GREEDY = SamplingParams(temperature=0.0)


def tiny_runner() -> ModelRunner:
    config = dataclasses.replace(
        MODEL_PRESETS["llama-3.1-8b"], num_layers=2, hidden_size=64, intermediate_size=128, vocab_size=300,
        num_attention_heads=4, num_kv_heads=2, head_dim=16,
    )
    runner = ModelRunner(config, dtype="float32", block_size=4, load_format="dummy")
    runner.load_weights()
    return runner


def test_only_sequences_that_reach_their_end_get_a_token(smollm_runner_fp32) -> None:
    out = smollm_runner_fp32.execute([
        ScheduledSeq("chunk", [1, 2, 3, 4, 5], 0, [200], needs_sample=False, sampling=GREEDY),
        ScheduledSeq("last", [1, 2, 3], 0, [201], sampling=GREEDY),
    ])
    assert list(out) == ["last"]
    timings = smollm_runner_fp32.last_timings
    assert timings.forward_s > 0 and timings.sample_s > 0


def test_too_few_blocks_is_rejected_before_compute() -> None:
    runner = tiny_runner()
    runner.allocate_kv_cache(8)
    with pytest.raises(ValueError, match="cannot hold 9 tokens"):
        runner.execute([ScheduledSeq("x", list(range(9)), 0, [0, 1])])


def test_profile_run_at_worst_case_shape_with_a_few_blocks() -> None:
    runner = tiny_runner()
    runner.allocate_kv_cache(3)
    timings = runner.profile_run(max_num_batched_tokens=64, max_num_seqs=5)
    assert timings.forward_s > 0 and timings.sample_s > 0
    assert runner.num_blocks == 3


def test_profile_run_without_a_cache_leaves_none_behind() -> None:
    runner = tiny_runner()
    runner.profile_run(max_num_batched_tokens=16, max_num_seqs=16)
    assert runner.kv_caches == []


def test_execute_before_allocating_the_cache_says_so() -> None:
    with pytest.raises(RuntimeError, match="allocate_kv_cache"):
        tiny_runner().execute([ScheduledSeq("x", [1], 0, [0])])


def test_bad_dtype_and_backend_are_user_errors() -> None:
    config = MODEL_PRESETS["smollm2-135m"]
    with pytest.raises(UserError, match="--dtype"):
        ModelRunner(config, dtype="int3")
    with pytest.raises(UserError, match="attention backend"):
        ModelRunner(config, attention_backend="flash")
