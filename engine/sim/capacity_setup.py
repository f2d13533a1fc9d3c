"""What ``engine capacity`` simulates on, and the fixes it tries.

A :class:`Deployment` is a :class:`~engine.sim.simulate.SimSetup` plus how it was made:

- ``this`` machine (:func:`this_machine`): the recording's own scheduler limits and KV pool (its
  resolved flags and phase E's blocks, as ``engine replay`` reads them) with the step cost fitted
  to its steps (engine/sim/step_fit.py) in place of the roofline; ``-dp N`` is N such machines;
- a GPU preset (:func:`gpu_deployment`): ``engine simulate``'s setup, the memory plan and the
  roofline, for ``--model`` (or the model the trace names) at vLLM's default limits. With
  ``-tp T`` each rank computes a T-th of the FLOPs as well as reading a T-th of the weights
  (the all-reduces between them are not counted).

:func:`fixes_for` turns the binding constraint into deployments that move it, each with its
flag in numbers: a KV pool twice the size, twice ``--max-num-seqs``, twice the tensor
parallelism on a GPU preset, or the data-parallel replicas a target rate needs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from engine.budget.memory import GiB, GpuPreset
from engine.config import EngineConfig
from engine.errors import UserError
from engine.events import EngineConfigEvent, Recording, StartupPhase
from engine.modelspec.config import ModelConfig
from engine.modelspec.readers import load_model_config
from engine.sim.capacity import COMPUTE, KV_BLOCKS, MAX_NUM_SEQS, QUEUE
from engine.sim.replay import recorded_flags, scheduler_config_from_recording
from engine.sim.simulate import DEFAULT_EFFICIENCY, DEFAULT_MODEL, SimSetup, build_setup
from engine.sim.step_fit import StepFit

THIS = "this"
MAX_TP = 8  # one node's GPUs
# The fitted cost replaces the roofline, so this preset's figures are never used: it only lets the
# memory plan be drawn for the recording's pool.
THIS_MACHINE = GpuPreset(THIS, 1 << 20, 1.0, 1.0, "this machine (step cost fitted to a recording)")
_SHAPE_FIELDS = ("num_layers", "hidden_size", "intermediate_size", "vocab_size", "num_attention_heads",
                 "num_kv_heads", "head_dim", "max_position_embeddings")


@dataclass(frozen=True, slots=True)
class Overrides:
    """The deployment flags ``engine capacity`` takes; None keeps the recording's (this machine)
    or vLLM's defaults (a GPU preset)."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    num_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    efficiency: float = DEFAULT_EFFICIENCY


@dataclass(slots=True)
class Deployment:
    setup: SimSetup
    hardware: str  # THIS or a GPU preset's name
    model: str
    overrides: Overrides
    bytes_per_kv_token: int
    fit: StepFit | None = None
    recording: Recording | None = None  # this machine's: its variants start from it again

    @property
    def num_blocks(self) -> int:
        return self.setup.scheduler.num_blocks

    @property
    def block_size(self) -> int:
        return self.setup.scheduler.block_size

    def pool_bytes(self, blocks: int) -> int:
        return blocks * self.block_size * self.bytes_per_kv_token

    def describe(self) -> str:
        s = self.setup.scheduler
        where = "this machine" if self.hardware == THIS else f"{self.setup.gpu.description or self.hardware}"
        layout = f"-tp {self.overrides.tensor_parallel_size}" if self.overrides.tensor_parallel_size > 1 else ""
        layout += f" -dp {self.setup.data_parallel_size}" if self.setup.data_parallel_size > 1 else ""
        return (f"{self.model} on {where}{' (' + layout.strip() + ')' if layout else ''}: KV pool {s.num_blocks:,} "
                f"blocks x {s.block_size} ({self.pool_bytes(s.num_blocks) / GiB:,.2f} GiB), max-num-seqs "
                f"{s.max_num_seqs}, max-num-batched-tokens {s.max_num_batched_tokens:,}, max-model-len "
                f"{s.max_model_len:,}")


def _model_config(name: str, summary: dict[str, Any]) -> ModelConfig:  # the engine.config event's JSON
    """The recorded model: its preset or file when this machine has it, else its recorded shapes."""
    try:
        return load_model_config(name)
    except UserError:
        try:
            shapes: dict[str, Any] = {k: int(summary[k]) for k in _SHAPE_FIELDS}
            return ModelConfig(name, **shapes)
        except (KeyError, TypeError, ValueError):
            raise UserError(f"the recording's model {name!r} is neither a preset nor a file here, and its "
                            "engine.config event lacks its shapes") from None


def _recorded_bytes_per_token(rec: Recording, summary: dict[str, Any]) -> int:
    for ev in rec.events:
        if isinstance(ev, StartupPhase) and ev.phase == "E" and ev.data.get("bytes_per_token"):
            return int(ev.data["bytes_per_token"])
    return int(summary.get("bytes_per_kv_token") or 0)


def this_machine(rec: Recording, fit: StepFit, overrides: Overrides) -> Deployment:
    """The recorded deployment on the fitted cost (see the module doc)."""
    if overrides.tensor_parallel_size > 1:
        raise UserError("-tp with --hardware this: the fit measured one process on this machine and cannot say "
                        "what tensor parallelism would do here; give --hardware a GPU preset for -tp")
    flags = recorded_flags(rec)
    summary = next((dict(ev.model) for ev in rec.events if isinstance(ev, EngineConfigEvent)), {})
    name = str(summary.get("name") or flags.get("model") or "the recorded model")
    sched = scheduler_config_from_recording(rec)
    sched = dataclasses.replace(
        sched, num_blocks=overrides.num_blocks or sched.num_blocks,
        max_num_seqs=overrides.max_num_seqs or sched.max_num_seqs,
        max_num_batched_tokens=overrides.max_num_batched_tokens or sched.max_num_batched_tokens,
        max_model_len=overrides.max_model_len or sched.max_model_len)
    engine = EngineConfig(model=name, max_model_len=sched.max_model_len, max_num_seqs=sched.max_num_seqs,
                          max_num_batched_tokens=sched.max_num_batched_tokens, block_size=sched.block_size,
                          data_parallel_size=overrides.data_parallel_size if overrides.data_parallel_size > 1 else None)
    setup = build_setup(_model_config(name, summary), THIS_MACHINE, engine, num_gpu_blocks_override=sched.num_blocks)
    setup = dataclasses.replace(setup, scheduler=sched, step_cost=fit)
    per_token = _recorded_bytes_per_token(rec, summary) or setup.plan.bytes_per_token
    return Deployment(setup, THIS, name, overrides, per_token, fit, rec)


def gpu_deployment(model: str | None, gpu: str, overrides: Overrides) -> Deployment:
    """``engine simulate``'s setup for ``model`` on ``gpu`` with the overrides (see the module doc)."""
    name = model or DEFAULT_MODEL
    o = overrides
    engine = EngineConfig(model=name, tensor_parallel_size=o.tensor_parallel_size, max_model_len=o.max_model_len,
                          gpu_memory_utilization=o.gpu_memory_utilization,
                          data_parallel_size=o.data_parallel_size if o.data_parallel_size > 1 else None)
    if o.max_num_seqs:
        engine.max_num_seqs = o.max_num_seqs
    if o.max_num_batched_tokens:
        engine.max_num_batched_tokens = o.max_num_batched_tokens
    setup = build_setup(name, gpu, engine, efficiency=o.efficiency, num_gpu_blocks_override=o.num_blocks)
    tp = o.tensor_parallel_size
    if tp > 1:  # build_setup's roofline splits the bytes by rank, not yet the FLOPs
        cost = setup.cost
        setup = dataclasses.replace(setup, cost=dataclasses.replace(
            cost, num_parameters=cost.num_parameters // tp, expert_parameters=cost.expert_parameters // tp))
    return Deployment(setup, setup.gpu.name, setup.model.name, overrides, setup.plan.bytes_per_token)


def rebuild(dep: Deployment, **changes: int) -> Deployment:
    """``dep`` with some overrides changed, built again the way it was built."""
    overrides = dataclasses.replace(dep.overrides, **changes)
    if dep.hardware == THIS:
        assert dep.recording is not None and dep.fit is not None
        return this_machine(dep.recording, dep.fit, overrides)
    return gpu_deployment(dep.model, dep.hardware, overrides)


@dataclass(slots=True)
class Fix:
    """A change that moves the binding constraint, in flags, and the deployment it makes."""

    label: str
    deployment: Deployment


def _pool_fix(dep: Deployment) -> Fix:
    blocks = dep.num_blocks * 2
    size = dep.pool_bytes(blocks)
    flag = (f"--kv-cache-memory-bytes {size:,}" if dep.hardware == THIS
            else f"--num-gpu-blocks-override {blocks:,}, {(size - dep.pool_bytes(dep.num_blocks)) / GiB:,.1f} GiB "
                 "more per GPU than the plan leaves")
    return Fix(f"KV pool 2x: {blocks:,} blocks, {size / GiB:,.2f} GiB ({flag})", rebuild(dep, num_blocks=blocks))


def _replicas(dep: Deployment, max_rate: float, target_rate: float | None) -> int:
    dp = dep.setup.data_parallel_size
    if target_rate and max_rate > 0 and target_rate > max_rate:
        return max(dp + 1, math.ceil(dp * target_rate / max_rate))
    return dp * 2


def fixes_for(dep: Deployment, binding: str, max_rate: float, target_rate: float | None = None) -> list[Fix]:
    """The deployments that move ``binding`` (see the module doc), each to be searched again."""
    out: list[Fix] = []
    tp = dep.overrides.tensor_parallel_size
    gpu = dep.hardware != THIS
    if binding == KV_BLOCKS:
        out.append(_pool_fix(dep))
    if binding == MAX_NUM_SEQS:
        seqs = dep.setup.scheduler.max_num_seqs * 2
        out.append(Fix(f"--max-num-seqs {seqs}", rebuild(dep, max_num_seqs=seqs)))
    if gpu and binding in (KV_BLOCKS, COMPUTE, QUEUE) and tp * 2 <= MAX_TP:
        out.append(Fix(f"-tp {tp * 2} (twice the GPUs per replica: each reads and computes half)",
                       rebuild(dep, tensor_parallel_size=tp * 2)))
    if binding in (COMPUTE, QUEUE):
        n = _replicas(dep, max_rate, target_rate)
        what = "machines like this one" if not gpu else "replicas"
        out.append(Fix(f"-dp {n} ({n} {what} behind one balancer)", rebuild(dep, data_parallel_size=n)))
    return out
