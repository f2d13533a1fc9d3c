"""vLLM's prompt_logprobs in the runner: the LM head on every prompt row of a chunk, only
for the sequences that ask, equal to a log-softmax of the model's own full-sequence fp32
logits however the prompt is chunked; nothing extra runs for a batch that does not ask."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.core.sampling_params import SamplingParams
from engine.errors import UserError
from engine.model.runner import ModelRunner, ScheduledSeq
from engine.model.sampler import prompt_token_logprobs
from engine.modelspec.config import ModelConfig

PROMPT_LEN = 70
CHUNKS = ((0, 30), (30, 40))  # (start, tokens): the prompt over two prefill steps


@pytest.fixture(scope="module")
def tiny_runner(smollm_config: ModelConfig) -> ModelRunner:
    """SmolLM2's layout cut to 2 layers and a 4,096-token vocabulary, random weights, fp32."""
    config = dataclasses.replace(smollm_config, num_layers=2, vocab_size=4096, source="preset", path=None)
    runner = ModelRunner(config, dtype="float32", load_format="dummy", attention_backend="torch")
    runner.load_weights()
    runner.allocate_kv_cache(16)
    return runner


def _prompt() -> list[int]:
    return torch.randint(3, 4096, (PROMPT_LEN,), generator=torch.Generator().manual_seed(0)).tolist()


def _targets(prompt: list[int], start: int, num_tokens: int) -> list[int]:
    return prompt[start + 1:min(start + num_tokens, len(prompt) - 1) + 1]


@torch.inference_mode()
def _full_sequence_logprobs(runner: ModelRunner, prompt: list[int]) -> torch.Tensor:
    prepared = runner.prepare([ScheduledSeq("whole", prompt, 0, list(range(8)), True, SamplingParams())])
    hidden = runner.model(prepared.input_ids, prepared.positions, runner.kv_caches, prepared.model_meta)
    return runner.model.compute_logits(hidden).float().log_softmax(dim=-1)


def test_chunked_prompt_logprobs_equal_the_full_sequence_log_softmax(tiny_runner: ModelRunner) -> None:
    prompt = _prompt()
    expected = _full_sequence_logprobs(tiny_runner, prompt)
    asks = SamplingParams(temperature=0, prompt_logprobs=3)
    found, rows = [], 0
    for start, n in CHUNKS:
        seq = ScheduledSeq("asks", prompt[start:start + n], start, list(range(8)), start + n == PROMPT_LEN, asks,
                           prompt_targets=_targets(prompt, start, n))
        with torch.inference_mode():
            tiny_runner.execute([seq])
        found += tiny_runner.last_prompt_logprobs["asks"]
        rows += tiny_runner.last_prompt_logprob_rows
    assert rows == len(found) == PROMPT_LEN - 1  # the last position predicts an output token
    for position, entry in enumerate(found):
        row = expected[position]
        assert entry.token_id == prompt[position + 1]
        assert entry.logprob == pytest.approx(float(row[entry.token_id]), abs=1e-4)
        assert entry.rank == 1 + int((row > row[entry.token_id]).sum())
        assert [t for t, _ in entry.top] == row.topk(3).indices.tolist()


def test_a_batch_without_prompt_logprobs_runs_the_head_on_sampled_rows_only(tiny_runner: ModelRunner) -> None:
    prompt = _prompt()
    quiet = ScheduledSeq("quiet", prompt[:30], 0, list(range(8)), False, SamplingParams(temperature=0))
    asks = ScheduledSeq("asks", prompt[:30], 0, list(range(8, 16)), False, SamplingParams(prompt_logprobs=0),
                        prompt_targets=_targets(prompt, 0, 30))
    with torch.inference_mode():
        tiny_runner.execute([quiet, asks])
        assert set(tiny_runner.last_prompt_logprobs) == {"asks"} and tiny_runner.last_prompt_logprob_rows == 30
        assert all(entry.top == () for entry in tiny_runner.last_prompt_logprobs["asks"])
        tiny_runner.execute([quiet])
    assert tiny_runner.last_prompt_logprobs == {} and tiny_runner.last_prompt_logprob_rows == 0


def test_prompt_token_logprobs_are_each_rows_log_softmax() -> None:
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    tokens = [3, 9, 0, 39, 17]
    expected = logits.float().log_softmax(dim=-1)
    for i, entry in enumerate(prompt_token_logprobs(logits, tokens, 2)):
        assert entry.token_id == tokens[i]
        assert entry.logprob == pytest.approx(float(expected[i, tokens[i]]), abs=1e-6)
        assert [t for t, _ in entry.top] == expected[i].topk(2).indices.tolist()


def test_a_prompt_logprobs_count_out_of_range_is_refused() -> None:
    with pytest.raises(UserError, match="prompt_logprobs 21"):
        SamplingParams(prompt_logprobs=21)
