"""The Triton attention backend: the AttentionBackend protocol over the kernels
in triton_kernels.py. Runs natively on CUDA, or on CPU tensors under the Triton
interpreter (TRITON_INTERPRET=1, set before triton is first imported).

Kernel choice per call: a decode-only batch whose longest context reaches
``split_k_min_seq_len`` uses the split-K (flash-decoding) pair, so a few long
sequences still spread over many programs; everything else (prefill chunks,
mixed batches, short decodes) uses the single paged-attention kernel.
"""

from __future__ import annotations

import torch
import triton

from engine.errors import UserError
from engine.model.attention.base import AttentionMetadata
from engine.model.attention.kv_quant import is_quantized
from engine.model.attention.triton_kernels import (
    NO_WINDOW,
    kernels_interpreted,
    paged_attention_kernel,
    paged_decode_split_kernel,
    reduce_decode_splits_kernel,
    reshape_and_cache_kernel,
)

LOG2_E = 1.4426950408889634
# Rows per prefill tile (query tokens x heads of one KV group); 64 keeps a tile
# in registers for head_dim 128 on current GPUs.
PREFILL_TILE_ROWS = 64
# tl.dot needs at least 16 rows, columns and inner size on NVIDIA GPUs.
MIN_DOT_SIZE = 16


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _cache_strides(kv_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Strides of (block, K/V, slot, kv head); head_dim must be unit-stride."""
    if kv_cache.dim() != 5 or kv_cache.stride(-1) != 1:
        raise ValueError(
            "kv_cache must be [num_blocks, 2, block_size, num_kv_heads, head_dim] with a contiguous head_dim, "
            f"got shape {tuple(kv_cache.shape)} strides {kv_cache.stride()}"
        )
    return kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3)


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


class TritonAttentionBackend:
    """AttentionBackend on Triton kernels.

    ``split_k_min_seq_len``: decode-only batches whose ``max_seq_len`` is at least
    this use split-K; ``num_splits``: how many KV partitions split-K uses (fixed,
    so one compiled kernel and CUDA-graph-friendly workspace shapes).
    """

    name = "triton"

    def __init__(self, split_k_min_seq_len: int = 1024, num_splits: int = 8) -> None:
        if num_splits < 1:
            raise UserError(f"num_splits must be >= 1, got {num_splits}")
        self.split_k_min_seq_len = split_k_min_seq_len
        self.num_splits = num_splits
        # On a GPU the dots take native fp16/bf16 operands; the interpreter's bf16 dot is wrong.
        self.upcast_dots = kernels_interpreted()

    def check_kv_cache_dtype(self, dtype: torch.dtype) -> None:
        """The Triton kernels read and write fp32/fp16/bf16 caches only; int8's in-row
        scales and fp8 are implemented by the torch backend (CPU decode kernel)."""
        if is_quantized(dtype):
            raise UserError(
                f"--kv-cache-dtype {str(dtype).removeprefix('torch.')} is not supported by the Triton attention "
                "backend; use --kv-cache-dtype auto/bfloat16/float16, or --attention-backend torch (dequantizes in torch)"
            )

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        self.check_kv_cache_dtype(kv_cache.dtype)
        num_tokens, num_kv_heads, head_dim = key.shape
        if num_tokens == 0:
            return
        key, value = _unit_last_stride(key), _unit_last_stride(value)
        stride_block, stride_kv, stride_slot, stride_head = _cache_strides(kv_cache)
        reshape_and_cache_kernel[(num_tokens,)](
            key,
            value,
            kv_cache,
            slot_mapping,
            key.stride(0),
            key.stride(1),
            value.stride(0),
            value.stride(1),
            stride_block,
            stride_kv,
            stride_slot,
            stride_head,
            num_kv_heads,
            head_dim,
            kv_cache.shape[2],
            HEADS_PADDED=_next_pow2(num_kv_heads),
            HEAD_DIM_PADDED=_next_pow2(head_dim),
        )

    def uses_split_k(self, meta: AttentionMetadata) -> bool:
        return meta.is_pure_decode and meta.max_seq_len >= self.split_k_min_seq_len and self.num_splits > 1

    def forward(
        self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        num_tokens, num_heads = query.shape[0], query.shape[1]
        out = torch.empty_like(query)
        if num_tokens == 0 or meta.num_seqs == 0:
            return out
        block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
        if block_size < MIN_DOT_SIZE or block_size & (block_size - 1):
            raise UserError(
                f"the Triton backend needs a power-of-two block size >= {MIN_DOT_SIZE}, got {block_size}; "
                "pass --block-size 16 or 32"
            )
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        query = _unit_last_stride(query)
        window = sliding_window or NO_WINDOW
        if self.uses_split_k(meta):
            self._decode_split_k(out, query, kv_cache, meta, scale, window)
        else:
            self._paged_attention(out, query, kv_cache, meta, scale, window)
        return out

    def _paged_attention(
        self,
        out: torch.Tensor,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int = NO_WINDOW,
    ) -> None:
        num_heads, head_dim = query.shape[1], query.shape[2]
        block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
        queries_per_kv = num_heads // num_kv_heads
        # Decodes: one token per tile. Prefill: as many tokens as fill the tile's rows.
        block_q = 1 if meta.is_pure_decode else max(1, PREFILL_TILE_ROWS // queries_per_kv)
        block_m = max(MIN_DOT_SIZE, _next_pow2(block_q * queries_per_kv))
        grid = (meta.num_seqs, num_kv_heads, triton.cdiv(meta.max_query_len, block_q))
        stride_block, stride_kv, stride_slot, stride_head = _cache_strides(kv_cache)
        paged_attention_kernel[grid](
            out,
            query,
            kv_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            query.stride(0),
            query.stride(1),
            out.stride(0),
            out.stride(1),
            meta.block_tables.stride(0),
            stride_block,
            stride_kv,
            stride_slot,
            stride_head,
            scale * LOG2_E,
            head_dim,
            window,
            QUERIES_PER_KV=queries_per_kv,
            BLOCK_Q=block_q,
            BLOCK_M=block_m,
            BLOCK_SIZE=block_size,
            HEAD_DIM_PADDED=_next_pow2(head_dim),
            UPCAST=self.upcast_dots,
        )

    def _decode_split_k(
        self,
        out: torch.Tensor,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int = NO_WINDOW,
    ) -> None:
        num_heads, head_dim = query.shape[1], query.shape[2]
        block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
        queries_per_kv = num_heads // num_kv_heads
        num_seqs = meta.num_seqs
        partial_out = torch.empty(
            (num_seqs, num_heads, self.num_splits, head_dim), dtype=torch.float32, device=query.device
        )
        partial_lse = torch.empty(
            (num_seqs, num_heads, self.num_splits), dtype=torch.float32, device=query.device
        )
        stride_block, stride_kv, stride_slot, stride_head = _cache_strides(kv_cache)
        head_dim_padded = _next_pow2(head_dim)
        paged_decode_split_kernel[(num_seqs, num_kv_heads, self.num_splits)](
            partial_out,
            partial_lse,
            query,
            kv_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            query.stride(0),
            query.stride(1),
            meta.block_tables.stride(0),
            stride_block,
            stride_kv,
            stride_slot,
            stride_head,
            scale * LOG2_E,
            head_dim,
            num_heads,
            window,
            QUERIES_PER_KV=queries_per_kv,
            BLOCK_M=max(MIN_DOT_SIZE, _next_pow2(queries_per_kv)),
            NUM_SPLITS=self.num_splits,
            BLOCK_SIZE=block_size,
            HEAD_DIM_PADDED=head_dim_padded,
            UPCAST=self.upcast_dots,
        )
        reduce_decode_splits_kernel[(num_seqs, num_heads)](
            out,
            partial_out,
            partial_lse,
            meta.query_start_loc,
            out.stride(0),
            out.stride(1),
            head_dim,
            num_heads,
            NUM_SPLITS=self.num_splits,
            SPLITS_PADDED=_next_pow2(self.num_splits),
            HEAD_DIM_PADDED=head_dim_padded,
        )
