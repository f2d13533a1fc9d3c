"""The run's memory plan rebuilt from its startup events, and the same plan with
changed flags: every pool figure the doctor proposes goes through
:func:`engine.budget.memory.plan_memory`, the project's one budget formula.

A run reports its measured inputs in phases B–E (total memory, utilization,
weights, activation peak, non-torch); ``replan`` keeps them and changes only the
flags asked. A new ``--max-num-batched-tokens`` scales the measured activation
peak by the formula's own estimate for the two budgets, since only the old one
was measured.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from doctor.facts import RunFacts
from engine.budget.memory import MemoryPlan, estimate_activation_peak_bytes, plan_memory
from engine.budget.stages import PipelinePlan, plan_stages
from engine.events.phase_data import BudgetData, LoadWeightsData, ProfileRunData
from engine.modelspec.config import ModelConfig

_MODEL_FIELDS = {f.name for f in dataclasses.fields(ModelConfig)}


def model_of(facts: RunFacts) -> ModelConfig | None:
    """The model's shapes from ``engine.config``'s summary (None when the run did not say)."""
    summary = {k: v for k, v in facts.model.items() if k in _MODEL_FIELDS}
    try:
        return ModelConfig(**summary) if summary else None
    except TypeError:
        return None


def _record(facts: RunFacts, letter: str, kind: type[Any]) -> Any:
    event = facts.phases.get(letter)
    return kind.from_dict(event.data) if event is not None and event.data else None


def replan(facts: RunFacts, **changes: Any) -> MemoryPlan | None:
    """The run's plan with ``changes`` (flag names underscored: ``kv_cache_dtype="fp8"``,
    ``gpu_memory_utilization=0.95``, ``max_num_batched_tokens=2048``); None when the
    run did not report the model or its budget (a recording cut before phase E)."""
    inputs = _plan_inputs(facts, changes)
    return plan_memory(check_fits=False, **inputs) if inputs is not None else None


def replan_stages(facts: RunFacts, pipeline_parallel_size: int, **changes: Any) -> PipelinePlan | None:
    """The run as ``pipeline_parallel_size`` stages (``engine plan -pp``'s per-stage budget on
    the run's GPU): each stage's weights from its own shapes (what the run measured was one
    process's share), its measured activation peak and non-torch memory kept; None as
    :func:`replan`, or when the model has fewer layers than stages."""
    inputs = _plan_inputs(facts, changes)
    if inputs is None or pipeline_parallel_size > inputs["model"].num_layers:
        return None
    model = inputs.pop("model")
    inputs["weights"] = None
    return plan_stages(model, pipeline_parallel_size, **inputs)


def _plan_inputs(facts: RunFacts, changes: dict[str, Any]) -> dict[str, Any] | None:
    """``plan_memory``'s keywords for the run with ``changes`` (see :func:`replan`)."""
    model = model_of(facts)
    budget: BudgetData | None = _record(facts, "B", BudgetData)
    kv = facts.kv_cache
    if model is None or budget is None or kv is None or not budget.total_bytes:
        return None
    weights: LoadWeightsData | None = _record(facts, "C", LoadWeightsData)
    profile: ProfileRunData | None = _record(facts, "D", ProfileRunData)
    flags = {name: facts.flag(name) for name in ("gpu_memory_utilization", "kv_cache_dtype", "dtype",
                                                 "tensor_parallel_size", "max_num_batched_tokens", "max_num_seqs")}
    flags.update(changes)
    dtype = flags["dtype"] if flags["dtype"] not in (None, "auto") else model.dtype
    tp = int(flags["tensor_parallel_size"] or 1)
    old_tokens = int(facts.flag("max_num_batched_tokens", 8192))
    new_tokens = int(flags["max_num_batched_tokens"] or old_tokens)
    seqs = int(flags["max_num_seqs"] or 256)
    activation = profile.activation_peak_bytes if profile is not None else None
    weights_measured = weights.weights_bytes if weights is not None else None
    if tp != int(facts.flag("tensor_parallel_size", 1) or 1):
        # The run measured one rank's slice: another split is estimated from the shapes (and says so).
        weights_measured = activation = None
    if activation is not None and new_tokens != old_tokens:
        old_est = estimate_activation_peak_bytes(model, old_tokens, seqs, dtype, tp)
        activation = int(activation * estimate_activation_peak_bytes(model, new_tokens, seqs, dtype, tp) / old_est)
    # A fixed pool (--kv-cache-memory-bytes, --num-gpu-blocks-override, the CPU cap) keeps its bytes.
    fixed_pool = kv.kv_pool_bytes if kv.kv_pool_overridden else None
    return dict(
        model=model, total_bytes=int(budget.total_bytes),
        gpu_memory_utilization=float(flags["gpu_memory_utilization"] or budget.gpu_memory_utilization or 0.9),
        max_model_len=int(kv.max_model_len or facts.flag("max_model_len") or model.max_position_embeddings),
        block_size=facts.block_size, kv_cache_dtype=str(flags["kv_cache_dtype"] or "auto"), dtype=dtype,
        tensor_parallel_size=tp, weights=weights_measured,
        activation_peak=activation, non_torch=profile.non_torch_bytes if profile is not None else None,
        kv_cache_memory_bytes=fixed_pool, max_num_batched_tokens=new_tokens, max_num_seqs=seqs)
