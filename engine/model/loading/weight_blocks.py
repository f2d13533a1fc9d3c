"""A decoder model's weights as blocks: which projections are held as GGUF blocks (or
packed from floats), their kernels, and the float weights made again where no kernel runs.

These are functions over a model (:class:`engine.model.families.llama.LlamaForCausalLM` or a
family's subclass) rather than methods of it: every family shares one way of holding and
binding quantized weights, and the model class keeps its layers and forward.

A model loaded from its GGUF blocks (:mod:`engine.model.loading.gguf_blocks`) holds no float copy
of a block-backed projection or of the embedding: the float parameter is a placeholder
of its shape over one element (:func:`holds_nothing`), made again from the blocks
(:func:`restore_float`) where the kernel plan chooses a float implementation or no
kernel can be built.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
from torch import nn

from engine.model.layers.quantized_linear import (
    BLOCK_FORMATS,
    GEMV_FORMATS,
    BlockPart,
    QuantizedLinear,
    bind_kernels,
    fits,
    row_bytes,
)

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


class BlockHolder(Protocol):
    """A module that holds quantized entries: the model (its LM head's, as ``"head"``) and each
    decoder layer (its projections'), with the kernel plan's route for each."""

    quantized: dict[str, QuantizedLinear]
    kernel_routes: dict[str, Callable[[torch.Tensor], torch.Tensor]]
    _buffers: dict[str, torch.Tensor | None]

    def register_buffer(self, name: str, tensor: torch.Tensor | None, persistent: bool = True) -> None: ...


def holds_nothing(t: torch.Tensor) -> bool:
    """A placeholder for a float weight not held: its shape over one element."""
    return not t.is_mkldnn and t.dim() == 2 and t.numel() > 1 and t.stride() == (0, 0)


def placeholder(like: torch.Tensor) -> nn.Parameter:
    """A parameter of ``like``'s shape and dtype that holds one element."""
    zero = torch.zeros(1, 1, dtype=like.dtype, device=like.device).expand(like.shape)
    return nn.Parameter(zero, requires_grad=False)


def head_attr(model: Any) -> str:
    """The parameter the LM head multiplies by: the embedding when the model ties them."""
    return "embed_tokens" if model.lm_head is None else "lm_head"


def float_attr(model: Any, module: BlockHolder, name: str) -> str:
    """The float parameter behind quantized entry ``name`` of ``module``."""
    return head_attr(model) if name == "head" else name


def restore_float(model: Any, module: BlockHolder, name: str) -> torch.Tensor:
    """``module``'s float weight behind entry ``name`` made again from its blocks (their
    values exactly), in the model's dtype."""
    q = module.quantized[name]
    attr = float_attr(model, module, name)
    dtype = getattr(module, attr).dtype
    weight = nn.Parameter(q.dequantize().to(dtype), requires_grad=False)
    setattr(module, attr, weight)
    return weight


def quantized_modules(model: Any) -> dict[str, BlockHolder]:
    return {"": model, **{f"layers.{i}.": layer for i, layer in enumerate(model.layers)}}


def entries_of(model: Any) -> list[tuple[BlockHolder, str, QuantizedLinear]]:
    return [(module, name, q) for module in quantized_modules(model).values()
            for name, q in module.quantized.items()]


def install(module: BlockHolder, name: str, entry: QuantizedLinear, counts: dict[str, int]) -> None:
    """Hold ``entry`` on ``module`` (its parts as buffers, so ``weights_bytes`` counts them)."""
    for i, part in enumerate(entry.parts):
        suffix = BUFFER_SUFFIX[part.fmt] + (f"_{i}" if len(entry.parts) > 1 else "")
        module.register_buffer(f"{name}_{suffix}", part.blocks, persistent=False)
    module.quantized[name] = entry
    key = f"{entry.fmt if entry.fmt != 'mixed' else '+'.join(entry.formats)} {entry.source}"
    counts[key] = counts.get(key, 0) + 1


def targets(model: Any) -> list[tuple[BlockHolder, str, torch.Tensor, tuple[str, ...]]]:
    """``(module, entry name, float weight, HF parts)`` of the LM head and every projection."""
    head_name = "model.embed_tokens.weight" if model.lm_head is None else "lm_head.weight"
    out: list[tuple[BlockHolder, str, torch.Tensor, tuple[str, ...]]] = [
        (model, "head", getattr(model, head_attr(model)), (head_name,))]
    for index, layer in enumerate(model.layers):
        out.extend((layer, name, getattr(layer, name),
                    tuple(f"model.layers.{index}.{part}" for part in PROJECTION_PARTS[name])) for name in PROJECTIONS)
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
def quantize_weights(model: Any, method: str, exact: tuple[str, ...], packed_fmt: str | None,
                     gguf_blocks: Mapping[str, tuple[str, torch.Tensor]] | None = None) -> dict[str, int]:
    """Install the quantized entries of the LM head and every projection: the file's blocks
    where ``gguf_blocks`` has every part in a format of ``exact``, else packed from the floats
    into ``packed_fmt`` (None: kept float). Q4_1 is interleaved 8 rows at a time where int8
    activations are on. Returns counts per ``"<format> <source>"`` (``"float"``: kept float)."""
    from engine.model.kernels import cpu_gemv

    counts: dict[str, int] = {}
    interleave = cpu_gemv.int8_activations_enabled()
    for module, name, weight, parts in targets(model):
        entry = entry_from_file(weight, [(gguf_blocks or {}).get(p) for p in parts], exact)
        if entry is None and packed_fmt is not None and weight.shape[1] % cpu_gemv.QK == 0 and not holds_nothing(weight):
            pack = cpu_gemv.quantize_q8_0 if packed_fmt == "q8_0" else cpu_gemv.quantize_q4_1
            entry = QuantizedLinear.single(pack(weight), packed_fmt, "packed")
        if entry is None:
            counts["float"] = counts.get("float", 0) + 1
            continue
        if entry.fmt == "q4_1" and interleave and weight.shape[0] % cpu_gemv.X8_ROWS == 0:
            # 8 rows interleaved: the kernel's int8 dot covers 8 rows per instruction.
            entry = QuantizedLinear.single(cpu_gemv.interleave_q4_1(entry.blocks), "q4_1x8", entry.source)
        install(module, name, entry, counts)
    model._gemv_pending = True
    return counts


def quantized_state(model: Any, counts: Mapping[str, int]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The one-part entries as flat tensors (``"layers.3.qkv_proj"``) and their ``"<format>
    <source>"``, plus the count kept float: what the startup cache stores so a warm start skips
    reading, concatenating and interleaving blocks."""
    tensors: dict[str, torch.Tensor] = {}
    formats = {"float": str(counts.get("float", 0))}
    for prefix, module in quantized_modules(model).items():
        for name, q in module.quantized.items():
            if len(q.parts) == 1:
                tensors[prefix + name] = q.blocks
                formats[prefix + name] = f"{q.fmt} {q.source}"
    return tensors, formats


def restore_quantized(model: Any, tensors: Mapping[str, torch.Tensor],
                      formats: Mapping[str, str]) -> dict[str, int] | None:
    """Install entries saved by :func:`quantized_state`; None, with nothing installed, when
    they do not fit this model (another shape or an older layout)."""
    plan: list[tuple[BlockHolder, str, QuantizedLinear]] = []
    for prefix, module in quantized_modules(model).items():
        for name in ("head",) if prefix == "" else PROJECTIONS:
            key = prefix + name
            if key not in tensors:
                continue
            fmt, _, source = formats.get(key, "").partition(" ")
            weight = getattr(module, float_attr(model, module, name))
            blocks = tensors[key]
            if fmt not in BLOCK_FORMATS or blocks.dtype != torch.uint8 or not fits(fmt, weight.shape[1]):
                return None
            entry = QuantizedLinear.single(blocks, fmt, source, int(weight.shape[1]))
            if tuple(blocks.shape) != (weight.shape[0], entry.nbytes // max(1, weight.shape[0])):
                return None
            plan.append((module, name, entry))
    kept_float = int(formats.get("float", "0"))
    if len(plan) + kept_float != 1 + len(model.layers) * len(PROJECTIONS):
        return None
    counts: dict[str, int] = {"float": kept_float} if kept_float else {}
    for module, name, entry in plan:
        install(module, name, entry, counts)
    model._gemv_pending = True
    return counts


def bind(model: Any) -> str | None:
    """Point every entry at its kernel (the GEMV module for one-part Q8_0/Q4_1, the
    block-type module for the rest). Entries no kernel serves here (no compiler, a kernel
    switched off, not on CPU) get their float weights made again from the blocks and run
    torch; returns that reason (None when every entry has its kernel)."""
    from engine.model.kernels import cpu_gemv

    entries = entries_of(model)
    on_cpu = model.embed_tokens.device.type == "cpu"
    wants_gemv = any(len(q.parts) == 1 and q.fmt in GEMV_FORMATS for _, _, q in entries)
    wants_quant = any(len(q.parts) > 1 or q.fmt not in GEMV_FORMATS for _, _, q in entries)
    gemv_kernel = cpu_gemv.load_kernel() if on_cpu and wants_gemv else None
    quant_kernel = None
    if on_cpu and wants_quant:
        from engine.model.kernels import cpu_quant

        quant_kernel = cpu_quant.load_kernel()
    bind_kernels([q for _, _, q in entries], gemv_kernel, quant_kernel)
    unbound = [(module, name, q) for module, name, q in entries if q.gemv is None]
    for module, name, q in unbound:
        q.max_rows = 0
        if holds_nothing(getattr(module, float_attr(model, module, name))):
            restore_float(model, module, name)
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
    for module, name, _ in entries_of(model):
        if holds_nothing(getattr(module, float_attr(model, module, name))):
            restore_float(model, module, name)
            restored += 1
    return restored
