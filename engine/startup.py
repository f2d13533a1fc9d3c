"""Startup in phases A–G, each measured and emitted as ``startup.phase`` events.

A init (device, versions, memory snapshot) → B budget (requested = total ×
utilization; refuse if less is free) → C load weights → D profile run (one
dummy step at the worst-case shape; the activation peak is measured) → E KV
cache (pool = requested − weights − peak − non-torch, through engine.memory) →
F graphs / compile → G ready.

Each phase emits a ``begin`` and an ``end`` (or ``skipped`` / ``failed``) event
with its duration and device memory before and after, plus a log line.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.config import EngineConfig, ModelConfig, load_model_config
from engine.cuda_graphs import DecodeGraphs, graphs_supported
from engine.device import MemoryReading, device_word, measure_peak, read_memory, resolve_device, versions
from engine.errors import BudgetError, UserError
from engine.events import PHASES, EngineConfigEvent, EventBus, StartupPhase
from engine.logs import get_logger
from engine.memory import (
    GiB,
    MemoryPlan,
    bytes_per_kv_token,
    check_plan_fits,
    kv_cache_size_line,
    max_concurrency_line,
    plan_memory,
    weights_bytes,
)
from engine.model.tokenizer import Tokenizer
from engine.runner import ModelRunner
from engine.scheduler import SchedulerConfig

# vLLM's CPU backend sizes its pool from VLLM_CPU_KVCACHE_SPACE (4 GiB by
# default) rather than from all of RAM; kvscope does the same when the user
# gave neither --device-memory nor --kv-cache-memory-bytes.
CPU_DEFAULT_KV_SPACE_GIB = 4.0
# The profile run on 2 CPU cores at vLLM's GPU default of 8,192 tokens takes
# ~20 s; 2,048 keeps startup short and still lets a long prompt prefill in chunks.
GPU_DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
CPU_DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


@dataclass(slots=True)
class PhaseHandle:
    """What a phase body fills in: its numbers, or a skip reason."""

    data: dict[str, Any] = field(default_factory=dict)
    skipped: str | None = None


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

    @property
    def startup_seconds(self) -> float:
        return sum(self.phase_seconds.values())


class PhaseRecorder:
    """Emits the begin/end events of each phase with memory readings around it."""

    def __init__(self, bus: EventBus, device: torch.device, device_memory_gib: float | None, log: Any) -> None:
        self.bus = bus
        self.device = device
        self.device_memory_gib = device_memory_gib
        self.log = log
        self.seconds: dict[str, float] = {}

    def reading(self) -> MemoryReading:
        return read_memory(self.device, self.device_memory_gib)

    @contextmanager
    def phase(self, letter: str) -> Iterator[PhaseHandle]:
        name = PHASES[letter]
        before = self.reading().to_dict()
        self.bus.publish(StartupPhase(phase=letter, name=name, status="begin", memory_before=before))
        handle = PhaseHandle()
        start = time.perf_counter()
        try:
            yield handle
        except Exception as exc:
            duration = time.perf_counter() - start
            self.seconds[letter] = duration
            reason = str(exc) if isinstance(exc, UserError) else f"{type(exc).__name__}: {exc}"
            self.bus.publish(StartupPhase(phase=letter, name=name, status="failed", duration_s=duration,
                                          memory_before=before, memory_after=self.reading().to_dict(),
                                          data=handle.data, reason=reason))
            self.log.error(f"phase {letter} ({name}) failed", reason=reason)
            raise
        duration = time.perf_counter() - start
        self.seconds[letter] = duration
        status = "skipped" if handle.skipped else "end"
        self.bus.publish(StartupPhase(phase=letter, name=name, status=status, duration_s=duration,
                                      memory_before=before, memory_after=self.reading().to_dict(),
                                      data=handle.data, reason=handle.skipped))
        self.log.info(f"phase {letter} {name} {'skipped' if handle.skipped else 'done'} in {duration:.2f} s",
                      **({"reason": handle.skipped} if handle.skipped else {}))


def _resolve_dtype(config: EngineConfig, model: ModelConfig, device: torch.device) -> str:
    if config.dtype != "auto":
        return config.dtype
    if device.type == "cpu":
        return "bfloat16"  # this CPU has AVX512-BF16; float32 is available with --dtype
    return model.dtype if model.dtype in ("bfloat16", "float16") else "bfloat16"


def _model_summary(model: ModelConfig, dtype: str, bytes_per_token: int) -> dict[str, Any]:
    summary = model.summary()
    summary["dtype"] = dtype
    summary["bytes_per_kv_token"] = bytes_per_token
    return summary


def start_engine(config: EngineConfig, bus: EventBus, progress: Callable[[int, int], None] | None = None) -> StartupResult:
    """Run phases A–G. Raises UserError (after a ``failed`` phase event) when the
    budget does not fit, with the numbers and the flags that would fix it."""
    log = get_logger("kvscope.startup")
    device = resolve_device(config.device)
    if device.type == "cpu":
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if config.max_num_batched_tokens == GPU_DEFAULT_MAX_NUM_BATCHED_TOKENS:  # flag left at its GPU default
            config.max_num_batched_tokens = CPU_DEFAULT_MAX_NUM_BATCHED_TOKENS
    config.device = device.type
    model = load_model_config(config.model)
    dtype = _resolve_dtype(config, model, device)
    config.dtype = dtype
    if config.max_model_len is None:
        config.max_model_len = model.max_position_embeddings
    if config.max_model_len > model.max_position_embeddings:
        raise UserError(f"--max-model-len {config.max_model_len:,} is beyond the model's maximum "
                        f"({model.max_position_embeddings:,} positions); lower it")
    if config.attention_backend == "auto":
        config.attention_backend = "triton" if device.type == "cuda" else "torch"
    per_token = bytes_per_kv_token(model, config.kv_cache_dtype, config.tensor_parallel_size, dtype)
    bus.publish(EngineConfigEvent(config=config.to_dict(), model=_model_summary(model, dtype, per_token)))
    phases = PhaseRecorder(bus, device, config.device_memory_gib, log)

    with phases.phase("A") as a:
        reading = phases.reading()
        a.data.update(versions(device))
        a.data["memory_source"] = reading.source
        a.data["total_bytes"] = reading.total
        a.data["free_bytes"] = reading.free
        log.info(f"device {device} ({reading.source}): {reading.total / GiB:.2f} GiB total, "
                 f"{reading.free / GiB:.2f} GiB free; torch {torch.__version__}, {torch.get_num_threads()} threads")

    with phases.phase("B") as b:
        requested = reading.total * config.gpu_memory_utilization
        b.data.update(total_bytes=reading.total, gpu_memory_utilization=config.gpu_memory_utilization,
                      requested_bytes=int(requested), free_bytes=reading.free, memory_source=reading.source)
        if config.kv_cache_memory_bytes is None and reading.free < requested:
            raise BudgetError(
                f"free memory on device ({reading.free / GiB:.2f}/{reading.total / GiB:.2f} GiB) is less than "
                f"desired memory utilization ({config.gpu_memory_utilization}, {requested / GiB:.2f} GiB); "
                f"lower --gpu-memory-utilization to {reading.free / reading.total:.2f} or less"
                + (", or give --device-memory GiB" if device.type == "cpu" else ", or free the device")
            )
        needed_weights = weights_bytes(model, dtype)
        if config.kv_cache_memory_bytes is None and needed_weights > requested:
            raise BudgetError(
                f"the weights ({needed_weights / GiB:.2f} GiB in {dtype}) do not fit the requested "
                f"{requested / GiB:.2f} GiB ({reading.total / GiB:.2f} GiB x {config.gpu_memory_utilization}); "
                f"raise --gpu-memory-utilization to at least {needed_weights / reading.total:.2f}"
                + (" or --device-memory" if device.type == "cpu" else "")
            )
        log.info(f"budget: requested {requested / GiB:.2f} GiB = {reading.total / GiB:.2f} GiB x "
                 f"{config.gpu_memory_utilization}")

    with phases.phase("C") as c:
        runner = ModelRunner(model, dtype=dtype, block_size=config.block_size, device=str(device),
                             attention_backend=config.attention_backend, load_format=config.load_format,
                             seed=config.seed, quantization=config.quantization)
        info = runner.load_weights(progress)
        tokenizer = _tokenizer_for(model) if config.load_format != "dummy" else _dummy_tokenizer(model)
        c.data.update(weights_bytes=info.weights_bytes, load_seconds=info.load_seconds,
                      load_format=info.load_format, source=info.source, num_tensors=info.num_tensors,
                      weights_cache=info.cache, quantization=config.quantization)
        log.info(f"Model loading took {info.weights_bytes / GiB:.4f} GiB and {info.load_seconds:.2f} seconds"
                 + (f" (weights cache {info.cache})" if info.cache != "none" else ""))

    with phases.phase("D") as d:
        _, peak = measure_peak(device, lambda: runner.profile_run(config.max_num_batched_tokens,
                                                                  config.max_num_seqs))
        d.data.update(activation_peak_bytes=peak.activation_peak_bytes, non_torch_bytes=peak.non_torch_bytes,
                      method=peak.method, max_num_batched_tokens=config.max_num_batched_tokens,
                      max_num_seqs=config.max_num_seqs, estimated=[])
        log.info(f"profile run: {config.max_num_batched_tokens} tokens over {config.max_num_seqs} sequences; "
                 f"activation peak {peak.activation_peak_bytes / GiB:.3f} GiB, non-torch "
                 f"{peak.non_torch_bytes / GiB:.3f} GiB ({peak.method})")

    with phases.phase("E") as e:
        kv_bytes = config.kv_cache_memory_bytes
        capped = False
        plan_kwargs: dict[str, Any] = dict(
            model=model, total_bytes=reading.total, gpu_memory_utilization=config.gpu_memory_utilization,
            max_model_len=config.max_model_len, block_size=config.block_size,
            kv_cache_dtype=config.kv_cache_dtype, dtype=dtype, tensor_parallel_size=config.tensor_parallel_size,
            weights=info.weights_bytes, activation_peak=peak.activation_peak_bytes,
            non_torch=peak.non_torch_bytes, max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
        )
        plan = plan_memory(kv_cache_memory_bytes=kv_bytes, check_fits=False, **plan_kwargs)
        if (device.type == "cpu" and kv_bytes is None and config.device_memory_gib is None
                and plan.kv_pool_bytes > CPU_DEFAULT_KV_SPACE_GIB * GiB):
            plan = plan_memory(kv_cache_memory_bytes=int(CPU_DEFAULT_KV_SPACE_GIB * GiB), check_fits=False,
                               **plan_kwargs)
            capped = True
        e.data.update(plan.phase_data()["E"])
        e.data["cpu_default_cap"] = capped
        check_plan_fits(plan)
        runner.allocate_kv_cache(plan.num_blocks)
        word = device_word(device)
        if capped:
            log.info(f"CPU KV pool capped at the default {CPU_DEFAULT_KV_SPACE_GIB:g} GiB "
                     "(give --device-memory or --kv-cache-memory-bytes to size it)")
        log.info(f"{word} KV cache pool: {plan.kv_pool_bytes / GiB:.2f} GiB, {plan.num_blocks:,} blocks of "
                 f"{plan.block_size}")
        log.info(kv_cache_size_line(word, plan.kv_cache_tokens))
        log.info(max_concurrency_line(plan.max_model_len, plan.max_concurrency))

    with phases.phase("F") as f:
        if device.type == "cuda":
            reason = graphs_supported(device, config.enforce_eager)
            if reason is not None:
                f.skipped = reason
            else:
                graphs = DecodeGraphs(runner.model, runner.kv_caches, config.block_size, config.max_model_len, device)
                sizes = [s for s in config.cuda_graph_sizes if s <= config.max_num_seqs]
                report = graphs.capture(sizes)
                runner.decode_graphs = graphs
                f.data.update(cuda_graph_bytes=report.graph_bytes, batch_sizes=report.batch_sizes,
                              capture_seconds=report.seconds)
                log.info(f"Graph capturing finished in {report.seconds:.0f} secs, took "
                         f"{report.graph_bytes / GiB:.2f} GiB")
        else:
            start = time.perf_counter()
            unavailable = runner.enable_cpu_decode_kernel()
            f.data["cpu_decode_kernel"] = unavailable or "enabled"
            f.data["kernel_seconds"] = time.perf_counter() - start
            log.info(f"CPU paged-decode kernel: {unavailable or 'enabled'} ({f.data['kernel_seconds']:.2f} s)")
            if config.compile:
                start = time.perf_counter()
                runner.compile()
                f.data["compile_seconds"] = time.perf_counter() - start
                log.info(f"torch.compile of the decode step took {f.data['compile_seconds']:.2f} s")
            elif unavailable is not None:
                f.skipped = f"CPU: no CUDA graphs; decode kernel unavailable ({unavailable}); --compile not given"

    with phases.phase("G") as g:
        g.data["startup_seconds"] = sum(phases.seconds.values())
        g.data["pid"] = os.getpid()

    scheduler_config = SchedulerConfig.from_flags(config.to_dict(), num_blocks=plan.num_blocks,
                                                  max_model_len=config.max_model_len)
    return StartupResult(config, model, device, runner, tokenizer, plan, scheduler_config, dict(phases.seconds))


def _tokenizer_for(model: ModelConfig) -> Tokenizer:
    """A GGUF file's tokenizer comes from the startup cache (building its BPE takes seconds)."""
    from pathlib import Path

    from engine.config import resolve_model_file
    from engine.model.startup_cache import cached_tokenizer

    location = Path(model.path) if model.path else resolve_model_file(model.name)
    if location is not None and location.is_file():
        return cached_tokenizer(location)
    return Tokenizer.for_model(model)


def _dummy_tokenizer(model: ModelConfig) -> Tokenizer:
    """Dummy weights of a preset have no tokenizer file: use the bundled one
    when the vocabulary fits, so text in/out still works for benchmarks."""
    from engine.config import BUNDLED_MODEL_NAME

    bundled = load_model_config(BUNDLED_MODEL_NAME)
    return _tokenizer_for(bundled)
