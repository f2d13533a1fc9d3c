"""Phase F: on CUDA the decode graphs captured; on CPU the kernel builds joined, the kernel plan
and precision reported, ``--compile`` and every step shape warmed."""

from __future__ import annotations

import dataclasses
import time

from engine.budget.memory import GiB
from engine.events import EventBus, StartupProgress
from engine.events.phase_data import GraphsCompileData
from engine.model.cuda_graphs import DecodeGraphs, graphs_supported
from engine.model.kernels.background import KernelBuilds
from engine.model.plan.setting import PLAN_ENV
from engine.model.runner import ModelRunner
from engine.startup.inputs import StartupInputs
from engine.startup.recorder import PhaseHandle, progress_events


def cuda_phase_f(f: PhaseHandle, s: StartupInputs, runner: ModelRunner) -> None:
    """CUDA phase F: capture the decode graphs (or say why not)."""
    config = s.config
    reason = graphs_supported(s.device, config.enforce_eager)
    if reason is None and runner.hybrid_kv_cache:
        reason = "the hybrid KV cache's per-group block tables are not captured in the decode graphs yet"
    if reason is None and getattr(runner.model, "expert_counter", None) is not None:
        # the grouped experts slice by each step's per-expert counts, read on the host (engine/model/layers/moe.py)
        reason = "a mixture-of-experts model's grouped experts size their matmuls per step: not capturable"
    if reason is not None:
        f.skipped = reason
        return
    graphs = DecodeGraphs(runner.model, runner.kv_caches, config.block_size, s.max_model_len, s.device)
    sizes = [size for size in config.cuda_graph_sizes if size <= config.max_num_seqs]
    report = graphs.capture(sizes)
    runner.decode_graphs = graphs
    f.record = GraphsCompileData(cuda_graph_bytes=report.graph_bytes, batch_sizes=tuple(report.batch_sizes),
                                 capture_seconds=report.seconds)
    s.log.info(f"Graph capturing finished in {report.seconds:.0f} secs, took {report.graph_bytes / GiB:.2f} GiB")


def cpu_phase_f(f: PhaseHandle, s: StartupInputs, runner: ModelRunner, kernels: KernelBuilds | None,
                bus: EventBus) -> None:
    """CPU phase F: join the kernel builds started in phase A, route decode
    attention through the kernel, ``--compile`` if asked, then warm every step
    shape class the runner uses so the first real step runs at speed."""
    config, log = s.config, s.log
    building = kernels is not None and not kernels.done()
    if building:
        bus.publish(StartupProgress(phase="F", what="kernel builds", done=0, total=1, unit="waits"))
    waited = kernels.join() if kernels is not None else 0.0
    if building:
        bus.publish(StartupProgress(phase="F", what="kernel builds", done=1, total=1, unit="waits"))
    reports = kernels.reports() if kernels is not None else []
    unavailable = runner.enable_cpu_decode_kernel()
    f.record = GraphsCompileData(cpu_decode_kernel=unavailable or "enabled", kernel_seconds=waited,
                                 kernels=tuple(r.to_dict() for r in reports))
    for r in reports:
        log.info(f"CPU kernel {r.name}: {r.status} ({r.seconds:.2f} s"
                 + (f", waited {r.waited_s:.1f} s for another builder" if r.waited_s > 0.5 else "")
                 + (f"; {r.reason}" if r.reason else "") + ")")
    log.info(f"CPU paged-decode kernel: {unavailable or 'enabled'} (phase F waited {waited:.2f} s for builds)")
    layers = runner.model.routing.fused_decode_status(runner.kv_cache_dtype)
    f.record = dataclasses.replace(f.record, cpu_decode_layers=layers)
    plan = runner.kernel_plan
    if plan is not None:
        f.record = dataclasses.replace(f.record, kernel_plan=plan.to_json())
        for line in plan.table_lines():
            log.info(line)
    else:
        log.info(f"kernel plan off ({PLAN_ENV}=off, tensor parallel or not on CPU): the fallback "
                 "constants (GEMV_MAX_ROWS) route the projections")
    log.info(f"CPU fused decode layers: {layers}")
    precision = runner.model.routing.precision_report(runner.kv_cache_dtype)
    f.record = dataclasses.replace(f.record, precision=precision)
    log.info("precision: " + "; ".join(f"{part} {how}" for part, how in precision.items()))
    if config.compile:
        start = time.perf_counter()
        runner.compile()
        compile_seconds = time.perf_counter() - start
        f.record = dataclasses.replace(f.record, compile_seconds=compile_seconds)
        log.info(f"torch.compile of the decode step took {compile_seconds:.2f} s")
    warm = runner.warm_up(config.max_num_seqs, progress_events(bus, "F", "warm-up", "step shapes"))
    f.record = dataclasses.replace(f.record, warmup_seconds=warm)
    log.info(f"warmed decode and mixed step shapes in {warm:.2f} s")
