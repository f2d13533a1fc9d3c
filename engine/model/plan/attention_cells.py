"""Prefill attention's cells of the plan: which candidates ``model``'s backend has (torch's SDPA in
float32 or bf16, the paged prefill kernels) and each timed on one causal chunk per multi-row class."""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from engine.model.plan import stability
from engine.model.plan.choice import choose, relative_error, timed_round_robin
from engine.model.plan.kernel_plan import ATTENTION, STEP_CLASSES, Cell, KernelPlan

if TYPE_CHECKING:
    import torch


def attention_candidates(model: Any, bf16: bool) -> tuple[str, ...]:
    """The prefill-attention candidates ``model``'s backend has: float32 SDPA always; bf16 SDPA
    when ``bf16`` (native, ``--dtype auto``); the paged kernels the backend has (the bf16 one
    only when ``bf16``)."""
    out = ["torch"]
    if bf16:
        out.append("bf16")
    kernels = getattr(model.backend, "prefill_kernels", {})
    out.extend(name for name in ("paged", "paged_bf16") if name in kernels and (bf16 or name == "paged"))
    return tuple(out)


def attention_cells(model: Any, candidates: Sequence[str], generator: torch.Generator, deadline: float,
                    done: Mapping[tuple[str, str], Cell] | None = None,
                    incumbent: KernelPlan | None = None) -> list[Cell]:
    """Prefill attention of one ``rows``-token causal chunk (layer 0's heads) per multi-row class,
    each candidate as the backend runs it over a paged cache of 16-token blocks: torch's SDPA over
    the gathered context (float32, or q, K, V rounded to bf16) and the paged kernels reading it in
    place (over the cache dtype the engine stores, where they read it); checked against float32
    SDPA over the same K and V. A class past ``deadline`` runs ``incumbent``'s choice (a quiet
    earlier plan's) where this start has it, else float32 SDPA."""
    import torch
    import torch.nn.functional as F

    from engine.model.attention.torch_backend import gather_blocks

    layer = model.layers[0]
    heads, kv_heads, head_dim = layer.num_heads, layer.num_kv_heads, layer.head_dim
    scale, gqa = 1.0 / math.sqrt(head_dim), heads != kv_heads
    block = 16

    def sdpa(q: torch.Tensor, cache: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
        kv = gather_blocks(cache, torch.arange(cache.shape[0]))  # the backend's gather through the block table
        k = kv[:, 0].reshape(-1, kv_heads, head_dim)[:rows].transpose(0, 1)[None].to(dtype)
        v = kv[:, 1].reshape(-1, kv_heads, head_dim)[:rows].transpose(0, 1)[None].to(dtype)
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None].to(dtype), k, v, is_causal=True, scale=scale,
                                             enable_gqa=gqa)
        return out[0].transpose(0, 1).float()

    cells = []
    for sc in STEP_CLASSES:
        if sc.lo == 1:
            continue  # decode rows: the paged-decode kernel
        if done and (ATTENTION, sc.name) in done and set(done[(ATTENTION, sc.name)].us) >= set(candidates):
            cells.append(done[(ATTENTION, sc.name)])
            continue
        cell = Cell(ATTENTION, sc.name, sc.rows, f"{heads}q/{kv_heads}kv x {head_dim}")
        cells.append(cell)
        if time.perf_counter() > deadline:
            _leave_unmeasured(cell, candidates, incumbent)
            continue
        rows = sc.rows
        q = torch.randn(rows, heads, head_dim, generator=generator)
        blocks = -(-rows // block)
        cache = torch.randn(blocks, 2, block, kv_heads, head_dim, generator=generator)
        stored = getattr(model.backend, "kv_cache_dtype", None)
        if stored in (torch.bfloat16, torch.float16):  # the engine's K and V, and the reference's, as stored
            cache = cache.to(stored)
        calls = {"torch": functools.partial(sdpa, q, cache, rows, torch.float32)}
        if "bf16" in candidates:
            calls["bf16"] = functools.partial(sdpa, q, cache, rows, torch.bfloat16)
        table = torch.arange(blocks, dtype=torch.int32)[None]
        for name in ("paged", "paged_bf16"):
            if name in candidates:
                calls[name] = functools.partial(model.backend.prefill_kernels[name], q, cache, table,
                                                torch.tensor([rows], dtype=torch.int32), torch.tensor([0, rows]), scale)
        reference = calls["torch"]()
        cell.error = {name: relative_error(call(), reference) for name, call in calls.items()}
        cell.us.update(timed_round_robin(calls))
        choose(cell)
    return cells


def _leave_unmeasured(cell: Cell, candidates: Sequence[str], incumbent: KernelPlan | None) -> None:
    """A class past the bound: ``incumbent``'s choice (a quiet earlier plan's) where this start has
    it, else float32 SDPA, until a later start measures it."""
    held = stability.incumbent_for(incumbent, ATTENTION, cell.step, "")
    cell.chosen, cell.measured = (held if held in candidates else "torch"), False
    source = "the incumbent plan's choice" if cell.chosen == held else "float32 SDPA"
    cell.why = f"not measured: the bound was reached ({source}; the next start measures it)"
