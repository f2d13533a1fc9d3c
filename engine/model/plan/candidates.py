"""The candidates that multiply one projection: which ones this weight and this CPU have
(``candidates_for``), each made into a call with the copies it keeps (``implementation``), and
oneDNN's packed linear that the ``fp32pack`` and ``bf16`` candidates run."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.model.plan.kernel_plan import CANDIDATES

if TYPE_CHECKING:  # torch is imported where it runs: ``engine plan`` reads the switch and stored plans without it
    import torch

# The copies a plan's candidates keep, registered as ``<projection>_<suffix>`` buffers: bf16 (dense,
# only where this torch has no oneDNN linear), the oneDNN-packed bf16 copy, the float32 weight packed
# likewise, the int8 weights and their scales, the blocks regrouped by 16 rows (x16).
PLAN_COPY_SUFFIXES = ("bf16", "bf16_packed", "fp32_packed", "int8pack", "int8pack_scale", "x16")
# Candidates that multiply the GGUF's blocks (or a lossless regrouping of them), never the float
# weight: their reference is the blocks' own values, and they need no float copy held.
BLOCK_CANDIDATES = frozenset({"gemv", "x16"})


@dataclass(slots=True)
class Implementation:
    """One candidate for one weight: the call, and the tensors it keeps (bf16 or int8 copies)."""

    call: Callable[[torch.Tensor], torch.Tensor]
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    # A candidate that computes in another dtype (bf16): the call without its cast back, and that
    # dtype, so the next op can take the output as it is (engine/model/families/llama.py mlp_block).
    native: Callable[[torch.Tensor], torch.Tensor] | None = None
    computes_in: torch.dtype | None = None


def candidates_for(weight: torch.Tensor, quantized: Any, gemv_kernel: Any, native_bf16: bool,
                   group: str, approximate: bool = True) -> list[str]:
    """The candidates this weight can run here (``quantized``: its QuantizedLinear or None).
    ``approximate`` (``--dtype auto``) adds those that round the weights further (bf16, int8);
    a dtype given by flag keeps to its own precision: the GEMV over the file's blocks and torch."""
    import torch

    out = []
    if quantized is not None and quantized.gemv is not None:
        out.append("gemv")
        if "q4_1x8" not in quantized.formats and x16_fast():
            out.append("x16")
        if weight.dtype == torch.float32 and group != "head":
            out.append("dequant")  # no float copy held: the blocks widened each call, then one GEMM
    out.append("torch")
    if weight.dtype == torch.float32 and mkldnn_linear_available():
        out.append("fp32pack")
    if approximate and weight.dtype == torch.float32 and native_bf16 and group != "head":
        out.append("bf16")
    if approximate and weight.dtype == torch.float32 and hasattr(torch, "_weight_int8pack_mm"):
        out.append("int8pack")
    return out


def implementation(candidate: str, weight: torch.Tensor, quantized: Any, gemv_kernel: Any,
                   group: str = "") -> Implementation:
    """``candidate`` for ``weight`` (``[out, in]``), copies made now. The LM head's (``group``
    "head") take float32 rows and sum and return float32 in every dtype mode: its ``torch``
    widens a bf16 weight slice by slice (engine/model/layers/projection_linear.py fp32_linear), never rounding logits to bf16."""
    import torch
    import torch.nn.functional as F

    if candidate == "gemv":
        return Implementation(quantized.matmul)
    if candidate == "x16":
        return _x16_implementation(quantized)
    if candidate == "dequant":
        return Implementation(lambda x: F.linear(x, quantized.dequantize().to(x.dtype)))
    if candidate == "torch":
        if group == "head":
            from engine.model.layers.projection_linear import fp32_linear

            return Implementation(lambda x: fp32_linear(x, weight))
        return Implementation(lambda x: F.linear(x, weight))
    if candidate == "fp32pack":
        packed32 = pack_for_mkldnn(weight.float().contiguous())
        assert packed32 is not None, "fp32pack is a candidate only where oneDNN's linear is available"
        return Implementation(_packed_linear(packed32, torch.float32), {"fp32_packed": packed32})
    if candidate == "bf16":
        w16 = weight.to(torch.bfloat16).contiguous()
        packed = pack_for_mkldnn(w16)
        if packed is None:
            def dense(x: torch.Tensor) -> torch.Tensor:
                return F.linear(x.to(torch.bfloat16), w16)

            return Implementation(lambda x: dense(x).to(x.dtype), {"bf16": w16}, dense, torch.bfloat16)
        native = _packed_linear(packed, torch.bfloat16, cast_back=False)
        return Implementation(_packed_linear(packed, torch.bfloat16), {"bf16_packed": packed}, native, torch.bfloat16)
    if candidate == "int8pack":
        scale = (weight.float().abs().amax(dim=1) / 127.0).clamp_min(1e-12)
        q = torch.round(weight.float() / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        dtype = weight.dtype
        return Implementation(lambda x: torch._weight_int8pack_mm(x.to(dtype), q, scale.to(dtype)),
                              {"int8pack": q, "int8pack_scale": scale.to(dtype)})
    raise ValueError(f"kernel plan: unknown candidate {candidate!r} (known: {', '.join(CANDIDATES)})")


def x16_fast() -> bool:
    """Whether the block-type kernel is built here with its vpdpbusd x16 path."""
    from engine.model.kernels import cpu_quant

    kernel = cpu_quant.load_kernel()
    return kernel is not None and bool(kernel.x16_native())


def _x16_implementation(quantized: Any) -> Implementation:
    """The parts' records packed into one held buffer, each part a view of its slice."""
    import math

    import torch

    from engine.model.kernels import cpu_quant

    kernel = cpu_quant.load_kernel()
    assert kernel is not None, "x16 is a candidate only where the block-type kernel is built"
    codes = [cpu_quant.format_id(p.fmt) for p in quantized.parts]
    shapes = [cpu_quant.x16_shape(p.rows, quantized.in_features, code) for p, code in zip(quantized.parts, codes,
                                                                                          strict=True)]
    sizes = [math.prod(shape) for shape in shapes]
    held = torch.empty(sum(sizes), dtype=torch.uint8)
    packs = [piece.view(shape) for piece, shape in zip(held.split(sizes), shapes, strict=True)]
    for part, code, pack in zip(quantized.parts, codes, packs, strict=True):
        kernel.pack_x16_into(part.blocks, code, pack)
    rows, matmul = [p.rows for p in quantized.parts], kernel.x16_matmul_segments
    return Implementation(lambda x: matmul(x, packs, rows, codes), {"x16": held})


def pack_for_mkldnn(weight: torch.Tensor) -> torch.Tensor | None:
    """A bf16 or float32 ``weight`` reordered once into oneDNN's blocked layout for its linear, or
    None where this torch has no oneDNN linear. ``F.linear`` reorders (or MKL packs) the weight on
    every call: prepacked, a bf16 projection ran 15-30 % faster at 8-256 rows (SmolLM2's 3072x576
    and 576x1536), and the float32 LM head (49152x576) 3.5x faster at 16 rows (7 against 25 ms),
    on 2 Zen 4 cores (AVX512-BF16); a bf16 copy gives the same output bits as F.linear."""
    import torch

    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, 256)  # type: ignore[no-any-return]
    except (AttributeError, RuntimeError):
        return None


def _packed_linear(packed: torch.Tensor, dtype: torch.dtype,
                   cast_back: bool = True) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x @ W.T`` over a :func:`pack_for_mkldnn` weight of ``dtype``, rows cast to it (and the
    output back to the rows' dtype unless ``cast_back`` is False)."""
    import torch

    linear = torch.ops.mkldnn._linear_pointwise
    if not cast_back:
        return lambda x: linear(x.to(dtype), packed, None, "none", [], "")
    return lambda x: linear(x.to(dtype), packed, None, "none", [], "").to(x.dtype)


@functools.cache
def mkldnn_linear_available() -> bool:
    """Whether this torch packs and runs oneDNN's linear (the CPU wheels do)."""
    import torch

    probe = pack_for_mkldnn(torch.ones(8, 8))
    if probe is None:
        return False
    try:
        torch.ops.mkldnn._linear_pointwise(torch.ones(1, 8), probe, None, "none", [], "")
    except RuntimeError:
        return False
    return True


def mkldnn_bf16_pack_available() -> bool:
    """Whether oneDNN packs a bf16 weight here: it needs AVX512-BW/VL/DQ or AVX-NE-CONVERT, so on
    AVX2 the bf16 candidate keeps a dense bf16 copy (``bf16``) instead of a packed one."""
    import torch

    return pack_for_mkldnn(torch.ones(8, 8, dtype=torch.bfloat16)) is not None

