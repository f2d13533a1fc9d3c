"""Triton attention kernels against a plain-torch reference.

Runs natively on a CUDA device, or on CPU under the Triton interpreter:
``TRITON_INTERPRET=1 .venv/bin/python -m pytest -m triton tests/model/test_triton_attention.py``
(``make test-triton``). The interpreter is slow (about 0.5 ms per program and
1-3 ms per ``tl.dot``), so the shapes are small but keep every edge the kernels
have: ragged lengths, block boundaries, random block tables, GQA groups that
are not a power of two, chunked prefill on cached context, and split-K.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not (INTERPRET or torch.cuda.is_available()):
    pytest.skip(
        "Triton kernels need a CUDA device or TRITON_INTERPRET=1 (run `make test-triton`)",
        allow_module_level=True,
    )

from engine.errors import UserError  # noqa: E402
from engine.model.attention.base import AttentionMetadata, allocate_kv_cache  # noqa: E402
from engine.model.attention.selector import get_attention_backend, resolve_backend_name  # noqa: E402
from engine.model.attention.triton_backend import TritonAttentionBackend  # noqa: E402

pytestmark = pytest.mark.triton

DEVICE = torch.device("cpu" if INTERPRET else "cuda")
NUM_KV_HEADS = 2
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@dataclass
class Batch:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    new_key: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    new_value: torch.Tensor
    kv_cache: torch.Tensor  # context already written; the new tokens not yet
    meta: AttentionMetadata
    scale: float


def make_batch(
    seq_lens: list[int],
    query_lens: list[int],
    *,
    block_size: int,
    queries_per_kv: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int = 0,
    spare_blocks: int = 3,
) -> Batch:
    """A batch whose sequences own randomly chosen, non-contiguous physical
    blocks; each sequence's cached context (``seq_len - query_len`` tokens) is
    already in the cache, written by the reference writer."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    max_blocks = max([*blocks_per_seq, 1])
    physical = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.zeros((len(seq_lens), max_blocks), dtype=torch.int32)
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = torch.tensor([physical.pop() for _ in range(n)], dtype=torch.int32)

    def slot(seq: int, pos: int) -> int:
        return int(block_tables[seq, pos // block_size]) * block_size + pos % block_size

    context_slots = [
        slot(i, p) for i, (s, q) in enumerate(zip(seq_lens, query_lens, strict=True)) for p in range(s - q)
    ]
    new_slots = [
        slot(i, p) for i, (s, q) in enumerate(zip(seq_lens, query_lens, strict=True)) for p in range(s - q, s)
    ]

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    kv_cache = allocate_kv_cache(1, num_blocks, block_size, NUM_KV_HEADS, head_dim, dtype)[0]
    reference_write_kv(
        randn(len(context_slots), NUM_KV_HEADS, head_dim),
        randn(len(context_slots), NUM_KV_HEADS, head_dim),
        kv_cache,
        torch.tensor(context_slots, dtype=torch.int64),
    )
    num_tokens = sum(query_lens)
    query_start_loc = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(torch.tensor(query_lens, dtype=torch.int32), 0)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(new_slots, dtype=torch.int64).to(DEVICE),
        query_start_loc=query_start_loc.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(DEVICE),
        block_tables=block_tables.to(DEVICE),
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
    )
    return Batch(
        query=randn(num_tokens, NUM_KV_HEADS * queries_per_kv, head_dim).to(DEVICE),
        new_key=randn(num_tokens, NUM_KV_HEADS, head_dim).to(DEVICE),
        new_value=randn(num_tokens, NUM_KV_HEADS, head_dim).to(DEVICE),
        kv_cache=kv_cache.to(DEVICE),
        meta=meta,
        scale=head_dim**-0.5,
    )


def reference_write_kv(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    block_size = kv_cache.shape[2]
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            kv_cache[slot // block_size, 0, slot % block_size] = key[token]
            kv_cache[slot // block_size, 1, slot % block_size] = value[token]


def reference_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Sequence by sequence in fp32: gather the context through the block table,
    repeat KV heads for GQA, mask key positions after each query's own."""
    query, kv_cache = query.float().cpu(), kv_cache.float().cpu()
    block_size = kv_cache.shape[2]
    queries_per_kv = query.shape[1] // kv_cache.shape[3]
    out = torch.zeros_like(query)
    starts = meta.query_start_loc.tolist()
    for i, seq_len in enumerate(meta.seq_lens.tolist()):
        q = query[starts[i] : starts[i + 1]]  # [q_len, H, D]
        q_len = q.shape[0]
        if q_len == 0:
            continue
        positions = torch.arange(seq_len)
        blocks = meta.block_tables[i].cpu().long()[positions // block_size]
        key = kv_cache[blocks, 0, positions % block_size].repeat_interleave(queries_per_kv, dim=1)
        value = kv_cache[blocks, 1, positions % block_size].repeat_interleave(queries_per_kv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, key) * scale
        query_pos = torch.arange(seq_len - q_len, seq_len)
        scores = scores.masked_fill(positions[None, :] > query_pos[:, None], float("-inf"))
        out[starts[i] : starts[i + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), value)
    return out


def run_and_compare(batch: Batch, backend: TritonAttentionBackend) -> torch.Tensor:
    """Write the new K/V with the kernel, check the cache against the reference
    writer, run attention, check it against the reference; returns the output."""
    expected_cache = batch.kv_cache.clone().cpu()
    reference_write_kv(
        batch.new_key.cpu(), batch.new_value.cpu(), expected_cache, batch.meta.slot_mapping.cpu()
    )
    backend.write_kv(batch.new_key, batch.new_value, batch.kv_cache, batch.meta.slot_mapping)
    assert torch.equal(batch.kv_cache.cpu(), expected_cache)

    out = backend.forward(batch.query, batch.kv_cache, batch.meta, batch.scale)
    assert out.shape == batch.query.shape and out.dtype == batch.query.dtype
    expected = reference_attention(batch.query, batch.kv_cache, batch.meta, batch.scale)
    torch.testing.assert_close(
        out.float().cpu(), expected, atol=TOLERANCE[out.dtype], rtol=TOLERANCE[out.dtype]
    )
    return out


# A mixed batch: a prefill from scratch, a chunk on cached context that starts
# mid-block, a decode at the very first position, decodes ending on and just
# past a block boundary, and a chunk longer than one query tile.
MIXED_SEQ_LENS = [37, 53, 1, 32, 33, 90]
MIXED_QUERY_LENS = [37, 13, 1, 1, 1, 70]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("queries_per_kv", [1, 3, 4])
@pytest.mark.parametrize("block_size", [16, 32])
def test_mixed_prefill_and_decode_batch(
    block_size: int, queries_per_kv: int, head_dim: int, dtype: torch.dtype
) -> None:
    batch = make_batch(
        MIXED_SEQ_LENS,
        MIXED_QUERY_LENS,
        block_size=block_size,
        queries_per_kv=queries_per_kv,
        head_dim=head_dim,
        dtype=dtype,
        seed=block_size + queries_per_kv + head_dim,
    )
    run_and_compare(batch, TritonAttentionBackend())


def test_bf16_matches_reference() -> None:
    # bf16 dots are wrong in the interpreter; the backend upcasts there, natively it does not.
    batch = make_batch(
        MIXED_SEQ_LENS, MIXED_QUERY_LENS, block_size=16, queries_per_kv=3, head_dim=64, dtype=torch.bfloat16
    )
    run_and_compare(batch, TritonAttentionBackend())


def test_head_dim_not_power_of_two() -> None:
    # head_dim 80 is padded to 128 inside the kernels and masked; the split-K pair pads the same way.
    batch = make_batch(
        [45, 70], [45, 1], block_size=16, queries_per_kv=3, head_dim=80, dtype=torch.float32, seed=80
    )
    run_and_compare(batch, TritonAttentionBackend())
    decode = make_batch([70, 33], [1, 1], block_size=16, queries_per_kv=3, head_dim=80, dtype=torch.float32)
    run_and_compare(decode, TritonAttentionBackend(split_k_min_seq_len=64, num_splits=3))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_ragged_batches(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    num_seqs = int(torch.randint(1, 6, (1,), generator=gen))
    seq_lens = torch.randint(1, 80, (num_seqs,), generator=gen).tolist()
    query_lens = [int(torch.randint(1, n + 1, (1,), generator=gen)) for n in seq_lens]
    batch = make_batch(
        seq_lens, query_lens, block_size=16, queries_per_kv=4, head_dim=64, dtype=torch.float32, seed=seed
    )
    run_and_compare(batch, TritonAttentionBackend())


def test_chunked_prefill_equals_whole_prefill() -> None:
    """Prefilling 50 tokens as chunks of 20, 20 and 10 (each attending to the
    previous chunks through the cache) gives the one-shot prefill's output."""
    whole = make_batch([50], [50], block_size=16, queries_per_kv=3, head_dim=64, dtype=torch.float32)
    backend = TritonAttentionBackend()
    expected = run_and_compare(whole, backend)

    kv_cache = torch.zeros_like(whole.kv_cache)
    chunk_outputs = []
    for start, end in [(0, 20), (20, 40), (40, 50)]:
        meta = AttentionMetadata(
            slot_mapping=whole.meta.slot_mapping[start:end],
            query_start_loc=torch.tensor([0, end - start], dtype=torch.int32, device=DEVICE),
            seq_lens=torch.tensor([end], dtype=torch.int32, device=DEVICE),
            block_tables=whole.meta.block_tables,
            max_query_len=end - start,
            max_seq_len=end,
        )
        backend.write_kv(whole.new_key[start:end], whole.new_value[start:end], kv_cache, meta.slot_mapping)
        chunk_outputs.append(backend.forward(whole.query[start:end], kv_cache, meta, whole.scale))
    torch.testing.assert_close(torch.cat(chunk_outputs), expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("queries_per_kv", [1, 3, 4])
def test_split_k_decode(queries_per_kv: int, dtype: torch.dtype) -> None:
    """Long and short decodes through split-K: 4 splits over 300 tokens of
    16-token blocks, and sequences with fewer blocks than splits (empty splits)."""
    seq_lens = [300, 129, 5, 64]
    backend = TritonAttentionBackend(split_k_min_seq_len=256, num_splits=4)
    batch = make_batch(
        seq_lens,
        [1] * len(seq_lens),
        block_size=16,
        queries_per_kv=queries_per_kv,
        head_dim=64,
        dtype=dtype,
        seed=queries_per_kv,
    )
    assert backend.uses_split_k(batch.meta)
    split_out = run_and_compare(batch, backend)

    single_pass = TritonAttentionBackend(split_k_min_seq_len=10**9)
    assert not single_pass.uses_split_k(batch.meta)
    torch.testing.assert_close(
        single_pass.forward(batch.query, batch.kv_cache, batch.meta, batch.scale),
        split_out,
        atol=TOLERANCE[dtype],
        rtol=TOLERANCE[dtype],
    )


def test_split_k_not_used_for_prefill_or_short_decodes() -> None:
    backend = TritonAttentionBackend(split_k_min_seq_len=256)
    mixed = make_batch([300, 10], [1, 10], block_size=16, queries_per_kv=1, head_dim=64, dtype=torch.float32)
    short = make_batch([200, 10], [1, 1], block_size=16, queries_per_kv=1, head_dim=64, dtype=torch.float32)
    assert not backend.uses_split_k(mixed.meta)
    assert not backend.uses_split_k(short.meta)


def test_single_token_sequence() -> None:
    """The first token of a sequence attends only to itself: output = its value."""
    batch = make_batch([1], [1], block_size=32, queries_per_kv=3, head_dim=128, dtype=torch.float32)
    out = run_and_compare(batch, TritonAttentionBackend())
    expected = batch.new_value.repeat_interleave(3, dim=1)
    torch.testing.assert_close(out, expected)


def test_empty_batch() -> None:
    batch = make_batch([40], [1], block_size=16, queries_per_kv=1, head_dim=64, dtype=torch.float32)
    backend = TritonAttentionBackend()
    before = batch.kv_cache.clone()
    empty = torch.empty((0, NUM_KV_HEADS, 64), device=DEVICE)
    backend.write_kv(empty, empty, batch.kv_cache, torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert torch.equal(batch.kv_cache, before)

    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64, device=DEVICE),
        query_start_loc=torch.zeros(1, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.empty(0, dtype=torch.int32, device=DEVICE),
        block_tables=torch.empty((0, 1), dtype=torch.int32, device=DEVICE),
        max_query_len=0,
        max_seq_len=0,
    )
    out = backend.forward(empty, batch.kv_cache, meta, 0.125)
    assert out.shape == (0, NUM_KV_HEADS, 64)


def test_padding_slots_are_not_written() -> None:
    batch = make_batch([20], [4], block_size=16, queries_per_kv=1, head_dim=64, dtype=torch.float32)
    slots = batch.meta.slot_mapping.clone()
    slots[1] = -1
    slots[3] = -1
    expected = batch.kv_cache.clone().cpu()
    reference_write_kv(batch.new_key.cpu(), batch.new_value.cpu(), expected, slots.cpu())
    TritonAttentionBackend().write_kv(batch.new_key, batch.new_value, batch.kv_cache, slots)
    assert torch.equal(batch.kv_cache.cpu(), expected)
    block, offset = divmod(int(slots[0]), 16)
    assert torch.equal(batch.kv_cache[block, 0, offset].cpu(), batch.new_key[0].cpu())
    skipped_block, skipped_offset = divmod(int(batch.meta.slot_mapping[1]), 16)
    assert not batch.kv_cache[skipped_block, :, skipped_offset].any()


def test_rejects_block_size_too_small_for_tl_dot() -> None:
    batch = make_batch([10], [10], block_size=8, queries_per_kv=1, head_dim=64, dtype=torch.float32)
    with pytest.raises(UserError, match="block size"):
        TritonAttentionBackend().forward(batch.query, batch.kv_cache, batch.meta, batch.scale)


@pytest.mark.skipif(
    importlib.util.find_spec("engine.model.attention.torch_backend") is None,
    reason="engine/model/attention/torch_backend.py does not exist yet",
)
@pytest.mark.parametrize("queries_per_kv", [1, 3])
def test_matches_torch_backend(queries_per_kv: int) -> None:
    torch_backend = get_attention_backend("torch", "cpu")
    batch = make_batch(
        MIXED_SEQ_LENS,
        MIXED_QUERY_LENS,
        block_size=16,
        queries_per_kv=queries_per_kv,
        head_dim=64,
        dtype=torch.float32,
    )
    torch_cache = batch.kv_cache.clone().cpu()
    torch_meta = AttentionMetadata(
        slot_mapping=batch.meta.slot_mapping.cpu(),
        query_start_loc=batch.meta.query_start_loc.cpu(),
        seq_lens=batch.meta.seq_lens.cpu(),
        block_tables=batch.meta.block_tables.cpu(),
        max_query_len=batch.meta.max_query_len,
        max_seq_len=batch.meta.max_seq_len,
        query_lens_cpu=batch.meta.query_lens_cpu,
        seq_lens_cpu=batch.meta.seq_lens_cpu,
    )
    torch_backend.write_kv(batch.new_key.cpu(), batch.new_value.cpu(), torch_cache, torch_meta.slot_mapping)
    expected = torch_backend.forward(batch.query.cpu(), torch_cache, torch_meta, batch.scale)
    out = run_and_compare(batch, TritonAttentionBackend())
    assert torch.equal(batch.kv_cache.cpu(), torch_cache)
    torch.testing.assert_close(out.cpu(), expected, atol=2e-5, rtol=2e-5)


def test_selector_auto_resolves_by_device() -> None:
    assert resolve_backend_name("auto", "cuda") == "triton"
    assert resolve_backend_name("auto", "cpu") == "torch"
    assert resolve_backend_name("triton", "cpu") == "triton"
    with pytest.raises(UserError, match="auto, torch or triton"):
        resolve_backend_name("flash", "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device makes triton a valid choice")
def test_selector_refuses_triton_on_cpu_without_interpreter() -> None:
    # A fresh interpreter without TRITON_INTERPRET: the kernels compile for a GPU that is not there.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    probe = (
        "from engine.model.attention.selector import get_attention_backend\n"
        "from engine.errors import UserError\n"
        "try:\n    get_attention_backend('triton', 'cpu')\nexcept UserError as e:\n    print(e)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "TRITON_INTERPRET=1" in result.stdout and "--attention-backend torch" in result.stdout


def test_selector_gives_triton_backend_where_kernels_can_run() -> None:
    assert isinstance(get_attention_backend("triton", DEVICE), TritonAttentionBackend)
    if not INTERPRET:
        assert isinstance(get_attention_backend("auto", DEVICE), TritonAttentionBackend)


def test_smollm2_logits_match_torch_backend(smollm_config, smollm_runner_fp32) -> None:
    """End to end: the bundled SmolLM2 (GQA 3, head dim 64, 30 layers) in fp32,
    a prefill step then a step mixing a prefill chunk on cached context with a
    decode; the Triton backend's logits match the torch backend's."""
    from engine.model.runner import ModelRunner, ScheduledSeq

    triton_runner = ModelRunner(
        smollm_config, dtype="float32", block_size=16, device=str(DEVICE), attention_backend="triton"
    )
    assert isinstance(triton_runner.backend, TritonAttentionBackend)
    triton_runner.load_weights()
    triton_runner.allocate_kv_cache(8)

    prompt_a = [
        1,
        9690,
        198,
        2683,
        359,
        253,
        5356,
        5646,
        11173,
        3365,
        3511,
        308,
        34519,
        28,
        7018,
        411,
        407,
        19712,
        8182,
        2,
    ]
    prompt_b = [1, 4093, 198, 1780, 314]
    # Distinct, non-contiguous blocks; the torch runner's cache is shared with other tests, so use high ids there.
    steps = [
        [
            ScheduledSeq("a", prompt_a[:12], 0, [5, 2], needs_sample=False),
            ScheduledSeq("b", prompt_b, 0, [7]),
        ],
        [
            ScheduledSeq("a", prompt_a[12:], 12, [5, 2]),
            ScheduledSeq("b", [28], len(prompt_b), [7]),
        ],
    ]
    offset = smollm_runner_fp32.num_blocks - 8
    for step in steps:
        triton_logits = triton_runner.logits_for(step)
        torch_step = [
            ScheduledSeq(
                s.request_id, s.token_ids, s.start_position, [b + offset for b in s.block_ids], s.needs_sample
            )
            for s in step
        ]
        torch_logits = smollm_runner_fp32.logits_for(torch_step)
        assert triton_logits.keys() == torch_logits.keys() and triton_logits
        for request_id, logits in triton_logits.items():
            torch.testing.assert_close(logits.cpu(), torch_logits[request_id].cpu(), atol=1e-3, rtol=1e-3)
            assert int(logits.argmax()) == int(torch_logits[request_id].argmax())
