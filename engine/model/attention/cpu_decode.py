"""C++ paged-attention kernels on CPU: pure-decode batches, and the prefill chunks of a step.

The torch backend gathers every sequence's whole context out of the paged
cache (``kv_cache[block_tables]``) in every layer and then runs SDPA over the
copy; with 16 sequences of 600 tokens that gather plus SDPA is ~60% of a decode
step. This kernel reads K and V in place through the block table, one
(sequence, KV head) pair per task on torch's intra-op thread pool, and never
copies the context. A sliding-window layer's call reads only the window's
positions (the older keys are never touched, not just masked).

``paged_prefill`` does the same for the prefill chunks of a step (causal within a chunk,
its cached context visible): all of them in one call, flash style, with no gathered copy
and no padded mask; the kernel plan (engine/model/plan/) times it against
torch's SDPA and picks it where it wins. ``paged_prefill_bf16`` is its twin with both products
on AVX512-BF16's vdpbf16ps over a bf16 cache (twice float32 FMA's work per instruction).

Quantized caches (engine/model/attention/kv_quant.py) are read in place too: int8 rows
are widened and multiplied by the fp32 scale stored right after them, fp8 bytes
go through a 256-entry table; the query and output stay in the model's dtype.
With one byte per element the kernel streams a quarter of fp32's K/V bytes.

The C++ is ``csrc/paged_attention.cpp`` (the kernels) and ``csrc/paged_attention_bindings.cpp``
(the entry points). It is compiled once per CPU type and torch version into kvscope's kernel cache
(:mod:`engine.model.kernels.build`, shared by every checkout and venv). When no compiler or ninja is
available, :func:`load_kernel` returns None and the torch path is used; the
reason is :func:`unavailable_reason`, for the startup event.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

from engine.model.attention.kv_quant import FP8_DTYPES
from engine.model.kernels.build import BuildReport, CachedKernel, KernelSpec

# The C++ lives beside this module (csrc/): the kernels (how a cache row widens, the decode kernels,
# the float32 and bf16 prefill kernels) and the torch-facing entry points.
_CSRC = Path(__file__).resolve().parent / "csrc"
_CPP_SOURCE = (_CSRC / "paged_attention.cpp").read_text() + (_CSRC / "paged_attention_bindings.cpp").read_text()

SPEC = KernelSpec(name="kvscope_cpu_decode", source=_CPP_SOURCE,
                  functions=("paged_decode", "paged_prefill", "paged_prefill_bf16", "has_bf16_dot"))

KERNEL = CachedKernel(SPEC, "KVSCOPE_CPU_DECODE_KERNEL")


def load_kernel(log: Callable[[str], None] | None = None) -> ModuleType | None:
    """The compiled module (with ``paged_decode``), or None when it cannot be built
    here or ``KVSCOPE_CPU_DECODE_KERNEL=0`` turns it off. Built once per CPU type
    and torch version into the shared kernel cache (engine/model/kernels/build.py)."""
    return KERNEL.get(log)


def unavailable_reason() -> str | None:
    """Why :func:`load_kernel` gave None (switched off, or the build's error)."""
    return KERNEL.unavailable_reason


_NO_TABLE = torch.empty(0)
_FP8_TABLES: dict[torch.dtype, torch.Tensor] = {}


def fp8_table(dtype: torch.dtype) -> torch.Tensor:
    """The float value of each of the 256 bytes of an fp8 ``dtype``: the kernel
    decodes fp8 by table lookup rather than bit manipulation per element."""
    if dtype not in _FP8_TABLES:
        _FP8_TABLES[dtype] = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    return _FP8_TABLES[dtype]


def _table_for(kv_dtype: torch.dtype) -> torch.Tensor:
    """The kernels' fp8 table argument: the cache dtype's table, empty for any other cache."""
    return fp8_table(kv_dtype) if kv_dtype in FP8_DTYPES else _NO_TABLE


def ensure_built(log: Callable[[str], None] | None = None) -> BuildReport | None:
    """Build or load the kernel now (startup's background thread, ``engine build-kernels``);
    None when it is switched off."""
    return KERNEL.ensure_built(log)


def paged_decode(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """Attention of one query row per sequence over its paged context (only its last
    ``sliding_window`` positions for a sliding-window layer). A float32 query, or any query
    over an int8/fp8 cache, keeps its dtype; another query is cast to the cache's dtype."""
    kernel = load_kernel()
    assert kernel is not None
    return kernel.paged_decode(query, kv_cache, block_tables, seq_lens, scale, _table_for(kv_cache.dtype),
                               sliding_window or 0)


# Head dims paged_prefill is compiled for (whole 16-float registers); other models use torch's SDPA.
PREFILL_HEAD_DIMS = (64, 128, 256)


def paged_prefill(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                  query_start: torch.Tensor, scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """Attention of each sequence's new rows (``query_start``: the S + 1 row offsets; a
    sequence's rows are the last of its ``seq_lens`` positions) over its paged context,
    causal, in one call for the whole step. Returns float32 ``[rows, heads, head_dim]``."""
    kernel = load_kernel()
    assert kernel is not None
    return kernel.paged_prefill(query, kv_cache, block_tables, seq_lens,
                                query_start, scale, _table_for(kv_cache.dtype), sliding_window or 0)


def bf16_prefill_available() -> bool:
    """Whether :func:`paged_prefill_bf16` runs here: the kernel is built, by a compiler that
    targets AVX512-BF16 (``-march=native`` on such a CPU)."""
    kernel = load_kernel()
    return kernel is not None and bool(kernel.has_bf16_dot())


def paged_prefill_bf16(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                       seq_lens: torch.Tensor, query_start: torch.Tensor, scale: float,
                       sliding_window: int | None = None) -> torch.Tensor:
    """:func:`paged_prefill` over a bf16 cache with q·K and p·V on vdpbf16ps: q and the softmax
    weights are rounded to bf16 (~2e-3 relative, like torch's bf16 flash SDPA), the sums stay
    float32. Returns float32 ``[rows, heads, head_dim]``."""
    kernel = load_kernel()
    assert kernel is not None
    return kernel.paged_prefill_bf16(query, kv_cache, block_tables, seq_lens,
                                     query_start, scale, sliding_window or 0)
