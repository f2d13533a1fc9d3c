"""Paging must be invisible: how a prompt is split into steps and where its blocks
live must not change the logits; batching must not change greedy outputs."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from engine.model.attention.base import AttentionMetadata
from engine.model.attention.torch_backend import TorchAttentionBackend
from engine.model.runner import ScheduledSeq

PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain gravity to a child.",
    "List three fruits.", "What is 2 + 2?", "Translate 'hello' into Spanish.", "Who wrote Hamlet?",
    "Describe a cat in one sentence.", "Why is the sky blue?", "Give me a name for a dog.",
    "What color is grass?", "How many legs does a spider have?", "Say something kind.",
    "What is the boiling point of water?", "Name a planet.", "What do bees make?",
]
TOLERANCE = 1e-4


def chat(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True)


def test_one_step_three_chunks_and_prefix_hit_give_same_logits(smollm_runner_fp32, smollm_tokenizer) -> None:
    runner = smollm_runner_fp32
    ids = chat(smollm_tokenizer, "Tell me a short story about a brave little robot.")
    n = len(ids)
    assert n > 40
    whole = runner.logits_for([ScheduledSeq("a", ids, 0, [0, 1, 2, 3])])["a"]

    # Three chunks, scattered non-contiguous blocks; only the last chunk samples.
    blocks = [17, 9, 40, 3]
    cuts = [0, 13, 31, n]
    for lo, hi in itertools.pairwise(cuts):
        out = runner.logits_for([ScheduledSeq("b", ids[lo:hi], lo, blocks, needs_sample=hi == n)])
    chunked = out["b"]

    # Prefix-cache hit: a new request reuses the first two full blocks of "b" and computes the rest.
    hit = 32
    reused = runner.logits_for([ScheduledSeq("c", ids[hit:], hit, [17, 9, 61, 62])])["c"]

    assert (chunked - whole).abs().max().item() < TOLERANCE
    assert (reused - whole).abs().max().item() < TOLERANCE
    assert int(whole.argmax()) == int(chunked.argmax()) == int(reused.argmax())


def test_mixed_prefill_and_decode_step_matches_separate_steps(smollm_runner_fp32, smollm_tokenizer) -> None:
    runner = smollm_runner_fp32
    a, b = chat(smollm_tokenizer, PROMPTS[0]), chat(smollm_tokenizer, PROMPTS[1])
    runner.execute([ScheduledSeq("a", a, 0, [100, 101, 102])])
    alone_a = runner.logits_for([ScheduledSeq("a", [42], len(a), [100, 101, 102])])["a"]
    alone_b = runner.logits_for([ScheduledSeq("b", b, 0, [110, 111, 112])])["b"]
    mixed = runner.logits_for([
        ScheduledSeq("a", [42], len(a), [100, 101, 102]),  # rewrites the same slot with the same K/V
        ScheduledSeq("b", b, 0, [120, 121, 122]),
    ])
    assert (mixed["a"] - alone_a).abs().max().item() < TOLERANCE
    assert (mixed["b"] - alone_b).abs().max().item() < TOLERANCE


@pytest.mark.slow  # 17 greedy generations, ~16 s; the mixed-batch tests above cover batching in the default suite
def test_batch_of_16_matches_each_alone_greedy(greedy_generate, smollm_tokenizer) -> None:
    prompts = [chat(smollm_tokenizer, p) for p in PROMPTS]
    batched = greedy_generate(prompts, 8)
    alone = [greedy_generate([p], 8)[0] for p in prompts]
    assert batched == alone
    assert len({tuple(o) for o in batched}) > 8  # different prompts, different answers


def naive_attention(query, kv_cache, seq_lens, query_lens, block_tables, scale):
    """Per-sequence, per-head loop: obviously right, slow."""
    block_size = kv_cache.shape[2]
    group = query.shape[1] // kv_cache.shape[3]
    out = torch.empty_like(query)
    start = 0
    for b, (seq_len, q_len) in enumerate(zip(seq_lens, query_lens, strict=True)):
        slots = [block_tables[b][p // block_size] * block_size + p % block_size for p in range(seq_len)]
        keys = torch.stack([kv_cache[s // block_size, 0, s % block_size] for s in slots])
        values = torch.stack([kv_cache[s // block_size, 1, s % block_size] for s in slots])
        for i in range(q_len):
            pos = seq_len - q_len + i
            for h in range(query.shape[1]):
                scores = keys[: pos + 1, h // group] @ query[start + i, h] * scale
                out[start + i, h] = scores.softmax(-1) @ values[: pos + 1, h // group]
        start += q_len
    return out


@pytest.mark.parametrize("query_lens", [[1, 1, 1], [5, 1, 17]])
def test_torch_backend_matches_naive_attention(query_lens: list[int]) -> None:
    generator = torch.Generator().manual_seed(0)
    block_size, heads, kv_heads, head_dim = 4, 6, 2, 8
    seq_lens = [9, 3, 20]
    tables = [[7, 2, 5], [0], [1, 3, 4, 6, 8]]
    kv_cache = torch.randn(10, 2, block_size, kv_heads, head_dim, generator=generator)
    tokens = sum(query_lens)
    query = torch.randn(tokens, heads, head_dim, generator=generator)
    width = max(map(len, tables))
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    meta = AttentionMetadata(
        slot_mapping=torch.full((tokens,), -1, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
    scale = 1 / math.sqrt(head_dim)
    backend = TorchAttentionBackend()
    backend.write_kv(query[:, :kv_heads], query[:, :kv_heads], kv_cache, meta.slot_mapping)  # all -1: no writes
    got = backend.forward(query, kv_cache, meta, scale)
    expected = naive_attention(query, kv_cache, seq_lens, query_lens, tables, scale)
    assert (got - expected).abs().max().item() < 1e-5


def test_write_kv_puts_each_token_at_its_slot() -> None:
    kv_cache = torch.zeros(4, 2, 4, 1, 2)
    key = torch.arange(6, dtype=torch.float32).view(3, 1, 2)
    TorchAttentionBackend().write_kv(key, -key, kv_cache, torch.tensor([13, -1, 2]))
    assert kv_cache[3, 0, 1].tolist() == [[0.0, 1.0]]
    assert kv_cache[0, 1, 2].tolist() == [[-4.0, -5.0]]
    assert not (kv_cache.abs() == 2).any()  # the token at slot -1 (values 2, 3) was not written
    assert int((kv_cache != 0).sum()) == 6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn])
def test_gather_blocks_is_the_block_tables_indexing(dtype: torch.dtype) -> None:
    """The backend's one gather (index_select on the flattened table) equals ``kv_cache[table]``
    for a sequence's row and for a whole batch's table, in every cache dtype."""
    from engine.model.attention.torch_backend import gather_blocks

    cache = torch.randn(40, 2, 16, 2, 8, generator=torch.Generator().manual_seed(0)).to(dtype)
    for table in (torch.tensor([5, 0, 39], dtype=torch.int32), torch.tensor([[3, 7], [39, 3]], dtype=torch.int32),
                  torch.tensor([], dtype=torch.int32)):
        expected = cache[table.to(torch.int64)]
        got = gather_blocks(cache, table)
        assert got.shape == expected.shape
        assert torch.equal(got.view(torch.uint8) if dtype.itemsize == 1 else got,
                           expected.view(torch.uint8) if dtype.itemsize == 1 else expected)
