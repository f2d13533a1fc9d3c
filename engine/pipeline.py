"""``--pipeline-parallel-size P``: a model's layers in P contiguous stages, one process per
rank (a stage is one rank, or ``T`` under ``--tensor-parallel-size T``).

Every family the single-rank engine serves runs in stages (Llama, Qwen2/2.5, Qwen3, Mistral,
Phi-3, Gemma 3, and the MoE families): a stage runs its model's own layer class through
the model's ``decoder_layers`` (the op-by-op loop ``forward`` runs between the embedding
and the final norm; Gemma 3's picks each layer's rope), so nothing here knows a family.

Stage ``p`` holds layers ``stage_layer_ranges(L, P)[p]`` (vLLM's ``get_pp_indices``: an
even split, the remainder to the stages before the last) and the KV pool of those
layers only. A hybrid KV cache (Gemma 3's sliding and full layers, Mistral's and Phi-3's
window) keeps the whole model's groups on every stage, each group holding the stage's
own layers (:func:`~engine.budget.stages.stage_kv_cache_groups`, vLLM's
``get_kv_cache_configs``): the scheduler's one block table per group is valid on every
stage. Stage 0 is the engine's own process (rank 0: the scheduler, the embedding, and,
unlike vLLM, where the last stage samples, the final norm, LM head and sampler: the last
stage sends its hidden states back to rank 0, so sampling stays where every request's
state is).

Startup: every stage runs phases A-G itself (engine/startup/ with its
:class:`StageLayout`), as a tensor-parallel worker does: A joins the stages' group (and
rank 0 hands every stage its flags, which each resolves as rank 0 does), C loads the
model and keeps the stage's layers (:func:`carve_stage`), D profiles the stage, E sizes
the stage's pool from the stage's own budget and layers (its weights, its peak, its KV
bytes per token) and takes the fewest blocks of any stage (vLLM's executor takes the
minimum ``num_gpu_blocks`` over its workers), so one block table serves them all. Each
phase event carries ``rank``, ``pp_rank`` and ``tp_rank``; the stage processes of host 0
relay theirs to rank 0's bus as they run, other hosts' ranks once all are ready
(engine/workers.py's :class:`~engine.workers.WorkerGroup`, which also starts, watches
and stops them, and names a stage that dies: its rank, host, layers, pid and last
phase).

A step: rank 0 broadcasts the batch (the tensor-parallel control plane's object
broadcast), every stage splits it into ``MICRO_BATCHES`` micro-batches of whole
sequences and prepares each itself (the same tensors on every stage); activations go
stage to stage with ``torch.distributed`` ``isend``/``recv`` (gloo on CPU). Stage 0 runs
micro-batch 1 while stage 1 runs micro-batch 0, so two are in flight and the stages
overlap; each stage counts its **bubble** (seconds blocked in ``recv`` waiting for the
stage before it; for stage 0, for the last stage's results) and the **bytes** it sent,
and rank 0 gathers them into the step event (``pipeline_bubble_s``, ``pipeline_bytes``,
one entry per stage), with a MoE model's per-expert token counts (each stage counts its
own layers' experts; rank 0 sums them into ``expert_counts``).

Across hosts: every stage joins one ``torch.distributed`` group through a ``TCPStore`` at
``--master-addr:--master-port`` (torchrun's rendezvous; its ``RANK``/``WORLD_SIZE``/
``MASTER_ADDR``/``MASTER_PORT`` are read when the flags are absent, one process per host).
Host ``n`` of ``--nnodes N`` holds stages ``[n P/N, (n+1) P/N)``; host 0 serves and
holds stage 0, the others run their stages headless (``engine serve ... --node-rank n``,
:func:`engine.workers.run_node`). Each rank writes ``arrived/<rank>`` in the store on
arrival; host 0 waits ``--rendezvous-timeout`` seconds for all of them and then names the
ranks, and their hosts, that never arrived, instead of hanging in ``init_process_group``
(a rank process of host 0 that ends while it waits is named at once).

With ``--tensor-parallel-size T`` the replica is ``T x P`` ranks in vLLM's layout, ``rank
= pp_rank x T + tp_rank`` (:class:`StageLayout`): each stage is a tensor-parallel group of
``T`` consecutive ranks (engine/model/parallel.py's TensorParallel over that group), and
each rank sends its activations to the next stage's rank at the same ``tp_rank``. Chosen
over sending from the stage's first rank and broadcasting inside the next stage: after
the row-parallel all-reduce every rank of a stage holds the whole hidden state, so the T
pairs exchange independently with no extra collective (T copies cross the link; vLLM's
``send_tensor_dict(all_gather_group=...)`` sends 1/T each and all-gathers, which saves
link bytes for one more collective). Stage 0's ranks compute the LM head together (its
vocabulary columns are gathered to rank 0, which samples).

Not done (issue 37): the fused decode-layer kernel and the kernel plan (stages run the
op-by-op layers), prompt logprobs (refused: only the sampled rows reach rank 0), NCCL
(stages on CUDA are refused: the group is gloo's), and the phase events of ranks on other
hosts as they run (they reach rank 0's bus once every rank is ready,
:func:`relay_remote_phases`; a rank of another host that ends badly is reported in the
rendezvous store, :func:`report_ended`, and named by rank 0 from there). Each rank loads
the whole model and then drops the other stages' layers (phase C's peak is the whole
model's; vLLM builds only its layers), and keeps the embedding and LM head, which its
phase D and F forwards use (vLLM's middle stages hold neither).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from engine.budget.stages import stage_kv_cache_groups, stage_layer_ranges  # vLLM's get_pp_indices
from engine.config import EngineConfig
from engine.errors import ReplicaError, UserError

MICRO_BATCHES = 2  # in flight at once: stage p runs micro-batch i while stage p+1 runs i-1
STAGE_TIMEOUT = datetime.timedelta(days=1)  # a dead peer closes its sockets (gloo reports it at once)


def check_pipeline(config: EngineConfig, model: Any) -> None:
    """Refuse, before anything loads, what the stages do not run yet."""
    stages = config.pipeline_parallel_size or 1
    if stages == 1:
        return
    if config.compile:
        raise UserError(f"--compile with --pipeline-parallel-size {stages}: the stages run their layers op by op "
                        "uncompiled; drop --compile")
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

            host, _, free_port = free_init_method().removeprefix("tcp://").rpartition(":")
            return cls(host, int(free_port), 1, 0, timeout)
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


def join_stages(rank: int, stages: int, rendezvous: Rendezvous, tensor_parallel_size: int = 1,
                watch: Callable[[], BaseException | None] | None = None) -> None:
    """Join the replica's group (``stages x tensor_parallel_size`` ranks) through the store;
    on rank 0, wait for every rank to arrive and name those that never did, with their
    stage and host (a ReplicaError), within ``timeout_s``. ``watch``: rank 0's check on its
    own host's rank processes while it waits; the error it returns (one of them ended)
    is raised at once instead of waiting out the timeout for a rank that cannot come."""
    tp = tensor_parallel_size
    world = stages * tp
    timeout = datetime.timedelta(seconds=rendezvous.timeout_s)
    store = dist.TCPStore(rendezvous.master_addr, rendezvous.master_port, world_size=world, is_master=rank == 0,
                          timeout=timeout, wait_for_workers=False)
    store.set(f"arrived/{rank}", str(os.getpid()))

    def name(r: int) -> str:
        where = f"host {rendezvous.node_of(r // tp, stages)}"
        return f"stage {r} ({where})" if tp == 1 else f"rank {r} (stage {r // tp}, {where})"

    if rank == 0:
        deadline = time.monotonic() + rendezvous.timeout_s
        while missing := [r for r in range(1, world) if not store.check([f"arrived/{r}"])]:
            if watch is not None and (ended := watch()) is not None:
                raise ended
            if time.monotonic() > deadline:
                named = ", ".join(name(r) for r in missing)
                raise ReplicaError(
                    f"pipeline rendezvous at {rendezvous.master_addr}:{rendezvous.master_port}: {named} never "
                    f"arrived within {rendezvous.timeout_s:g} s (--rendezvous-timeout); start "
                    f"`engine serve ... --node-rank N` on each host, with the same --master-addr/--master-port")
            time.sleep(ARRIVAL_POLL_S)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=STAGE_TIMEOUT)


ENDED_KEY = "ended/{rank}"  # in the rendezvous store: how a rank of a host beyond 0 ended
STORE_CLIENT_TIMEOUT = datetime.timedelta(seconds=5)


def _store_client(rendezvous: Rendezvous) -> Any:
    return dist.TCPStore(rendezvous.master_addr, rendezvous.master_port, is_master=False,
                         timeout=STORE_CLIENT_TIMEOUT, wait_for_workers=False)


def report_ended(rendezvous: Rendezvous, rank: int, words: str) -> None:
    """A host beyond 0: say in the rendezvous store how its rank ``rank`` ended (``words``:
    who and how, a newline, its last phase), so rank 0 can name it (its own process table
    holds only host 0's ranks). Best effort: host 0 may be gone already."""
    with contextlib.suppress(Exception):
        _store_client(rendezvous).set(ENDED_KEY.format(rank=rank), words)


class EndedElsewhere:
    """Rank 0's reader of what the other hosts reported (:func:`report_ended`)."""

    def __init__(self, rendezvous: Rendezvous, stages: int, tensor_parallel_size: int) -> None:
        self.ranks = [r for r in range(stages * tensor_parallel_size)
                      if rendezvous.node_of(r // tensor_parallel_size, stages) != 0]
        self.store: Any = None
        if self.ranks:
            with contextlib.suppress(Exception):
                self.store = _store_client(rendezvous)

    def read(self) -> list[str]:
        """The reports so far, the culprit first: a rank that ended on its own before one
        whose exchange merely failed because of it."""
        if self.store is None:
            return []
        found = []
        with contextlib.suppress(Exception):
            keys = [ENDED_KEY.format(rank=r) for r in self.ranks]
            found = [self.store.get(key).decode() for key in keys if self.store.check([key])]
        return sorted(found, key=lambda words: "failed: RuntimeError" in words)


@dataclass(frozen=True, slots=True)
class StageLayout:
    """One rank's place in a pipeline-parallel replica, and where the ranks meet; what
    startup's phases read to run a stage (engine/startup/). vLLM's layout: ``rank =
    pp_rank x T + tp_rank`` for ``T`` = ``--tensor-parallel-size``, so each stage is a
    tensor-parallel group of ``T`` consecutive ranks."""

    rank: int  # in the whole replica, 0 .. stages x T - 1
    stages: int
    rendezvous: Rendezvous
    tensor_parallel_size: int = 1
    # rank 0's only (never sent to a process): the WorkerGroup's check for a rank process that ended
    watch: Callable[[], BaseException | None] | None = field(default=None, compare=False, repr=False)

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tensor_parallel_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tensor_parallel_size

    @property
    def world_size(self) -> int:
        return self.stages * self.tensor_parallel_size

    def peer(self, pp_rank: int) -> int:
        """The rank of stage ``pp_rank`` that this rank exchanges activations with: the one
        at the same tensor-parallel rank (every rank of a stage holds the whole hidden
        state after its all-reduce, so each sends its own copy, and no stage broadcasts)."""
        return (pp_rank % self.stages) * self.tensor_parallel_size + self.tp_rank

    @property
    def host(self) -> int:
        return self.rendezvous.node_of(self.pp_rank, self.stages)

    @property
    def ranks_on_host(self) -> int:
        """Processes sharing this host's cores: its stages' ranks."""
        return len(self.rendezvous.stages_of(self.host, self.stages)) * self.tensor_parallel_size

    def layers(self, num_layers: int) -> tuple[int, int]:
        return stage_layer_ranges(num_layers, self.stages)[self.pp_rank]

    def describe(self, num_layers: int) -> str:
        """How a failure names this rank."""
        first, end = self.layers(num_layers)
        where = f"host {self.host}, layers {first}-{end - 1}"
        if self.tensor_parallel_size == 1:
            return f"pipeline stage {self.pp_rank} ({where})"
        return f"pipeline stage {self.pp_rank} tensor-parallel rank {self.tp_rank} (rank {self.rank}, {where})"

    def join(self, config: EngineConfig | None = None) -> EngineConfig:
        """Meet the other ranks; rank 0 hands them its flags (a stage on another host runs
        what host 0 serves, whatever its own command line held)."""
        join_stages(self.rank, self.stages, self.rendezvous, self.tensor_parallel_size, self.watch)
        box = [config]
        dist.broadcast_object_list(box, src=0)
        assert box[0] is not None
        return box[0]

    def tensor_parallel(self, device: torch.device) -> Any:
        """This stage's tensor-parallel group (engine/model/parallel.py's TensorParallel over
        the stage's ranks), or None for one rank a stage. Every rank makes every stage's
        group, in stage order (``new_group`` is collective over the world)."""
        if self.tensor_parallel_size == 1:
            return None
        from engine.model.parallel import RankLayout, TensorParallel

        tp = self.tensor_parallel_size
        groups = [dist.new_group([p * tp + t for t in range(tp)]) for p in range(self.stages)]
        return TensorParallel(RankLayout(self.tp_rank, tp, ""), device, groups[self.pp_rank], self.pp_rank * tp)

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order (phase E's block counts)."""
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value)
        return out


def carve_stage(runner: Any, layers: tuple[int, int]) -> None:
    """Keep only the stage's ``layers`` of a ModelRunner loaded with the whole model (the
    others' weights are freed), each KV cache group holding the stage's own layers; the
    pool is allocated after (phase E), for those layers only."""
    import torch.nn as nn

    from engine.budget.stages import stage_model

    start, end = layers
    model = runner.model
    groups = runner.kv_cache_groups
    model.layers = nn.ModuleList(list(model.layers)[start:end])
    model.routing.fused_layers = []  # the fused decode layers are the whole model's: stages run op by op
    model.config = stage_model(model.config, layers)
    runner.set_kv_cache_groups(stage_kv_cache_groups(groups, layers) if groups else ())


@dataclass(slots=True)
class StageStats:
    """One stage's share of a step: time blocked waiting for its input, bytes it sent, and
    for a MoE model the tokens its layers routed to each expert (``[moe layer][expert]``
    over the whole model's MoE layers, zeros for the other stages')."""

    bubble_s: float = 0.0
    bytes_sent: int = 0
    compute_s: float = 0.0
    expert_counts: list[list[int]] | None = None


@dataclass
class Stage:
    """One rank's share of a stage's layers and KV pool: a ModelRunner carved by
    :func:`carve_stage` (under ``--tensor-parallel-size`` its slice of each layer)."""

    runner: Any  # engine.model.runner.ModelRunner
    layout: StageLayout
    layers: tuple[int, int]
    stats: StageStats = field(default_factory=StageStats)

    @classmethod
    def of(cls, runner: Any, layout: StageLayout, num_layers: int) -> Stage:
        return cls(runner, layout, layout.layers(num_layers))

    def micro_batches(self, batch: Sequence[Any]) -> list[list[Any]]:
        count = min(MICRO_BATCHES, len(batch))
        size = -(-len(batch) // count)
        return [list(batch[i:i + size]) for i in range(0, len(batch), size)]

    @torch.inference_mode()
    def run_layers(self, hidden: torch.Tensor, prepared: Any) -> torch.Tensor:
        """The model's own layer loop (its family's layers and ropes) over the stage's layers."""
        return self.runner.model.decoder_layers(hidden, prepared.positions, self.runner.kv_caches,
                                                prepared.model_meta)

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
        """This rank's part of one step. Stage 0's ranks return each micro-batch's prepared
        batch and its last stage's hidden states; the other stages' return []."""
        self.stats = StageStats()
        layout = self.layout
        first = layout.pp_rank == 0
        hidden_size = self.runner.model_config.hidden_size
        prepared = [self.runner.prepare(mb) for mb in self.micro_batches(batch)]
        sends = []
        for p in prepared:
            tokens = int(p.input_ids.shape[0])
            hidden = (self.runner.model.embed(p.input_ids) if first
                      else self._recv((tokens, hidden_size), layout.peer(layout.pp_rank - 1)))
            start = time.perf_counter()
            hidden = self.run_layers(hidden, p)
            self.stats.compute_s += time.perf_counter() - start
            sends.append(self._send(hidden, layout.peer(layout.pp_rank + 1)))
        results = []
        if first:
            for p in prepared:
                results.append((p, self._recv((int(p.input_ids.shape[0]), hidden_size), layout.peer(-1))))
        for handle in sends:
            handle.wait()
        counter = getattr(self.runner.model, "expert_counter", None)  # a MoE model (engine/model/layers/moe.py)
        self.stats.expert_counts = counter.take() if counter is not None else None
        return results

    @torch.inference_mode()
    def logits(self, results: Sequence[tuple[Any, torch.Tensor]]) -> list[tuple[Any, torch.Tensor | None]]:
        """Stage 0: the final norm and LM head of each micro-batch's sampled rows: logits on
        rank 0; None on stage 0's other tensor-parallel ranks, which lend their vocabulary
        columns (the head's gather is collective over the stage)."""
        from engine.model.kernels.cpu_norm import rms_norm

        model, eps = self.runner.model, self.runner.model_config.rms_norm_eps
        return [(prepared, model.compute_logits(rms_norm(hidden[prepared.sample_rows], model.norm, eps)))
                for prepared, hidden in results if prepared.sample_seqs]


def summed_expert_counts(stats: Sequence[StageStats]) -> list[list[int]] | None:
    """The whole model's per-expert counts from the stages' (each holds its own layers' rows)."""
    parts = [s.expert_counts for s in stats if s.expert_counts is not None]
    if not parts:
        return None
    return [[sum(values) for values in zip(*rows, strict=True)] for rows in zip(*parts, strict=True)]


class PipelineRunner:
    """Rank 0's runner under ``--pipeline-parallel-size``: ModelRunner's ``execute`` over the
    stages, and each step's stage statistics. The stage processes belong to the engine's
    WorkerGroup (engine/workers.py), which starts, watches and stops them."""

    def __init__(self, stage: Stage) -> None:
        self.stage = stage
        runner = stage.runner
        self.model = runner.model
        self.model_config = runner.model_config
        self.last_timings = runner.last_timings
        self.last_failed: dict[str, str] = {}
        self.last_logprobs: dict[str, Any] = {}  # the last step's, for the requests that ask
        self.last_stage_stats: list[StageStats] = []
        self.last_expert_counts: list[list[int]] | None = None

    @classmethod
    def start(cls, startup: Any, layout: StageLayout, bus: Any) -> PipelineRunner:
        """Rank 0's runner over its started stage, once every rank is ready: the startup
        phase events of the ranks on other hosts (:func:`relay_remote_phases`) are
        published on ``bus`` first (host 0's came through the WorkerGroup as they ran)."""
        from engine.events.schema import event_from_dict

        for phases in relay_remote_phases(layout, []):
            for row in phases:
                bus.publish(event_from_dict(row))
        return cls(Stage.of(startup.runner, layout, startup.model_config.num_layers))

    def execute(self, batch: Sequence[Any]) -> dict[str, int]:
        stage, runner = self.stage, self.stage.runner
        start = time.perf_counter()
        dist.broadcast_object_list([list(batch)], src=0)
        logits = stage.logits(stage.step(batch))
        stats: list[Any] = [None] * stage.layout.world_size
        dist.gather_object(stage.stats, stats, dst=0)
        forward_s = time.perf_counter() - start
        self.last_stage_stats = stats
        self.last_expert_counts = summed_expert_counts(stats)
        sampled: dict[str, int] = {}
        t0 = time.perf_counter()
        runner.last_failed, self.last_logprobs = {}, {}
        for prepared, rows in logits:  # ModelRunner's sampling, one micro-batch at a time
            tokens, logprobs = runner.sample_logits(prepared, rows)
            sampled.update(tokens)
            self.last_logprobs.update(logprobs)
        self.last_failed = runner.last_failed
        runner.last_timings = type(runner.last_timings)(forward_s=forward_s, sample_s=time.perf_counter() - t0)
        self.last_timings = runner.last_timings
        return sampled

    def step_fields(self) -> dict[str, Any]:
        """The step event's pipeline fields from the last step, one entry per stage: its
        bubble (the longest any of its ranks waited) and the bytes its ranks sent."""
        tp = self.stage.layout.tensor_parallel_size
        per_stage = [self.last_stage_stats[p:p + tp] for p in range(0, len(self.last_stage_stats), tp)]
        return {"pipeline_bubble_s": [max(s.bubble_s for s in ranks) for ranks in per_stage],
                "pipeline_bytes": [sum(s.bytes_sent for s in ranks) for ranks in per_stage]}

    # ModelRunner's attributes the engine reads, from stage 0's runner
    def __getattr__(self, name: str) -> Any:
        return getattr(self.stage.runner, name)


def relay_remote_phases(layout: StageLayout, phases: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Every rank, once started: a rank on a host beyond 0 hands rank 0 its ``phases`` (its
    startup.phase events as dicts; host 0's ranks relayed theirs through their queue and
    send none). Rank 0 gets every rank's list, in rank order; the others get []."""
    mine = phases if layout.host != 0 else []
    if layout.rank != 0:
        dist.gather_object(mine, None, dst=0)
        return []
    gathered: list[Any] = [None] * layout.world_size
    dist.gather_object(mine, gathered, dst=0)
    return gathered


def serve_stage(stage: Stage) -> None:
    """A stage process after startup: its part of every step rank 0 broadcasts, until it
    broadcasts None."""
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            return
        results = stage.step(box[0])
        if stage.layout.pp_rank == 0:  # stage 0's other tensor-parallel ranks lend their LM head columns
            stage.logits(results)
        dist.gather_object(stage.stats, None, dst=0)
