"""Our GGUF loader + model + paged attention against HF transformers' own GGUF
loading of the same file, both in float32."""

from __future__ import annotations

import pytest
import torch

from engine.model.runner import ScheduledSeq

# With the template's default system prompt this is 37 tokens.
CHAT = [{"role": "user", "content": "Name three primary colors, please."}]
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]  # a 0.08-logit near-tie at its first token
# The README's question: each of its ten answer tokens leads by >= 2.1 logits in fp32, --dtype auto
# and bf16 (Zen 4), so every path answers it alike. The end-of-text after them leads " This" by only
# 0.28, which a plan's bf16 prefill may flip: the README's examples stop at WATER_TOKENS.
WATER = [{"role": "user", "content": "What is the chemical symbol for water?"}]
WATER_ANSWER = "The chemical symbol for water is H2O."
WATER_TOKENS = 10


def chat_ids(tokenizer, messages) -> list[int]:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)


def test_chat_prompt_is_37_tokens(smollm_tokenizer) -> None:
    assert len(chat_ids(smollm_tokenizer, CHAT)) == 37


# Both transformers comparisons run in make test-slow: loading transformers' GGUF model takes
# ~20 s on 2 cores and imports triton, whose nanobind bindings print a leak report at exit.
@pytest.mark.slow
def test_logits_match_transformers_within_1e3(smollm_runner_fp32, smollm_tokenizer, hf_gguf_model) -> None:
    ids = chat_ids(smollm_tokenizer, CHAT)
    ours = smollm_runner_fp32.logits_for([ScheduledSeq("r", ids, 0, list(range(3)))])["r"]
    with torch.inference_mode():
        reference = hf_gguf_model(torch.tensor([ids])).logits[0, -1].float()
    assert ours.shape == reference.shape == (49152,)
    assert (ours - reference).abs().max().item() < 1e-3


@pytest.mark.slow  # 40 greedy tokens in both engines: ~15 s on 2 cores
def test_greedy_40_tokens_identical_to_transformers(greedy_generate, smollm_tokenizer, hf_gguf_model) -> None:
    ids = chat_ids(smollm_tokenizer, CHAT)
    ours = greedy_generate([ids], 40)[0]
    with torch.inference_mode():
        reference = hf_gguf_model.generate(
            torch.tensor([ids]), max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=2
        )[0, len(ids) :].tolist()
    assert ours == reference


def test_france_prompt_answers_paris(greedy_generate, smollm_tokenizer) -> None:
    ids = chat_ids(smollm_tokenizer, FRANCE)
    text = smollm_tokenizer.decode(greedy_generate([ids], 10)[0])
    assert text.startswith("The capital of France is Paris."), text
