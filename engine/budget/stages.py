"""The budget of a pipeline-parallel replica, stage by stage (``engine plan -tp T -pp P``).

As vLLM sizes it: each stage's GPUs hold its layers (``get_pp_indices``, the split in
engine/pipeline.py), stage 0 also the embedding and the last stage the final norm and
the LM head (its own copy even when the embeddings are tied), each divided over the
stage's ``T`` tensor-parallel ranks; each stage runs the budget formula on its own GPU
(requested - its weights - its activation peak - non-torch = its KV pool, holding its
layers' KV only), and the replica's block count is the smallest stage's (vLLM's
executor takes the minimum ``num_gpu_blocks`` over its workers), so one scheduler's
block ids are valid on every stage.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.budget.memory import GiB, MemoryPlan, plan_memory
from engine.core.kv_cache_groups import KVCacheGroup, kv_cache_groups
from engine.modelspec.config import DTYPE_BYTES, ModelConfig


def stage_layer_ranges(num_layers: int, stages: int) -> list[tuple[int, int]]:
    """``[start, end)`` per stage, vLLM's ``get_pp_indices``: ``L // P`` each, one more
    for each of the ``L % P`` stages counted back from the one before the last."""
    from engine.errors import UserError

    if stages > num_layers:
        raise UserError(f"--pipeline-parallel-size {stages}: the model has {num_layers} layers; give at most "
                        f"{num_layers}")
    sizes = [num_layers // stages] * stages
    for i in range(2, num_layers % stages + 2):
        sizes[-i] += 1
    starts = [sum(sizes[:i]) for i in range(stages)]
    return [(s, s + n) for s, n in zip(starts, sizes, strict=True)]


def stage_model(model: ModelConfig, layers: tuple[int, int]) -> ModelConfig:
    """The shapes one stage's KV pool and layers hold: ``layers``' count and layer types."""
    types = model.layer_types[layers[0]:layers[1]] if model.layer_types else None
    return dataclasses.replace(model, num_layers=layers[1] - layers[0], layer_types=types)


def stage_kv_cache_groups(groups: Sequence[KVCacheGroup], layers: tuple[int, int]) -> tuple[KVCacheGroup, ...]:
    """The whole model's KV cache groups, each holding only the stage's layers (renumbered
    from 0). As vLLM's ``get_kv_cache_configs``: the groups are the whole model's, so every
    stage keeps the scheduler's one block table per group, and a group may hold no layer
    of a stage (its blocks still name pages there: the block ids are shared)."""
    start, end = layers
    return tuple(KVCacheGroup(g.spec, tuple(i - start for i in g.layers if start <= i < end)) for g in groups)


@dataclass(frozen=True, slots=True)
class StagePlan:
    """One stage: its layers and its GPU's budget (per tensor-parallel rank)."""

    stage: int
    layers: tuple[int, int]
    plan: MemoryPlan

    def to_dict(self) -> dict[str, Any]:
        p = self.plan
        return {"stage": self.stage, "layers": list(self.layers), "weights_bytes": p.weights_bytes,
                "activation_peak_bytes": p.activation_peak_bytes, "kv_pool_bytes": p.kv_pool_bytes,
                "bytes_per_token": p.bytes_per_token, "num_blocks": p.num_blocks}


@dataclass(frozen=True, slots=True)
class PipelinePlan:
    stages: tuple[StagePlan, ...]
    block_size: int
    max_model_len: int

    @property
    def num_blocks(self) -> int:
        return min(s.plan.num_blocks for s in self.stages)

    @property
    def binding_stage(self) -> StagePlan:
        return min(self.stages, key=lambda s: (s.plan.num_blocks, s.stage))

    @property
    def kv_cache_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_concurrency(self) -> float:
        binding = self.binding_stage.plan
        return binding.max_concurrency * self.num_blocks / binding.num_blocks if binding.num_blocks else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"stages": [s.to_dict() for s in self.stages], "num_blocks": self.num_blocks,
                "kv_cache_tokens": self.kv_cache_tokens, "max_concurrency": self.max_concurrency,
                "binding_stage": self.binding_stage.stage}


def _layer_parameters(model: ModelConfig, count: int) -> int:
    """Parameters of ``count`` of the model's layers (the shapes' formula, less what is not a layer)."""
    return dataclasses.replace(model, num_layers=count).num_parameters - dataclasses.replace(
        model, num_layers=0).num_parameters


def stage_weights_bytes(model: ModelConfig, layers: tuple[int, int], first: bool, last: bool,
                        dtype: str | None = None, tensor_parallel_size: int = 1) -> int:
    """One GPU's weights in a stage: its layers, the embedding on the first stage, the final
    norm and LM head on the last, over the stage's tensor-parallel ranks."""
    params = _layer_parameters(model, layers[1] - layers[0])
    embedding = model.vocab_size * model.hidden_size
    params += embedding if first else 0
    params += (embedding + model.hidden_size) if last else 0
    return int(params * DTYPE_BYTES[(dtype or model.dtype).lower()] / tensor_parallel_size)


def plan_stages(model: ModelConfig, pipeline_parallel_size: int, **plan_kwargs: Any) -> PipelinePlan:
    """Every stage's plan (``plan_memory``'s keywords, the weights from the stage's own
    shapes unless given), and the replica's blocks: the fewest any stage holds."""
    stages = []
    ranges = stage_layer_ranges(model.num_layers, pipeline_parallel_size)
    tp = plan_kwargs.get("tensor_parallel_size", 1)
    given_weights = plan_kwargs.pop("weights", None)
    groups = plan_kwargs.pop("kv_cache_groups", None)
    if groups is None and model.layer_types:
        groups = kv_cache_groups(model.layer_types, model.sliding_window, model.num_layers)
    for index, layers in enumerate(ranges):
        first, last = index == 0, index == len(ranges) - 1
        weights = (given_weights * (layers[1] - layers[0]) // model.num_layers if given_weights is not None
                   else stage_weights_bytes(model, layers, first, last, plan_kwargs.get("dtype"), tp))
        own_groups = stage_kv_cache_groups(groups, layers) if groups is not None else None
        plan = plan_memory(model=stage_model(model, layers), weights=weights, check_fits=False,
                           kv_cache_groups=own_groups, **plan_kwargs)
        stages.append(StagePlan(index, layers, plan))
    return PipelinePlan(tuple(stages), plan_kwargs.get("block_size", 16), plan_kwargs["max_model_len"])


def stage_lines(pipeline: PipelinePlan) -> list[str]:
    """The plan's per-stage table, as ``engine plan`` prints it."""
    lines = ["  stage  layers      weights/GPU   activation   KV pool/GPU   KV B/token       blocks"]
    for s in pipeline.stages:
        p = s.plan
        lines.append(f"  {s.stage:>5}  {s.layers[0]:>3}-{s.layers[1] - 1:<4} {p.weights_bytes / GiB:>10.3f} GiB "
                     f"{p.activation_peak_bytes / GiB:>8.3f} GiB {p.kv_pool_bytes / GiB:>9.3f} GiB "
                     f"{p.bytes_per_token:>10,} {p.num_blocks:>12,}")
    binding = pipeline.binding_stage
    lines.append(f"  replica: {pipeline.num_blocks:,} blocks (stage {binding.stage}'s, the fewest: one block table "
                 f"serves every stage) = {pipeline.kv_cache_tokens:,} tokens, concurrency "
                 f"{pipeline.max_concurrency:.2f}x at {pipeline.max_model_len:,} tokens per request")
    return lines


# ------------------------------------------------------------------ the pipeline's idle time (issue 37)
DEFAULT_MICRO_BATCHES = 2  # engine/pipeline.py's MICRO_BATCHES (a test keeps the two equal)


def fill_drain_bubble(stages: int, micro_batches: int) -> float:
    """The share of a step each of ``stages`` equal stages idles when ``micro_batches``
    equal micro-batches fill and drain the pipeline within the step: (P - 1) / (M + P - 1).
    The least bubble a layout has; unequal stages or micro-batches add to it."""
    if stages < 2:
        return 0.0
    return (stages - 1) / (max(1, micro_batches) + stages - 1)
