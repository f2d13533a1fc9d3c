"""Tensor parallelism on torch.distributed: how a Llama's shapes split across ranks,
the process group, and the collectives the sharded layers call.

A replica of ``--tensor-parallel-size N`` is N processes, one rank each (gloo on CPU,
NCCL on CUDA), split as vLLM and Megatron split a Llama layer:

* column-parallel QKV and gate/up: each rank computes its heads' Q/K/V and its
  ``intermediate / N`` columns of gate and up, no communication;
* row-parallel O and down: each rank multiplies its slice of the input features,
  and one all-reduce sums the partial outputs (two per layer);
* vocab-parallel embedding (each rank looks up its ``ceil(vocab / N)`` rows, zeros
  elsewhere, one all-reduce) and LM head (each rank's logits columns, gathered at
  rank 0, which samples);
* KV heads ``num_kv_heads / N`` per rank, or one replicated head per rank when N is
  larger than the KV head count (vLLM's rule), so each rank's KV pool holds its heads
  of every token under the scheduler's block ids.

:class:`TensorParallel` times and counts every collective, so each step event can say
what the step spent in them (``collective_s``, ``collective_bytes``).
"""

from __future__ import annotations

import dataclasses
import datetime
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from engine.errors import BudgetError, UserError
from engine.modelspec.config import GiB, ModelConfig

# Collectives wait this long for a peer that is alive but silent (an idle server's workers
# wait in the control broadcast for the next step); a peer that dies closes its sockets,
# which gloo reports at once, so this bounds only a hung peer.
COLLECTIVE_TIMEOUT = datetime.timedelta(days=1)
# Phase B refuses a replica whose emptiest rank has less than 90 % of the fullest one's
# free memory (mini-sglang's and SGLang's check): every rank gets the pool the emptiest
# one can hold, so the others' difference would sit idle, and it usually means another
# process holds a device.
RANK_MEMORY_MARGIN = 0.10


@dataclass(frozen=True, slots=True)
class RankLayout:
    """Where one rank sits in its replica, and how the ranks meet (``tcp://host:port``)."""

    rank: int
    world_size: int
    init_method: str

    @property
    def is_driver(self) -> bool:
        """Rank 0 runs the scheduler, samples, and publishes the replica's events."""
        return self.rank == 0


def free_init_method() -> str:
    """A ``tcp://127.0.0.1:<port>`` rendezvous on a port free right now (vLLM's get_open_port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def check_shardable(model: ModelConfig, tp: int) -> None:
    """Refuse, before anything loads, a ``--tensor-parallel-size`` the model's shapes do not divide by."""
    if tp == 1:
        return
    problems = []
    if model.num_attention_heads % tp:
        problems.append(f"{model.num_attention_heads} attention heads")
    if model.num_kv_heads % tp and tp % model.num_kv_heads:
        problems.append(f"{model.num_kv_heads} KV heads (neither divisible by it nor dividing it)")
    if model.intermediate_size % tp:
        problems.append(f"intermediate size {model.intermediate_size:,}")
    if problems:
        sizes = [n for n in range(1, model.num_attention_heads + 1) if model.num_attention_heads % n == 0
                 and (model.num_kv_heads % n == 0 or n % model.num_kv_heads == 0) and model.intermediate_size % n == 0]
        raise UserError(f"--tensor-parallel-size {tp} does not divide {model.name}'s " + ", ".join(problems)
                        + f"; use one of {', '.join(map(str, sizes))}")


def replica_free_bytes(per_rank_free: Sequence[int], margin: float = RANK_MEMORY_MARGIN) -> int:
    """The replica's free memory: its emptiest rank's, or a BudgetError with each rank's
    numbers when they differ by more than ``margin`` of the largest."""
    low, high = min(per_rank_free), max(per_rank_free)
    if high > 0 and high - low > margin * high:
        listing = ", ".join(f"rank {r} {free / GiB:.2f} GiB" for r, free in enumerate(per_rank_free))
        emptiest = list(per_rank_free).index(low)
        raise BudgetError(f"free memory differs across the tensor-parallel ranks by more than {margin:.0%}: "
                          f"{listing}; every rank would get the pool rank {emptiest} can hold. Free the busier "
                          "device (another process holds it?) or run the replica on devices with equal free memory")
    return low


def vocab_shard_rows(vocab_size: int, tp: int) -> int:
    """Rows of the embedding / LM head each rank holds (the last rank's tail is zero padding)."""
    return -(-vocab_size // tp)


def rank_model_config(model: ModelConfig, tp: int) -> ModelConfig:
    """The shapes one rank's layers hold: its heads, KV heads, MLP columns and vocabulary rows."""
    check_shardable(model, tp)
    return dataclasses.replace(
        model, num_attention_heads=model.num_attention_heads // tp, num_kv_heads=max(1, model.num_kv_heads // tp),
        intermediate_size=model.intermediate_size // tp, vocab_size=vocab_shard_rows(model.vocab_size, tp))


def kv_head_start(model: ModelConfig, tp: int, rank: int) -> int:
    """The first KV head of ``rank``: its own slice, or when ``tp`` > KV heads the head
    ``tp / num_kv_heads`` consecutive ranks replicate."""
    if tp <= model.num_kv_heads:
        return rank * (model.num_kv_heads // tp)
    return rank // (tp // model.num_kv_heads)


@dataclass(slots=True)
class CollectiveStats:
    """What the collectives of a stretch of work cost on this rank."""

    seconds: float = 0.0
    bytes: int = 0  # each rank's payload: the tensor it contributes
    calls: int = 0


class TensorParallel:
    """One rank's handle on its replica's process group: the tensor collectives of the
    sharded layers (timed and counted in :attr:`stats`) and the object collectives of
    startup and the control plane."""

    def __init__(self, layout: RankLayout, device: torch.device, group: Any = None, driver_rank: int = 0) -> None:
        """``group``: the tensor collectives' process group (None: the whole world); under
        pipeline parallelism one stage's ranks, whose rank 0 is global ``driver_rank``
        (engine/pipeline.py). The control plane's broadcast is always the world's."""
        self.layout = layout
        self.rank = layout.rank
        self.world_size = layout.world_size
        self.device = device
        self.group = group
        self.driver_rank = driver_rank
        self.stats = CollectiveStats()

    @classmethod
    def join(cls, layout: RankLayout, device: torch.device) -> TensorParallel:
        """Join the replica's process group (blocks until every rank has joined)."""
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(layout.rank)
        if dist.is_initialized():
            raise RuntimeError("this process already holds a tensor-parallel group: one replica per process")
        dist.init_process_group(backend, init_method=layout.init_method, rank=layout.rank,
                                world_size=layout.world_size, timeout=COLLECTIVE_TIMEOUT)
        return cls(layout, device)

    @property
    def backend(self) -> str:
        return str(dist.get_backend())

    def take_stats(self) -> CollectiveStats:
        """The collectives since the last call (a step's), and start counting afresh."""
        stats, self.stats = self.stats, CollectiveStats()
        return stats

    # ------------------------------------------------------------------ tensors
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (the row-parallel layers' and embedding's reduce)."""
        start = time.perf_counter()
        dist.all_reduce(x, group=self.group)
        self._count(start, x)
        return x

    def gather_to_driver(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: every rank's ``x`` concatenated on the last dim (the LM head's logits
        columns); other ranks: None. A gather, not an all-gather: only rank 0 samples."""
        start = time.perf_counter()
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.layout.is_driver else None
        dist.gather(x, parts, dst=self.driver_rank, group=self.group)
        self._count(start, x)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def _count(self, start: float, x: torch.Tensor) -> None:
        self.stats.seconds += time.perf_counter() - start
        self.stats.bytes += x.numel() * x.element_size()
        self.stats.calls += 1

    # ------------------------------------------------------------------ objects
    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order (startup's free-memory and pool readings)."""
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value, group=self.group)
        return out

    def broadcast_from_driver(self, value: Any = None) -> Any:
        """The control plane: rank 0's ``value`` on every rank (the step's batch; None stops the workers)."""
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
