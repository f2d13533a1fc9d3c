"""Weight-only int8: real bytes reported, decode logits close to bf16, same greedy tokens."""

from __future__ import annotations

import pytest
import torch

from engine.errors import UserError
from engine.model.llama import INT8_MAX_ROWS, quantize_int8_per_channel
from engine.runner import ModelRunner, ScheduledSeq
from engine.sampler import SamplingParams


def test_per_channel_int8_round_trip_is_within_half_a_step() -> None:
    weight = torch.randn(64, 48) * torch.linspace(0.01, 3.0, 64)[:, None]
    q, scale = quantize_int8_per_channel(weight)
    assert q.dtype == torch.int8 and int(q.abs().max()) <= 127
    assert torch.all((q.float() * scale[:, None] - weight).abs() <= scale[:, None] / 2 + 1e-6)


def test_unknown_quantization_is_a_user_error(smollm_config) -> None:
    with pytest.raises(UserError, match="--quantization 'fp4'"):
        ModelRunner(smollm_config, quantization="fp4")


def _decode(runner: ModelRunner, prompt: list[int], steps: int,
            forced: list[int] | None = None) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decode, or teacher-forced along ``forced`` so both runners see the same context."""
    seq = ScheduledSeq("a", list(prompt), 0, list(range(8)), True, SamplingParams(temperature=0.0))
    tokens: list[int] = []
    logits: list[torch.Tensor] = []
    for step in range(steps):
        out = runner.logits_for([seq])["a"]
        logits.append(out)
        tokens.append(int(out.argmax()))
        seq.start_position += len(seq.token_ids)
        seq.token_ids = [forced[step] if forced else tokens[-1]]
    return tokens, logits


def test_int8_decode_matches_bf16(smollm_config, smollm_tokenizer) -> None:
    plain = ModelRunner(smollm_config, dtype="bfloat16")
    plain_info = plain.load_weights()
    quant = ModelRunner(smollm_config, dtype="bfloat16", quantization="int8")
    quant_info = quant.load_weights()
    # Real bytes: the bf16 weights plus an int8 copy (1 byte/param) and bf16 scales.
    assert quant_info.weights_bytes > plain_info.weights_bytes * 1.45
    assert quant_info.weights_bytes == quant.model.weights_bytes()
    for runner in (plain, quant):
        runner.allocate_kv_cache(8)
    prompt = smollm_tokenizer.encode("The capital of France is Paris. The capital of Italy is")
    plain_tokens, plain_logits = _decode(plain, prompt, 16)
    quant_tokens, quant_logits = _decode(quant, prompt, 16, forced=plain_tokens)
    agree = sum(a == b for a, b in zip(plain_tokens, quant_tokens, strict=True))
    assert quant_tokens[:3] == plain_tokens[:3] and agree >= 13, (plain_tokens, quant_tokens)
    # Decode steps (1 row <= INT8_MAX_ROWS) went through the int8 kernel: close, not identical.
    assert INT8_MAX_ROWS >= 1
    for a, b in zip(plain_logits[1:], quant_logits[1:], strict=True):
        assert not torch.equal(a, b)
        assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.99
