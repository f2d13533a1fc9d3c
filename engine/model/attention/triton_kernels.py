"""Triton kernels for the paged KV cache: writing new K/V, attention over a mixed
prefill/decode batch, and a split-K (flash-decoding) variant for long decodes.

Layouts follow engine/model/attention/base.py: the cache of one layer is
``[num_blocks, 2, block_size, num_kv_heads, head_dim]``; queries, keys and values
are ``[num_tokens, heads, head_dim]`` with a unit stride on ``head_dim``.

GQA is handled by packing the ``queries_per_kv`` query heads that share one KV
head into the rows of a tile, so each K/V block is loaded once per group and the
tile is tall enough for ``tl.dot`` (at least 16 rows) even for a single decode
token. Softmax runs online in base 2 (``exp2`` with the scale premultiplied by
log2(e)) and accumulates in fp32.

``UPCAST`` casts q/k/v to fp32 before ``tl.dot``: the Triton interpreter
computes bf16 dots wrongly, so under TRITON_INTERPRET=1 every dot runs in fp32;
on a GPU the dots take the native fp16/bf16 operands with fp32 accumulation.
"""

from __future__ import annotations

import triton
import triton.language as tl

# The ``window`` of full attention: wider than any context.
NO_WINDOW = 1 << 30


@triton.jit
def reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    kv_cache_ptr,
    slot_mapping_ptr,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_cache_block,
    stride_cache_kv,
    stride_cache_slot,
    stride_cache_head,
    num_kv_heads,
    head_dim,
    block_size,
    HEADS_PADDED: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
):
    """One program per token: copy its K and V (all KV heads) into the cache slot
    ``slot_mapping[token]``; a slot of -1 (padding) writes nothing."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    block = slot // block_size
    offset = slot % block_size

    offs_head = tl.arange(0, HEADS_PADDED)
    offs_dim = tl.arange(0, HEAD_DIM_PADDED)
    # The slot test is broadcast to a vector: the interpreter rejects a scalar bool inside a mask.
    write_head = (offs_head < num_kv_heads) & (offs_head * 0 + slot >= 0)
    mask = write_head[:, None] & (offs_dim < head_dim)[None, :]

    key = tl.load(
        key_ptr + token * stride_key_token + offs_head[:, None] * stride_key_head + offs_dim[None, :],
        mask=mask,
    )
    value = tl.load(
        value_ptr + token * stride_value_token + offs_head[:, None] * stride_value_head + offs_dim[None, :],
        mask=mask,
    )
    dest = (
        kv_cache_ptr
        + block * stride_cache_block
        + offset * stride_cache_slot
        + offs_head[:, None] * stride_cache_head
        + offs_dim[None, :]
    )
    tl.store(dest, key.to(kv_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dest + stride_cache_kv, value.to(kv_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _attend_kv_blocks(
    acc,
    row_max,
    row_sum,
    query,
    kv_cache_ptr,
    block_table_row_ptr,
    kv_head,
    query_pos,
    seq_len,
    window,
    block_lo,
    block_hi,
    stride_cache_block,
    stride_cache_kv,
    stride_cache_slot,
    stride_cache_head,
    qk_scale_log2,
    offs_dim,
    dim_mask,
    BLOCK_SIZE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Online-softmax attention of the query tile over logical KV blocks
    ``[block_lo, block_hi)`` of one sequence. A key at position ``p`` is visible
    to a row whose query sits at ``query_pos`` when ``query_pos - window < p <= query_pos``
    (causal, and within a sliding window; ``window`` is NO_WINDOW for full attention;
    padded rows carry ``query_pos = -1`` and see nothing)."""
    offs_slot = tl.arange(0, BLOCK_SIZE)
    kv_offsets = offs_slot[:, None] * stride_cache_slot + offs_dim[None, :]
    for logical_block in range(block_lo, block_hi):
        physical_block = tl.load(block_table_row_ptr + logical_block).to(tl.int64)
        key_pos = logical_block * BLOCK_SIZE + offs_slot
        in_seq = key_pos < seq_len
        block_base = kv_cache_ptr + physical_block * stride_cache_block + kv_head * stride_cache_head
        kv_mask = in_seq[:, None] & dim_mask[None, :]
        key = tl.load(block_base + kv_offsets, mask=kv_mask, other=0.0)
        value = tl.load(block_base + stride_cache_kv + kv_offsets, mask=kv_mask, other=0.0)
        if UPCAST:
            key = key.to(tl.float32)
            value = value.to(tl.float32)

        scores = tl.dot(query, tl.trans(key), input_precision="ieee") * qk_scale_log2
        visible = ((key_pos[None, :] <= query_pos[:, None]) & (key_pos[None, :] > query_pos[:, None] - window)
                   & in_seq[None, :])
        scores = tl.where(visible, scores, float("-inf"))

        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        # A row that has seen no visible key keeps max -inf; shift by 0 so it stays 0, not NaN.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        rescale = tl.exp2(row_max - shift)
        probs = tl.exp2(scores - shift[:, None])
        row_sum = row_sum * rescale + tl.sum(probs, axis=1)
        acc = acc * rescale[:, None] + tl.dot(probs.to(value.dtype), value, input_precision="ieee")
        row_max = new_max
    return acc, row_max, row_sum


@triton.jit
def paged_attention_kernel(
    out_ptr,
    query_ptr,
    kv_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    stride_query_token,
    stride_query_head,
    stride_out_token,
    stride_out_head,
    stride_block_table_seq,
    stride_cache_block,
    stride_cache_kv,
    stride_cache_slot,
    stride_cache_head,
    qk_scale_log2,
    head_dim,
    window,
    QUERIES_PER_KV: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Grid ``(num_seqs, num_kv_heads, cdiv(max_query_len, BLOCK_Q))``. Each
    program takes ``BLOCK_Q`` query tokens of one sequence times the
    ``QUERIES_PER_KV`` heads of one KV group (row ``r`` = token ``r // G``, head
    ``r % G``) and attends to the sequence's cached context plus its own chunk."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_block = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        context_len = seq_len - q_len

        offs_row = tl.arange(0, BLOCK_M)
        offs_dim = tl.arange(0, HEAD_DIM_PADDED)
        dim_mask = offs_dim < head_dim
        q_index = q_block * BLOCK_Q + offs_row // QUERIES_PER_KV
        head = kv_head * QUERIES_PER_KV + offs_row % QUERIES_PER_KV
        row_valid = (offs_row < BLOCK_Q * QUERIES_PER_KV) & (q_index < q_len)
        query_pos = tl.where(row_valid, context_len + q_index, -1)
        token = (q_start + q_index).to(tl.int64)

        tile_mask = row_valid[:, None] & dim_mask[None, :]
        query = tl.load(
            query_ptr
            + token[:, None] * stride_query_token
            + head[:, None] * stride_query_head
            + offs_dim[None, :],
            mask=tile_mask,
            other=0.0,
        )
        if UPCAST:
            query = query.to(tl.float32)

        acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], dtype=tl.float32)
        row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
        # Causality bounds the blocks: the last row of this tile sees up to its own position.
        last_pos = context_len + tl.minimum(q_len, (q_block + 1) * BLOCK_Q) - 1
        block_hi = last_pos // BLOCK_SIZE + 1
        acc, row_max, row_sum = _attend_kv_blocks(
            acc,
            row_max,
            row_sum,
            query,
            kv_cache_ptr,
            block_tables_ptr + seq.to(tl.int64) * stride_block_table_seq,
            kv_head,
            query_pos,
            seq_len,
            window,
            0,
            block_hi,
            stride_cache_block,
            stride_cache_kv,
            stride_cache_slot,
            stride_cache_head,
            qk_scale_log2,
            offs_dim,
            dim_mask,
            BLOCK_SIZE,
            UPCAST,
        )
        row_sum = tl.where(row_sum == 0.0, 1.0, row_sum)
        out = acc / row_sum[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_out_token + head[:, None] * stride_out_head + offs_dim[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=tile_mask,
        )


@triton.jit
def paged_decode_split_kernel(
    partial_out_ptr,
    partial_lse_ptr,
    query_ptr,
    kv_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    stride_query_token,
    stride_query_head,
    stride_block_table_seq,
    stride_cache_block,
    stride_cache_kv,
    stride_cache_slot,
    stride_cache_head,
    qk_scale_log2,
    head_dim,
    num_heads,
    window,
    QUERIES_PER_KV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Flash-decoding, first pass. Grid ``(num_seqs, num_kv_heads, NUM_SPLITS)``;
    every sequence has exactly one query token (its last position). Split ``s``
    covers an equal share of the sequence's KV blocks and writes its normalised
    partial output to ``partial_out[seq, head, s]`` and its log2-sum-exp to
    ``partial_lse[seq, head, s]`` (-inf when the split is empty)."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_blocks = tl.cdiv(seq_len, BLOCK_SIZE)
    blocks_per_split = tl.cdiv(num_blocks, NUM_SPLITS)
    block_lo = split * blocks_per_split
    block_hi = tl.minimum(block_lo + blocks_per_split, num_blocks)

    offs_row = tl.arange(0, BLOCK_M)
    offs_dim = tl.arange(0, HEAD_DIM_PADDED)
    dim_mask = offs_dim < head_dim
    row_valid = offs_row < QUERIES_PER_KV
    head = kv_head * QUERIES_PER_KV + offs_row
    query_pos = tl.where(row_valid, seq_len - 1, -1)

    tile_mask = row_valid[:, None] & dim_mask[None, :]
    query = tl.load(
        query_ptr + token * stride_query_token + head[:, None] * stride_query_head + offs_dim[None, :],
        mask=tile_mask,
        other=0.0,
    )
    if UPCAST:
        query = query.to(tl.float32)

    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], dtype=tl.float32)
    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, row_max, row_sum = _attend_kv_blocks(
        acc,
        row_max,
        row_sum,
        query,
        kv_cache_ptr,
        block_tables_ptr + seq.to(tl.int64) * stride_block_table_seq,
        kv_head,
        query_pos,
        seq_len,
        window,
        block_lo,
        block_hi,
        stride_cache_block,
        stride_cache_kv,
        stride_cache_slot,
        stride_cache_head,
        qk_scale_log2,
        offs_dim,
        dim_mask,
        BLOCK_SIZE,
        UPCAST,
    )
    empty = row_sum == 0.0
    out = acc / tl.where(empty, 1.0, row_sum)[:, None]
    lse = tl.where(empty, float("-inf"), row_max + tl.log2(tl.where(empty, 1.0, row_sum)))

    partial_row = (seq.to(tl.int64) * num_heads + head) * NUM_SPLITS + split
    tl.store(
        partial_out_ptr + partial_row[:, None] * head_dim + offs_dim[None, :],
        out,
        mask=tile_mask,
    )
    tl.store(partial_lse_ptr + partial_row, lse, mask=row_valid)


@triton.jit
def reduce_decode_splits_kernel(
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    query_start_loc_ptr,
    stride_out_token,
    stride_out_head,
    head_dim,
    num_heads,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PADDED: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
):
    """Flash-decoding, second pass. Grid ``(num_seqs, num_heads)``: weight each
    split's partial output by ``2^(lse_s - max lse)`` and normalise."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)

    offs_split = tl.arange(0, SPLITS_PADDED)
    offs_dim = tl.arange(0, HEAD_DIM_PADDED)
    split_mask = offs_split < NUM_SPLITS
    dim_mask = offs_dim < head_dim
    row = (seq * num_heads + head) * NUM_SPLITS + offs_split

    lse = tl.load(partial_lse_ptr + row, mask=split_mask, other=float("-inf"))
    lse_max = tl.max(lse, axis=0)
    weight = tl.exp2(lse - lse_max)  # empty splits: 2^-inf = 0; split 0 is never empty
    partial = tl.load(
        partial_out_ptr + row[:, None] * head_dim + offs_dim[None, :],
        mask=split_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    out = tl.sum(partial * weight[:, None], axis=0) / tl.sum(weight, axis=0)

    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    tl.store(
        out_ptr + token * stride_out_token + head * stride_out_head + offs_dim,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_mask,
    )


def kernels_interpreted() -> bool:
    """Whether these kernels run under the Triton interpreter. Triton decides this
    when it decorates them, i.e. when this module is first imported, so
    TRITON_INTERPRET=1 must be set before that."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(paged_attention_kernel, InterpretedFunction)
