"""GGUF block-type matmul for CPU: ``y = x @ dequant(W).T`` straight from a GGUF tensor's bytes
(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, ggml's type ids as format codes), with the
activations rounded per 32 values to int8 (ggml's Q8_1: ``d = amax / 127``, the block's sum)
and integer dot products (``vpdpbusd`` on AVX-512 VNNI, ``maddubs``/``madd`` otherwise).

A weight ``[N out, K in]`` is ``uint8 [N, K / block_weights * block_bytes]``: each output row's
blocks in order, exactly the GGUF tensor's bytes. Per-32 activation scales fit every type (the
K-quants' sub-blocks are 32 or 16 weights), so one quantization of ``x`` serves a layer whose
parts have different types (:func:`quant_matmul_segments`, as Q4_K_M files mix Q4_K and Q6_K).

Layout of the quantized activations (``QuantActs`` in the C++): 32-blocks interleaved 4 bytes at
a time, so int32 lane l of a ``vpdpbusd`` belongs to block l % (blocks per group). On AVX-512 a
group is 8 blocks (256 values): every format unpacks 8 blocks of weights (one K-quant block, or 8
ggml blocks gathered with VBMI byte permutes) into the same order with a few shuffles, four 64-byte
``vpdpbusd`` fold into the 8 blocks' dots, and a row costs one float FMA per 8 blocks with the
weights' (sub)scales times the activation scales. AVX2 uses 4-block groups. The constant parts of
the weights (Q4_0's -8, Q5_0's -16, Q6_K's -32, Q8_0's +128 bias on VNNI, the Q4_1/Q5_1/K-quant
minimums) are one more FMA against the activations' per-block sums. A weight row streams once;
each group is unpacked once and multiplied into a tile of up to 8 (AVX-512) or 4 (AVX2)
activation rows; rows of ``W`` are split over torch's intra-op threads in big contiguous chunks
(``at::parallel_for``).

Builds: the engine compiles with ``-march=native``; ``KVSCOPE_CPU_QUANT_ISA`` = ``native``
(default) | ``avx512`` (no VNNI) | ``avx2`` | ``scalar`` loads the same source compiled with the
wider paths switched off (its own cache entry), so every path is built and tested on one
machine. ``KVSCOPE_CPU_QUANT_KERNEL=0`` switches the kernel off. The C++ core (``csrc/quant_core.cpp``, ``CORE_SOURCE``,
namespace ``kvscope_quant``) is meant to be #included by other kernels: ``quantize_acts`` and
``matmul_rows`` / ``matmul_range`` (the latter serial, for a caller's own parallel region).

Speed: ``python -m bench.bench_quant``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

import torch

from engine.model.kernels.build import BuildReport, CachedKernel, KernelSpec

KERNEL_ENV = "KVSCOPE_CPU_QUANT_KERNEL"
ISA_ENV = "KVSCOPE_CPU_QUANT_ISA"

# ggml's type ids (ggml.h's enum ggml_type), used as the format codes.
FORMAT_IDS = {"q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "q4_k": 12, "q5_k": 13, "q6_k": 14}
FORMAT_NAMES = {code: name for name, code in FORMAT_IDS.items()}
# (weights per block, bytes per block), as ggml-common.h's block structs.
_GEOMETRY = {2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 12: (256, 144), 13: (256, 176),
             14: (256, 210)}

# The C++ lives beside this module (csrc/): the core (namespace kvscope_quant: formats, activation
# quantization, the tiles) that other kernels #include, the torch-facing bindings, and the block
# weights interleaved by 16 rows for many-row GEMMs (x16, not part of the core).
_CSRC = Path(__file__).resolve().parent / "csrc"
CORE_SOURCE = (_CSRC / "quant_core.cpp").read_text()
SOURCE = CORE_SOURCE + (_CSRC / "quant_bindings.cpp").read_text() + (_CSRC / "quant_x16.cpp").read_text()
FUNCTIONS = ("quant_matmul", "quant_matmul_segments", "dequantize", "dequantize_rows", "quantize_activations", "isa",
             "pack_x16", "pack_x16_into", "dequantize_x16", "x16_matmul_segments", "x16_record_bytes",
             "x16_native")

# No -ffast-math: dequantize() is bit-exact with gguf-py only without reassociation or FMA contraction.
_BASE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-math-errno")
# Each build a separate cache entry; the narrower ones switch the wider paths off on this CPU.
ISA_FLAGS = {
    "native": _BASE_FLAGS,
    "avx512": (*_BASE_FLAGS, "-mno-avx512vnni"),
    "avx2": (*_BASE_FLAGS, "-mno-avx512f"),
    "scalar": (*_BASE_FLAGS, "-mno-avx512f", "-mno-avx2", "-mno-fma", "-mno-f16c"),
}
ISAS = tuple(ISA_FLAGS)

KERNELS = {isa: CachedKernel(KernelSpec(name="kvscope_cpu_quant" if isa == "native" else f"kvscope_cpu_quant_{isa}",
                                        source=SOURCE, functions=FUNCTIONS, cflags=flags), KERNEL_ENV)
           for isa, flags in ISA_FLAGS.items()}


def selected_isa() -> str:
    """``$KVSCOPE_CPU_QUANT_ISA`` (``native`` when unset); an unknown value is an error."""
    isa = os.environ.get(ISA_ENV, "native").strip().lower() or "native"
    if isa not in ISA_FLAGS:
        raise ValueError(f"{ISA_ENV}={isa!r}: expected one of {', '.join(ISAS)}")
    return isa


def load_kernel(isa: str | None = None, log: Callable[[str], None] | None = None) -> ModuleType | None:
    """The compiled module for ``isa`` (default :func:`selected_isa`), or None when it cannot be
    built here or ``KVSCOPE_CPU_QUANT_KERNEL=0`` turns it off (checked on every call)."""
    return KERNELS[isa or selected_isa()].get(log)


def unavailable_reason(isa: str | None = None) -> str | None:
    """Why :func:`load_kernel` gave None (switched off, or the build's error)."""
    return KERNELS[isa or selected_isa()].unavailable_reason


def ensure_built(log: Callable[[str], None] | None = None) -> BuildReport | None:
    """Build or load the selected build now (``engine build-kernels``); None when switched off."""
    return KERNELS[selected_isa()].ensure_built(log)


def format_id(fmt: int | str) -> int:
    """ggml's type id for ``fmt`` (``"q4_k"`` or 12)."""
    code = FORMAT_IDS.get(fmt.lower()) if isinstance(fmt, str) else fmt
    if code not in _GEOMETRY:
        raise ValueError(f"unknown block format {fmt!r}; known: {', '.join(FORMAT_IDS)}")
    return code


def block_geometry(fmt: int | str) -> tuple[int, int]:
    """(weights per block, bytes per block) of ``fmt``."""
    return _GEOMETRY[format_id(fmt)]


def row_bytes(fmt: int | str, in_features: int) -> int:
    """Bytes of one output row of ``in_features`` weights (a multiple of the block size)."""
    weights, nbytes = block_geometry(fmt)
    if in_features % weights:
        raise ValueError(f"{in_features} in-features is not a multiple of {FORMAT_NAMES[format_id(fmt)]}'s "
                         f"{weights}-weight blocks")
    return in_features // weights * nbytes


def _kernel(isa: str | None) -> ModuleType:
    kernel = load_kernel(isa)
    if kernel is None:
        raise RuntimeError(f"CPU quant kernel unavailable: {unavailable_reason(isa)}")
    return kernel


def quant_matmul(x: torch.Tensor, w: torch.Tensor, fmt: int | str, isa: str | None = None) -> torch.Tensor:
    """``x [M, K] @ dequant(w).T`` as float32 ``[M, N]``, ``x`` rounded per 32 values to int8."""
    return _kernel(isa).quant_matmul(x, w, format_id(fmt))


def quant_matmul_segments(x: torch.Tensor, ws: Sequence[torch.Tensor], fmts: Sequence[int | str],
                          isa: str | None = None, passes: int = 1) -> torch.Tensor:
    """Several weights sharing ``x`` (quantized once): float32 ``[M, sum N_i]``, outputs side by side.
    ``passes=2`` rounds what the int8 rounding left of ``x`` again and adds its products (~15-bit
    activations for a second activation row's integer work) when ``x`` is one row; more rows round once."""
    return _kernel(isa).quant_matmul_segments(x, list(ws), [format_id(f) for f in fmts], passes)


def dequantize(w: torch.Tensor, fmt: int | str, isa: str | None = None) -> torch.Tensor:
    """float32 ``[N, K]`` of ``fmt`` blocks (bit-exact with gguf-py's dequantize)."""
    return _kernel(isa).dequantize(w, format_id(fmt))


def dequantize_rows(w: torch.Tensor, fmt: int | str, rows: torch.Tensor, isa: str | None = None) -> torch.Tensor:
    """float32 ``rows.shape + [K]``: only the weight rows ``rows`` names (an embedding lookup)."""
    return _kernel(isa).dequantize_rows(w, format_id(fmt), rows)


def quantize_activations(x: torch.Tensor, isa: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """What the matmul multiplies: ``(q int8 [M, K], d float32 [M, K / 32])``, ``x ~ q * d``."""
    q, d = _kernel(isa).quantize_activations(x)
    return q, d


# ---------------------------------------------------------------------- x16: blocks by 16 rows
def pack_x16(w: torch.Tensor, fmt: int | str, isa: str | None = None) -> torch.Tensor:
    """A weight's blocks regrouped 16 output rows at a time, as int8 values with fp32 scales (and
    minimums), losslessly (csrc/quant_x16.cpp): ``uint8 [ceil(N / 16), K / 32, record bytes]``."""
    return _kernel(isa).pack_x16(w, format_id(fmt))


def x16_shape(rows: int, in_features: int, fmt: int | str, isa: str | None = None) -> tuple[int, int, int]:
    """The shape :func:`pack_x16` gives a weight of ``rows`` x ``in_features`` in ``fmt``."""
    return -(-rows // 16), in_features // 32, int(_kernel(isa).x16_record_bytes(format_id(fmt)))


def x16_matmul_segments(x: torch.Tensor, packs: Sequence[torch.Tensor], rows: Sequence[int],
                        fmts: Sequence[int | str], isa: str | None = None) -> torch.Tensor:
    """:func:`quant_matmul_segments` over packed weights (each ``rows[i]`` outputs in ``fmts[i]``):
    the same sums, ``x`` rounded per 32 values to int8, 16 outputs per integer dot product."""
    return _kernel(isa).x16_matmul_segments(x, list(packs), list(rows), [format_id(f) for f in fmts])


def dequantize_x16(packed: torch.Tensor, rows: int, fmt: int | str, isa: str | None = None) -> torch.Tensor:
    """float32 ``[N, K]`` of a packed weight (equal to :func:`dequantize` of the blocks it came from)."""
    return _kernel(isa).dequantize_x16(packed, rows, format_id(fmt))


def x16_native(isa: str | None = None) -> bool:
    """Whether this build multiplies x16 weights with vpdpbusd (AVX-512 VNNI); elsewhere it runs
    the scalar reference, which no plan should choose."""
    return bool(_kernel(isa).x16_native())
