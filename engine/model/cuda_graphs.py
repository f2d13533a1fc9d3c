"""Phase F on CUDA: decode steps recorded as CUDA graphs, one per batch size.

A decode step launches hundreds of small kernels; replaying a captured graph
turns them into one launch. Each graph owns static input buffers (token ids,
positions, slot mapping, sequence lengths, block tables); a step copies its
inputs into the graph of the smallest captured size that holds it and pads the
rest: padded rows write nothing (slot -1) and attend to one token of block 0,
and their outputs are dropped.

The attention backend decides split-K on the host from ``max_seq_len``; a
graph freezes that choice, so capture uses the longest context (split-K on),
which is correct for short sequences too.

Only CUDA can run this; on CPU :func:`graphs_supported` says why not and phase F
is reported as skipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from engine.model.attention.base import AttentionMetadata


def graphs_supported(device: torch.device, enforce_eager: bool) -> str | None:
    """None when graphs can be captured, else the reason phase F is skipped."""
    if enforce_eager:
        return "--enforce-eager"
    if device.type != "cuda":
        return "CUDA graphs need a CUDA device"
    return None


@dataclass(slots=True)
class _Graph:
    graph: Any  # torch.cuda.CUDAGraph
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    output: torch.Tensor


@dataclass(slots=True)
class CaptureReport:
    batch_sizes: list[int]
    graph_bytes: int
    seconds: float
    per_size_bytes: dict[int, int] = field(default_factory=dict)


class DecodeGraphs:
    """Captured decode graphs for a model and its KV cache."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], block_size: int,
                 max_model_len: int, device: torch.device) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_blocks = -(-max_model_len // block_size)
        self.max_model_len = max_model_len
        self.device = device
        self.graphs: dict[int, _Graph] = {}
        self.pool: Any = None

    @property
    def max_batch(self) -> int:
        return max(self.graphs) if self.graphs else 0

    def _static(self, size: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.full((size,), -1, dtype=torch.int64, device=dev),
            query_start_loc=torch.arange(size + 1, dtype=torch.int32, device=dev),
            seq_lens=torch.ones(size, dtype=torch.int32, device=dev),
            block_tables=torch.zeros(size, self.max_blocks, dtype=torch.int32, device=dev),
            max_query_len=1,
            max_seq_len=self.max_model_len,
        )
        input_ids = torch.zeros(size, dtype=torch.int64, device=dev)
        positions = torch.zeros(size, dtype=torch.int64, device=dev)
        return input_ids, positions, meta

    @torch.inference_mode()
    def capture(self, batch_sizes: list[int]) -> CaptureReport:
        import time

        start = time.perf_counter()
        torch.cuda.synchronize(self.device)
        free_before, _ = torch.cuda.mem_get_info(self.device)
        per_size: dict[int, int] = {}
        self.pool = torch.cuda.graph_pool_handle()
        # Largest first, so smaller graphs reuse the pool the largest allocated.
        for size in sorted(set(batch_sizes), reverse=True):
            free_size_before, _ = torch.cuda.mem_get_info(self.device)
            input_ids, positions, meta = self._static(size)
            for _ in range(2):  # warm-up: autotuning and lazy allocations happen outside the graph
                self.model(input_ids, positions, self.kv_caches, meta)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                output = self.model(input_ids, positions, self.kv_caches, meta)
            torch.cuda.synchronize(self.device)
            self.graphs[size] = _Graph(graph, input_ids, positions, meta, output)
            per_size[size] = max(0, free_size_before - torch.cuda.mem_get_info(self.device)[0])
        free_after, _ = torch.cuda.mem_get_info(self.device)
        return CaptureReport(sorted(self.graphs), max(0, free_before - free_after), time.perf_counter() - start,
                             per_size)

    def can_run(self, meta: AttentionMetadata) -> bool:
        return meta.is_pure_decode and 0 < meta.num_seqs <= self.max_batch

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Replay the graph for a pure-decode batch; returns hidden ``[n, hidden]``."""
        n = meta.num_seqs
        size = min(s for s in self.graphs if s >= n)
        g = self.graphs[size]
        g.input_ids[:n].copy_(input_ids)
        g.positions[:n].copy_(positions)
        g.meta.slot_mapping[:n].copy_(meta.slot_mapping)
        g.meta.slot_mapping[n:].fill_(-1)
        g.meta.seq_lens[:n].copy_(meta.seq_lens)
        g.meta.seq_lens[n:].fill_(1)
        width = meta.block_tables.shape[1]
        g.meta.block_tables[:n, :width].copy_(meta.block_tables)
        g.meta.block_tables[n:].zero_()
        g.graph.replay()
        return g.output[:n]
