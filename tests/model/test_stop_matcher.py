"""The Aho-Corasick stop-string matcher (engine/model/loading/tokenizer.py::StopMatcher) against
the matcher it replaced, kept here as the reference: random texts over a small alphabet
(so stop strings occur, overlap and straddle pieces) fed in random pieces with random
stop lists must give the same match (earliest start, the first listed on a tie) and the
same held-back tail after every piece; and the detokenizer with either matcher must
emit the same deltas on the real tokenizer."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.model.loading.tokenizer import IncrementalDetokenizer, StopMatcher


def find_stop_string(text: str, stops: Sequence[str], new_from: int = 0) -> tuple[int, str] | None:
    """The earliest stop string in ``text`` that ends after ``new_from`` (where the new
    text began), as ``(index, stop)``; stop strings may straddle the boundary."""
    best: tuple[int, str] | None = None
    for stop in stops:
        index = text.find(stop, max(0, new_from - len(stop) + 1))
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    return best


class NaiveStopMatcher:
    """The old matcher behind StopMatcher's interface: every stop string searched over the
    text's tail and every prefix of every stop string tried against its end, O(stops x
    length) per piece."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.fed = 0
        self.held = 0

    def feed(self, text: str) -> tuple[int, str] | None:
        before, self.fed = self.fed, len(text)
        if len(text) <= before:
            return None
        match = find_stop_string(text, self.stops, before)
        if match is None:
            self.held = self._partial_stop_suffix(text)
        return match

    def _partial_stop_suffix(self, text: str) -> int:
        longest = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:k]):
                    longest = k
                    break
        return longest


ALPHABET = "ab\n é🤗"


@st.composite
def stop_lists(draw: st.DrawFn, text: str) -> list[str]:
    """Stop strings that often occur in ``text`` (slices of it, so ties, overlaps and
    nested matches are common) mixed with random ones."""
    def piece() -> str:
        if text and draw(st.booleans()):
            start = draw(st.integers(0, len(text) - 1))
            return text[start:start + draw(st.integers(1, 7))]
        return draw(st.text(ALPHABET, min_size=1, max_size=7))
    return [piece() for _ in range(draw(st.integers(1, 8)))]


@settings(max_examples=800, deadline=None)
@given(data=st.data(), text=st.text(ALPHABET, max_size=80), cuts=st.lists(st.integers(0, 80), max_size=20))
def test_matcher_agrees_with_the_naive_reference(data: st.DataObject, text: str, cuts: list[int]) -> None:
    stops = data.draw(stop_lists(text))
    ours, reference = StopMatcher(stops), NaiveStopMatcher(stops)
    for end in [*sorted({c for c in cuts if c <= len(text)}), len(text)]:
        got, want = ours.feed(text[:end]), reference.feed(text[:end])
        assert got == want
        if want is not None:
            return
        assert ours.held == reference.held, text[:end]


def test_ties_go_to_the_stop_listed_first_and_later_ends_can_start_earlier() -> None:
    assert StopMatcher(["abc", "ab"]).feed("xabc") == (1, "abc")
    assert StopMatcher(["ab", "abc"]).feed("xabc") == (1, "ab")
    assert StopMatcher(["bcd", "abcdef"]).feed("abcdef") == (0, "abcdef")
    matcher = StopMatcher(["a" * 5 + "b"])
    for n in range(1, 12):  # a long run of a prefix's character keeps the longest possible hold
        assert matcher.feed("a" * n) is None and matcher.held == min(n, 5)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(words=st.lists(st.sampled_from(["The", " answer", " is", " 42", ".\n", "🤗", " é", "ab", "b"]),
                      min_size=1, max_size=25),
       stops=st.lists(st.sampled_from(["42", "\n", "answer is", "🤗 é", "b.", "s 4", "zzz", "Theab"]),
                      min_size=1, max_size=4),
       include=st.booleans())
def test_detokenizer_emits_the_same_with_either_matcher(smollm_tokenizer, words: list[str], stops: list[str],
                                                        include: bool) -> None:
    ids = smollm_tokenizer.encode("".join(words))
    ours = IncrementalDetokenizer(smollm_tokenizer, stop=stops, include_stop=include)
    reference = IncrementalDetokenizer(smollm_tokenizer, stop=stops, include_stop=include)
    reference.matcher = NaiveStopMatcher(stops)  # type: ignore[assignment]
    got = [ours.add(i) for i in ids] + [ours.finish()]
    want = [reference.add(i) for i in ids] + [reference.finish()]
    assert got == want
    assert (ours.stop_reason, ours.text) == (reference.stop_reason, reference.text)


def test_an_empty_stop_list_is_refused() -> None:
    with pytest.raises(ValueError):
        StopMatcher(["", ""])
