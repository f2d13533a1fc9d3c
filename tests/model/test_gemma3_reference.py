"""Gemma 3 270M through kvscope's real path (paged cache, chunked prefill, decode steps,
the sliding-window layers masked to 512 positions) against transformers'
Gemma3ForCausalLM loaded from the same GGUF, both in float32, teacher-forced."""

from __future__ import annotations

import pytest
import torch

from tests.model.gemma3_fixtures import gemma3_gguf_or_skip, gemma3_runner, run_teacher_forced

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea,",
    "Les trois couleurs du drapeau français sont",
    "Q: What is 17 times 23?\nA:",
    "Photosynthesis is the process by which plants",
]
FORCED_TOKENS = 32
# Measured (fp32, AVX-512 Zen 4, 2 threads): 192/192 top-1, max |diff| 7.8e-05; past the window
# 32/32, 5.0e-05. The bounds leave room for another CPU's summation order, not for a wrong layer.
MIN_TOP1_AGREEMENT = 0.99
MAX_LOGIT_DIFF = 1e-3


@pytest.fixture(scope="module")
def hf_gemma3():
    transformers = pytest.importorskip("transformers")
    path = gemma3_gguf_or_skip()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def runner():
    return gemma3_runner(blocks=64)


@pytest.fixture(scope="module")
def block_runner():
    """The file's own blocks (Q4_K, Q5_0, Q6_K, Q8_0) multiplied with int8 activations."""
    return gemma3_runner(blocks=64, quantization="native")


@pytest.fixture(scope="module")
def tokenizer():
    from engine.model.loading.startup_cache import cached_tokenizer

    return cached_tokenizer(gemma3_gguf_or_skip())


def _compare(runner, hf, prompt_ids: list[int], chunk: int) -> tuple[int, int, float]:
    with torch.inference_mode():
        generated = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=FORCED_TOKENS, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, len(prompt_ids):].tolist()
        reference = hf(torch.tensor([prompt_ids + generated])).logits[0, len(prompt_ids) - 1 : -1].float()
    blocks = list(range(-(-(len(prompt_ids) + FORCED_TOKENS) // 16)))
    ours = torch.stack(run_teacher_forced(runner, prompt_ids, generated, chunk, blocks))
    agree = int((ours.argmax(-1) == reference.argmax(-1)).sum())
    return agree, len(generated), float((ours - reference).abs().max())


@pytest.mark.slow  # transformers' GGUF load of Gemma 3 takes ~80 s on 2 cores
def test_teacher_forced_agreement_with_transformers(runner, hf_gemma3, tokenizer) -> None:
    agree = total = 0
    worst = 0.0
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt, add_special_tokens=True)
        a, n, diff = _compare(runner, hf_gemma3, ids, chunk=5)
        agree, total, worst = agree + a, total + n, max(worst, diff)
    print(f"\nGemma 3 270M vs transformers, fp32: top-1 {agree}/{total}, max |logit diff| {worst:.3g}")
    assert total == len(PROMPTS) * FORCED_TOKENS
    assert agree / total >= MIN_TOP1_AGREEMENT
    assert worst < MAX_LOGIT_DIFF


@pytest.mark.slow
def test_past_the_sliding_window_agrees_with_transformers(runner, hf_gemma3, tokenizer) -> None:
    """A 700-token prompt: the sliding layers' queries past position 511 must not see the
    oldest keys (prefill in 256-token chunks, then decodes, all beyond the window)."""
    text = " ".join(f"Item {i}: the {['red', 'green', 'blue', 'small', 'large'][i % 5]} box." for i in range(120))
    ids = tokenizer.encode(text, add_special_tokens=True)[:700]
    assert len(ids) == 700
    agree, total, worst = _compare(runner, hf_gemma3, ids, chunk=256)
    print(f"\nGemma 3 270M, 700-token prompt vs transformers, fp32: top-1 {agree}/{total}, max diff {worst:.3g}")
    assert agree / total >= MIN_TOP1_AGREEMENT
    assert worst < MAX_LOGIT_DIFF


# The int8-activation path rounds every projection's input per 32 values (amax / 127, round half to even,
# as llama.cpp's Q8_0/Q8_1); on one-row steps Gemma 3's down projection twice (its remainder rounded
# again). Measured on AMD Zen 4, AVX-512 VNNI, 1 thread; the bound is the issue's.
# * Top-1 against transformers' fp32 here: 189/192; 188-190 with the prompts prefilled in chunks of 3, 4
#   or 7 tokens. Rounding once everywhere: 185/192 (184-188 over the chunkings, 186-187 op by op). The
#   misses are near-ties: 6 of these 192 reference positions have top-1 and top-2 within 0.02 logits.
# * The kernels are the rounding and no more: on this model's real activations each projection equals a
#   float64 matmul of the rounded activations with gguf's dequantized weights to 2e-7 (relative); the
#   rounding moves its output by 0.4-2 % of the largest. No projection carries it alone: each group
#   rounded alone on float weights (std of the top-2 gap's error) qkv 0.075, gate/up 0.081, down 0.063,
#   o 0.024 logits; all four 0.145.
# * llama.cpp (llama-cpp-python 0.3.36, Q8_0/Q8_K activations) on the same tokens: 186/192 (one batch),
#   185/192 (a token at a time), gap error 0.21. 24 other prompts (768 tokens): ours 756 (rounding
#   once 751), llama.cpp 747-750.
# * Every projection rounded twice: 192/192, but +25 % on the layers' matmuls (~+6.7 % of a decode step);
#   the down projection's one-row second pass: +0.37 ms of a ~20 ms single-stream step (+1-2 %).
MIN_TOP1_BLOCKS = 0.97


@pytest.mark.slow
def test_blocks_with_int8_activations_agree_with_transformers(block_runner, hf_gemma3, tokenizer) -> None:
    assert block_runner.model.routing.resolve() is None  # every projection on its block kernel
    agree = total = 0
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt, add_special_tokens=True)
        a, n, _ = _compare(block_runner, hf_gemma3, ids, chunk=5)
        agree, total = agree + a, total + n
    print(f"\nGemma 3 270M blocks + int8 activations vs transformers fp32: top-1 {agree}/{total}")
    assert agree / total >= MIN_TOP1_BLOCKS
