"""Phase D: the profile run, one dummy step at the worst-case shape whose activation peak phase E
subtracts; on CPU measured in parts and stored for the next start with these weights and flags."""

from __future__ import annotations

import time
from typing import Any

import torch

from engine.budget.memory import GiB
from engine.config import EngineConfig
from engine.core.kv_cache_groups import KVCacheGroup, groups_to_config
from engine.events import EventBus, StartupProgress
from engine.events.phase_data import ProfileRunData
from engine.model.memory import profile_cache, profile_parts
from engine.model.memory.device import measure_peak
from engine.model.plan.token_budget import BUDGET_MAX
from engine.model.runner import ModelRunner
from engine.modelspec.config import ModelConfig
from engine.startup.inputs import StartupInputs
from engine.startup.recorder import PhaseHandle
from engine.startup.resolve import model_facts


def _profile_key(config: EngineConfig, model: ModelConfig, groups: tuple[KVCacheGroup, ...] = (),
                 points: profile_parts.Points | None = None) -> str:
    # the hybrid layout only when there is one, so a full-attention model's key is what it was;
    # measured in parts, the step sizes profiled instead of the budget (the line holds at any)
    layout = {"kv_cache_groups": groups_to_config(groups)} if groups else {}
    step = {"whole_step": True} if points is None else {"profile_points": points}  # whole: tokens in the name
    return profile_cache.profile_key({**layout, **step,
        "weights": profile_cache.weights_identity(model.path, model_facts(model)), "dtype": config.dtype,
        "quantization": config.quantization, "kv_cache_dtype": config.kv_cache_dtype,
        "attention_backend": config.attention_backend, "block_size": config.block_size,
        "load_format": config.load_format,
        "max_num_seqs": config.max_num_seqs, "threads": torch.get_num_threads(), "torch": torch.__version__,
        "isa": torch.backends.cpu.get_cpu_capability(),
    })


def measure_profile(runner: ModelRunner, config: EngineConfig, model: ModelConfig, device: torch.device,
                    log: Any, shared: bool = False, cover: int | None = None) -> profile_cache.ProfileResult:
    """Phase D's measurement: on CPU the worst-case step's peak measured in parts, as a function of
    its tokens that holds up to ``cover`` (engine/model/memory/profile_parts.py), or its stored result
    (engine/model/memory/profile_cache.py) evaluated at this budget; else the whole step under the peak
    tracker. ``shared`` (tensor or pipeline parallelism): the forward is collective, so every rank
    measures the whole step (one rank reusing a stored result would leave the others waiting)."""
    tokens, seqs = config.max_num_batched_tokens, config.max_num_seqs
    local = device.type == "cpu" and not shared
    points = profile_parts.forward_points(tokens, seqs, cover) if local and profile_parts.applies(runner) else None
    key, stored = None, None
    if local:
        base = _profile_key(config, model, runner.kv_cache_groups, points)
        if points is not None:
            key, stored = base, profile_cache.load(base)
        else:  # the whole step: its tokens in the entry's name, an entry of a bigger step reused
            key, stored = profile_cache.whole_step_key(base, tokens), profile_cache.load_covering(base, tokens)
    if stored is not None:
        stored = stored.at_tokens(tokens)
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(stored.measured_at))
        log.info(f"profile run: reused the measurement of {when} for these weights, flags and sources: "
                 f"activation peak {stored.activation_peak_bytes / GiB:.3f} GiB at {tokens:,} tokens, "
                 f"non-torch {stored.non_torch_bytes / GiB:.3f} GiB ({profile_cache.PROFILE_CACHE_ENV}=0 measures again)")
        return stored
    if points is not None:
        log.info(f"profile run in parts: the forward at {points[0][0]:,} and {points[1][0]:,} tokens, the LM head "
                 f"over {seqs} rows, the sampler on a few rows, scaled to a {tokens:,}-token step")
        result = profile_parts.profile(runner, points, tokens, seqs)
    else:
        log.info(f"profile run: one forward of {tokens:,} tokens over {min(seqs, tokens)} sequences (the "
                 f"worst-case step) and a sampler pass over {seqs} rows")
        timings, peak = measure_peak(device, lambda: runner.profile_run(tokens, seqs))
        result = profile_cache.ProfileResult(peak.activation_peak_bytes, peak.non_torch_bytes, peak.method,
                                             timings.forward_s, timings.sample_s, time.time(), tokens=tokens,
                                             profiled_tokens=(tokens,))
    log.info(f"profile run: {tokens} tokens over {seqs} sequences; activation peak "
             f"{result.activation_peak_bytes / GiB:.3f} GiB, non-torch {result.non_torch_bytes / GiB:.3f} GiB "
             f"({result.method}); forward {result.forward_s:.2f} s, sampler {result.sample_s:.2f} s")
    if key is not None:
        profile_cache.store(key, result)
    return result


def phase_profile_run(d: PhaseHandle, s: StartupInputs, runner: ModelRunner, bus: EventBus,
                      shared: bool) -> profile_cache.ProfileResult:
    """Phase D: the measurement, with a ``startup.progress`` event before and after it. A budget the
    stored kernel plan chose is measured to cover any budget a later plan may choose."""
    bus.publish(StartupProgress(phase="D", what="profile run", done=0, total=1, unit="steps"))
    profile = measure_profile(runner, s.config, s.model, s.device, s.log, shared=shared,
                              cover=BUDGET_MAX if s.resolution.budget_from_plan else None)
    bus.publish(StartupProgress(phase="D", what="profile run", done=1, total=1, unit="steps"))
    d.record = ProfileRunData(
        activation_peak_bytes=profile.activation_peak_bytes, non_torch_bytes=profile.non_torch_bytes,
        method=profile.method, max_num_batched_tokens=s.config.max_num_batched_tokens,
        max_num_seqs=s.config.max_num_seqs, estimated=(), forward_s=profile.forward_s,
        sample_s=profile.sample_s, cached=profile.cached, measured_at=profile.measured_at,
        profiled_tokens=profile.profiled_tokens or (s.config.max_num_batched_tokens,))
    return profile
