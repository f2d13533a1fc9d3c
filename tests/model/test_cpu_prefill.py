"""The compiled paged prefill kernel (engine/model/attention/cpu_decode.py ``paged_prefill``)
against the torch backend's gather + padded-mask SDPA path on the same paged cache: chunks
from scratch and on cached context, decodes beside them, GQA, sliding windows, every cache
dtype, the head dims it is compiled for; and the backend routing chunks to it by the plan."""

from __future__ import annotations

import pytest
import torch

from engine.model.attention import cpu_decode
from engine.model.attention.base import AttentionMetadata
from engine.model.attention.kv_quant import dequantize_from_cache, is_quantized, quantize_for_cache
from engine.model.attention.torch_backend import TorchAttentionBackend


def paged_batch(seq_lens: list[int], query_lens: list[int], heads: int, kv_heads: int, head_dim: int,
                block_size: int, cache_dtype: torch.dtype,
                seed: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Queries, a paged cache of ``cache_dtype`` with shuffled block tables, and the metadata of
    a step whose sequence i has ``query_lens[i]`` new rows at the end of ``seq_lens[i]``."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 5
    raw = torch.randn(num_blocks, 2, block_size, kv_heads, head_dim, generator=gen) * 2
    cache = quantize_for_cache(raw, cache_dtype) if is_quantized(cache_dtype) else raw.to(cache_dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in blocks_per_seq:
        tables.append(order[used : used + n])
        used += n
    meta = step_metadata(seq_lens, query_lens, tables)
    return torch.randn(sum(query_lens), heads, head_dim, generator=gen), cache, meta


def step_metadata(seq_lens: list[int], query_lens: list[int], tables: list[list[int]]) -> AttentionMetadata:
    """The metadata of a step whose sequence i has ``query_lens[i]`` new rows at the end of its
    ``seq_lens[i]`` positions, in blocks ``tables[i]`` (padded with block 0)."""
    width = max(len(t) for t in tables)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return AttentionMetadata(
        slot_mapping=torch.zeros(starts[-1], dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_lens_cpu=list(query_lens), seq_lens_cpu=list(seq_lens),
    )


def reference(query: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float,
              window: int | None = None) -> torch.Tensor:
    """The padded-mask SDPA path (no kernels) over the cache's float32 values."""
    values = dequantize_from_cache(cache, torch.float32) if is_quantized(cache.dtype) else cache.float()
    return TorchAttentionBackend().forward(query, values, meta, scale, sliding_window=window)


def query_start(meta: AttentionMetadata) -> torch.Tensor:
    return meta.query_start_loc.to(torch.int64)


@pytest.mark.parametrize(
    ("seq_lens", "query_lens", "heads", "kv_heads", "head_dim", "block_size", "cache_dtype", "window"),
    [
        ([500], [500], 9, 3, 64, 16, torch.float32, None),  # one prompt from scratch
        ([50, 81, 37, 200, 1000], [50, 20, 1, 1, 128], 9, 3, 64, 16, torch.float32, None),  # chunks on context
        ([45, 300, 7], [45, 33, 7], 8, 2, 128, 32, torch.bfloat16, None),
        ([300, 5, 140], [300, 5, 17], 4, 1, 256, 16, torch.float16, 64),  # sliding window, chunk past it
        ([33, 129, 2], [33, 40, 2], 9, 3, 64, 8, torch.int8, None),  # int8 rows with their scales
        ([90, 260], [90, 19], 9, 3, 64, 16, torch.float8_e4m3fn, 48),
    ],
)
def test_kernel_matches_the_padded_sdpa_path(cpu_decode_kernel: object, seq_lens: list[int], query_lens: list[int],
                                             heads: int, kv_heads: int, head_dim: int, block_size: int,
                                             cache_dtype: torch.dtype, window: int | None) -> None:
    query, cache, meta = paged_batch(seq_lens, query_lens, heads, kv_heads, head_dim, block_size, cache_dtype,
                                     seed=len(seq_lens))
    scale = head_dim**-0.5
    out = cpu_decode.paged_prefill(query, cache, meta.block_tables, meta.seq_lens, query_start(meta), scale, window)
    expected = reference(query, cache, meta, scale, window)
    assert out.dtype == torch.float32 and out.shape == query.shape
    assert torch.allclose(out, expected, atol=2e-5, rtol=1e-4), (out - expected).abs().max()


def test_backend_routes_chunks_by_the_plan_and_keeps_decodes_on_the_decode_kernel(cpu_decode_kernel: object) -> None:
    """Two chunks go to the paged kernel (the 2-8 and 65+ classes), one to SDPA (9-64), the
    decodes to the decode kernel: the step's output equals the padded path's."""
    query, cache, meta = paged_batch([80, 81, 37, 200, 6], [80, 20, 1, 1, 6], 9, 3, 64, 16, torch.float32, seed=5)
    backend = TorchAttentionBackend()
    backend.decode_kernel = cpu_decode.paged_decode
    calls: list[int] = []

    def counted(q: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(q.shape[0])
        return cpu_decode.paged_prefill(q, *args)  # type: ignore[arg-type]

    backend.prefill_kernels = {"paged": counted}
    backend.prefill_attention = ((1, "torch"), (8, "paged"), (64, "torch"), (1 << 62, "paged"))
    out = backend.forward(query, cache, meta, 0.125)
    assert calls == [80 + 6]  # one call for both paged chunks; the 20-row chunk ran SDPA
    assert torch.allclose(out, reference(query, cache, meta, 0.125), atol=2e-5, rtol=1e-4)


def test_backend_gives_each_prefill_kernel_its_own_chunks_and_falls_back_from_one_it_lacks(
        cpu_decode_kernel: object) -> None:
    """A plan that picks the float32 kernel for one class and the bf16 one for another: each
    kernel gets its chunks in one call. A backend without the bf16 kernel (another cache dtype
    under a stored plan) runs those chunks on the float32 kernel instead."""
    query, cache, meta = paged_batch([80, 81, 37, 200, 6], [80, 20, 1, 1, 6], 9, 3, 64, 16, torch.bfloat16, seed=6)
    calls: dict[str, list[int]] = {"paged": [], "paged_bf16": []}

    def counted(name: str) -> object:
        def kernel(q: torch.Tensor, *args: object) -> torch.Tensor:
            calls[name].append(q.shape[0])
            return cpu_decode.paged_prefill(q, *args)  # type: ignore[arg-type]
        return kernel

    plan = ((1, "torch"), (8, "paged"), (64, "paged_bf16"), (1 << 62, "paged"))
    for kernels, expected in (({"paged", "paged_bf16"}, {"paged": [86], "paged_bf16": [20]}),
                              ({"paged"}, {"paged": [106], "paged_bf16": []})):
        backend = TorchAttentionBackend()
        backend.decode_kernel = cpu_decode.paged_decode
        backend.prefill_kernels = {name: counted(name) for name in kernels}  # type: ignore[misc]
        backend.prefill_attention = plan
        calls = {"paged": [], "paged_bf16": []}
        out = backend.forward(query, cache, meta, 0.125)
        assert calls == expected
        assert torch.allclose(out, reference(query, cache, meta, 0.125), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(
    ("seq_lens", "query_lens", "heads", "kv_heads", "head_dim", "block_size", "window"),
    [
        ([500], [500], 9, 3, 64, 16, None),  # one prompt from scratch: SmolLM2's heads
        ([50, 81, 37, 200, 1000], [50, 20, 1, 1, 128], 9, 3, 64, 16, None),  # chunks on context, decodes beside
        ([45, 300, 7], [45, 33, 7], 8, 2, 128, 32, None),
        ([300, 5, 140], [300, 5, 17], 4, 1, 256, 16, 64),  # sliding window, a chunk past it
        ([33, 129, 2], [33, 40, 2], 9, 3, 64, 8, 20),  # 8-token blocks, a window shorter than a key tile
        ([17], [17], 1, 1, 64, 16, None),  # one head: a lane group mostly padding
    ],
)
def test_bf16_kernel_matches_the_padded_sdpa_path_within_bf16_rounding(
        cpu_decode_kernel: object, seq_lens: list[int], query_lens: list[int], heads: int, kv_heads: int,
        head_dim: int, block_size: int, window: int | None) -> None:
    """The vdpbf16ps kernel over a bf16 cache: only q and the softmax weights are rounded to
    bf16, so it lands within ~2e-3 (relative RMS) of float32 attention over the same K and V;
    where the compiler does not target AVX512-BF16 it refuses by name."""
    query, cache, meta = paged_batch(seq_lens, query_lens, heads, kv_heads, head_dim, block_size, torch.bfloat16,
                                     seed=len(seq_lens) + heads)
    scale = head_dim**-0.5
    args = (query, cache, meta.block_tables, meta.seq_lens, query_start(meta), scale, window)
    if not cpu_decode.bf16_prefill_available():
        with pytest.raises(RuntimeError, match="built without AVX512-BF16"):
            cpu_decode.paged_prefill_bf16(*args)
        return
    out = cpu_decode.paged_prefill_bf16(*args)
    expected = reference(query, cache, meta, scale, window)
    assert out.dtype == torch.float32 and out.shape == query.shape and bool(torch.isfinite(out).all())
    error = ((out - expected).norm() / expected.norm()).item()
    assert 1e-4 < error < 5e-3, error  # bf16 rounding, not float32 sums, and not more


def test_a_head_dim_not_compiled_in_is_refused_by_name(cpu_decode_kernel: object) -> None:
    assert 80 not in cpu_decode.PREFILL_HEAD_DIMS  # Phi-2's: such models keep torch's SDPA
    query, cache, meta = paged_batch([20], [20], 4, 2, 80, 16, torch.float32, seed=1)
    with pytest.raises(RuntimeError, match="head dim 80 is not compiled in"):
        cpu_decode.paged_prefill(query, cache, meta.block_tables, meta.seq_lens, query_start(meta), 0.1)
