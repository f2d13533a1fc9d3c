"""Quantized KV cache formats (``--kv-cache-dtype int8 | fp8 | fp8_e4m3 | fp8_e5m2``).

Decode on CPU is bound by the bytes of K/V it streams per step, so storing the
cache in one byte per element cuts that traffic to a quarter of fp32 (half of
bf16) and lets the same pool hold 2-4x the tokens.

* ``int8``: symmetric, one fp32 scale per (token, KV head, K or V), computed from
  that row's own max |x| at write time. The scale is stored *inside* the cache
  tensor, in the 4 bytes after the row's ``head_dim`` int8 values, so a layer's
  cache stays one tensor ``[num_blocks, 2, block_size, num_kv_heads, head_dim + 4]``
  (int8): everything that moves a block id around (block tables, prefix
  caching, preemption) carries the scales with it, and the decode kernel reads
  each row and its scale from the same cache line. Error per element is at most
  half a step (``max|x| / 254``): ~1% relative on this model's K/V.
* ``fp8`` / ``fp8_e4m3`` / ``fp8_e5m2``: vLLM's formats with its default scale of
  1.0 (no scales stored: 1 byte per element exactly). Values are clamped to the
  format's finite range before the cast (torch's cast turns overflow into NaN).
  e4m3 has a 3-bit mantissa: ~2.6% relative error on SmolLM2's K/V (max |K| ~18,
  far below e4m3's 448); e5m2 trades one more bit of mantissa for range.

Everything here is plain torch, so the SDPA path works on any device; the CPU
decode kernel (engine/model/attention/cpu_decode.py) reads the same layouts in place.
"""

from __future__ import annotations

import torch

from engine.errors import UserError
from engine.modelspec.config import INT8_KV_SCALE_BYTES
from engine.modelspec.kv_cache_dtypes import KV_CACHE_DTYPES, check_kv_cache_dtype

# Names -> storage dtype, from the one --kv-cache-dtype table; "auto" (and nothing given) means the model's dtype.
_KV_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, entry.torch_name) for name, entry in KV_CACHE_DTYPES.items()}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
QUANTIZED_KV_DTYPES = (torch.int8, *FP8_DTYPES)
INT8_MAX = 127.0


def kv_cache_torch_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The storage dtype for ``--kv-cache-dtype name`` (``auto`` = the model's dtype)."""
    key = check_kv_cache_dtype(name)
    return model_dtype if key == "auto" else _KV_DTYPES[key]


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QUANTIZED_KV_DTYPES


def cache_row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements per (slot, KV head) row of the cache: ``head_dim``, plus the
    in-row fp32 scale for int8. Refuses int8 when ``head_dim`` is not a multiple
    of 4 (the scale would be misaligned)."""
    if dtype != torch.int8:
        return head_dim
    if head_dim % INT8_KV_SCALE_BYTES:
        raise UserError(f"--kv-cache-dtype int8 needs a head dim that is a multiple of 4, got {head_dim}")
    return head_dim + INT8_KV_SCALE_BYTES


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                   dtype: torch.dtype) -> tuple[int, int, int, int, int]:
    """One layer's cache shape for a storage dtype (see the module docstring)."""
    return (num_blocks, 2, block_size, num_kv_heads, cache_row_width(head_dim, dtype))


def quantize_int8_rows(x: torch.Tensor) -> torch.Tensor:
    """``[..., head_dim]`` float -> ``[..., head_dim + 4]`` int8: the rounded
    values over the row's scale ``max|x| / 127``, then that fp32 scale's bytes.
    An all-zero row gets scale 0 (and dequantizes to zeros)."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True) / INT8_MAX
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round(xf * inv).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return torch.cat([q, scale.view(torch.int8)], dim=-1)


def int8_rows_scale(packed: torch.Tensor) -> torch.Tensor:
    """The fp32 scales ``[..., 1]`` of packed int8 rows ``[..., head_dim + 4]`` (a view when aligned)."""
    tail = packed[..., -INT8_KV_SCALE_BYTES:]
    try:
        return tail.view(torch.float32)
    except RuntimeError:  # a slice whose strides are not multiples of 4 bytes
        return tail.contiguous().view(torch.float32)


def quantize_for_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` ``[..., head_dim]`` as it is stored in a cache of ``dtype``."""
    if dtype == torch.int8:
        return quantize_int8_rows(x)
    if dtype in FP8_DTYPES:
        limit = torch.finfo(dtype).max
        return x.float().clamp(-limit, limit).to(dtype)
    return x.to(dtype)


def dequantize_from_cache(stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows ``[..., width]`` (any storage dtype) -> ``[..., head_dim]`` in ``dtype``."""
    if stored.dtype == torch.int8:
        values = stored[..., :-INT8_KV_SCALE_BYTES].to(torch.float32) * int8_rows_scale(stored)
        return values.to(dtype)
    return stored.to(dtype)
