"""The fused decode layer's part of the plan: engine/model/kernels/cpu_layer.py's one-call layer timed
against the op-by-op layer (the plan's projections, the paged-decode kernel) at every step class,
and the rows up to which it serves pure-decode steps."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from engine.model.plan import stability
from engine.model.plan.choice import relative_error, timed_round_robin
from engine.model.plan.kernel_plan import ACCURACY_BOUND, STEP_CLASSES, KernelPlan, StepClass

if TYPE_CHECKING:
    import torch

FUSED_CONTEXT = 32  # tokens each sequence of the fused-layer timing attends over

# A callable (plan so far, deadline) -> (fused max rows, notes) that times the fused layer.
FusedTiming = Callable[[KernelPlan, float], tuple[int, list[str]]]


def fused_rows_from(timings: Sequence[tuple[StepClass, float, float, float]], max_rows: int,
                    bound: float = ACCURACY_BOUND, incumbent_rows: int | None = None) -> tuple[int, list[str]]:
    """From ``(class, fused µs, op-by-op µs, fused error)`` in class order: the rows up to which
    the fused layer wins from one row up (through the last class timed: ``max_rows``), and a
    note per class. ``incumbent_rows``: the rows the previous plan (or the fallback) ran fused;
    a class changes sides only on ``stability.MARGIN`` (None: the faster wins)."""
    rows, notes, winning = 0, [], True
    for sc, fused_us, layer_us, err in timings:
        held = None if incumbent_rows is None else min(sc.hi or max_rows, max_rows) <= incumbent_rows
        ok = err <= bound and stability.fused_wins(fused_us, layer_us, held)
        kept = " (kept as incumbent: within the margin)" if err <= bound and ok != (fused_us < layer_us) else ""
        notes.append(f"fused decode layer at {sc.rows} rows: {fused_us:,.1f} µs vs op-by-op {layer_us:,.1f} µs"
                     + (f" (error {err:.2e} > {bound:g}: rejected)" if err > bound else "")
                     + (" -> fused" if ok and winning else " -> op by op") + kept)
        if winning and ok:
            rows = min(sc.hi or max_rows, max_rows)
        else:
            winning = False
    if winning and timings:
        rows = max_rows
        notes.append(f"fused decode layer won at every size timed: it serves pure-decode steps up to {max_rows} rows")
    return rows, notes



def fused_timing(model: Any) -> FusedTiming | None:
    """The timing of the fused decode layer on ``model``'s layer 0 against the op-by-op layer
    (the plan's projections, the paged-decode kernel), or None where it cannot run."""
    import torch

    from engine.model.kernels import cpu_layer

    if getattr(model.backend, "decode_kernel", None) is None or cpu_layer.load_kernel() is None:
        return None
    kernel = cpu_layer.load_kernel()

    def run(plan: KernelPlan, deadline: float) -> tuple[int, list[str]]:
        incumbent_rows = plan.fused_max_rows  # what measure() set: the previous plan's rows, or the fallback's
        model.routing.install_plan(replace(plan, fused_max_rows=cpu_layer.MAX_ROWS))
        if not model.routing.fused_layers:
            return 0, ["fused decode layer does not apply to this model's layers or weights"]
        layer, args = model.layers[0], model.routing.fused_layers[0]
        timings, notes = [], []
        generator = torch.Generator().manual_seed(1)
        for sc in STEP_CLASSES:  # every class: past 64 rows a packed bf16 GEMM can beat its GEMV
            if time.perf_counter() > deadline:
                notes.append(f"fused decode layer not timed at {sc.rows} rows: the bound was reached (op by op)")
                break
            timings.append((sc, *_fused_against_layer(model, layer, kernel, args, min(sc.rows, cpu_layer.MAX_ROWS),
                                                      generator)))
        if not timings:  # the bound came first (installing the plan's copies took it): as past the bound
            plan.fused_timed = False  # else "off" was stored as if measured, and no later start timed it
            return cpu_layer.MAX_ROWS, ["fused decode layer not timed: the bound was reached (fallback: on; "
                                        "the next start times it)"]
        rows, fused_notes = fused_rows_from(timings, cpu_layer.MAX_ROWS, incumbent_rows=incumbent_rows)
        return rows, fused_notes + notes

    return run


def _fused_against_layer(model: Any, layer: Any, kernel: Any, args: tuple[tuple[object, ...], tuple[object, ...]],
                         rows: int, generator: torch.Generator) -> tuple[float, float, float]:
    """``(fused µs, op-by-op µs, relative difference)`` of one pure-decode step of ``rows``
    sequences, each attending over ``FUSED_CONTEXT`` tokens, through layer ``layer``."""
    import torch

    from engine.model.attention.base import AttentionMetadata

    block, (before, after) = 16, args
    per_seq = FUSED_CONTEXT // block + 1
    cache = torch.randn(rows * per_seq, 2, block, layer.num_kv_heads, layer.head_dim, generator=generator)
    tables = torch.arange(rows * per_seq, dtype=torch.int32).view(rows, per_seq)
    lens = torch.full((rows,), FUSED_CONTEXT + 1, dtype=torch.int32)
    slots = tables[:, FUSED_CONTEXT // block].to(torch.int64) * block + FUSED_CONTEXT % block
    meta = AttentionMetadata(slot_mapping=slots, query_start_loc=torch.arange(rows + 1, dtype=torch.int32),
                             seq_lens=lens, block_tables=tables, max_query_len=1, max_seq_len=FUSED_CONTEXT + 1,
                             query_lens_cpu=[1] * rows, seq_lens_cpu=[FUSED_CONTEXT + 1] * rows)
    rotary = model.rotary_local if getattr(layer, "is_sliding", False) else model.rotary  # Gemma 3's two bases
    cos, sin = rotary.cos_sin(torch.full((rows,), FUSED_CONTEXT), model.dtype)
    hidden = torch.randn(rows, layer.input_layernorm.shape[0], generator=generator)
    entry = getattr(kernel, getattr(layer, "fused_entry", "decode_layer"))  # Gemma 3: decode_layer_gemma3

    def fused_call() -> torch.Tensor:
        return entry(hidden, *before, cos.view(rows, -1), sin.view(rows, -1), cache, slots, tables, lens, *after)

    def layer_call() -> torch.Tensor:
        return layer(hidden, cos, sin, cache, meta, model.backend)

    with torch.inference_mode():
        err = relative_error(fused_call(), layer_call())
        us = timed_round_robin({"fused": fused_call, "layer": layer_call})
        return us["fused"], us["layer"], err

