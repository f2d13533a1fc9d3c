"""The plan a start runs: pinned, stored (a quiet one in place of a loaded one), or measured now
and stored, then installed on the model (engine/model/runner.py resolve_kernel_plan)."""

from __future__ import annotations

from typing import Any

from engine.model.loading.weight_blocks import quantized_linears
from engine.model.plan import stability
from engine.model.plan.fused_layer import fused_timing
from engine.model.plan.kernel_plan import KernelPlan
from engine.model.plan.measurement import measure
from engine.model.plan.setting import plan_enabled, plan_setting
from engine.model.plan.store import load_stored, pinned, store, stored_for_model


def resolve(model: Any, key: str, native_bf16: bool, isa: str, log: Any = None,
            approximate: bool = True) -> KernelPlan | None:
    """The plan for this start, installed on ``model``: pinned by ``KVSCOPE_KERNEL_PLAN``, the
    stored one for ``key``, or measured now (and stored); None when the variable is ``off``
    (the fallback constants run). ``approximate``: see :func:`candidates_for`."""
    import torch

    from engine.model.kernels import cpu_gemv

    if not plan_enabled() or getattr(model, "expert_counter", None) is not None:
        return None  # a MoE model's experts run grouped (engine/model/layers/moe.py); the plan times dense layers
    load = stability.current_load()
    plan, previous = _start_plan(key, model.config.name, isa, load, log)
    remeasure = plan is not None and plan.source == "stored" and stability.measured_overloaded(plan, load)
    if remeasure and log is not None and plan is not None:
        log.info(f"the stored kernel plan was measured at load average {plan.load_average:g} on {plan.cpus} CPUs "
                 f"(other processes' threads skew its timings); the load is {load:.2f} now: measuring again")
    resume = plan if plan is not None and plan.source == "stored" and not remeasure and plan.unmeasured else None
    if resume is not None and stability.defer_resume(resume, load):
        if log is not None:
            log.info(f"the stored kernel plan left {resume.unmeasured} cells on the fallback constants; the load is "
                     f"{load:.2f} on {stability.cpu_count(resume)} CPUs: a quieter start measures them")
        resume = None
    if resume is not None and log is not None:
        log.info(f"the stored kernel plan left {resume.unmeasured} cells on the fallback constants (its bound was "
                 "reached): measuring them now")
    if plan is None or remeasure or resume is not None:
        incumbent = resume or _incumbent_plan(previous, model.config.name, isa)
        model.routing.bind_pending()  # each quantized weight bound to its kernel (the GEMV candidate)
        gemv_kernel = cpu_gemv.load_kernel() if quantized_linears(model) else None
        plan = measure(model, gemv_kernel, native_bf16, isa, model.routing.fallback_candidate, fused=fused_timing(model),
                       approximate=approximate, resume=resume,
                       incumbent=incumbent)
        plan.key, plan.model, plan.threads = key, model.config.name, torch.get_num_threads()
        plan = _settle_measured(plan, previous, log)
    model.routing.install_plan(plan)
    if log is not None:
        log.info(plan.summary())
    return plan


def _stored_like(name: str, isa: str) -> list[KernelPlan]:
    """The stored plans of model ``name`` on this ISA at this thread count (any other flags or sources)."""
    import torch

    threads = torch.get_num_threads()
    return [p for p in stored_for_model(name) if p.isa == isa and p.threads == threads]


def _start_plan(key: str, name: str, isa: str, load: float, log: Any) -> tuple[KernelPlan | None, KernelPlan | None]:
    """``(the plan to start from, the plan stored under key)``: the pinned plan; the stored one (on a
    loaded machine the last quiet plan instead of a loaded one, stability.settle_stored); or
    None to measure (nothing stored, or ``KVSCOPE_KERNEL_PLAN=measure``)."""
    plan = pinned()
    if plan is not None:
        return plan, None
    previous = load_stored(key)
    if previous is None or plan_setting().lower() == "measure":
        return None, previous
    settled = stability.settle_stored(previous, load, _stored_like(name, isa))
    if settled.message and log is not None:
        log.warning(settled.message)
    return settled.plan, previous


def _incumbent_plan(previous: KernelPlan | None, name: str, isa: str) -> KernelPlan | None:
    """The plan whose choices a new measurement must beat by the margin: the stored plan of this key
    if it was measured quiet, else the newest quiet plan of the model here (its choices this start
    cannot run are no incumbents: choose() keeps only one that passed), else None (the fallback's)."""
    if previous is not None and not stability.plan_loaded(previous):
        return previous
    quiet = [p for p in _stored_like(name, isa) if not stability.plan_loaded(p)]
    return max(quiet, key=lambda p: p.measured_at, default=None)


def _settle_measured(plan: KernelPlan, previous: KernelPlan | None, log: Any) -> KernelPlan:
    """Store ``plan`` unless it was measured loaded over a quiet plan; what this start runs (a loaded
    measurement gives way to the last quiet plan it can run: stability.settle_measured)."""
    settled = stability.settle_measured(plan, previous, _stored_like(plan.model, plan.isa))
    if settled.store:
        store(plan)
    if settled.message and log is not None:
        log.warning(settled.message)
    return settled.plan


def stored_for_start(key: str, name: str, isa: str, load: float | None = None) -> KernelPlan | None:
    """The plan a start with ``key`` would run before measuring (engine/startup/ derives the
    token budget from it): pinned, or stored (the last quiet plan in place of a loaded one on a
    loaded machine); None when nothing is stored."""
    plan = pinned()
    if plan is not None:
        return plan
    stored = load_stored(key)
    if stored is None:
        return None
    load = stability.current_load() if load is None else load
    return stability.settle_stored(stored, load, _stored_like(name, isa)).plan
