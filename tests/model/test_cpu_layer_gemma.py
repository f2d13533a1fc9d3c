"""The fused decode layer (engine/model/kernels/cpu_layer.py) over any GGUF block format and
Gemma 3's layer, against the op-by-op layer it replaces:

* a one-layer Llama-shaped model whose projections are K-quant and mixed blocks (a QKV of
  Q5_0/Q5_0/Q8_0 parts as Gemma 3's files hold it, Q4_K, Q5_K, Q6_K, Q4_0/Q4_1/Q5_1, and one
  q8_0 weight on cpu_gemv's path next to them), batches below and past the GEMV's rows;
* Gemma 3 270M (the real GGUF's blocks): a sliding and a full layer over contexts longer than the
  512-token window, the cache rows it writes, and the window really applied;
* greedy decode of Gemma 3 on the hybrid KV cache (one table per group), fused against
  ``KVSCOPE_CPU_LAYER_KERNEL=0``.

Both paths round the activations to int8 per 32 values (cpu_quant) the same way, so on one layer they
differ by float32 rounding only: measured (Zen 4, AVX-512 VNNI) 2-4e-7 relative on these inputs. An
activation on an int8 rounding boundary can land one step apart (~1e-3 on its layer); the end-to-end
test allows for that.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.core.kv_cache_groups import kv_cache_groups
from engine.core.sampling_params import SamplingParams
from engine.model.attention.base import AttentionMetadata
from engine.model.kernels import cpu_layer
from engine.model.layers.quantized_linear import BlockPart, QuantizedLinear, dequantize_part
from engine.model.loading import weight_blocks
from engine.model.plan import fused_layer
from engine.model.runner import ModelRunner, ScheduledSeq
from tests.model.gemma3_fixtures import gemma3_config, gemma3_runner
from tests.model.test_cpu_quant import random_blocks

BLOCK = 16
LAYER_RTOL = 5e-4  # a layer's output: float32 rounding (2-4e-7) unless an activation sits on an int8 rounding
# boundary, where the two paths' sums (C++ vs torch norms) round it one step apart: 6.8e-5 seen once in a full run


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _decode_meta(seq_lens: list[int], max_len: int) -> tuple[AttentionMetadata, torch.Tensor]:
    """A pure-decode step of ``len(seq_lens)`` sequences, each its own blocks, the new token at
    position seq_len - 1; and the positions."""
    rows, per_seq = len(seq_lens), max_len // BLOCK + 1
    tables = torch.arange(rows * per_seq, dtype=torch.int32).view(rows, per_seq)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    positions = lens.to(torch.int64) - 1
    slots = tables[torch.arange(rows), positions // BLOCK].to(torch.int64) * BLOCK + positions % BLOCK
    meta = AttentionMetadata(slot_mapping=slots, query_start_loc=torch.arange(rows + 1, dtype=torch.int32),
                             seq_lens=lens, block_tables=tables, max_query_len=1, max_seq_len=max(seq_lens),
                             query_lens_cpu=[1] * rows, seq_lens_cpu=list(seq_lens))
    return meta, positions


def _layer_pair(model, index: int, seq_lens: list[int], window: int | None = None,
                seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fused output, op-by-op output, fused cache, op-by-op cache) of layer ``index`` on one
    pure-decode step over a random cache; ``window`` overrides the fused call's window."""
    layer, (before, after) = model.layers[index], model.routing.fused_layers[index]
    generator = torch.Generator().manual_seed(seed)
    meta, positions = _decode_meta(seq_lens, max(seq_lens))
    cache = torch.randn(meta.block_tables.numel(), 2, BLOCK, layer.num_kv_heads, layer.head_dim, generator=generator)
    rotary = model.rotary_local if getattr(layer, "is_sliding", False) else model.rotary
    cos, sin = rotary.cos_sin(positions, model.dtype)
    rows = len(seq_lens)
    hidden = torch.randn(rows, layer.input_layernorm.shape[0], generator=generator) * 4
    entry = getattr(cpu_layer.load_kernel(), getattr(layer, "fused_entry", "decode_layer"))
    if window is not None:
        after = (*after[:-1], window)
    fused_cache, ref_cache = cache.clone(), cache.clone()
    with torch.inference_mode():
        fused = entry(hidden, *before, cos.view(rows, -1), sin.view(rows, -1), fused_cache, meta.slot_mapping,
                      meta.block_tables, meta.seq_lens, *after)
        ref = layer(hidden, cos, sin, ref_cache, meta, model.backend)
    return fused, ref, fused_cache, ref_cache


# ---------------------------------------------------------------------- any block format, Llama's layer
# Each projection's parts: (format, rows as a fraction of its outputs' thirds or halves).
MIXES = {
    "gemma-like": {"qkv_proj": ("q5_0", "q5_0", "q8_0"), "o_proj": ("q4_k",), "gate_up_proj": ("q4_k", "q6_k"),
                   "down_proj": ("q5_k",)},
    "small-blocks": {"qkv_proj": ("q4_0", "q4_1", "q5_1"), "o_proj": ("q8_0",), "gate_up_proj": ("q6_k",),
                     "down_proj": ("q4_0", "q8_0")},
}


def _parts_of(layer, name: str, formats: tuple[str, ...], seed: int) -> tuple[BlockPart, ...]:
    """Random valid blocks for ``name``: QKV split at its Q/K/V rows, others in equal row chunks."""
    out_features, in_features = getattr(layer, name).shape
    if name == "qkv_proj" and len(formats) == 3:
        rows = [layer.q_size, layer.kv_size, layer.kv_size]
    else:
        rows = [out_features // len(formats)] * len(formats)
    return tuple(BlockPart(fmt, random_blocks(fmt, n, in_features, seed + i))
                 for i, (fmt, n) in enumerate(zip(formats, rows, strict=True)))


@pytest.fixture(scope="module", params=list(MIXES))
def blocks_model(request, cpu_layer_kernel, smollm_config):
    """One Llama layer (hidden 512, 8 heads of 64, 2 KV heads, MLP 1024: whole 256-weight K-quant
    blocks everywhere) with its projections as random blocks of ``MIXES[param]``, its float
    weights their values exactly (what a step past the GEMV's rows multiplies)."""
    config = dataclasses.replace(smollm_config, num_layers=1, hidden_size=512, num_attention_heads=8, num_kv_heads=2,
                                 head_dim=64, intermediate_size=1024, vocab_size=512, tie_word_embeddings=False,
                                 source="preset", path=None)
    runner = ModelRunner(config, dtype="float32", quantization=None, load_format="dummy")
    runner.load_weights()
    runner.allocate_kv_cache(64)
    assert runner.enable_cpu_decode_kernel() is None
    model, layer, counts = runner.model, runner.model.layers[0], {}
    with torch.no_grad():
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.uniform_(0.01, 0.03)  # K-quant random blocks are large weights: keep the projections' outputs O(1)
        for i, (name, formats) in enumerate(MIXES[request.param].items()):
            entry = QuantizedLinear(_parts_of(layer, name, formats, 10 * i), getattr(layer, name).shape[1], "gguf")
            weight_blocks.install(layer.projections[name], entry, counts)
            getattr(layer, name).copy_(torch.cat([dequantize_part(p, entry.in_features) for p in entry.parts]))
    model.routing.pending = True
    model.routing.resolve()
    return request.param, model


def test_projection_codes_name_each_part(blocks_model) -> None:
    """Mixed and K-quant weights go through cpu_quant's codes (ggml id + 100), the one-part q8_0
    through cpu_gemv's (0), exactly as the op-by-op path binds them."""
    mix, model = blocks_model
    (before, _after), = model.routing.fused_layers
    codes = [a for a in before if isinstance(a, list) and a and isinstance(a[0], int)]
    if mix == "gemma-like":
        assert codes == [[106, 106, 108], [112], [112, 114], [113]]
    else:
        assert codes == [[102, 103, 107], [0], [114], [102, 108]]
    assert model.routing.fused_decode_status(torch.float32).startswith("enabled")


@pytest.mark.parametrize("seq_lens", [[40], [70, 9, 33], [20 + 7 * i for i in range(12)]])
def test_fused_layer_over_any_block_format(blocks_model, seq_lens: list[int]) -> None:
    """1, 3 and 12 sequences (12: past the q8_0 GEMV's 8 rows, its float weight through torch's GEMM
    inside the call): the layer's output and the K/V rows it writes match the op-by-op layer's."""
    _, model = blocks_model
    fused, ref, fused_cache, ref_cache = _layer_pair(model, 0, seq_lens)
    assert _rel(fused, ref) < LAYER_RTOL, _rel(fused, ref)
    assert _rel(fused_cache, ref_cache) < LAYER_RTOL
    assert not torch.equal(fused_cache, torch.zeros_like(fused_cache))


def test_the_kernel_plan_times_the_fused_layer(blocks_model) -> None:
    _, model = blocks_model
    fused_us, layer_us, err = fused_layer._fused_against_layer(
        model, model.layers[0], cpu_layer.load_kernel(), model.routing.fused_layers[0], 2, torch.Generator().manual_seed(0))
    assert fused_us > 0 and layer_us > 0 and err < LAYER_RTOL


# ---------------------------------------------------------------------- Gemma 3 270M
@pytest.fixture(scope="module")
def gemma(cpu_layer_kernel):
    """The real file's blocks (Q5_0/Q8_0 QKV parts, Q4_K, Q6_K), as ``--quantization auto`` loads them."""
    runner = gemma3_runner(quantization="native")
    assert runner.model.routing.fused_decode_status(runner.kv_cache_dtype).startswith("enabled")
    assert len(runner.model.routing.fused_layers) == len(runner.model.layers)
    return runner


@pytest.mark.parametrize("index", [0, 5])  # layer 0 slides (window 512), layer 5 attends to everything
def test_gemma3_layer_matches_the_op_by_op_layer(gemma, index: int) -> None:
    """Contexts past the window (700, 530 tokens) and within it (40). Measured (Zen 4): 3.2e-7 (sliding)
    and 3.7e-7 (full) relative."""
    model = gemma.model
    assert model.layers[index].is_sliding == (index == 0)
    fused, ref, fused_cache, ref_cache = _layer_pair(model, index, [700, 530, 40])
    assert _rel(fused, ref) < LAYER_RTOL, _rel(fused, ref)
    assert _rel(fused_cache, ref_cache) < LAYER_RTOL


def test_gemma3_rounds_its_down_projections_input_twice(gemma) -> None:
    """Gemma 3's down projection (its input carries the outliers) rounds its remainder again, on both
    paths: two-pass codes (200 + the ggml id) in the fused call, passes=2 on the op-by-op one."""
    model = gemma.model
    for layer, (before, _after) in zip(model.layers, model.routing.fused_layers, strict=True):
        codes = [a for a in before if isinstance(a, list) and a and isinstance(a[0], int)]
        assert all(c >= cpu_layer.TWO_PASS_CODE_BASE for c in codes[3]), codes
        assert all(cpu_layer.QUANT_CODE_BASE <= c < cpu_layer.TWO_PASS_CODE_BASE for part in codes[:3] for c in part)
        assert layer.projections["down_proj"].blocks.activation_passes == 2
        assert {layer.projections[n].blocks.activation_passes for n in ("qkv_proj", "o_proj", "gate_up_proj")} == {1}


def test_gemma3_sliding_layer_attends_its_window_only(gemma) -> None:
    """The same sliding layer without its window bound (window 0: every position) is another
    result (2e-2 apart here): the bound is what makes the two paths agree past 512 tokens."""
    fused, ref, _, _ = _layer_pair(gemma.model, 0, [700, 530, 40], window=0)
    assert _rel(fused, ref) > 1e-3
    fused, ref, _, _ = _layer_pair(gemma.model, 0, [300, 40])  # within the window: the bound changes nothing
    assert _rel(fused, ref) < LAYER_RTOL


def test_the_kernel_plan_times_gemma3s_fused_layer(gemma) -> None:
    """fused_layer.fused_timing's comparison on layer 0 (sliding, the local rope base)."""
    model = gemma.model
    fused_us, layer_us, err = fused_layer._fused_against_layer(
        model, model.layers[0], cpu_layer.load_kernel(), model.routing.fused_layers[0], 1, torch.Generator().manual_seed(0))
    assert fused_us > 0 and layer_us > 0 and err < LAYER_RTOL, err


def _greedy(runner: ModelRunner, prompts: list[list[int]], steps: int, fused: bool,
            monkeypatch: pytest.MonkeyPatch) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Prefill each prompt, then ``steps`` batched greedy decode steps, each sequence with one
    table per KV cache group (disjoint blocks: the groups share the KV tensors)."""
    monkeypatch.setenv(cpu_layer.KERNEL_ENV, "1" if fused else "0")
    groups = len(runner.kv_cache_groups)
    per_seq = 48  # blocks per table: 768 positions
    seqs = [ScheduledSeq(str(i), list(p), 0, [], True, SamplingParams(temperature=0.0),
                         block_tables=[list(range((i * groups + g) * per_seq + 1, (i * groups + g + 1) * per_seq + 1))
                                       for g in range(groups)])
            for i, p in enumerate(prompts)]
    tokens: list[list[int]] = [[] for _ in prompts]
    logits = []
    for _ in range(steps):
        out = runner.logits_for(seqs)
        logits.append(torch.stack([out[s.request_id] for s in seqs]))
        for i, s in enumerate(seqs):
            tokens[i].append(int(out[s.request_id].argmax()))
            s.start_position += len(s.token_ids)
            s.token_ids = [tokens[i][-1]]
    return tokens, logits


def test_gemma3_greedy_decode_fused_equals_op_by_op(cpu_layer_kernel, monkeypatch) -> None:
    """16 greedy tokens of 2 prompts (one past the window) on the hybrid KV cache (six groups: each
    layer its group's table, slots and lengths): the same tokens with the fused layer as without.
    Over 18 layers an activation whose float32 value differs in the last bits between the paths
    (the rotary, GELU, summation order) now and then rounds to the neighbouring int8 step, one of
    1024 inputs moved by 1/127 of its block's max: ~1e-3 on that layer, a few 1e-2 on the logits
    (measured on Zen 4: cosine >= 0.997, as SmolLM2's q4_1x8 pair in test_cpu_layer.py). So the
    prompts are ones whose greedy path has no near-tie (top-2 gap >= 0.3; "The capital of France
    is" has a 0.01 tie at its 12th token, which such a step flips)."""
    from engine.model.loading.startup_cache import cached_tokenizer
    from tests.model.gemma3_fixtures import gemma3_gguf_or_skip

    config = gemma3_config()
    runner = ModelRunner(config, dtype="float32", block_size=BLOCK, attention_backend="torch", quantization="native",
                         kv_cache_groups=kv_cache_groups(config.layer_types, config.sliding_window))
    runner.load_weights()
    runner.allocate_kv_cache(2 * 6 * 48 + 1)
    assert runner.enable_cpu_decode_kernel() is None
    assert runner.model.routing.fused_decode_status(runner.kv_cache_dtype).startswith("enabled")
    tokenizer = cached_tokenizer(gemma3_gguf_or_skip())
    long = " ".join(f"Fact {i}: the number {i} comes after {i - 1}." for i in range(1, 38)) + " Fact 38:"
    prompts = [tokenizer.encode(text, add_special_tokens=True) for text in (long, "Water boils at")]
    assert len(prompts[0]) > config.sliding_window
    ref_tokens, ref_logits = _greedy(runner, prompts, 16, fused=False, monkeypatch=monkeypatch)
    tokens, logits = _greedy(runner, prompts, 16, fused=True, monkeypatch=monkeypatch)
    assert tokens == ref_tokens
    assert torch.equal(logits[0], ref_logits[0])  # the prefill step is not fused
    cos = torch.nn.functional.cosine_similarity(torch.cat(logits[1:]), torch.cat(ref_logits[1:]), dim=-1)
    assert float(cos.min()) > 0.99, float(cos.min())
    assert any(not torch.equal(a, b) for a, b in zip(logits[1:], ref_logits[1:], strict=True))  # really fused
