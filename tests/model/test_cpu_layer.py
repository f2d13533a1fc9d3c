"""The fused decode layer (engine/model/kernels/cpu_layer.py) against the op-by-op path it
replaces: the same real model, the same contexts, logits within float32 summation noise
and the same greedy tokens; a QKV bias, an int8 KV cache and a batch past the GEMV's
rows included; prefill steps stay on the op-by-op path (bit-equal logits). The tight
comparisons keep Q4_1 row by row with float activations (KVSCOPE_CPU_INT8_ACTIVATIONS=0),
where the two paths differ only in summation order; with the default q4_1x8 (activations
rounded to int8) a value on a rounding boundary lands one step apart, so that pair is
compared by tokens and cosine."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.core.sampling_params import SamplingParams
from engine.model.kernels import cpu_gemv, cpu_layer
from engine.model.loading import weight_blocks
from engine.model.runner import ModelRunner, ScheduledSeq

GREEDY = SamplingParams(temperature=0.0)


def _runner(config, kv_cache_dtype: str = "auto", int8_activations: bool = False, **kwargs) -> ModelRunner:
    runner = ModelRunner(config, dtype="float32", quantization="int4", kv_cache_dtype=kv_cache_dtype, **kwargs)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(cpu_gemv.INT8_ACTIVATIONS_ENV, "1" if int8_activations else "0")
        runner.load_weights()
    runner.allocate_kv_cache(96)  # 8 blocks for each of up to 12 sequences
    assert runner.enable_cpu_decode_kernel() is None
    return runner


@pytest.fixture(scope="module")
def bundled_runner(cpu_layer_kernel, smollm_config) -> ModelRunner:
    """The bundled model at int4 with a float32 cache, loaded once for the tests that only read it
    (each prefills its own sequences into the same blocks): a load is ~3 s of the default suite."""
    return _runner(smollm_config)


def _decode(runner: ModelRunner, prompts: list[list[int]], steps: int, fused: bool,
            monkeypatch: pytest.MonkeyPatch,
            forced: list[list[int]] | None = None) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Prefill every prompt (one step), then ``steps`` batched greedy decode steps,
    with the fused layer switched on or off for the decode steps; ``forced`` feeds
    those tokens instead of the argmax (teacher forcing)."""
    monkeypatch.setenv(cpu_layer.KERNEL_ENV, "1" if fused else "0")
    seqs = [ScheduledSeq(str(i), list(p), 0, list(range(i * 8, i * 8 + 8)), True, GREEDY)
            for i, p in enumerate(prompts)]
    tokens: list[list[int]] = [[] for _ in prompts]
    logits = []
    for _ in range(steps + 1):
        out = runner.logits_for(seqs)
        logits.append(torch.stack([out[s.request_id] for s in seqs]))
        for i, s in enumerate(seqs):
            tokens[i].append(int(out[s.request_id].argmax()))
            s.start_position += len(s.token_ids)
            s.token_ids = [forced[i][len(tokens[i]) - 1] if forced else tokens[i][-1]]
    return tokens, logits


def _compare(runner: ModelRunner, prompts: list[list[int]], steps: int, monkeypatch: pytest.MonkeyPatch,
             atol: float) -> None:
    ref_tokens, ref_logits = _decode(runner, prompts, steps, fused=False, monkeypatch=monkeypatch)
    tokens, logits = _decode(runner, prompts, steps, fused=True, monkeypatch=monkeypatch)
    assert tokens == ref_tokens
    assert torch.equal(logits[0], ref_logits[0])  # the prefill step is not fused
    worst = max(float((a - b).abs().max()) for a, b in zip(logits[1:], ref_logits[1:], strict=True))
    assert worst < atol, worst
    # The decode steps really ran another path: float32 sums in another order differ somewhere.
    assert any(not torch.equal(a, b) for a, b in zip(logits[1:], ref_logits[1:], strict=True))


def test_fused_layer_matches_the_op_by_op_step(bundled_runner, cpu_layer_kernel, smollm_config, smollm_tokenizer, monkeypatch) -> None:
    """The bundled GGUF at int4 (its own Q4_1 blocks), 3 sequences x 12 decode steps.
    Measured (AVX2 Zen 3): identical greedy tokens, logits within 2.8e-5 of the op-by-op path."""
    runner = bundled_runner
    # A GGUF read as blocks holds no float copy of its projections: the GEMV serves every batch size.
    assert runner.model.routing.fused_decode_status(runner.kv_cache_dtype) == (
        "enabled for pure-decode steps of <= 256 sequences (GEMV at every batch size)")
    prompts = [smollm_tokenizer.encode(p) for p in ("The capital of France is", "def add(a, b):", "Once upon")]
    _compare(runner, prompts, 12, monkeypatch, atol=2e-3)


def test_fused_layer_with_int8_activations_matches_the_op_by_op_step(cpu_layer_kernel, smollm_config,
                                                                     smollm_tokenizer, monkeypatch) -> None:
    """The default q4_1x8 projections in both paths, 12 sequences (more than one 8-row
    tile) x 8 steps, the fused path teacher-forced along the op-by-op tokens. An activation
    on a rounding boundary lands one int8 step apart when the float sums before it differ
    in the last bit (float activations agree to 2.8e-5 above), so this compares tokens and
    cosine. Measured (AVX2 Zen 3): 104/108 tokens, min logit cosine 0.9972."""
    runner = _runner(smollm_config, int8_activations=True)
    assert {p.blocks.fmt for layer in runner.model.layers for p in layer.projections.values() if p.blocks} == {"q4_1x8"}
    assert runner.model.routing.fused_decode_status(runner.kv_cache_dtype) == (
        "enabled for pure-decode steps of <= 256 sequences (GEMV at every batch size)")
    texts = ["The capital of France is", "def add(a, b):", "Once upon a time", "The three primary colors are",
             "import numpy as", "Water boils at", "My favourite book is", "The quick brown fox",
             "In 1969, the first", "To make a cup of tea,", "SELECT name FROM", "The speed of light is"]
    prompts = [smollm_tokenizer.encode(t) for t in texts]
    ref_tokens, ref_logits = _decode(runner, prompts, 8, fused=False, monkeypatch=monkeypatch)
    tokens, logits = _decode(runner, prompts, 8, fused=True, monkeypatch=monkeypatch, forced=ref_tokens)
    agree = sum(a == b for ref, got in zip(ref_tokens, tokens, strict=True) for a, b in zip(ref, got, strict=True))
    assert agree >= 0.95 * sum(len(t) for t in ref_tokens), (agree, ref_tokens, tokens)
    assert torch.equal(logits[0], ref_logits[0])
    cos = torch.nn.functional.cosine_similarity(torch.cat(logits[1:]), torch.cat(ref_logits[1:]), dim=-1)
    assert float(cos.min()) > 0.99, float(cos.min())


def test_fused_layer_with_an_int8_kv_cache(cpu_layer_kernel, smollm_config, smollm_tokenizer, monkeypatch) -> None:
    """The int8 cache rows (values and the fp32 scale after them) are written as kv_quant
    writes them, so both paths read the same cache. Measured: identical tokens, max logit
    difference 3.0e-2 (AVX2, per-row decode kernel) and 0.20-0.25 (Zen 4, the tiled decode
    kernel): a value on a rounding boundary lands one int8 step apart, and 30 layers of
    one-step differences in K and V add up in the later steps."""
    runner = _runner(smollm_config, kv_cache_dtype="int8")
    assert runner.model.routing.fused_decode_status(runner.kv_cache_dtype).startswith("enabled")
    prompts = [smollm_tokenizer.encode(p) for p in ("The three primary colors are", "import numpy as")]
    _compare(runner, prompts, 8, monkeypatch, atol=0.35)


def test_fused_layer_with_a_bf16_kv_cache(cpu_layer_kernel, smollm_config, smollm_tokenizer, monkeypatch) -> None:
    """The bf16 cache (the CPU default under --dtype auto where bf16 is native): K and V rounded
    to nearest even as torch's .to(bfloat16) rounds them, float32 queries and sums on both paths.
    Same tokens; a K or V value on a rounding boundary can land one bf16 step apart when the
    float sums before it differ (measured on Zen 4: max logit difference 2.3e-2)."""
    runner = _runner(smollm_config, kv_cache_dtype="bfloat16")
    assert runner.model.routing.fused_decode_status(runner.kv_cache_dtype).startswith("enabled")
    prompts = [smollm_tokenizer.encode(p) for p in ("The three primary colors are", "import numpy as")]
    _compare(runner, prompts, 8, monkeypatch, atol=0.08)


def test_fused_layer_with_a_qkv_bias(cpu_layer_kernel, smollm_config, monkeypatch) -> None:
    """Dummy weights packed to Q4_1, with a QKV bias (Qwen2's layout) and an untied head."""
    config = dataclasses.replace(smollm_config, num_layers=2, vocab_size=4096, tie_word_embeddings=False,
                                 attention_bias=True, source="preset", path=None)
    runner = _runner(config, load_format="dummy")
    with torch.no_grad():
        for layer in runner.model.layers:
            assert layer.qkv_bias is not None
            layer.qkv_bias.uniform_(-0.5, 0.5)
    assert runner.model.routing.fused_decode_status(runner.kv_cache_dtype).startswith("enabled")
    _compare(runner, [list(range(5, 40)), list(range(100, 117))], 6, monkeypatch, atol=1e-3)


def test_batches_beyond_the_gemv_rows_use_float_gemm_inside_the_call(cpu_layer_kernel, smollm_config,
                                                                     monkeypatch) -> None:
    """12 sequences (more rows than the GEMV serves): each projection multiplies the float
    weights with torch's GEMM inside the fused call, as F.linear does in the op-by-op path.
    The float weights are made again from the blocks (a GGUF read as blocks holds none)."""
    runner = _runner(smollm_config)
    assert weight_blocks.restore_float_weights(runner.model) > 0
    runner.model.routing.resolve()
    assert runner.model.routing.fused_decode_status(runner.kv_cache_dtype) == (
        "enabled for pure-decode steps of <= 256 sequences (GEMV up to 8 rows, float GEMM above)")
    prompts = [[100 + i, 200 + i, 300 + i, 400 + i] for i in range(12)]
    _compare(runner, prompts, 3, monkeypatch, atol=2e-3)


def test_status_names_why_the_fused_layer_is_off(bundled_runner, cpu_layer_kernel, smollm_config, monkeypatch) -> None:
    runner = bundled_runner
    assert runner.model.routing.fused_decode_status(torch.float16).startswith("off: torch.float16 KV cache")
    monkeypatch.setenv(cpu_layer.KERNEL_ENV, "0")
    assert runner.model.routing.fused_decode_status(torch.float32) == f"off: {cpu_layer.KERNEL_ENV}=0"
    plain = ModelRunner(smollm_config, dtype="float32", quantization=None)
    assert plain.model.routing.fused_decode_status(torch.float32).startswith("off: no quantized projections")
