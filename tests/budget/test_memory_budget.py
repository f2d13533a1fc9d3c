"""The budget arithmetic against every figure of the background documents."""

from __future__ import annotations

import pytest

from engine.budget.memory import (
    GiB,
    bytes_per_kv_token,
    kv_cache_size_line,
    max_concurrency_line,
    parse_bytes,
    parse_gib,
    plan_memory,
    required_utilization,
)
from engine.errors import BudgetError, UserError
from engine.modelspec.presets import MODEL_PRESETS
from engine.modelspec.readers import load_model_config

LLAMA8 = MODEL_PRESETS["llama-3.1-8b"]
LLAMA70 = MODEL_PRESETS["llama-3.1-70b"]


def test_llama8_parameter_count_is_exact_from_shapes() -> None:
    assert LLAMA8.num_parameters == 8_030_261_248


def test_llama8_bytes_per_token_is_128_kib() -> None:
    assert bytes_per_kv_token(LLAMA8) == 131_072


def test_worked_example_with_background_weights() -> None:
    plan = plan_memory(model=LLAMA8, total_bytes=int(79.6 * GiB), gpu_memory_utilization=0.92,
                       max_model_len=32768, weights=int(14.957 * GiB), activation_peak=4 * GiB,
                       non_torch=int(0.3 * GiB))
    assert plan.num_blocks == 27_635
    assert plan.kv_cache_tokens == 442_160
    assert f"{plan.max_concurrency:.2f}" == "13.49"
    assert kv_cache_size_line("GPU", plan.kv_cache_tokens) == "GPU KV cache size: 442,160 tokens"
    assert max_concurrency_line(32768, plan.max_concurrency) == (
        "Maximum concurrency for 32,768 tokens per request: 13.49x")
    assert plan.estimated == []


def test_worked_example_with_exact_parameter_count_keeps_the_precision() -> None:
    plan = plan_memory(model=LLAMA8, total_bytes=int(79.6 * GiB), gpu_memory_utilization=0.92,
                       max_model_len=32768, activation_peak=4 * GiB, non_torch=int(0.3 * GiB))
    assert plan.weights_bytes == 8_030_261_248 * 2
    assert plan.num_blocks == 27_634
    assert plan.kv_cache_tokens == 442_144


def test_80gib_at_090_with_reserve() -> None:
    plan = plan_memory(model=LLAMA8, total_bytes=80 * GiB, gpu_memory_utilization=0.90, max_model_len=16384,
                       weights=15 * GiB, activation_peak=0, non_torch=3 * GiB)
    assert plan.kv_cache_tokens == 442_368
    assert plan.kv_cache_tokens // 16384 == 27


def test_llama70_tp4() -> None:
    assert bytes_per_kv_token(LLAMA70, tensor_parallel_size=4) == 81_920
    plan = plan_memory(model=LLAMA70, total_bytes=80 * GiB, gpu_memory_utilization=0.90, max_model_len=16384,
                       weights=33 * GiB, activation_peak=0, non_torch=4 * GiB, tensor_parallel_size=4)
    assert plan.kv_cache_tokens == 458_752


def test_smollm2_from_bundled_gguf() -> None:
    cfg = load_model_config("smollm2-135m")
    assert cfg.source == "gguf"
    assert (cfg.num_layers, cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert bytes_per_kv_token(cfg) == 23_040
    assert bytes_per_kv_token(cfg, "fp8") == 11_520
    assert bytes_per_kv_token(cfg, "float32") == 46_080


def test_kv_cache_memory_bytes_overrides_the_pool() -> None:
    plan = plan_memory(model=LLAMA8, total_bytes=80 * GiB, gpu_memory_utilization=0.9, max_model_len=4096,
                       kv_cache_memory_bytes=10 * GiB, weights=15 * GiB, activation_peak=GiB, non_torch=0)
    assert plan.kv_pool_overridden
    assert plan.kv_cache_tokens == 10 * GiB // 131_072


def test_estimates_are_marked() -> None:
    plan = plan_memory(model=LLAMA8, total_bytes=80 * GiB, gpu_memory_utilization=0.9, max_model_len=4096)
    assert set(plan.estimated) == {"activation_peak", "non_torch"}
    assert plan.activation_peak_bytes > 0


def test_refuses_when_weights_do_not_fit() -> None:
    with pytest.raises(BudgetError, match=r"raise --gpu-memory-utilization to at least 0\.70"):
        plan_memory(model=LLAMA8, total_bytes=24 * GiB, gpu_memory_utilization=0.5, max_model_len=4096)
    # 16.26 GiB of weights, peak and non-torch on a 16 GiB device: no utilization helps, so none is advised.
    with pytest.raises(BudgetError, match=r"cannot fit at any --gpu-memory-utilization") as info:
        plan_memory(model=LLAMA8, total_bytes=16 * GiB, gpu_memory_utilization=0.9, max_model_len=4096)
    assert "to at least" not in str(info.value)


def test_refuses_when_one_request_does_not_fit_and_names_the_fix() -> None:
    with pytest.raises(BudgetError) as info:
        plan_memory(model=LLAMA8, total_bytes=24 * GiB, gpu_memory_utilization=0.9, max_model_len=131072,
                    activation_peak=GiB, non_torch=0)
    message = str(info.value)
    # 16 GiB of KV for one 131,072-token request beside 15 GiB of weights: more than 24 GiB,
    # so only the length can change the outcome.
    assert "131,072" in message and "--max-model-len to 46,208" in message
    assert "--gpu-memory-utilization" not in message
    with pytest.raises(BudgetError) as info:
        plan_memory(model=LLAMA8, total_bytes=40 * GiB, gpu_memory_utilization=0.5, max_model_len=131072,
                    activation_peak=GiB, non_torch=0)
    assert "raise --gpu-memory-utilization to at least 0.80" in str(info.value)


def test_required_utilization_round_trip() -> None:
    plan = plan_memory(model=LLAMA8, total_bytes=80 * GiB, gpu_memory_utilization=0.9, max_model_len=4096,
                       weights=15 * GiB, activation_peak=GiB, non_torch=0)
    assert required_utilization(plan, plan.kv_pool_bytes) == pytest.approx(0.9)


@pytest.mark.parametrize("bad", ["12 GB", "abc", "-1", "nan", "inf"])
def test_parse_gib_rejects_ambiguous_or_bad(bad: str) -> None:
    with pytest.raises(UserError):
        parse_gib(bad, "--weights")


def test_parse_bytes_binary_suffixes() -> None:
    assert parse_bytes("50GiB", "--kv-cache-memory-bytes") == 50 * GiB
    assert parse_bytes("1,024", "--kv-cache-memory-bytes") == 1024
    with pytest.raises(UserError):
        parse_bytes("-5", "--kv-cache-memory-bytes")


@pytest.mark.parametrize("util", [0.0, 1.5, -0.1])
def test_plan_memory_rejects_bad_utilization(util: float) -> None:
    with pytest.raises(UserError):
        plan_memory(model=LLAMA8, total_bytes=80 * GiB, gpu_memory_utilization=util, max_model_len=4096)
