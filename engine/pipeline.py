"""``--pipeline-parallel-size P``: a Llama's layers in P contiguous stages, one process each.

Stage ``p`` holds layers ``stage_layer_ranges(L, P)[p]`` (vLLM's ``get_pp_indices``: an
even split, the remainder to the stages before the last) and the KV pool of those
layers only, with the scheduler's block count: each stage's pool is its layers' share of
the bytes. Stage 0 is the engine's own process (rank 0: the scheduler, the embedding,
and, unlike vLLM, where the last stage samples, the final norm, LM head and sampler:
the last stage sends its hidden states back to rank 0, so sampling stays where every
request's state is).

A step: rank 0 broadcasts the batch (the tensor-parallel control plane's object
broadcast), every stage splits it into ``MICRO_BATCHES`` micro-batches of whole
sequences and prepares each itself (the same tensors on every stage); activations go
stage to stage with ``torch.distributed`` ``isend``/``recv`` (gloo on CPU). Stage 0 runs
micro-batch 1 while stage 1 runs micro-batch 0, so two are in flight and the stages
overlap; each stage counts its **bubble** (seconds blocked in ``recv`` waiting for the
stage before it; for stage 0, for the last stage's results) and the **bytes** it sent,
and rank 0 gathers them into the step event (``pipeline_bubble_s``, ``pipeline_bytes``,
one entry per stage).

Across hosts: every stage joins one ``torch.distributed`` group through a ``TCPStore`` at
``--master-addr:--master-port`` (torchrun's rendezvous; its ``RANK``/``WORLD_SIZE``/
``MASTER_ADDR``/``MASTER_PORT`` are read when the flags are absent, one process per host).
Host ``n`` of ``--nnodes N`` holds stages ``[n P/N, (n+1) P/N)``; host 0 serves and
holds stage 0, the others run their stages headless (``engine serve ... --node-rank n``,
:func:`run_node`). Each stage writes ``arrived/<rank>`` in the store on arrival; host 0
waits ``--rendezvous-timeout`` seconds for all of them and then names the stages, and
their hosts, that never arrived, instead of hanging in ``init_process_group``.

Not done (issue 37): composition with ``--tensor-parallel-size`` (refused), sliding-window
and MoE families (refused), the fused decode-layer kernel (stages run the op-by-op
layers), per-stage startup phases (the stage workers load in phase G's wake, and phase
B/E size the pool for every layer on rank 0's budget; ``engine plan -pp`` has the
per-stage arithmetic).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from engine.budget.config import EngineConfig
from engine.budget.stages import stage_layer_ranges  # vLLM's get_pp_indices; the plan's split too
from engine.errors import ReplicaError, UserError

MICRO_BATCHES = 2  # in flight at once: stage p runs micro-batch i while stage p+1 runs i-1
STAGE_TIMEOUT = datetime.timedelta(days=1)  # a dead peer closes its sockets (gloo reports it at once)
STOP_WAIT_S = 5.0


def check_pipeline(config: EngineConfig, model: Any) -> None:
    """Refuse, before anything loads, what the stages do not run yet."""
    stages = config.pipeline_parallel_size or 1
    if stages == 1:
        return
    if config.tensor_parallel_size > 1:
        raise UserError(f"--pipeline-parallel-size {stages} with --tensor-parallel-size "
                        f"{config.tensor_parallel_size}: T x P ranks are not composed yet; use one of them")
    if model.layer_types or getattr(model, "num_experts", None) or model.architecture not in ("llama",):
        raise UserError(f"--pipeline-parallel-size {stages}: only Llama-family models run in stages yet "
                        f"({model.name} is {model.architecture})")
    stage_layer_ranges(model.num_layers, stages)


DEFAULT_MASTER_PORT = 29500  # torchrun's
DEFAULT_RENDEZVOUS_TIMEOUT_S = 300.0
ARRIVAL_POLL_S = 0.2


@dataclass(frozen=True, slots=True)
class Rendezvous:
    """Where the stages meet, and which host this process is."""

    master_addr: str
    master_port: int
    nnodes: int = 1
    node_rank: int = 0
    timeout_s: float = DEFAULT_RENDEZVOUS_TIMEOUT_S

    @classmethod
    def of(cls, config: EngineConfig, environ: Any = None) -> Rendezvous:
        """The flags, else torchrun's environment (one process per host), else one host
        on a free loopback port."""
        env = os.environ if environ is None else environ
        timeout = config.rendezvous_timeout_s or DEFAULT_RENDEZVOUS_TIMEOUT_S
        nnodes = config.nnodes or int(env.get("WORLD_SIZE", 1))
        node_rank = config.node_rank if config.node_rank is not None else int(env.get("RANK", 0))
        if nnodes == 1 and config.master_port is None and "MASTER_PORT" not in env:
            from engine.model.parallel import free_init_method

            host, _, port = free_init_method().removeprefix("tcp://").rpartition(":")
            return cls(host, int(port), 1, 0, timeout)
        if not 0 <= node_rank < nnodes:
            raise UserError(f"--node-rank {node_rank}: give 0..{nnodes - 1} (--nnodes {nnodes})")
        addr = config.master_addr or env.get("MASTER_ADDR", "127.0.0.1")
        port = config.master_port or int(env.get("MASTER_PORT", DEFAULT_MASTER_PORT))
        return cls(addr, port, nnodes, node_rank, timeout)

    def stages_of(self, node: int, stages: int) -> range:
        if stages % self.nnodes:
            raise UserError(f"--pipeline-parallel-size {stages} over --nnodes {self.nnodes}: give a multiple of "
                            f"{self.nnodes} (each host holds as many stages)")
        per = stages // self.nnodes
        return range(node * per, (node + 1) * per)

    def node_of(self, rank: int, stages: int) -> int:
        return rank // (stages // self.nnodes)


def join_stages(rank: int, stages: int, rendezvous: Rendezvous) -> None:
    """Join the stages' group through the store; on rank 0, wait for every stage to arrive
    and name those that never did (a ReplicaError) within ``timeout_s``."""
    timeout = datetime.timedelta(seconds=rendezvous.timeout_s)
    store = dist.TCPStore(rendezvous.master_addr, rendezvous.master_port, world_size=stages, is_master=rank == 0,
                          timeout=timeout, wait_for_workers=False)
    store.set(f"arrived/{rank}", str(os.getpid()))
    if rank == 0:
        deadline = time.monotonic() + rendezvous.timeout_s
        while missing := [r for r in range(1, stages) if not store.check([f"arrived/{r}"])]:
            if time.monotonic() > deadline:
                named = ", ".join(f"stage {r} (host {rendezvous.node_of(r, stages)})" for r in missing)
                raise ReplicaError(
                    f"pipeline rendezvous at {rendezvous.master_addr}:{rendezvous.master_port}: {named} never "
                    f"arrived within {rendezvous.timeout_s:g} s (--rendezvous-timeout); start "
                    f"`engine serve ... --node-rank N` on each host, with the same --master-addr/--master-port")
            time.sleep(ARRIVAL_POLL_S)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=stages, timeout=STAGE_TIMEOUT)


@dataclass(slots=True)
class StageStats:
    """One stage's share of a step: time blocked waiting for its input, bytes it sent."""

    bubble_s: float = 0.0
    bytes_sent: int = 0
    compute_s: float = 0.0


@dataclass
class Stage:
    """One stage's layers and KV pool, on top of a ModelRunner loaded with the whole model
    (the layers outside the stage are dropped after the load)."""

    runner: Any  # engine.model.runner.ModelRunner
    rank: int
    stages: int
    layers: tuple[int, int]
    stats: StageStats = field(default_factory=StageStats)

    @classmethod
    def carve(cls, runner: Any, rank: int, stages: int, num_blocks: int) -> Stage:
        """Keep only this stage's layers and allocate their KV pool (``num_blocks`` blocks)."""
        import torch.nn as nn

        start, end = stage_layer_ranges(runner.model_config.num_layers, stages)[rank]
        model = runner.model
        model.layers = nn.ModuleList(list(model.layers)[start:end])
        model._fused_layers = []  # the fused decode layers are the whole model's: stages run op by op
        model.config = dataclasses.replace(model.config, num_layers=end - start)
        runner.kv_caches = []
        runner.allocate_kv_cache(num_blocks)
        return cls(runner, rank, stages, (start, end))

    @property
    def kv_pool_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.runner.kv_tensors)

    def micro_batches(self, batch: Sequence[Any]) -> list[list[Any]]:
        count = min(MICRO_BATCHES, len(batch))
        size = -(-len(batch) // count)
        return [list(batch[i:i + size]) for i in range(0, len(batch), size)]

    @torch.inference_mode()
    def run_layers(self, hidden: torch.Tensor, prepared: Any) -> torch.Tensor:
        model = self.runner.model
        cos, sin = model.rotary.cos_sin(prepared.positions, model.dtype)
        for layer, kv_cache in zip(model.layers, self.runner.kv_caches, strict=True):
            hidden = layer(hidden, cos, sin, kv_cache, prepared.meta, model.backend)
        return hidden

    def _recv(self, shape: tuple[int, int], src: int) -> torch.Tensor:
        buffer = torch.empty(shape, dtype=self.runner.model.dtype)
        start = time.perf_counter()
        dist.recv(buffer, src=src)
        self.stats.bubble_s += time.perf_counter() - start
        return buffer

    def _send(self, tensor: torch.Tensor, dst: int) -> Any:
        self.stats.bytes_sent += tensor.numel() * tensor.element_size()
        return dist.isend(tensor.contiguous(), dst=dst)

    def step(self, batch: Sequence[Any]) -> list[tuple[Any, torch.Tensor]]:
        """This stage's part of one step. Rank 0 returns each micro-batch's prepared batch
        and its last stage's hidden states; the other stages return []."""
        self.stats = StageStats()
        hidden_size = self.runner.model_config.hidden_size
        prepared = [self.runner.prepare(mb) for mb in self.micro_batches(batch)]
        sends = []
        for p in prepared:
            tokens = int(p.input_ids.shape[0])
            hidden = (self.runner.model.embed(p.input_ids) if self.rank == 0
                      else self._recv((tokens, hidden_size), self.rank - 1))
            start = time.perf_counter()
            hidden = self.run_layers(hidden, p)
            self.stats.compute_s += time.perf_counter() - start
            sends.append(self._send(hidden, (self.rank + 1) % self.stages))
        results = []
        if self.rank == 0:
            for p in prepared:
                results.append((p, self._recv((int(p.input_ids.shape[0]), hidden_size), self.stages - 1)))
        for handle in sends:
            handle.wait()
        return results


class PipelineRunner:
    """Rank 0's runner under ``--pipeline-parallel-size``: ModelRunner's ``execute`` over the
    stages, the stage workers it started, and each step's stage statistics."""

    def __init__(self, stage: Stage, processes: list[Any]) -> None:
        self.stage = stage
        self.processes = processes
        runner = stage.runner
        self.model = runner.model
        self.model_config = runner.model_config
        self.last_timings = runner.last_timings
        self.last_failed: dict[str, str] = {}
        self.last_stage_stats: list[StageStats] = []
        self.steps = 0
        self._closed = False

    @classmethod
    def start(cls, config: EngineConfig, startup: Any) -> PipelineRunner:
        """Carve rank 0's loaded runner into stage 0, start this host's other stages, meet
        the other hosts' at the rendezvous, and hand every stage what it loads: the resolved
        flags, the model and the scheduler's block count."""
        stages = config.pipeline_parallel_size or 1
        rendezvous = Rendezvous.of(config)
        local = list(rendezvous.stages_of(0, stages))[1:]
        processes = start_stage_processes(local, stages, rendezvous)
        stage = Stage.carve(startup.runner, 0, stages, startup.plan.num_blocks)
        try:
            join_stages(0, stages, rendezvous)
            dist.broadcast_object_list([(startup.config, startup.model_config, startup.plan.num_blocks)], src=0)
            layouts: list[Any] = [None] * stages
            dist.all_gather_object(layouts, (stage.layers, stage.kv_pool_bytes))
        except BaseException:
            _stop(processes)
            if dist.is_initialized():
                with contextlib.suppress(Exception):
                    dist.destroy_process_group()
            raise
        runner = cls(stage, processes)
        runner.stage_layouts = layouts
        runner.rendezvous = rendezvous
        return runner

    def execute(self, batch: Sequence[Any]) -> dict[str, int]:
        stage, runner = self.stage, self.stage.runner
        start = time.perf_counter()
        try:
            dist.broadcast_object_list([list(batch)], src=0)
            results = stage.step(batch)
            stats: list[Any] = [None] * stage.stages
            dist.gather_object(stage.stats, stats, dst=0)
        except RuntimeError as exc:
            raise self._failure(exc) from exc
        self.steps += 1
        forward_s = time.perf_counter() - start
        self.last_stage_stats = stats
        sampled: dict[str, int] = {}
        t0 = time.perf_counter()
        self.last_failed = {}
        with torch.inference_mode():
            for prepared, hidden in results:
                if not prepared.sample_seqs:
                    continue
                from engine.model.kernels.cpu_norm import rms_norm

                normed = rms_norm(hidden[prepared.sample_rows], self.model.norm, self.model_config.rms_norm_eps)
                logits = self.model.compute_logits(normed)
                tokens = runner.sampler.sample(logits, [s.sampling for s in prepared.sample_seqs],
                                               prepared.sample_positions).tolist()
                sampled.update({s.request_id: int(t) for s, t in zip(prepared.sample_seqs, tokens, strict=True)})
        runner.last_timings = type(runner.last_timings)(forward_s=forward_s, sample_s=time.perf_counter() - t0)
        self.last_timings = runner.last_timings
        return sampled

    def step_fields(self) -> dict[str, Any]:
        """The step event's pipeline fields from the last step: each stage's bubble and bytes sent."""
        return {"pipeline_bubble_s": [s.bubble_s for s in self.last_stage_stats],
                "pipeline_bytes": [s.bytes_sent for s in self.last_stage_stats]}

    def _failure(self, exc: BaseException) -> ReplicaError:
        deadline = time.monotonic() + STOP_WAIT_S
        while time.monotonic() < deadline and all(p.exitcode is None for p in self.processes):
            time.sleep(0.1)
        ended = [(rank, p) for rank, p in enumerate(self.processes, 1) if p.exitcode is not None]
        if not ended:
            where = (f" on this host; a stage on another host (hosts 1..{self.rendezvous.nnodes - 1}) may have "
                     f"stopped" if self.rendezvous.nnodes > 1 else "")
            return ReplicaError(f"pipeline stage exchange failed during step {self.steps + 1} with every stage "
                                f"still running{where} ({type(exc).__name__}: {exc}); the replica is stopped")
        rank, process = ended[0]
        code = process.exitcode
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        return ReplicaError(f"pipeline stage {rank} (pid {process.pid}, layers {self.stage_layouts[rank][0]}) {how} "
                            f"during step {self.steps + 1}; the replica is stopped")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        healthy = all(p.is_alive() for p in self.processes) and dist.is_initialized()
        if healthy:
            with contextlib.suppress(RuntimeError):
                dist.broadcast_object_list([None], src=0)
        _stop(self.processes, STOP_WAIT_S if healthy else 0.0)
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()

    # ModelRunner's attributes the engine reads, from stage 0's runner
    def __getattr__(self, name: str) -> Any:
        return getattr(self.stage.runner, name)


def _stop(processes: list[Any], wait_s: float = 0.0) -> None:
    deadline = time.monotonic() + wait_s
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.terminate()
            process.join(2.0)
        if process.is_alive():
            process.kill()
            process.join(2.0)


def start_stage_processes(ranks: Sequence[int], stages: int, rendezvous: Rendezvous) -> list[Any]:
    """This host's stage processes (spawned; each dies with this process)."""
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    processes = [context.Process(target=stage_main, name=f"kvscope-pp-stage{rank}", daemon=True,
                                 args=(rank, stages, rendezvous, os.getpid())) for rank in ranks]
    for process in processes:
        process.start()
    return processes


def run_node(config: EngineConfig) -> int:
    """A host other than 0 (``--node-rank n``): run its stages until host 0 stops them.
    Exit status 0 when every stage ended cleanly, else 1."""
    stages = config.pipeline_parallel_size or 1
    rendezvous = Rendezvous.of(config)
    if stages == 1:
        raise UserError(f"--node-rank {rendezvous.node_rank}: hosts beyond 0 run pipeline stages; give "
                        "--pipeline-parallel-size (a multiple of --nnodes)")
    processes = start_stage_processes(list(rendezvous.stages_of(rendezvous.node_rank, stages)), stages, rendezvous)
    try:
        for process in processes:
            process.join()
    finally:
        _stop(processes)
    return 0 if all(p.exitcode == 0 for p in processes) else 1


def stage_main(rank: int, stages: int, rendezvous: Rendezvous, parent_pid: int) -> None:
    """Stage ``rank``'s process: meet the others, load the model rank 0 names, keep its
    layers and their pool, then run its part of every step rank 0 broadcasts until it
    broadcasts None."""
    from engine.workers import _die_with_parent

    _die_with_parent(parent_pid)
    from engine.model.runner import ModelRunner

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // len(rendezvous.stages_of(rendezvous.node_rank, stages))))
    code = 0
    try:
        join_stages(rank, stages, rendezvous)
        setup: list[Any] = [None]
        dist.broadcast_object_list(setup, src=0)
        config, model_config, num_blocks = setup[0]
        runner = ModelRunner(model_config, dtype=config.dtype, block_size=config.block_size, device=config.device,
                             attention_backend=config.attention_backend, load_format=config.load_format,
                             seed=config.seed, quantization=None, kv_cache_dtype=config.kv_cache_dtype)
        runner.load_weights()
        if runner.device.type == "cpu":
            runner.enable_cpu_decode_kernel()  # as rank 0's phase F: the same attention path on every stage
        stage = Stage.carve(runner, rank, stages, num_blocks)
        dist.all_gather_object([None] * stages, (stage.layers, stage.kv_pool_bytes))
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0)
            if box[0] is None:
                break
            stage.step(box[0])
            dist.gather_object(stage.stats, None, dst=0)
    except BaseException:
        import traceback

        traceback.print_exc()  # rank 0 names the stage and how it ended; the cause is on stderr
        code = 1
    os._exit(code)
