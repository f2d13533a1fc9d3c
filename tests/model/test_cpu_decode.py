"""The compiled CPU paged-decode kernel against the torch backend's gather + SDPA
path: same inputs, random block tables, ragged lengths, GQA, dtypes."""

from __future__ import annotations

import pytest
import torch

from engine.model.attention import cpu_decode
from engine.model.attention.base import AttentionMetadata
from engine.model.attention.torch_backend import TorchAttentionBackend


def decode_batch(seq_lens: list[int], heads: int, kv_heads: int, head_dim: int, block_size: int,
                 dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 7
    kv = torch.randn(num_blocks, 2, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(blocks_per_seq)
    tables, used = [], 0
    for n in blocks_per_seq:
        row = order[used : used + n]
        used += n
        tables.append(row + [0] * (width - n))
    query = torch.randn(len(seq_lens), heads, head_dim, generator=gen).to(dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(len(seq_lens), dtype=torch.int64),
        query_start_loc=torch.arange(len(seq_lens) + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        max_query_len=1,
        max_seq_len=max(seq_lens),
    )
    return query, kv, meta


@pytest.mark.parametrize(
    ("seq_lens", "heads", "kv_heads", "head_dim", "block_size", "dtype"),
    [
        ([1, 17, 300, 64], 9, 3, 64, 16, torch.float32),
        ([5, 33, 129], 8, 8, 128, 32, torch.float32),
        ([2, 600, 45, 16, 250], 9, 3, 64, 16, torch.bfloat16),
        ([700], 12, 3, 64, 16, torch.bfloat16),
    ],
)
def test_kernel_matches_the_torch_path(cpu_decode_kernel: object, seq_lens: list[int], heads: int, kv_heads: int,
                                       head_dim: int, block_size: int, dtype: torch.dtype) -> None:
    query, kv, meta = decode_batch(seq_lens, heads, kv_heads, head_dim, block_size, dtype, seed=len(seq_lens))
    reference = TorchAttentionBackend().forward(query, kv, meta, head_dim**-0.5)
    out = cpu_decode.paged_decode(query, kv, meta.block_tables, meta.seq_lens, head_dim**-0.5)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert out.dtype == reference.dtype and out.shape == reference.shape
    assert torch.allclose(out.float(), reference.float(), atol=tolerance, rtol=tolerance)


def test_backend_uses_the_kernel_only_for_pure_decode(cpu_decode_kernel: object) -> None:
    backend = TorchAttentionBackend()
    backend.decode_kernel = cpu_decode.paged_decode
    query, kv, meta = decode_batch([40, 9], 9, 3, 64, 16, torch.float32, seed=3)
    with_kernel = backend.forward(query, kv, meta, 0.125)
    without = TorchAttentionBackend().forward(query, kv, meta, 0.125)
    assert torch.allclose(with_kernel, without, atol=1e-5)


def test_mixed_batch_with_kernel_matches_the_padded_path(cpu_decode_kernel: object) -> None:
    """Prefill chunks (one from scratch, one on cached context) mixed with decodes."""
    gen = torch.Generator().manual_seed(11)
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    seq_lens, query_lens = [50, 1 + 80, 37, 200], [50, 20, 1, 1]
    num_blocks = 40
    kv = torch.randn(num_blocks, 2, block_size, kv_heads, head_dim, generator=gen)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(-(-n // block_size) for n in seq_lens)
    tables, used = [], 0
    for n in seq_lens:
        k = -(-n // block_size)
        tables.append(order[used : used + k] + [0] * (width - k))
        used += k
    tokens = sum(query_lens)
    query = torch.randn(tokens, heads, head_dim, generator=gen)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(tokens, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_lens_cpu=query_lens, seq_lens_cpu=seq_lens,
    )
    with_kernel = TorchAttentionBackend()
    with_kernel.decode_kernel = cpu_decode.paged_decode
    fast = with_kernel.forward(query, kv, meta, head_dim**-0.5)
    reference = TorchAttentionBackend().forward(query, kv, meta, head_dim**-0.5)
    assert torch.allclose(fast, reference, atol=1e-5, rtol=1e-4)
