"""A refused budget's fixes as data (issue 48): the check raises BudgetRefused carrying
each fix's flag, current value, proposed value and why; its sentence is rendered from
them, and the failed phase records them (engine/budget/fixes.py ``recorded_fixes``)."""

from __future__ import annotations

import pytest

from engine.budget.fixes import BudgetRefused, Fix, advice, recorded_fixes
from engine.budget.memory import (
    GiB,
    at_least,
    at_most,
    fixed_pool_fixes,
    free_memory_fixes,
    plan_memory,
    required_utilization,
    weights_fixes,
)
from engine.errors import BudgetError
from engine.modelspec.presets import MODEL_PRESETS

LLAMA8 = MODEL_PRESETS["llama-3.1-8b"]


def refusal(**kwargs: object) -> BudgetRefused:
    with pytest.raises(BudgetRefused) as info:
        plan_memory(model=LLAMA8, **kwargs)  # type: ignore[arg-type]
    return info.value


def test_a_refusal_carries_its_fixes_and_its_sentence_is_rendered_from_them() -> None:
    exc = refusal(total_bytes=24 * GiB, gpu_memory_utilization=0.9, max_model_len=131072,
                  activation_peak=GiB, non_torch=0)
    assert isinstance(exc, BudgetError)  # callers catching the budget's error still do
    (fix,) = exc.fixes  # no utilization holds 16 GiB of KV beside 15 GiB of weights on 24 GiB
    assert (fix.flag, fix.current, fix.proposed) == ("--max-model-len", 131072, 46208)
    assert str(exc) == f"{exc.problem}; try {advice(fix)}"
    assert advice(fix) == "lower --max-model-len to 46,208 or less (the longest request the pool holds)"


def test_a_proposed_utilization_is_one_that_suffices() -> None:
    exc = refusal(total_bytes=40 * GiB, gpu_memory_utilization=0.5, max_model_len=131072,
                  activation_peak=GiB, non_torch=0)
    util = next(f for f in exc.fixes if f.flag == "--gpu-memory-utilization")
    assert (util.current, util.proposed) == (0.5, 0.8)
    plan = plan_memory(model=LLAMA8, total_bytes=40 * GiB, gpu_memory_utilization=util.proposed,
                       max_model_len=131072, activation_peak=GiB, non_torch=0)
    assert plan.kv_cache_tokens >= 131072 and required_utilization(plan, plan.kv_pool_bytes) <= util.proposed
    assert "raise --gpu-memory-utilization to at least 0.80 (" in str(exc)


def test_no_pool_at_all_names_a_flagless_fix_when_no_utilization_helps() -> None:
    exc = refusal(total_bytes=16 * GiB, gpu_memory_utilization=0.9, max_model_len=4096)
    assert [f.flag for f in exc.fixes] == ["", "--max-num-batched-tokens"]
    assert exc.fixes[0].proposed is None and "cannot fit at any --gpu-memory-utilization" in exc.fixes[0].why


def test_rounding_keeps_the_advised_value_on_the_safe_side() -> None:
    assert (at_least(0.693), at_least(0.7), at_least(0.7000001)) == (0.7, 0.7, 0.71)
    assert (at_most(0.129), at_most(0.12)) == (0.12, 0.12)


def test_the_startup_checks_fixes() -> None:
    small = fixed_pool_fixes(4 << 20, 94_371_840, 4096, 176)
    assert [(f.flag, f.current, f.proposed) for f in small] == [
        ("--kv-cache-memory-bytes", 4 << 20, 94_371_840), ("--max-model-len", 4096, 176)]
    assert [f.flag for f in fixed_pool_fixes(1, 94_371_840, 4096, 0)] == ["--kv-cache-memory-bytes"]
    cpu = free_memory_fixes(3 * GiB, 24 * GiB, 0.9, cpu=True)
    assert [(f.flag, f.proposed) for f in cpu] == [("--gpu-memory-utilization", 0.12), ("--device-memory", 3.33)]
    gpu = free_memory_fixes(3 * GiB, 24 * GiB, 0.9, cpu=False)
    assert gpu[1].flag == "" and "free the device" in advice(gpu[1])
    assert [(f.flag, f.proposed) for f in weights_fixes(2 * GiB, 4 * GiB, 0.01, cpu=False)] == [
        ("--gpu-memory-utilization", 0.5)]
    assert weights_fixes(8 * GiB, 4 * GiB, 0.9, cpu=False)[0].flag == ""  # no utilization above 1


def test_the_recorded_fixes_read_back_as_the_same_fixes() -> None:
    exc = BudgetRefused("too small", [Fix("--max-model-len", 4096, 176, "the longest request the pool holds"),
                                      Fix("", None, None, "a smaller model")])
    rows = recorded_fixes(exc)
    assert [Fix.from_json(r) for r in rows] == list(exc.fixes)
    assert recorded_fixes(ValueError("not the budget's")) == []
    assert str(exc) == ("too small; try lower --max-model-len to 176 or less (the longest request the pool "
                        "holds) or a smaller model")
