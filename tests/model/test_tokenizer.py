"""Our tokenizer (built from the GGUF vocabulary and merges) against HF transformers
loading the same GGUF, the chat template, and incremental detokenizing with stop strings."""

from __future__ import annotations

import pytest

from engine.model.loading.tokenizer import IncrementalDetokenizer, StopMatcher

TRICKY = [
    "Hello world", "  leading spaces", "trailing spaces   ", "tabs\tand\nnewlines\r\n\n\n",
    "émojis 🤗👍🏽 and ZWJ 👩‍👩‍👧", "中文字符和日本語のテキスト", "<|im_start|>user\nhi<|im_end|>",
    "don't won't it's I'M WE'LL", "a    b", "https://example.com/a?b=c&d=%20", "price 12345.67 and 3,000,000",
    "x" * 60, "Ñandú über café naïve", "\u200b zero width\u00a0nbsp", "<|endoftext|> in text", "def f(x):\n    return x**2",
    "", " ", "\n",
]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "What is the capital of France?"},
]


@pytest.mark.slow  # transformers' own GGUF tokenizer takes ~9 s to build (make test-slow)
@pytest.mark.parametrize("text", TRICKY)
def test_encoding_matches_transformers(text: str, smollm_tokenizer, hf_gguf_tokenizer) -> None:
    ours = smollm_tokenizer.encode(text)
    assert ours == hf_gguf_tokenizer.encode(text, add_special_tokens=False)
    assert smollm_tokenizer.decode(ours, skip_special_tokens=False) == text


def test_digits_are_single_tokens_as_in_smollm2s_own_tokenizer(smollm_tokenizer) -> None:
    ids = smollm_tokenizer.encode("2024")
    assert [smollm_tokenizer.id_to_token(i) for i in ids] == ["2", "0", "2", "4"]


@pytest.mark.slow  # transformers' GGUF tokenizer, as above
def test_chat_template_matches_transformers(smollm_tokenizer, hf_gguf_tokenizer) -> None:
    for add in (True, False):
        ours = smollm_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=add)
        theirs = hf_gguf_tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=add)
        assert ours == theirs
    assert smollm_tokenizer.apply_chat_template(MESSAGES, tokenize=True) == smollm_tokenizer.encode(
        smollm_tokenizer.apply_chat_template(MESSAGES)
    )


def test_special_tokens(smollm_tokenizer) -> None:
    assert smollm_tokenizer.bos_token_id == 1
    assert smollm_tokenizer.eos_token_id == 2
    assert smollm_tokenizer.id_to_token(2) == "<|im_end|>"
    assert 2 in smollm_tokenizer.stop_token_ids
    assert smollm_tokenizer.decode([1, 19556, 2]) == "Hello"
    assert smollm_tokenizer.vocab_size == 49152


def test_incremental_detokenizer_equals_full_decode(smollm_tokenizer) -> None:
    text = "Grüße 🤗👍🏽 中文 — done."
    ids = smollm_tokenizer.encode(text)
    detok = IncrementalDetokenizer(smollm_tokenizer)
    deltas = [detok.add(i) for i in ids] + [detok.finish()]
    assert "".join(deltas) == detok.text == text
    assert not any("\ufffd" in d for d in deltas)  # partial UTF-8 held back


@pytest.mark.parametrize(("include", "expected"), [(False, "The answer is 4"), (True, "The answer is 42.\n")])
def test_stop_string_straddling_tokens_cuts_the_text(smollm_tokenizer, include: bool, expected: str) -> None:
    ids = smollm_tokenizer.encode("The answer is 42.\nMore text that must not appear.")
    detok = IncrementalDetokenizer(smollm_tokenizer, stop=["2.\n", "zzz"], include_stop=include)
    emitted = "".join(detok.add(i) for i in ids) + detok.finish()
    assert detok.stop_reason == "2.\n"
    assert detok.text == emitted == expected


def test_stop_matcher_finds_the_earliest_stop_and_holds_a_possible_start() -> None:
    assert StopMatcher(["END", "STOP"]).feed("abcSTOPxyEND") == (3, "STOP")
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("xxST") is None and matcher.held == 2
    assert matcher.feed("xxSTOP") == (2, "STOP")  # straddles the two pieces


def test_text_that_may_start_a_stop_string_is_held_until_finish(smollm_tokenizer) -> None:
    detok = IncrementalDetokenizer(smollm_tokenizer, stop=["Hello there"])
    emitted = "".join(detok.add(i) for i in smollm_tokenizer.encode("Say Hello"))
    assert emitted == "Say "
    assert detok.finish() == "Hello"
    assert detok.stop_reason is None
