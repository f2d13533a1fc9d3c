"""``engine simulate``: the real scheduler and KV cache manager at GPU scale, with
a roofline cost model in place of the forward pass (background parts 4 and 6; the
work it counts is engine/events/roofline.py's, shared with /metrics' MFU estimates).

A step costs::

    max(bytes read / (bandwidth x efficiency), FLOPs / (peak FLOP/s x efficiency))
    bytes = weights + KV bytes of every scheduled request's context
    FLOPs = 2 x parameters x tokens scheduled

The simulation publishes the same events as the real engine (``engine.config``,
``startup.phase`` A-G marked ``simulated`` with the planned memory numbers,
``request.*``, ``step``, ``stats``) on an :class:`~engine.events.EventBus` whose
clock is the simulated clock, so the monitor, the metrics sinks and ``engine
replay`` read a simulation exactly like a real run.

Arrivals come from a workload (:mod:`engine.sim.workload`): by scheduler tick (the
background's "arrives at step k"), by simulated time, or closed-loop (``concurrency``
users, each sending its next request when the previous one finishes).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.budget.memory import GiB, GpuPreset, MemoryPlan, gpu_preset, plan_memory
from engine.budget.stages import DEFAULT_MICRO_BATCHES, PipelinePlan, plan_stages
from engine.budget.vision import MultimodalBudget, multimodal_from_flags, vision_preset
from engine.config import EngineConfig
from engine.core.encoder_cache import MultimodalInput
from engine.core.kv_cache_groups import (
    KVCacheGroup,
    config_groups,
    groups_to_config,
    kv_cache_groups,
    parse_layer_pattern,
)
from engine.core.request import Request
from engine.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from engine.core.step_loop import ExecutedStep, run_step
from engine.errors import UserError
from engine.events import PHASES, EngineConfigEvent, Event, EventBus, StartupPhase
from engine.events.exporters.stats import StatsReporter
from engine.events.folds.pipeline_idle import PipelineIdle
from engine.events.folds.tally import RunTally
from engine.events.phase_data import InitData
from engine.events.roofline import Roofline
from engine.modelspec.config import DTYPE_BYTES, ModelConfig
from engine.modelspec.readers import load_model_config
from engine.sim.driver import SAMPLED_TOKEN_ID
from engine.sim.workload import Arrivals, TokenIdSource, WorkloadRequest

DEFAULT_MODEL = "llama-3.1-8b"
DEFAULT_GPU = "h100-80gb"
DEFAULT_EFFICIENCY = 0.6
# Pipeline stages sit on different nodes (the background's rule); a stage boundary is one
# 400 Gb/s NIC per GPU (InfiniBand NDR / RoCE, as in a DGX H100): 50 GB/s each way.
DEFAULT_PIPELINE_LINK_GBS = 50.0

LIMIT_SEQS = "max-num-seqs"
LIMIT_KV = "kv-pool"
LIMIT_TOKENS = "max-num-batched-tokens"
LIMITS = (LIMIT_SEQS, LIMIT_KV, LIMIT_TOKENS)


# ------------------------------------------------------------------ cost model
@dataclass(frozen=True, slots=True)
class CostModel:
    """Roofline step time of a dense decoder on one GPU (background parts 4, 6)."""

    weights_bytes: int
    bytes_per_kv_token: int
    num_parameters: int
    bandwidth_bytes_s: float  # peak
    peak_flops: float  # peak dense BF16
    efficiency: float = DEFAULT_EFFICIENCY
    vision_weights_bytes: int = 0  # a VL model's encoder: read once per step that encodes
    vision_parameters: int = 0
    encoder_positions_per_token: int = 1  # patches per output embedding (Qwen: 2x2 merged)
    # A mixture-of-experts model: its experts' parameters and bytes (inside the totals), experts per
    # MoE layer and top-k; a step computes over the active parameters and reads the experts it routes to.
    expert_parameters: int = 0
    expert_weights_bytes: int = 0
    num_experts: int = 0
    experts_per_token: int = 0

    roofline: Roofline = field(init=False, repr=False, compare=False)  # the work counted (engine/events/roofline.py)

    def __post_init__(self) -> None:
        if not 0 < self.efficiency <= 1:
            raise UserError(f"--efficiency {self.efficiency}: must be in (0, 1], the fraction of peak kernels reach")
        object.__setattr__(self, "roofline", Roofline(
            self.num_parameters, self.weights_bytes, self.bytes_per_kv_token, self.expert_parameters,
            self.expert_weights_bytes, self.num_experts, self.experts_per_token))

    @classmethod
    def for_gpu(cls, model: ModelConfig, gpu: GpuPreset, plan: MemoryPlan,
                efficiency: float = DEFAULT_EFFICIENCY) -> CostModel:
        mm = plan.multimodal
        vision = vision_preset(model.name)
        return cls(
            vision_weights_bytes=mm.vision_weights_bytes if mm else 0,
            vision_parameters=mm.vision_parameters if mm else 0,
            encoder_positions_per_token=vision.spatial_merge_size**2 if vision else 1,
            weights_bytes=plan.weights_bytes - (mm.vision_weights_bytes if mm else 0),  # a step reads the LLM's
            bytes_per_kv_token=plan.bytes_per_token,
            num_parameters=model.num_parameters,
            expert_parameters=model.expert_parameters,
            # the experts' share of the weights a step reads (dtype and tensor parallelism follow the plan's)
            expert_weights_bytes=(plan.weights_bytes - (mm.vision_weights_bytes if mm else 0))
            * model.expert_parameters // model.num_parameters,
            num_experts=model.num_experts or 0,
            experts_per_token=model.num_experts_per_tok or 0,
            bandwidth_bytes_s=gpu.bandwidth_tbs * 1e12,
            peak_flops=gpu.bf16_tflops * 1e12,
            efficiency=efficiency,
        )

    def memory_seconds(self, kv_tokens_read: int, num_tokens: int | None = None) -> float:
        return self.roofline.read_bytes(kv_tokens_read, num_tokens) / (self.bandwidth_bytes_s * self.efficiency)

    def compute_seconds(self, num_tokens: int) -> float:
        return self.roofline.flops(num_tokens) / (self.peak_flops * self.efficiency)

    def step_seconds(self, num_tokens: int, kv_tokens_read: int) -> float:
        memory = self.memory_seconds(kv_tokens_read, num_tokens)
        compute = self.compute_seconds(num_tokens)
        return memory if memory > compute else compute

    def encoder_seconds(self, tokens: int) -> float:
        """The vision tower on ``tokens`` output embeddings: its weights read once, 2 FLOPs
        per parameter per patch position (0 when the step encodes nothing)."""
        if tokens <= 0:
            return 0.0
        memory = self.vision_weights_bytes / (self.bandwidth_bytes_s * self.efficiency)
        compute = 2.0 * self.vision_parameters * tokens * self.encoder_positions_per_token / (
            self.peak_flops * self.efficiency)
        return max(memory, compute)

    def decode_tokens_per_s(self, num_requests: int, context_tokens: int) -> float:
        """Total output tokens/s of ``num_requests`` decoding at ``context_tokens`` each."""
        return num_requests / self.step_seconds(num_requests, num_requests * context_tokens)


class StepCost(Protocol):
    """A step's seconds from what it schedules, measured rather than derived (engine/sim/step_fit.py
    fits one to a recording's own steps); a setup that has one runs it instead of the roofline."""

    def seconds(self, prefill_tokens: int, decode_rows: int, kv_tokens_read: int) -> float: ...


@dataclass(frozen=True, slots=True)
class PipelineCost:
    """A pipeline-parallel replica's step (issue 37): each stage's GPU has its own roofline
    (its layers' weights and KV, :func:`stage_cost_models`); the step's sequences are split
    into ``micro_batches`` contiguous micro-batches of whole sequences (as engine/pipeline.py
    splits them), and micro-batch ``m`` starts on stage ``p`` once stage ``p`` is done with
    ``m - 1`` and its activations arrived from stage ``p - 1`` (``tokens x hidden x dtype``
    bytes over ``link_bytes_s``). The step ends when the last micro-batch leaves the last
    stage, which samples (vLLM's place, so it sends nothing); a stage's **bubble** is the
    step's time less its busy time, what the real engine counts as blocked in ``recv``.
    Each micro-batch reads its stage's weights again: micro-batching costs bandwidth when
    decoding. Steps do not overlap (kvscope's engine; vLLM's virtual engines keep P
    batches in flight, which this does not model)."""

    stages: tuple[CostModel, ...]
    micro_batches: int = DEFAULT_MICRO_BATCHES
    activation_bytes_per_token: int = 0
    link_bytes_s: float = DEFAULT_PIPELINE_LINK_GBS * 1e9

    def step(self, sequences: Sequence[tuple[int, int]]) -> dict[str, Any]:
        """Timings for one step of ``(tokens, KV tokens read)`` per scheduled sequence:
        ``duration_s`` / ``forward_s`` and the step event's ``pipeline_bubble_s`` and
        ``pipeline_bytes`` (one entry per stage)."""
        work = [(sum(t for t, _ in mb), sum(k for _, k in mb)) for mb in split_micro_batches(sequences,
                                                                                            self.micro_batches)]
        ready = [0.0] * len(work)  # when micro-batch m's input is on the current stage
        busy = [0.0] * len(self.stages)
        sent = [0] * len(self.stages)
        last = len(self.stages) - 1
        for p, cost in enumerate(self.stages):
            free = 0.0
            for m, (tokens, kv_read) in enumerate(work):
                seconds = cost.step_seconds(tokens, kv_read)
                free = max(ready[m], free) + seconds
                busy[p] += seconds
                if p < last:
                    nbytes = tokens * self.activation_bytes_per_token
                    sent[p] += nbytes
                    ready[m] = free + nbytes / self.link_bytes_s
                else:
                    ready[m] = free
        duration = max(ready, default=0.0)
        return {"forward_s": duration, "duration_s": duration,
                "pipeline_bubble_s": [duration - b for b in busy], "pipeline_bytes": sent}


def split_micro_batches(items: Sequence[Any], count: int) -> list[Sequence[Any]]:
    """``count`` contiguous micro-batches of whole sequences, the first ones a sequence
    longer when they do not divide (engine/pipeline.py's ``Stage.micro_batches``)."""
    count = max(1, min(count, len(items)))
    size = -(-len(items) // count)
    return [items[i:i + size] for i in range(0, len(items), size)]


def stage_cost_models(model: ModelConfig, gpu: GpuPreset, pipeline: PipelinePlan,
                      efficiency: float = DEFAULT_EFFICIENCY) -> tuple[CostModel, ...]:
    """One roofline per stage: the stage's own weights and KV bytes per token (its plan),
    and its layers' share of the model's FLOPs."""
    out = []
    for stage in pipeline.stages:
        share = (stage.layers[1] - stage.layers[0]) / model.num_layers
        whole = CostModel.for_gpu(model, gpu, stage.plan, efficiency)
        out.append(dataclasses.replace(whole, num_parameters=int(model.num_parameters * share),
                                       expert_parameters=int(model.expert_parameters * share)))
    return tuple(out)



# ----------------------------------------------------------------------- setup
@dataclass(slots=True)
class SimSetup:
    """Everything a simulation runs on: presets, flags, the memory plan, the
    scheduler's limits and the cost model."""

    model: ModelConfig
    gpu: GpuPreset
    engine: EngineConfig
    plan: MemoryPlan
    scheduler: SchedulerConfig
    cost: CostModel
    pipeline: PipelinePlan | None = None  # --pipeline-parallel-size > 1: every stage's plan
    pipeline_cost: PipelineCost | None = None
    step_cost: StepCost | None = None  # a measured cost (engine capacity's fit) in place of the roofline

    @property
    def data_parallel_size(self) -> int:
        return self.engine.data_parallel_size or 1

    def recording_config(self) -> dict[str, Any]:
        """The header / ``engine.config`` flags: the EngineConfig dict plus what was simulated."""
        cfg = self.engine.to_dict()
        cfg["max_model_len"] = self.plan.max_model_len
        cfg["simulation"] = {
            "gpu": self.gpu.name,
            "bandwidth_tbs": self.gpu.bandwidth_tbs,
            "bf16_tflops": self.gpu.bf16_tflops,
            "efficiency": self.cost.efficiency,
            "num_blocks": self.scheduler.num_blocks,
        }
        if self.pipeline_cost is not None:
            cfg["simulation"]["pipeline_micro_batches"] = self.pipeline_cost.micro_batches
            cfg["simulation"]["pipeline_link_gbs"] = self.pipeline_cost.link_bytes_s / 1e9
        if self.scheduler.kv_cache_groups:  # a hybrid KV cache: replay and the KV events read the groups
            cfg["kv_cache_groups"] = groups_to_config(self.scheduler.kv_cache_groups)
        return cfg


def model_kv_cache_groups(model: ModelConfig, layer_pattern: str | None = None,
                          sliding_window: int | None = None) -> tuple[KVCacheGroup, ...]:
    """The model's KV cache groups: its own ``layer_types`` (a Gemma 3 preset), or
    ``layer_pattern`` (``"5:1"``: five sliding layers then one full, repeated) with
    ``sliding_window`` laid over a preset's layers; () for full attention everywhere."""
    window = sliding_window or getattr(model, "sliding_window", None)
    layer_types = parse_layer_pattern(layer_pattern, model.num_layers) if layer_pattern else getattr(
        model, "layer_types", None)
    if layer_pattern and not window:
        raise UserError(f"--layer-pattern {layer_pattern}: give --sliding-window too (the model has none)")
    try:
        groups = kv_cache_groups(layer_types, window, model.num_layers)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    return config_groups(groups)


def _check_stage_flags(stages: int, groups: tuple[KVCacheGroup, ...], mm: MultimodalBudget | None, micro_batches: int,
                       pipeline_link_gbs: float) -> None:
    """Pipeline stages simulate full-attention text models, with at least one micro-batch over a real link."""
    if stages > 1 and (groups or mm is not None):
        raise UserError(f"--pipeline-parallel-size {stages}: sliding-window layers and vision encoders are not "
                        "simulated in stages; drop --layer-pattern / --limit-mm-per-prompt or give -pp 1")
    if micro_batches < 1 or pipeline_link_gbs <= 0:
        raise UserError(f"--pipeline-micro-batches {micro_batches} / --pipeline-link-gbs {pipeline_link_gbs:g}: "
                        "give at least 1 micro-batch and a positive link speed")


def _plan_replica(model_cfg: ModelConfig, gpu_cfg: GpuPreset, eng: EngineConfig, dtype: str,
                  groups: tuple[KVCacheGroup, ...], mm: MultimodalBudget | None,
                  num_gpu_blocks_override: int | None) -> tuple[MemoryPlan, PipelinePlan | None]:
    """The replica's memory plan (with several stages, the binding stage's) and its stages' plan, the pool
    fixed where ``num_gpu_blocks_override`` says."""
    max_model_len = eng.max_model_len or model_cfg.max_position_embeddings
    stages = eng.pipeline_parallel_size or 1
    plan_kwargs: dict[str, Any] = dict(
        total_bytes=int(gpu_cfg.total_gib * GiB),
        gpu_memory_utilization=eng.gpu_memory_utilization,
        max_model_len=max_model_len,
        block_size=eng.block_size,
        kv_cache_dtype=eng.kv_cache_dtype,
        dtype=dtype,
        tensor_parallel_size=eng.tensor_parallel_size,
        kv_cache_memory_bytes=eng.kv_cache_memory_bytes,
        max_num_batched_tokens=eng.max_num_batched_tokens,
        max_num_seqs=eng.max_num_seqs,
    )
    pipeline = None
    if stages > 1:
        pipeline = plan_stages(model_cfg, stages, **plan_kwargs)
        plan = pipeline.binding_stage.plan
        if num_gpu_blocks_override is None and pipeline.kv_cache_tokens < max_model_len:
            raise UserError(f"--pipeline-parallel-size {stages} on {gpu_cfg.name}: stage "
                            f"{pipeline.binding_stage.stage}'s GPU holds {max(0, pipeline.kv_cache_tokens):,} tokens "
                            f"of KV, less than one --max-model-len {max_model_len:,} request; lower --max-model-len, "
                            "raise --gpu-memory-utilization or add stages (engine plan -pp shows each stage)")
    else:
        plan = plan_memory(model=model_cfg, check_fits=num_gpu_blocks_override is None, multimodal=mm,
                           kv_cache_groups=groups, **plan_kwargs)
    if num_gpu_blocks_override is not None:
        if num_gpu_blocks_override < 1:
            raise UserError(f"--num-gpu-blocks-override {num_gpu_blocks_override}: must be at least 1")
        plan = plan.with_num_blocks(num_gpu_blocks_override)
    return plan, pipeline


def _scheduler_config(eng: EngineConfig, plan: MemoryPlan, groups: tuple[KVCacheGroup, ...],
                      mm: MultimodalBudget | None) -> SchedulerConfig:
    """The scheduler's limits from the flags and the plan's pool, with the hybrid groups and the encoder's budgets."""
    try:
        sched = SchedulerConfig.from_flags(eng.to_dict(), num_blocks=plan.num_blocks, block_size=plan.block_size,
                                           max_model_len=plan.max_model_len)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if groups:
        sched = dataclasses.replace(sched, kv_cache_groups=groups)
    if mm is not None:
        sched = dataclasses.replace(sched, encoder_compute_budget=mm.encoder_compute_budget,
                                    encoder_cache_size=mm.encoder_cache_size)
    return sched


def build_setup(
    model: str | ModelConfig = DEFAULT_MODEL,
    gpu: str | GpuPreset = DEFAULT_GPU,
    engine: EngineConfig | None = None,
    *,
    efficiency: float = DEFAULT_EFFICIENCY,
    num_gpu_blocks_override: int | None = None,
    multimodal: dict[str, Any] | None = None,
    layer_pattern: str | None = None,
    sliding_window: int | None = None,
    micro_batches: int = DEFAULT_MICRO_BATCHES,
    pipeline_link_gbs: float = DEFAULT_PIPELINE_LINK_GBS,
) -> SimSetup:
    """Plan memory for ``model`` on ``gpu`` with ``engine``'s flags (vLLM's names) and
    derive the scheduler limits and the cost model. ``num_gpu_blocks_override``
    fixes the pool size (vLLM's ``--num-gpu-blocks-override``); ``multimodal``
    (``engine.cli.flags.multimodal_flags``) plans a VL preset's encoder, whose
    budgets become the scheduler's second limit. A model with sliding-window layers (its
    ``layer_types``, or ``layer_pattern`` and ``sliding_window`` laid over a preset) runs
    the hybrid KV cache manager on the budget's hybrid pool (engine/budget/memory.py).
    ``--pipeline-parallel-size P`` plans every stage on its own GPU (engine/budget/stages.py,
    ``engine plan -pp``): the replica's pool is the fewest blocks any stage holds, the plan
    the startup events report is that stage's, and each step runs through
    :class:`PipelineCost` with ``micro_batches`` over ``pipeline_link_gbs`` GB/s links."""
    model_cfg = model if isinstance(model, ModelConfig) else load_model_config(model)
    gpu_cfg = gpu if isinstance(gpu, GpuPreset) else gpu_preset(gpu)
    eng = dataclasses.replace(engine) if engine is not None else EngineConfig(model=model_cfg.name)
    eng.model = model_cfg.name
    dtype = model_cfg.dtype if eng.dtype == "auto" else eng.dtype
    mm = multimodal_from_flags(model_cfg, **(multimodal or {}), max_num_batched_tokens=eng.max_num_batched_tokens,
                               max_num_seqs=eng.max_num_seqs, dtype=dtype,
                               tensor_parallel_size=eng.tensor_parallel_size)
    groups = model_kv_cache_groups(model_cfg, layer_pattern, sliding_window)
    _check_stage_flags(eng.pipeline_parallel_size or 1, groups, mm, micro_batches, pipeline_link_gbs)
    plan, pipeline = _plan_replica(model_cfg, gpu_cfg, eng, dtype, groups, mm, num_gpu_blocks_override)
    sched = _scheduler_config(eng, plan, groups, mm)
    eng.max_model_len = plan.max_model_len
    pipeline_cost = None
    if pipeline is not None:
        pipeline_cost = PipelineCost(stage_cost_models(model_cfg, gpu_cfg, pipeline, efficiency), micro_batches,
                                     int(model_cfg.hidden_size * DTYPE_BYTES[dtype.lower()]), pipeline_link_gbs * 1e9)
    return SimSetup(model_cfg, gpu_cfg, eng, plan, sched, CostModel.for_gpu(model_cfg, gpu_cfg, plan, efficiency),
                    pipeline, pipeline_cost)


def concurrency_limits(setup: SimSetup, tokens_per_request: int) -> dict[str, float]:
    """The two limits on resident requests (background 5.2) for requests of
    ``tokens_per_request`` tokens: ``max-num-seqs`` and KV pool tokens / length."""
    return {
        LIMIT_SEQS: float(setup.scheduler.max_num_seqs),
        LIMIT_KV: setup.plan.kv_cache_tokens / tokens_per_request,
    }


def concurrency_crossover_tokens(setup: SimSetup) -> float:
    """Request length (tokens) above which the KV pool, not max-num-seqs, binds."""
    return setup.plan.kv_cache_tokens / setup.scheduler.max_num_seqs


# ---------------------------------------------------------------- the startup
def _reading(total: int, allocated: int, peak: int | None = None) -> dict[str, Any]:
    return {"total": total, "free": total - allocated, "allocated": allocated, "reserved": allocated,
            "peak": allocated if peak is None else peak, "source": "simulated"}


def publish_startup(bus: EventBus, setup: SimSetup) -> None:
    """``engine.config`` and phases A-G, every one marked simulated, with the plan's numbers."""
    plan = setup.plan
    summary = setup.model.summary()
    summary["bytes_per_kv_token"] = plan.bytes_per_token
    bus.publish(EngineConfigEvent(config=setup.recording_config(), model=summary))
    records = plan.phase_records()
    records["A"] = InitData(device="cuda", gpu=setup.gpu.name, simulated=True)
    total = plan.total_bytes
    weights = plan.weights_bytes
    allocated_after = {"A": 0, "B": 0, "C": weights, "D": weights, "E": weights + plan.kv_pool_bytes,
                       "F": weights + plan.kv_pool_bytes, "G": weights + plan.kv_pool_bytes}
    before = 0
    for letter, name in PHASES.items():
        after = allocated_after[letter]
        peak = weights + plan.activation_peak_bytes if letter == "D" else after
        bus.publish(StartupPhase(phase=letter, name=name, status="begin", simulated=True,
                                 memory_before=_reading(total, before)))
        if letter == "F":
            bus.publish(StartupPhase(phase=letter, name=name, status="skipped", simulated=True, duration_s=0.0,
                                     reason="simulated: no CUDA graphs are captured",
                                     memory_before=_reading(total, before), memory_after=_reading(total, after)))
        else:
            bus.publish(StartupPhase(phase=letter, name=name, status="end", simulated=True, duration_s=0.0,
                                     data=records[letter].to_dict() if letter in records else {},
                                     memory_before=_reading(total, before),
                                     memory_after=_reading(total, after, peak)))
        before = after


# ------------------------------------------------------------------ the result
def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default); 0.0 for no values."""
    if not values:
        return 0.0
    import numpy as np

    return float(np.percentile(np.asarray(values, dtype=float), q))


@dataclass(slots=True)
class SimResult(RunTally):
    """What a simulation measured: the run's tally (folded from its events; the
    simulator subscribes the result itself to the bus) plus the simulator's own
    clock. Per-step series are indexed by scheduler step; ``*_tick`` dicts use the
    arrival tick counter (idle ticks included), so ``first_token_tick - arrival_tick
    + 1`` is the background's TTFT in steps."""

    sim_seconds: float = 0.0
    wall_seconds: float = 0.0
    num_blocks: int = 0
    limit_steps: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LIMITS, 0))
    arrival_tick: dict[str, int] = field(default_factory=dict)
    first_token_tick: dict[str, int] = field(default_factory=dict)
    step_start_s: list[float] = field(default_factory=list)
    completed: bool = True
    pipeline: PipelineIdle = field(default_factory=PipelineIdle)  # each stage's bubble, --pipeline-parallel-size

    def __call__(self, event: Event) -> None:
        RunTally.__call__(self, event)
        self.pipeline(event)

    @property
    def step_seconds(self) -> list[float]:
        return self.step_forward_s

    @property
    def peak_pool_fraction(self) -> float:
        return self.peak_blocks_used / self.num_blocks if self.num_blocks else 0.0

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.sim_seconds if self.sim_seconds > 0 else 0.0

    @property
    def total_throughput(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.sim_seconds if self.sim_seconds > 0 else 0.0

    @property
    def binding_limit(self) -> str:
        """The concurrency limit that held requests in the waiting queue on the most
        steps, or ``none``. The token budget only slows admission (prompts get in a
        chunk at a time), so it is named only when neither concurrency limit ever held."""
        steps = self.limit_steps
        best = LIMIT_SEQS if steps[LIMIT_SEQS] >= steps[LIMIT_KV] else LIMIT_KV
        if steps[best] > 0:
            return best
        return LIMIT_TOKENS if steps[LIMIT_TOKENS] > 0 else "none"

    def ttft_steps(self) -> list[int]:
        return [self.first_token_tick[r] - self.arrival_tick[r] + 1 for r in self.first_token_tick]

    def decode_only_throughput(self) -> float:
        """Output tokens/s over the steps with no prefill at all (steady decoding)."""
        tokens = seconds = 0.0
        for p, d, s in zip(self.step_prefill, self.step_decode, self.step_seconds, strict=True):
            if p == 0 and d > 0:
                tokens += d
                seconds += s
        return tokens / seconds if seconds > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        ttft = list(self.ttft_s.values())
        return {
            "steps": self.steps,
            "simulated_s": self.sim_seconds,
            "wall_s": self.wall_seconds,
            "steps_per_wall_s": self.steps / self.wall_seconds if self.wall_seconds > 0 else 0.0,
            "finished": self.finished,
            "rejected": self.rejected,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "output_tokens_per_s": self.output_throughput,
            "total_tokens_per_s": self.total_throughput,
            "ttft_p50_s": percentile(ttft, 50),
            "ttft_p90_s": percentile(ttft, 90),
            "ttft_p99_s": percentile(ttft, 99),
            "itl_p50_s": percentile(self.itl_s, 50),
            "itl_p90_s": percentile(self.itl_s, 90),
            "itl_p99_s": percentile(self.itl_s, 99),
            "itl_max_s": max(self.itl_s, default=0.0),
            "preemptions": self.preemptions,
            "peak_running": self.peak_running,
            "peak_waiting": self.peak_waiting,
            "peak_blocks_used": self.peak_blocks_used,
            "num_blocks": self.num_blocks,
            "peak_pool_fraction": self.peak_pool_fraction,
            "binding_limit": self.binding_limit,
            "limit_steps": dict(self.limit_steps),
            "completed": self.completed,
            **({"pipeline_bubble_fraction": self.pipeline.fractions,
                "pipeline_bytes_per_step": self.pipeline.bytes_per_step()} if self.pipeline.stages else {}),
            **({"encoder_items": self.encoder_items, "encoder_tokens": self.encoder_tokens,
                "peak_encoder_cache_tokens": self.peak_encoder_cache_tokens,
                "encoder_cache_capacity": self.encoder_cache_capacity} if self.encoder_cache_capacity else {}),
        }


StepHook = Callable[[Scheduler, SchedulerOutput], None]
StopWhen = Callable[[Scheduler, SchedulerOutput], bool]


# -------------------------------------------------------------- the simulation
def clocked_bus(bus: EventBus | None, clock: Callable[[], float], stats_interval: float) -> EventBus:
    """The caller's bus (or, without one, a private one: the result is a fold of the events) on
    the simulated ``clock``; ``stats_interval`` > 0 adds a :class:`StatsReporter` publishing
    ``stats`` events on that time axis (no log lines)."""
    out = bus if bus is not None else EventBus()
    out.set_clock(clock)
    if bus is not None and stats_interval > 0:
        bus.subscribe(StatsReporter(bus, stats_interval, device_word="GPU", log=None))
    return out


class Simulation:
    """Runs a workload through a fresh :class:`Scheduler` under the cost model.

    ``bus`` (optional) gets the simulated clock; subscribe sinks before
    :meth:`run`. ``stats_interval`` > 0 adds a :class:`StatsReporter` that
    publishes ``stats`` events on the simulated time axis (no log lines).
    """

    def __init__(self, setup: SimSetup, bus: EventBus | None = None, *, stats_interval: float = 0.0) -> None:
        self.setup = setup
        self.now = 0.0
        self.bus = clocked_bus(bus, self.clock, stats_interval)
        self.scheduler = Scheduler(setup.scheduler, self.bus)

    def clock(self) -> float:
        return self.now

    def run(
        self,
        workload: Sequence[WorkloadRequest],
        *,
        concurrency: int | None = None,
        startup: bool = True,
        max_steps: int = 50_000_000,
        stop_when: StopWhen | None = None,
        on_step: StepHook | None = None,
    ) -> SimResult:
        """Simulate until every request finished (or ``stop_when`` says stop).

        ``concurrency`` switches to closed-loop arrivals: that many requests in
        flight, the next one sent (in workload order) when one finishes.
        """
        wall_start = time.perf_counter()
        bus = self.bus
        if startup and bus.has_subscribers:
            publish_startup(bus, self.setup)
        result = SimResult(num_blocks=self.scheduler.config.num_blocks)
        arrivals = Arrivals(workload, concurrency)
        bus.subscribe(result)
        try:
            tick_of_step = self._steps(arrivals, result, max_steps, stop_when, on_step)
        finally:
            bus.unsubscribe(result)
        result.first_token_tick = {r: tick_of_step[i] for r, i in result.first_token_step.items()}
        result.completed = not self.scheduler.has_unfinished() and not arrivals.pending
        result.sim_seconds = self.now
        result.wall_seconds = time.perf_counter() - wall_start
        return result

    def _steps(self, arrivals: Arrivals, result: SimResult, max_steps: int, stop_when: StopWhen | None,
               on_step: StepHook | None) -> dict[int, int]:
        """The step loop: send what is due, step, repeat; returns each step's arrival tick."""
        sched = self.scheduler
        ids = TokenIdSource()
        executor = CostModelExecutor(self, result.limit_steps)
        tick_of_step: dict[int, int] = {}  # scheduler step index -> arrival tick

        def send(spec: WorkloadRequest, arrival_time: float) -> bool:
            req = Request(spec.request_id, ids.prompt(spec), spec.output_tokens, ignore_eos=True,
                          arrival_time=arrival_time, priority=spec.priority, mm_inputs=mm_inputs(spec))
            if not sched.add_request(req, self.now):
                return False
            result.arrival_tick[spec.request_id] = arrivals.tick
            return True

        while result.steps < max_steps:
            arrivals.send_due(self.now, send)
            if not sched.has_unfinished():
                if not arrivals.pending:
                    break
                self.now = arrivals.skip_idle(self.now)
                continue
            result.step_start_s.append(self.now)
            step = run_step(sched, executor, self.bus, self.now)
            tick_of_step[step.output.step_index] = arrivals.tick
            arrivals.in_flight -= len(step.finished)
            if on_step is not None:
                on_step(sched, step.output)
            arrivals.tick += 1
            if stop_when is not None and stop_when(sched, step.output):
                break
        return tick_of_step


class CostModelExecutor:
    """The simulator's executor: a step takes the cost model's seconds for its tokens and
    the KV it reads, the simulated clock advances by them (before the update, so the
    finish events carry the step's end), and it counts which limit held the queue back."""

    def __init__(self, sim: Simulation, limit_steps: dict[str, int]) -> None:
        self.sim = sim
        self.limit_steps = limit_steps
        self._tokens = [SAMPLED_TOKEN_ID]

    def execute(self, output: SchedulerOutput, now: float) -> ExecutedStep:
        sched, cfg = self.sim.scheduler, self.sim.scheduler.config
        kv_read = output.kv_tokens_read
        num_tokens = output.num_prefill_tokens + output.num_decode_tokens
        if sched.waiting:
            if output.preempted_req_ids:
                self.limit_steps[LIMIT_KV] += 1
            elif len(sched.running) >= cfg.max_num_seqs:
                self.limit_steps[LIMIT_SEQS] += 1
            elif num_tokens >= cfg.max_num_batched_tokens:
                self.limit_steps[LIMIT_TOKENS] += 1
            else:
                self.limit_steps[LIMIT_KV] += 1
        pipeline = self.sim.setup.pipeline_cost
        timings: dict[str, Any]
        if pipeline is not None:
            timings = pipeline.step([(s.num_tokens, s.start_position + s.num_tokens) for s in output.scheduled])
            seconds = timings["duration_s"]
        else:
            fitted = self.sim.setup.step_cost
            seconds = (fitted.seconds(output.num_prefill_tokens, output.num_decode_tokens, kv_read) if fitted
                       else self.sim.setup.cost.step_seconds(num_tokens, kv_read))
            timings = {"forward_s": seconds, "duration_s": seconds}
        if output.encoder_inputs:  # the encoder runs first, then the forward that reads its outputs
            encode = self.sim.setup.cost.encoder_seconds(sum(tokens for _, _, tokens in output.encoder_inputs))
            seconds += encode
            timings = {**timings, "encode_s": encode, "duration_s": seconds}
        self.sim.now = now + seconds
        sampled = {s.request.request_id: self._tokens for s in output.scheduled if s.samples}
        return ExecutedStep(sampled, self.sim.now, timings=timings)


def mm_inputs(spec: WorkloadRequest) -> tuple[MultimodalInput, ...]:
    """A request's items as placeholder runs, one after another after its shared prefix."""
    out: list[MultimodalInput] = []
    offset = spec.shared_prefix_tokens
    for modality, tokens in spec.mm_items:
        out.append(MultimodalInput(offset, tokens, modality))
        offset += tokens
    return tuple(out)


def simulate(setup: SimSetup, workload: Sequence[WorkloadRequest], bus: EventBus | None = None,
             **kwargs: Any) -> SimResult:
    """One-call form of :class:`Simulation`."""
    return Simulation(setup, bus).run(workload, **kwargs)


# ---------------------------------------------------------------------- sweeps
def long_prompt_sweep(
    setup: SimSetup,
    caps: Sequence[int],
    *,
    long_prompt: int = 16_000,
    num_decoders: int = 60,
    decoder_prompt: int = 1500,
    decoder_output: int = 400,
) -> list[dict[str, Any]]:
    """Background 6.1: ``num_decoders`` requests are decoding when a
    ``long_prompt``-token prompt arrives. For each ``--max-num-batched-tokens``
    cap: the long prompt's TTFT (seconds and steps) and the worst inter-token
    gap everyone else sees while it is being prefilled."""
    rows: list[dict[str, Any]] = []
    for cap in caps:
        eng = dataclasses.replace(setup.engine, max_num_batched_tokens=int(cap))
        sched_cfg = dataclasses.replace(setup.scheduler, max_num_batched_tokens=int(cap))
        point = dataclasses.replace(setup, engine=eng, scheduler=sched_cfg)
        arrive = math.ceil(num_decoders * decoder_prompt / cap) + 2  # every decoder is decoding by then
        workload = [WorkloadRequest(f"d{i}", decoder_prompt, decoder_output, arrival_step=0) for i in range(num_decoders)]
        workload.append(WorkloadRequest("long", long_prompt, 1, arrival_step=arrive))
        def long_done(sched: Scheduler, out: SchedulerOutput) -> bool:
            return "long" in out.finished

        result = Simulation(point).run(workload, stop_when=long_done)
        # every tick runs a step here (the decoders never leave the engine idle): ticks are step indices
        first = result.arrival_tick["long"]
        last = result.first_token_tick["long"]
        during = result.step_seconds[first : last + 1]
        rows.append({
            "max_num_batched_tokens": int(cap),
            "long_prompt_tokens": long_prompt,
            "ttft_s": result.ttft_s.get("long", float("nan")),
            "ttft_steps": last - first + 1,
            "worst_itl_others_s": max(during, default=0.0),
        })
    return rows


def concurrency_sweep(
    setup: SimSetup,
    levels: Sequence[int],
    *,
    prompt_range: tuple[int, int] = (500, 3000),
    output_range: tuple[int, int] = (150, 400),
    requests_per_user: int = 4,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """The saturation curve: ``c`` closed-loop users for each level, each sending
    ``requests_per_user`` requests back to back (draws as the background's)."""
    from engine.sim.workload import WorkloadSpec, generate_workload

    rows: list[dict[str, Any]] = []
    for c in levels:
        n = max(int(c) * requests_per_user, 8)
        workload = generate_workload(WorkloadSpec(n, prompt_range, output_range, seed=seed))
        result = Simulation(setup).run(workload, concurrency=int(c))
        s = result.summary()
        rows.append({
            "concurrency": int(c),
            "requests": n,
            "output_tokens_per_s": s["output_tokens_per_s"],
            "ttft_p50_s": s["ttft_p50_s"],
            "ttft_p99_s": s["ttft_p99_s"],
            "itl_p50_s": s["itl_p50_s"],
            "itl_p99_s": s["itl_p99_s"],
            "preemptions": s["preemptions"],
        })
    return rows
