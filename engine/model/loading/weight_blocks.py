"""A decoder model's weights as blocks: which projections are held as GGUF blocks (or
packed from floats), their kernels, and the float weights made again where no kernel runs.

These are functions over a model (:class:`engine.model.families.llama.LlamaForCausalLM` or a
family's subclass) rather than methods of it: every family shares one way of holding and
binding quantized weights, and the model class keeps its layers and forward. Each projection's
blocks live on its :class:`~engine.model.layers.projection_linear.ProjectionLinear` (the model's
``projections["head"]``, each layer's ``projections[name]``); a family that cannot hold blocks
says why in ``quantization_refusal``.

A model loaded from its GGUF blocks (:mod:`engine.model.loading.gguf_blocks`) holds no float copy
of a block-backed projection or of the embedding: the float parameter is a placeholder
of its shape over one element (:func:`~engine.model.layers.projection_linear.holds_nothing`), made
again from the blocks where the kernel plan chooses a float implementation or no kernel can be built.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from engine.model.layers.projection_linear import ProjectionLinear
from engine.model.layers.quantized_linear import (
    BLOCK_FORMATS,
    GEMV_FORMATS,
    BlockPart,
    QuantizedLinear,
    bind_kernels,
    fits,
    row_bytes,
)

QUANTIZATION_METHODS = ("int8", "int4", "native")
# method -> (GGUF block formats used as they are, the format float weights are packed into).
# int4 keeps a Q8_0 tensor (SmolLM2's tied embedding/LM head) as Q8_0: requantizing it
# to 4 bits would add error the GGUF does not have. native (chosen by --quantization auto
# for a file of mixed block types, a K-quant file): the GGUF's own blocks in every format a
# kernel reads (engine/model/layers/quantized_linear.py), nothing packed (other weights stay float).
METHOD_FORMATS: dict[str, tuple[tuple[str, ...], str | None]] = {
    "int8": (("q8_0",), "q8_0"),
    "int4": (("q4_1", "q8_0"), "q4_1"),
    "native": (("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k"), None),
}
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# HF tensors each fused projection is made of, in row order.
PROJECTION_PARTS = {
    "qkv_proj": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "o_proj": ("self_attn.o_proj.weight",),
    "gate_up_proj": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "down_proj": ("mlp.down_proj.weight",),
}
# Buffer suffix of each format (bench_engine.py finds quantized copies by ``_int<bits>``).
BUFFER_SUFFIX = {"q8_0": "int8", "q4_1": "int4", "q4_1x8": "int4", "q4_0": "int4", "q5_0": "int5",
                 "q5_1": "int5", "q4_k": "int4", "q5_k": "int5", "q6_k": "int6"}


def head_attr(model: Any) -> str:
    """The parameter the LM head multiplies by: the embedding when the model ties them."""
    return "embed_tokens" if model.lm_head is None else "lm_head"


def projections(model: Any) -> dict[str, ProjectionLinear]:
    """Every projection of ``model`` by its flat name: ``"head"``, then ``"layers.<i>.<name>"``."""
    return {"head": model.projections["head"],
            **{f"layers.{i}.{name}": p for i, layer in enumerate(model.layers) for name, p in layer.projections.items()}}


def quantized_projections(model: Any) -> list[ProjectionLinear]:
    """The projections held as blocks."""
    return [p for p in projections(model).values() if p.blocks is not None]


def quantized_linears(model: Any) -> list[QuantizedLinear]:
    """The blocks of every projection held as blocks."""
    return [p.blocks for p in projections(model).values() if p.blocks is not None]


def install(projection: ProjectionLinear, entry: QuantizedLinear, counts: dict[str, int]) -> None:
    """Hold ``entry`` as ``projection``'s blocks (its parts as buffers of the module that holds the
    projection, so ``weights_bytes`` counts them), its input rounded twice where the owner's family
    asks it (``inputs_rounded_twice``)."""
    if projection.name in getattr(projection.owner, "inputs_rounded_twice", ()):
        entry.activation_passes = 2
    for i, part in enumerate(entry.parts):
        suffix = BUFFER_SUFFIX[part.fmt] + (f"_{i}" if len(entry.parts) > 1 else "")
        projection.owner.register_buffer(f"{projection.name}_{suffix}", part.blocks, persistent=False)
    projection.blocks = entry
    key = f"{entry.fmt if entry.fmt != 'mixed' else '+'.join(entry.formats)} {entry.source}"
    counts[key] = counts.get(key, 0) + 1


def targets(model: Any) -> list[tuple[ProjectionLinear, tuple[str, ...]]]:
    """``(projection, HF parts)`` of the LM head and every layer's projections."""
    head_name = "model.embed_tokens.weight" if model.lm_head is None else "lm_head.weight"
    out: list[tuple[ProjectionLinear, tuple[str, ...]]] = [(model.projections["head"], (head_name,))]
    for index, layer in enumerate(model.layers):
        out.extend((layer.projections[name], tuple(f"model.layers.{index}.{part}" for part in PROJECTION_PARTS[name]))
                   for name in PROJECTIONS)
    return out


def entry_from_file(weight: torch.Tensor, found: list[tuple[str, torch.Tensor] | None],
                    exact: tuple[str, ...]) -> QuantizedLinear | None:
    """The weight's entry from the file's blocks, when every part is there in a format of
    ``exact`` and the rows add up to the weight's shape."""
    if not found or any(f is None or f[0] not in exact or not fits(f[0], weight.shape[1]) for f in found):
        return None
    # One part per file tensor, even where neighbours share a format: a part stays a view of the mapped
    # file (a concatenation would copy it), and the kernel quantizes the activations once for all parts.
    parts = tuple(BlockPart(f[0], f[1]) for f in found if f is not None)
    entry = QuantizedLinear(parts, int(weight.shape[1]), "gguf")
    widths_ok = all(p.blocks.shape[1] == row_bytes(p.fmt, int(weight.shape[1])) for p in parts)
    if not widths_ok or entry.out_features != weight.shape[0]:
        return None
    if len({p.fmt for p in parts}) == 1 and parts[0].fmt in GEMV_FORMATS:
        # one format the GEMV module reads (SmolLM2's Q4_1): one tensor, interleaved next
        blocks = parts[0].blocks if len(parts) == 1 else torch.cat([p.blocks for p in parts])
        return QuantizedLinear.single(blocks, parts[0].fmt, "gguf", entry.in_features)
    return entry


@torch.no_grad()
def quantize_weights(model: Any, method: str, gguf_blocks: Mapping[str, tuple[str, torch.Tensor]] | None = None,
                     pack: bool = True) -> dict[str, int]:
    """Install weight-only quantized entries of the LM head and every projection (after loading):
    a GGUF's own blocks (:func:`engine.model.loading.gguf_blocks.read_gguf_blocks`) where ``method``
    takes their format, other weights packed from the floats (``pack``; else kept float). The
    kernels are bound at the first forward. Returns counts per ``"<format> <source>"``."""
    refusal = getattr(model, "quantization_refusal", None)
    if refusal is not None:
        from engine.errors import UserError

        raise UserError(f"--quantization {method}: {refusal}")
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization {method!r}: use one of {', '.join(QUANTIZATION_METHODS)}")
    exact, packed_fmt = METHOD_FORMATS[method]
    return _install_entries(model, exact, packed_fmt if pack else None, gguf_blocks)


def _install_entries(model: Any, exact: tuple[str, ...], packed_fmt: str | None,
                     gguf_blocks: Mapping[str, tuple[str, torch.Tensor]] | None) -> dict[str, int]:
    """The entries of the LM head and every projection: the file's blocks where ``gguf_blocks`` has
    every part in a format of ``exact``, else packed from the floats into ``packed_fmt`` (None: kept
    float). Q4_1 is interleaved 8 rows at a time where int8 activations are on. Returns counts per
    ``"<format> <source>"`` (``"float"``: kept float)."""
    from engine.model.kernels import cpu_gemv

    counts: dict[str, int] = {}
    interleave = cpu_gemv.int8_activations_enabled()
    for projection, parts in targets(model):
        weight = projection.weight
        entry = entry_from_file(weight, [(gguf_blocks or {}).get(p) for p in parts], exact)
        if entry is None and packed_fmt is not None and weight.shape[1] % cpu_gemv.QK == 0 and projection.holds_float():
            pack = cpu_gemv.quantize_q8_0 if packed_fmt == "q8_0" else cpu_gemv.quantize_q4_1
            entry = QuantizedLinear.single(pack(weight), packed_fmt, "packed")
        if entry is None:
            counts["float"] = counts.get("float", 0) + 1
            continue
        if entry.fmt == "q4_1" and interleave and weight.shape[0] % cpu_gemv.X8_ROWS == 0:
            # 8 rows interleaved: the kernel's int8 dot covers 8 rows per instruction.
            entry = QuantizedLinear.single(cpu_gemv.interleave_q4_1(entry.blocks), "q4_1x8", entry.source)
        install(projection, entry, counts)
    model.routing.pending = True
    return counts


def quantized_state(model: Any, counts: Mapping[str, int]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The one-part entries as flat tensors (``"layers.3.qkv_proj"``) and their ``"<format>
    <source>"``, plus the count kept float: what the startup cache stores so a warm start skips
    reading, concatenating and interleaving blocks."""
    tensors: dict[str, torch.Tensor] = {}
    formats = {"float": str(counts.get("float", 0))}
    for key, projection in projections(model).items():
        q = projection.blocks
        if q is not None and len(q.parts) == 1:
            tensors[key] = q.blocks
            formats[key] = f"{q.fmt} {q.source}"
    return tensors, formats


def restore_quantized(model: Any, tensors: Mapping[str, torch.Tensor],
                      formats: Mapping[str, str]) -> dict[str, int] | None:
    """Install entries saved by :func:`quantized_state`; None, with nothing installed, when
    they do not fit this model (another shape or an older layout)."""
    plan: list[tuple[ProjectionLinear, QuantizedLinear]] = []
    for key, projection in projections(model).items():
        if key not in tensors:
            continue
        fmt, _, source = formats.get(key, "").partition(" ")
        weight = projection.weight
        blocks = tensors[key]
        if fmt not in BLOCK_FORMATS or blocks.dtype != torch.uint8 or not fits(fmt, weight.shape[1]):
            return None
        entry = QuantizedLinear.single(blocks, fmt, source, int(weight.shape[1]))
        if tuple(blocks.shape) != (weight.shape[0], entry.nbytes // max(1, weight.shape[0])):
            return None
        plan.append((projection, entry))
    kept_float = int(formats.get("float", "0"))
    if len(plan) + kept_float != 1 + len(model.layers) * len(PROJECTIONS):
        return None
    counts: dict[str, int] = {"float": kept_float} if kept_float else {}
    for projection, entry in plan:
        install(projection, entry, counts)
    model.routing.pending = True
    return counts


def bind(model: Any) -> str | None:
    """Point every entry at its kernel (the GEMV module for one-part Q8_0/Q4_1, the
    block-type module for the rest). Entries no kernel serves here (no compiler, a kernel
    switched off, not on CPU) get their float weights made again from the blocks and run
    torch; returns that reason (None when every entry has its kernel)."""
    from engine.model.kernels import cpu_gemv

    entries = quantized_linears(model)
    on_cpu = model.embed_tokens.device.type == "cpu"
    wants_gemv = any(len(q.parts) == 1 and q.fmt in GEMV_FORMATS for q in entries)
    wants_quant = any(len(q.parts) > 1 or q.fmt not in GEMV_FORMATS for q in entries)
    gemv_kernel = cpu_gemv.load_kernel() if on_cpu and wants_gemv else None
    quant_kernel = None
    if on_cpu and wants_quant:
        from engine.model.kernels import cpu_quant

        quant_kernel = cpu_quant.load_kernel()
    bind_kernels(entries, gemv_kernel, quant_kernel)
    unbound = [p for p in quantized_projections(model) if p.blocks is not None and p.blocks.gemv is None]
    for projection in unbound:
        assert projection.blocks is not None
        projection.blocks.max_rows = 0
        if not projection.holds_float():
            projection.restore_float()
    if not unbound:
        return None
    reasons = []
    if not on_cpu:
        reasons.append("not on CPU")
    if wants_gemv and gemv_kernel is None and on_cpu:
        reasons.append(f"Q8_0/Q4_1 GEMV: {cpu_gemv.unavailable_reason()}")
    if wants_quant and quant_kernel is None and on_cpu:
        from engine.model.kernels import cpu_quant

        reasons.append(f"block-type kernel: {cpu_quant.unavailable_reason()}")
    return (f"CPU kernels unavailable ({'; '.join(reasons) or 'no kernel for these formats'}): {len(unbound)} of "
            f"{len(entries)} quantized weights run their float weights through torch F.linear")


def restore_float_weights(model: Any) -> int:
    """Make every float weight not held again from its blocks (a plan that uses them, a
    re-measurement, a fallback). Returns how many were restored."""
    restored = 0
    for projection in quantized_projections(model):
        if not projection.holds_float():
            projection.restore_float()
            restored += 1
    return restored
