"""The sampled tokens' log-probabilities: an fp32 log-softmax of the sampler's own logits
(vLLM's raw logprobs: before bias and temperature), with the rank and the alternatives,
and nothing computed for a batch that asks for none."""

from __future__ import annotations

import pytest
import torch

from engine.core.sampling_params import SamplingParams
from engine.errors import UserError
from engine.model.runner import ModelRunner, ScheduledSeq
from engine.model.sampler import Sampler, token_logprobs


def test_logprobs_are_the_log_softmax_of_the_sampled_rows() -> None:
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 50, generator=generator).to(torch.bfloat16)  # computed in fp32 whatever comes in
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, seed=1, logit_bias={7: 5.0}),
              SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=2)]
    tokens = Sampler().sample(logits.float(), params).tolist()
    rows, counts = [1, 2, 3], [3, 0, 5]
    found = token_logprobs(logits, rows, [tokens[r] for r in rows], counts)
    expected = torch.log_softmax(logits.float(), dim=-1)
    for entry, row, count in zip(found, rows, counts, strict=True):
        assert entry.token_id == tokens[row]
        assert entry.logprob == pytest.approx(float(expected[row, tokens[row]]), abs=1e-6)
        assert entry.rank == 1 + int((expected[row] > expected[row, tokens[row]]).sum())
        best = expected[row].topk(count)
        assert [t for t, _ in entry.top] == best.indices.tolist()
        assert [lp for _, lp in entry.top] == pytest.approx(best.values.tolist(), abs=1e-6)
    assert found[1].rank == 1 and found[1].top == ()  # greedy: the argmax, no alternatives asked


@pytest.mark.slow  # a real forward of the bundled model: ~16 s on the loaded 2-core Zen 4
def test_the_runner_computes_logprobs_only_for_rows_that_ask(smollm_runner_fp32: ModelRunner) -> None:
    prompt = [504, 3575, 282, 4649, 314]  # "The capital of France is"
    asks = SamplingParams(temperature=0, logprobs=4)
    batch = [ScheduledSeq("asks", prompt, 0, [0], True, asks),
             ScheduledSeq("quiet", prompt, 0, [1], True, SamplingParams(temperature=0))]
    logits = smollm_runner_fp32.logits_for(batch)
    sampled = smollm_runner_fp32.execute(batch)
    entries = smollm_runner_fp32.last_logprobs
    assert set(entries) == {"asks"}
    expected = torch.log_softmax(logits["asks"].float(), dim=-1)
    entry = entries["asks"]
    assert entry.token_id == sampled["asks"] and entry.rank == 1
    assert entry.logprob == pytest.approx(float(expected.max()), abs=1e-5)
    assert [t for t, _ in entry.top] == expected.topk(4).indices.tolist()
    smollm_runner_fp32.execute(batch[1:])
    assert smollm_runner_fp32.last_logprobs == {}


def test_a_logprobs_count_out_of_range_is_refused() -> None:
    with pytest.raises(UserError, match="logprobs 21"):
        SamplingParams(logprobs=21)
