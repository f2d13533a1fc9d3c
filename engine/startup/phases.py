"""Startup in phases A–G, each measured and emitted as ``startup.phase`` events.

A init (device, versions, memory snapshot) → B budget (requested = total ×
utilization; refuse if less is free) → C load weights → D profile run (one
dummy step at the worst-case shape; the activation peak is measured) → E KV
cache (pool = requested − weights − peak − non-torch, through engine.budget.memory) →
F graphs / compile → G ready.

Each phase emits a ``begin`` and an ``end`` (or ``skipped`` / ``failed``) event
with its duration and device memory before and after, plus a log line. Its
numbers are the phase's record from engine/events/phase_data.py, published as
``record.to_dict()``. ``prepare_startup`` (engine/startup/inputs.py) does everything
before phase A (the device, the model, ``resolve_config``); ``start_engine`` runs one
function per phase, each in the module of its phase group (engine/startup/__init__.py).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine import startup_eta
from engine.budget.memory import MemoryPlan
from engine.config import EngineConfig
from engine.core.scheduler_config import SchedulerConfig
from engine.events import EngineConfigEvent, EventBus
from engine.events.phase_data import ReadyData
from engine.gc_policy import freeze_startup_heap, restore_collections
from engine.logs import get_logger
from engine.model.kernels.background import KernelBuilds
from engine.model.loading.tokenizer import Tokenizer
from engine.model.memory.device import MemoryReading
from engine.model.parallel import RankLayout, TensorParallel, replica_free_bytes
from engine.model.runner import ModelRunner
from engine.modelspec.config import ModelConfig
from engine.startup.device_budget import phase_budget, phase_init
from engine.startup.inputs import StartupInputs, model_summary, prepare_startup, resolved_config_dict
from engine.startup.kv_pool import phase_kv_cache
from engine.startup.profile_run import phase_profile_run
from engine.startup.recorder import PhaseRecorder, progress_events
from engine.startup.warmup import cpu_phase_f, cuda_phase_f
from engine.startup.weights import phase_load_weights


@dataclass(slots=True)
class StartupResult:
    config: EngineConfig
    model_config: ModelConfig
    device: torch.device
    runner: ModelRunner
    tokenizer: Tokenizer
    plan: MemoryPlan
    scheduler_config: SchedulerConfig
    phase_seconds: dict[str, float]
    parallel: TensorParallel | None = None  # this rank's group under --tensor-parallel-size > 1

    @property
    def startup_seconds(self) -> float:
        return sum(self.phase_seconds.values())


def start_engine(config: EngineConfig, bus: EventBus, progress: Callable[[int, int], None] | None = None,
                 rank: RankLayout | None = None, stage: Any = None) -> StartupResult:
    """Resolve the flags (``config`` itself is not changed), then run phases A–G.
    ``rank``: this process's place in a tensor-parallel replica (engine/workers.py
    starts the others); phase A joins the replica's group, B and E agree across ranks.
    ``stage``: this process's pipeline stage (engine/pipeline.py's StageLayout): phase A
    joins the stages (rank 0 hands them its flags), C keeps the stage's layers, B and E
    budget the stage's weights and KV pool and E takes the fewest blocks of any stage.
    Raises UserError (after a ``failed`` phase event) when the budget does not fit,
    with the numbers and the flags that would fix it; everything the flags alone
    decide is refused in phase B, before weights load. A model with sliding-window layers
    runs vLLM's hybrid KV cache (one block table per group) unless
    ``--disable-hybrid-kv-cache-manager`` (vLLM's flag) keeps every layer on one
    full-attention table."""
    log = get_logger("kvscope.startup")
    s = prepare_startup(config, log, stage)
    bus.publish(EngineConfigEvent(config=resolved_config_dict(s),
                                  model=model_summary(s.model, s.config.dtype, s.bytes_per_token)))
    if stage is not None:
        phases = PhaseRecorder(bus, s.device, s.config.device_memory_gib, log, rank=stage.rank,
                               pp_rank=stage.pp_rank, tp_rank=stage.tp_rank)
    else:
        phases = PhaseRecorder(bus, s.device, s.config.device_memory_gib, log, rank=rank.rank if rank else None)
    eta = _eta_session(s, bus, lead=(rank is None or rank.rank == 0) and (stage is None or stage.rank == 0))
    try:
        result = _phases_a_to_g(config, s, phases, bus, progress, rank, stage)
        if eta is not None:
            eta.record(result.phase_seconds)
        return result
    finally:
        if eta is not None:
            eta.close()


def _eta_session(s: StartupInputs, bus: EventBus, lead: bool) -> startup_eta.EtaSession | None:
    """The lead rank's prediction of this start, published before phase A (engine/startup_eta.py)."""
    if not lead:
        return None
    key = startup_eta.start_key(s.config.to_dict(), s.model.path, s.model.name)
    return startup_eta.EtaSession(bus, s.log, key, startup_eta.model_bytes_of(s.model.path),
                                  startup_eta.history_path()).open()


def _phases_a_to_g(config: EngineConfig, s: StartupInputs, phases: PhaseRecorder, bus: EventBus,
                   progress: Callable[[int, int], None] | None, rank: RankLayout | None,
                   stage: Any) -> StartupResult:
    """Phases A-G of :func:`start_engine`."""
    parallel: TensorParallel | None = None
    with phases.phase("A") as a:
        if rank is not None:
            parallel = TensorParallel.join(rank, s.device)
        if stage is not None:
            if not torch.distributed.is_initialized():  # rank 0 (a stage process joined first)
                stage.join(config)
            parallel = stage.tensor_parallel(s.device)  # T x P: this stage's ranks
        reading = phases.reading()
        kernels = phase_init(a, s, reading)
    try:
        return _phases_b_to_g(s, phases, reading, kernels, parallel, bus, progress, stage)
    except BaseException:
        if kernels is not None:
            kernels.settle()
        raise


def _phases_b_to_g(s: StartupInputs, phases: PhaseRecorder, reading: MemoryReading, kernels: KernelBuilds | None,
                   parallel: TensorParallel | None, bus: EventBus, progress: Callable[[int, int], None] | None,
                   stage: Any = None) -> StartupResult:
    """Phases B-G of :func:`start_engine` (A has started the kernel builds it settles on failure)."""
    with phases.phase("B") as b:
        if parallel is not None:  # the replica has what its emptiest rank has
            reading = dataclasses.replace(reading, free=replica_free_bytes(parallel.all_gather(reading.free)))
        phase_budget(b, s, reading)
    with phases.phase("C") as c:
        runner, tokenizer, info = phase_load_weights(c, s, progress_events(bus, "C", "weights", "tensors", progress),
                                                     parallel)
    with phases.phase("D") as d:
        profile = phase_profile_run(d, s, runner, bus, shared=parallel is not None or stage is not None)
    with phases.phase("E") as e:
        plan = phase_kv_cache(e, s, reading, info.weights_bytes, profile, runner, parallel, stage)
    with phases.phase("F") as f:
        if s.device.type == "cuda":
            cuda_phase_f(f, s, runner)
        else:
            cpu_phase_f(f, s, runner, kernels, bus)
    with phases.phase("G") as g:
        restore_collections()  # the objects startup made are made: collect at the usual rate again
        freeze_startup_heap()  # and a collection during serving skips them (engine/gc_policy.py)
        g.record = ReadyData(startup_seconds=sum(phases.seconds.values()), pid=os.getpid())
    scheduler_config = SchedulerConfig.from_flags(resolved_config_dict(s), num_blocks=plan.num_blocks,
                                                  max_model_len=s.max_model_len)
    return StartupResult(s.config, s.model, s.device, runner, tokenizer, plan, scheduler_config,
                         dict(phases.seconds), parallel)
