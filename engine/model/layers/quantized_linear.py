"""One weight held as GGUF blocks, and how a step multiplies by it.

A projection of a GGUF model is held as the file's own blocks (Q4_0, Q4_1, Q5_0, Q5_1,
Q8_0, Q4_K, Q5_K, Q6_K), memory-mapped where no row moves: the bytes a decode step
streams are the file's, not a float32 copy of 4-8x the size. A fused projection (QKV,
gate/up) may mix types, as real Q4_K_M files do (Gemma 3 270M: Q and K in Q5_0, V in
Q8_0 on half its layers), so a :class:`QuantizedLinear` is a list of row parts, each in
its own format; the kernel quantizes the activations once per step and writes every
part's rows side by side (:mod:`engine.model.kernels.cpu_quant`).

The type owns its three ways to run:

* ``matmul(x)``: the bound kernel (the GEMV over the blocks, int8 activations);
* ``dequantize()`` / ``dequantize_rows(ids)``: float32 values, exactly the file's (the
  reference, the float copy a kernel plan may choose, the embedding rows a step reads);
* no kernel (no compiler, ``KVSCOPE_CPU_QUANT_KERNEL=0``): the model makes its float
  weights again from ``dequantize()`` and runs torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType

import numpy as np
import torch

from engine.model.kernels.cpu_quant import FORMAT_IDS, block_geometry

X8_ROWS = 8  # rows the q4_1x8 layout interleaves (engine/model/kernels/cpu_gemv.py)

# Block formats by name: (ggml type id, weights a block, bytes a block), the kernel module's facts.
# "q4_1x8" is the Q4_1 blocks of 8 rows interleaved at load (engine/model/kernels/cpu_gemv.py), same bytes.
BLOCK_FORMATS: dict[str, tuple[int, int, int]] = {
    **{name: (code, *block_geometry(code)) for name, code in FORMAT_IDS.items()},
    "q4_1x8": (FORMAT_IDS["q4_1"], *block_geometry("q4_1")),
}
# ggml type id -> format name, for the formats a GGUF tensor can be read in as it is.
FORMAT_OF_GGML_TYPE = {ggml_id: name for name, (ggml_id, _, _) in BLOCK_FORMATS.items() if name != "q4_1x8"}
# The formats the original GEMV module multiplies (float or int8 activations, a fused-layer code each).
GEMV_FORMATS = frozenset({"q8_0", "q4_1", "q4_1x8"})


def row_bytes(fmt: str, in_features: int) -> int:
    """Bytes of one output row of ``in_features`` weights in ``fmt``."""
    _, per_block, size = BLOCK_FORMATS[fmt]
    return in_features // per_block * size


def fits(fmt: str, in_features: int) -> bool:
    """Whether a row of ``in_features`` weights is whole blocks of ``fmt``."""
    return fmt in BLOCK_FORMATS and in_features % BLOCK_FORMATS[fmt][1] == 0


@dataclass(slots=True)
class BlockPart:
    """Consecutive output rows of a weight in one format: ``uint8 [rows, row bytes]``."""

    fmt: str
    blocks: torch.Tensor

    @property
    def rows(self) -> int:
        return int(self.blocks.shape[0])


def dequantize_part(part: BlockPart, in_features: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """float32 ``[rows, in]`` of ``part`` (the rows ``rows`` selects, or all): the file's
    values exactly. The C++ kernel where built, else gguf's numpy reference."""
    blocks = part.blocks if rows is None else part.blocks.index_select(0, rows)
    if part.fmt in GEMV_FORMATS:
        from engine.model.kernels.cpu_gemv import dequantize

        return dequantize(blocks, part.fmt)
    from engine.model.kernels import cpu_quant

    kernel = cpu_quant.load_kernel()
    if kernel is not None:
        return kernel.dequantize(blocks.contiguous(), BLOCK_FORMATS[part.fmt][0])
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    values = gguf_dequantize(blocks.contiguous().numpy(), GGMLQuantizationType(BLOCK_FORMATS[part.fmt][0]))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(blocks.shape[0], in_features)


@dataclass(slots=True)
class QuantizedLinear:
    """A weight ``[out, in]`` as block parts (in row order) and how a step multiplies by it
    once the kernel is bound (``gemv``: ``x [rows, in] -> float32 [rows, out]``)."""

    parts: tuple[BlockPart, ...]
    in_features: int
    source: str  # "gguf" (the file's own blocks) | "packed" (quantized from floats here)
    max_rows: int = 0  # steps of at most this many tokens use ``gemv``; 0: always the float weights
    gemv: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None, repr=False)
    kernels: tuple[ModuleType | None, ModuleType | None] = field(default=(None, None), repr=False)  # (GEMV, block-type) bound with
    # int8 roundings of the input on the block-type kernel: 2 rounds the remainder again on one-row
    # steps (a family's choice for a projection whose inputs carry outliers: Gemma 3's down projection)
    activation_passes: int = 1

    @classmethod
    def single(cls, blocks: torch.Tensor, fmt: str, source: str, in_features: int | None = None) -> QuantizedLinear:
        """One format throughout (``in_features`` read from the row width when omitted)."""
        if in_features is None:
            _, per_block, size = BLOCK_FORMATS[fmt]
            in_features = int(blocks.shape[1]) // size * per_block
        return cls((BlockPart(fmt, blocks),), in_features, source)

    @property
    def fmt(self) -> str:
        """The format, or ``"mixed"`` when the parts differ."""
        formats = {p.fmt for p in self.parts}
        return formats.pop() if len(formats) == 1 else "mixed"

    @property
    def formats(self) -> tuple[str, ...]:
        return tuple(p.fmt for p in self.parts)

    @property
    def blocks(self) -> torch.Tensor:
        """The blocks of a one-part weight (the GEMV module's and the fused layer's input)."""
        if len(self.parts) != 1:
            raise ValueError(f"a weight of {len(self.parts)} parts ({', '.join(self.formats)}) has no single block tensor")
        return self.parts[0].blocks

    @property
    def out_features(self) -> int:
        return sum(p.rows for p in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(p.blocks.numel() for p in self.parts)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` in float32 through the bound kernel."""
        assert self.gemv is not None, "QuantizedLinear.matmul before a kernel was bound"
        return self.gemv(x)

    def first_rows(self, rows: int) -> QuantizedLinear:
        """The weight's first ``rows`` output rows (the kernel plan times a slice)."""
        parts, left = [], rows
        for part in self.parts:
            if left <= 0:
                break
            parts.append(BlockPart(part.fmt, part.blocks[:left]))
            left -= part.rows
        return QuantizedLinear(tuple(parts), self.in_features, self.source, self.max_rows, None,
                               activation_passes=self.activation_passes)

    def bind_like(self, other: QuantizedLinear) -> None:
        """Bind to the kernels ``other`` was bound with (a slice of it, timed by the plan)."""
        if other.gemv is not None:
            bind_kernels([self], *other.kernels)

    def dequantize(self) -> torch.Tensor:
        """float32 ``[out, in]``: the blocks' values exactly."""
        return torch.cat([dequantize_part(p, self.in_features) for p in self.parts])

    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 ``[len(ids), in]`` of the rows ``ids`` (an embedding lookup): only those
        rows are read. A one-part weight only (an embedding is one tensor)."""
        flat = ids.reshape(-1).to(torch.int64)
        if len(self.parts) > 1:
            out = self.dequantize().index_select(0, flat)
        elif self.parts[0].fmt == "q4_1x8":  # rows interleaved by 8: their whole groups, then the rows
            groups, where = torch.unique(flat // X8_ROWS, return_inverse=True)
            rows = (groups[:, None] * X8_ROWS + torch.arange(X8_ROWS)).reshape(-1)
            out = dequantize_part(self.parts[0], self.in_features, rows)[where * X8_ROWS + flat % X8_ROWS]
        else:
            out = dequantize_part(self.parts[0], self.in_features, flat)
        return out.reshape(*ids.shape, self.in_features)


def bind_kernels(entries: Sequence[QuantizedLinear], gemv_kernel: ModuleType | None,
                 quant_kernel: ModuleType | None) -> list[str]:
    """Point each entry at its kernel: the GEMV module's for a one-part Q8_0/Q4_1/q4_1x8
    weight, the block-type module's for the rest. Returns why entries stay unbound (no
    kernel for their formats): those run their float weights."""
    missing: list[str] = []
    for q in entries:
        q.gemv, q.kernels = None, (gemv_kernel, quant_kernel)
        if len(q.parts) == 1 and q.fmt in GEMV_FORMATS and gemv_kernel is not None:
            fn, blocks = getattr(gemv_kernel, f"gemv_{q.fmt}"), q.blocks
            # Float activations here: int8 ones (llama.cpp's Q8 x Q4 dot) measured no faster for these.
            q.gemv = lambda x, fn=fn, blocks=blocks: fn(x, blocks, 0)
        elif quant_kernel is not None and all(p.fmt != "q4_1x8" for p in q.parts):
            q.gemv = _segments_call(quant_kernel, q)
        else:
            missing.append("/".join(sorted(set(q.formats))))
    return sorted(set(missing))


def _segments_call(kernel: ModuleType, q: QuantizedLinear) -> Callable[[torch.Tensor], torch.Tensor]:
    codes = [BLOCK_FORMATS[p.fmt][0] for p in q.parts]
    blocks = [p.blocks for p in q.parts]
    if len(blocks) == 1 and q.activation_passes == 1:
        fn1, w, code = kernel.quant_matmul, blocks[0], codes[0]
        return lambda x: fn1(x, w, code)
    fn, passes = kernel.quant_matmul_segments, q.activation_passes
    return lambda x: fn(x, blocks, codes, passes)
