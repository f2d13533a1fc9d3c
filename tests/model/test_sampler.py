"""The batched sampler: greedy, temperature, top-k, top-p and per-request seeds."""

from __future__ import annotations

import pytest
import torch

from engine.core.sampling_params import SamplingParams
from engine.errors import UserError
from engine.model.sampler import Sampler


def logits_rows(rows: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_per_row() -> None:
    logits = logits_rows(5)
    tokens = Sampler().sample(logits, [SamplingParams(temperature=0.0)] * 5)
    assert tokens.tolist() == logits.argmax(-1).tolist()


def test_top_k_1_and_tiny_top_p_reduce_to_greedy_in_a_mixed_batch() -> None:
    logits = logits_rows(4)
    params = [
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=5.0, top_p=1e-6),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=1, seed=3),
    ]
    for _ in range(10):
        assert Sampler(seed=_).sample(logits, params).tolist() == logits.argmax(-1).tolist()


def test_top_k_only_returns_the_k_best() -> None:
    logits = logits_rows(1, vocab=100)
    best3 = set(logits[0].topk(3).indices.tolist())
    sampler = Sampler(seed=1)
    seen = {int(sampler.sample(logits, [SamplingParams(temperature=10.0, top_k=3)])[0]) for _ in range(200)}
    assert seen == best3


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    sampler = Sampler(seed=2)
    seen = {int(sampler.sample(probs.log(), [SamplingParams(top_p=0.8)])[0]) for _ in range(300)}
    assert seen == {0, 1}


def test_temperature_one_follows_the_distribution() -> None:
    probs = torch.tensor([0.6, 0.3, 0.1])
    sampler = Sampler(seed=4)
    logits = probs.log().expand(4000, 3).contiguous()
    tokens = sampler.sample(logits, [SamplingParams(temperature=1.0)] * 4000)
    freq = torch.bincount(tokens, minlength=3).float() / 4000
    assert (freq - probs).abs().max().item() < 0.03


def test_seed_reproduces_whatever_the_batch_and_position_matters() -> None:
    logits = logits_rows(3, vocab=1000)
    seeded = SamplingParams(temperature=1.0, seed=123)
    other = SamplingParams(temperature=1.0)
    first = Sampler(seed=0).sample(logits, [other, seeded, other], positions=[5, 7, 5])[1]
    alone = Sampler(seed=99).sample(logits[1:2], [seeded], positions=[7])[0]
    assert int(first) == int(alone)
    draws = {int(Sampler().sample(logits[1:2], [seeded], positions=[p])[0]) for p in range(30)}
    assert len(draws) > 1


@pytest.mark.parametrize(
    "kwargs", [{"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -2}, {"max_tokens": 0}]
)
def test_bad_parameters_are_user_errors(kwargs: dict) -> None:
    with pytest.raises(UserError):
        SamplingParams(**kwargs)


def test_single_stop_string_becomes_a_list() -> None:
    assert SamplingParams(stop="END").stop == ["END"]  # type: ignore[arg-type]
