"""Sliding-window attention in every CPU path: the torch backend's masks (pure decode and
mixed batches), the C++ paged-decode kernel's window, and the kernel's mixed-batch path,
each against a dense reference that applies transformers' rule (a query at position p
sees keys p - W + 1 ... p)."""

from __future__ import annotations

import pytest
import torch

from engine.model.attention.torch_backend import TorchAttentionBackend
from tests.model.test_cpu_prefill import step_metadata

BLOCK = 4
HEADS, KV_HEADS, DIM = 4, 2, 8


def _reference(q_rows, keys, values, positions, window, scale):
    """Dense attention of rows at ``positions`` over keys 0..len-1 of one sequence."""
    out = []
    for row, pos in zip(q_rows, positions, strict=True):
        key_pos = torch.arange(keys.shape[0])
        visible = key_pos <= pos
        if window is not None:
            visible &= key_pos > pos - window
        k = keys.repeat_interleave(HEADS // KV_HEADS, dim=1)  # [ctx, heads, dim]
        v = values.repeat_interleave(HEADS // KV_HEADS, dim=1)
        scores = torch.einsum("hd,thd->ht", row, k) * scale
        scores[:, ~visible] = float("-inf")
        out.append(torch.einsum("ht,thd->hd", scores.softmax(-1), v))
    return torch.stack(out)


def _batch(seq_lens: list[int], query_lens: list[int], seed: int = 0):
    """A filled paged cache, a query per new token, the metadata, and each sequence's dense K/V."""
    gen = torch.Generator().manual_seed(seed)
    per_seq_blocks = [-(-n // BLOCK) for n in seq_lens]
    cache = torch.zeros(sum(per_seq_blocks) + 1, 2, BLOCK, KV_HEADS, DIM)
    tables, dense, next_block = [], [], 1  # block 0 stays unused: a wrong table reads zeros
    for n, blocks in zip(seq_lens, per_seq_blocks, strict=True):
        ids = list(range(next_block, next_block + blocks))[::-1]  # out of order on purpose
        next_block += blocks
        k, v = torch.randn(n, KV_HEADS, DIM, generator=gen), torch.randn(n, KV_HEADS, DIM, generator=gen)
        for t in range(n):
            cache[ids[t // BLOCK], 0, t % BLOCK], cache[ids[t // BLOCK], 1, t % BLOCK] = k[t], v[t]
        tables.append(ids)
        dense.append((k, v))
    meta = step_metadata(seq_lens, query_lens, tables)
    starts = meta.query_start_loc.tolist()
    query = torch.randn(starts[-1], HEADS, DIM, generator=gen)
    expected = torch.cat([
        _reference(query[starts[i]:starts[i + 1]], k, v, list(range(n - q, n)), WINDOW, 0.3)
        for i, ((k, v), n, q) in enumerate(zip(dense, seq_lens, query_lens, strict=True))
    ])
    full = torch.cat([
        _reference(query[starts[i]:starts[i + 1]], k, v, list(range(n - q, n)), None, 0.3)
        for i, ((k, v), n, q) in enumerate(zip(dense, seq_lens, query_lens, strict=True))
    ])
    return cache, query, meta, expected, full


WINDOW = 5
# Decodes at, inside and well past the window; a prefill chunk that crosses it; a whole
# prompt longer than the window; a one-token context.
DECODE = ([3, 5, 6, 23], [1, 1, 1, 1])
MIXED = ([23, 9, 14, 1], [1, 9, 6, 1])


@pytest.mark.parametrize("lens", [DECODE, MIXED], ids=["decode", "mixed"])
def test_torch_backend_masks_keys_older_than_the_window(lens) -> None:
    cache, query, meta, expected, full = _batch(*lens)
    out = TorchAttentionBackend().forward(query, cache, meta, 0.3, sliding_window=WINDOW)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert (out - full).abs().max() > 1e-2  # the window changed the answer: the test can see a missing mask
    no_window = TorchAttentionBackend().forward(query, cache, meta, 0.3)
    torch.testing.assert_close(no_window, full, atol=1e-5, rtol=1e-5)


def test_one_backend_serves_sliding_and_full_layers_of_one_step() -> None:
    """The plan cache is per (metadata, window): a full layer after a sliding one of the same
    step must not reuse the sliding layer's mask."""
    cache, query, meta, expected, full = _batch(*MIXED)
    backend = TorchAttentionBackend()
    torch.testing.assert_close(backend.forward(query, cache, meta, 0.3, sliding_window=WINDOW), expected,
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(backend.forward(query, cache, meta, 0.3), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("lens", [DECODE, MIXED], ids=["decode", "mixed"])
def test_cpu_decode_kernel_reads_only_the_window(cpu_decode_kernel, lens) -> None:
    from engine.model.attention import cpu_decode

    cache, query, meta, expected, full = _batch(*lens)
    backend = TorchAttentionBackend()
    backend.decode_kernel = cpu_decode.paged_decode
    out = backend.forward(query, cache, meta, 0.3, sliding_window=WINDOW)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(backend.forward(query, cache, meta, 0.3), full, atol=1e-5, rtol=1e-5)
