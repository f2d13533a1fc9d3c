"""OpenAI's logit_bias in the batched sampler: added to the logits before greedy's argmax,
temperature, top-k and top-p; only the rows that carry one change; the caller's logits
are left as they were; and SamplingParams refuses what the sampler could not honour."""

from __future__ import annotations

import math

import pytest
import torch

from engine.core.sampling_params import MAX_LOGIT_BIAS_ENTRIES, SamplingParams
from engine.errors import UserError
from engine.model.sampler import Sampler


def logits_rows(rows: int, vocab: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_rows_take_the_argmax_after_the_bias_and_other_rows_are_untouched() -> None:
    logits = logits_rows(4)
    before = logits.clone()
    first, last = int(logits[0].argmax()), int(logits[2].argmin())
    second = int(logits[0].topk(2).indices[1])
    params = [
        SamplingParams(temperature=0.0, logit_bias={first: -100}),  # banned: the runner-up wins
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logit_bias={last: 100.0}),  # the worst token forced
        SamplingParams(temperature=0.0, logit_bias={}),
    ]
    tokens = Sampler().sample(logits, params).tolist()
    assert tokens == [second, int(logits[1].argmax()), last, int(logits[3].argmax())]
    assert torch.equal(logits, before)  # a failed batch is re-sampled row by row from these


def test_sampled_rows_never_draw_a_banned_token_and_always_draw_a_forced_one() -> None:
    logits = logits_rows(1, vocab=8).expand(300, 8).contiguous()
    top = int(logits[0].argmax())
    sampler = Sampler(seed=5)
    banned = sampler.sample(logits, [SamplingParams(temperature=1.0, top_k=2, logit_bias={top: -100})] * 300)
    assert top not in banned.tolist()
    assert len(set(banned.tolist())) == 2  # top_k=2 applies to the biased logits
    forced = sampler.sample(logits, [SamplingParams(temperature=1.5, top_p=0.9, logit_bias={3: 100})] * 300)
    assert set(forced.tolist()) == {3}


def test_the_bias_is_added_before_the_temperature() -> None:
    rows, temperature = 6000, 0.5
    logits = torch.zeros(rows, 3)
    bias = {0: 0.5, 2: -0.25}
    tokens = Sampler(seed=7).sample(logits, [SamplingParams(temperature=temperature, logit_bias=bias)] * rows)
    want = torch.tensor([0.5, 0.0, -0.25]).div(temperature).softmax(-1)
    freq = torch.bincount(tokens, minlength=3).float() / rows
    assert (freq - want).abs().max().item() < 0.03, (freq, want)


def test_a_seeded_biased_row_samples_the_same_alone_and_in_a_batch() -> None:
    logits = logits_rows(3, vocab=500)
    biased = SamplingParams(temperature=1.0, seed=11, logit_bias={i: -100 for i in range(0, 500, 2)})
    other = SamplingParams(temperature=0.8)
    in_batch = Sampler(seed=0).sample(logits, [other, biased, other], positions=[1, 2, 3])[1]
    alone = Sampler(seed=9).sample(logits[1:2], [biased], positions=[2])[0]
    assert int(in_batch) == int(alone) and int(alone) % 2 == 1


@pytest.mark.parametrize(
    ("bias", "needle"),
    [
        ({-1: 1.0}, "logit_bias key -1"),
        ({True: 1.0}, "logit_bias key True"),
        ({5: 100.5}, "logit_bias value 100.5"),
        ({5: -101}, "logit_bias value -101"),
        ({5: math.nan}, "logit_bias value nan"),
        ({5: math.inf}, "logit_bias value inf"),
        ({5: "1"}, "logit_bias value '1'"),
        ({i: 1.0 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)}, f"at most {MAX_LOGIT_BIAS_ENTRIES:,}"),
    ],
)
def test_bad_logit_bias_is_a_user_error_naming_the_field(bias: dict, needle: str) -> None:
    with pytest.raises(UserError, match=r"^logit_bias") as info:
        SamplingParams(logit_bias=bias)
    assert needle in str(info.value)


def test_the_limits_themselves_are_accepted() -> None:
    params = SamplingParams(logit_bias={i: (-100 if i % 2 else 100) for i in range(MAX_LOGIT_BIAS_ENTRIES)})
    assert len(params.logit_bias) == MAX_LOGIT_BIAS_ENTRIES
