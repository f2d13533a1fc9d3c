"""The phase -> span-name table covers every phase and keeps vLLM's names."""

import pytest

from engine.events import PHASES
from engine.events.phase_names import API_SERVER_SETUP, PHASE_SPANS, VLLM_GROUPS, span_name, vllm_group


def test_every_phase_has_a_span_name_and_vllms_names_are_kept() -> None:
    assert list(PHASE_SPANS) == list(PHASES)
    assert [span_name(letter) for letter in "ACF"] == ["Init device", "Load model", "Compile/warmup"]
    assert API_SERVER_SETUP == "API server setup"
    assert len({span.span_name for span in PHASE_SPANS.values()}) == len(PHASES)
    assert all(letter in PHASES for letters in VLLM_GROUPS.values() for letter in letters)
    assert vllm_group("E") == "Prepare model" and vllm_group("C") is None


def test_an_unknown_letter_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match="expected one of A, B, C, D, E, F, G"):
        span_name("H")
