"""Gemma 3 270M in the default suite: its config from the GGUF header, its SentencePiece
tokenizer (ids transformers gives for the same file), its chat template, and a short
greedy generation through the paged cache (fp32; transformers greedy says the same)."""

from __future__ import annotations

import pytest

from engine.core.sampling_params import SamplingParams
from engine.model.runner import ScheduledSeq
from engine.modelspec.config import FULL_ATTENTION, SLIDING_ATTENTION
from engine.modelspec.presets import MODEL_PRESETS
from tests.model.gemma3_fixtures import GEMMA3, gemma3_config, gemma3_gguf_or_skip, gemma3_runner


@pytest.fixture(scope="module")
def runner():
    return gemma3_runner(blocks=32)


@pytest.fixture(scope="module")
def tokenizer():
    from engine.model.loading.startup_cache import cached_tokenizer

    return cached_tokenizer(gemma3_gguf_or_skip())


def test_config_from_the_gguf_header() -> None:
    config = gemma3_config()
    assert (config.architecture, config.num_layers, config.hidden_size, config.intermediate_size) == \
        ("gemma3", 18, 640, 2048)
    assert (config.num_attention_heads, config.num_kv_heads, config.head_dim, config.vocab_size) == (4, 1, 256, 262144)
    assert config.layer_types == ((SLIDING_ATTENTION,) * 5 + (FULL_ATTENTION,)) * 3
    assert (config.sliding_window, config.rope_theta, config.rope_local_base_freq) == (512, 1e6, 1e4)
    assert config.query_pre_attn_scalar == 256 and config.tie_word_embeddings
    assert config.num_parameters == 268_098_176  # google/gemma-3-270m's count
    preset = MODEL_PRESETS[GEMMA3]  # the shapes-only preset agrees with the file
    assert (preset.layer_types, preset.num_parameters) == (config.layer_types, config.num_parameters)


# Ids from transformers 5.x's tokenizer loaded from the same GGUF (tests/model/test_gemma3_tokenizer.py
# compares a few dozen more strings against it directly in the slow suite).
KNOWN_IDS = {
    "The capital of France is": [818, 5279, 529, 7001, 563],
    "  two  spaces": [138, 13498, 138, 35220],
    "naïve café 日本語 🤖": [1789, 238527, 560, 33443, 33375, 238582, 236743, 246143],
    "\n\n\nnewlines\n": [109, 208697, 107],
    "<start_of_turn>user\nHi<end_of_turn>\n": [105, 2364, 107, 10979, 106, 107],
}


@pytest.mark.parametrize("text", list(KNOWN_IDS))
def test_tokenizer_matches_transformers_ids(tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert ids == KNOWN_IDS[text]
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_chat_template_bos_and_stops(tokenizer) -> None:
    rendered = tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": "Hi"}])
    assert rendered == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert tokenizer.encode("Hi", add_special_tokens=True)[0] == tokenizer.bos_token_id == 2
    assert tokenizer.stop_token_ids == [1, 106]  # <eos>, <end_of_turn>


def test_greedy_capital_of_france(runner, tokenizer) -> None:
    """Prefill in two chunks, then decode steps: transformers' greedy continuation (fp32)."""
    prompt = tokenizer.encode("The capital of France is", add_special_tokens=True)
    greedy = SamplingParams(temperature=0.0)
    blocks = [3, 1, 2]
    runner.execute([ScheduledSeq("g", prompt[:3], 0, blocks, False, greedy)])
    out = [runner.execute([ScheduledSeq("g", prompt[3:], 3, blocks, True, greedy)])["g"]]
    while len(out) < 8:
        out.append(runner.execute([ScheduledSeq("g", [out[-1]], len(prompt) + len(out) - 1, blocks, True,
                                                 greedy)])["g"])
    assert tokenizer.decode(out) == " the capital of the country of France."


def test_larger_gemma3_rope_scaling_from_gguf_keys_and_presets() -> None:
    """Gemma 3 4B/12B/27B scale their global layers' rope linearly by 8 (config.json's
    rope_scaling; llama.cpp's converter writes gemma3.rope.scaling.type/factor): read from
    the GGUF keys and carried by the presets; the 270M (no such keys) stays plain."""
    from engine.errors import UserError
    from engine.modelspec.config import RopeScaling
    from engine.modelspec.families import _gemma3_gguf_fields

    scaled = _gemma3_gguf_fields({"gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": 8.0}, 34, 256)
    assert scaled["rope_scaling"] == RopeScaling(rope_type="linear", factor=8.0)
    assert _gemma3_gguf_fields({}, 18, 256)["rope_scaling"] is None
    assert MODEL_PRESETS["gemma-3-4b"].rope_scaling == MODEL_PRESETS["gemma-3-27b"].rope_scaling == scaled["rope_scaling"]
    assert MODEL_PRESETS["gemma-3-270m"].rope_scaling is None
    with pytest.raises(UserError, match="positive 'factor'"):
        _gemma3_gguf_fields({"gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": "8"}, 34, 256)
