"""kvscope's Gemma 3 tokenizer (built from the GGUF with the tokenizers library) against
transformers' tokenizer loaded from the same GGUF, over varied text."""

from __future__ import annotations

import pytest

from tests.model.gemma3_fixtures import gemma3_gguf_or_skip

TEXTS = [
    "The capital of France is", "Hello, world!", "hello world", " leading space", "trailing space ",
    "  two  spaces", "\ttab\tseparated\t", "    four-space indent", "a\n\nb\n\n\nc", "\r\nwindows\r\nlines",
    "naïve café résumé", "日本語のテキスト", "Привет, мир", "مرحبا بالعالم", "emoji 🤖🚀👍🏽 and ZWJ 👨‍👩‍👧",
    "12345 67890", "3.14159 2.71828", "1,000,000 and 1e-9", "0x1F 0b1010 0o777", "phone: +1 (555) 010-9999",
    "def f(x):\n    return x ** 2\n", "for (int i = 0; i < n; ++i) { sum += a[i]; }", "SELECT * FROM t WHERE id=1;",
    "<div class=\"x\">&amp;</div>", "https://example.com/a?b=c&d=e#f", "user@example.com",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n", "<bos>text<eos>", "[multimodal] tag",
    "A\u00a0non-breaking\u2009thin space", "zero\u200bwidth", "\u0000nul and \u007fdel", "ﬁ ligature Ⅻ",
    "", " ", "   ", "\n", "!!!???...", "CamelCaseIdentifierWithManyParts", "snake_case_identifier_here",
]


@pytest.mark.slow  # transformers builds the 262,144-token tokenizer from the GGUF: ~60 s on 2 cores
def test_encodings_match_transformers() -> None:
    transformers = pytest.importorskip("transformers")
    from engine.model.loading.startup_cache import cached_tokenizer

    path = gemma3_gguf_or_skip()
    ours = cached_tokenizer(path)
    reference = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    mismatched = [(text, ours.encode(text), reference.encode(text, add_special_tokens=False))
                  for text in TEXTS if ours.encode(text) != reference.encode(text, add_special_tokens=False)]
    assert not mismatched
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=True)
        assert ids == reference.encode(text)  # <bos> first, as transformers adds it
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)
