"""vLLM's prompt_logprobs on the wire, without a server: the request field's checks (a
count in 0..20; a stream refuses it but 0, as vLLM does) and the answer's shape (None for
the first prompt token, then ``{token id: {logprob, rank, decoded_token}}`` with the
prompt's own token first, each alternative once, -inf sent as vLLM's -9999)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from engine.model.sampler import TokenLogprobs
from engine.serve.logprobs import LOWEST_LOGPROB, prompt_logprobs
from engine.serve.protocol import APIError, ChatCompletionRequest, CompletionChoice, CompletionRequest

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("make", [lambda **f: CompletionRequest(prompt="hi", **f),
                                  lambda **f: ChatCompletionRequest(messages=MESSAGES, **f)])
def test_prompt_logprobs_is_a_count_and_a_stream_takes_only_0(make: Any) -> None:
    assert make(prompt_logprobs=5).sampling_params(4).prompt_logprobs == 5
    assert make(prompt_logprobs=None).sampling_params(4).prompt_logprobs is None
    make(prompt_logprobs=0, stream=True).check_supported()
    for fields in ({"prompt_logprobs": 1, "stream": True}, {"prompt_logprobs": -1}, {"prompt_logprobs": 21},
                   {"prompt_logprobs": True}, {"prompt_logprobs": "2"}):
        with pytest.raises(APIError) as refused:
            make(**fields).check_supported()
        assert refused.value.status == 400 and refused.value.param == "prompt_logprobs", fields


def test_the_answer_lists_the_prompt_token_first_then_its_alternatives_once(smollm_tokenizer: Any) -> None:
    entries = [None,
               TokenLogprobs(token_id=504, logprob=-3.5, rank=4, top=((28, -0.5), (29, -1.25))),
               TokenLogprobs(token_id=28, logprob=-0.5, rank=1, top=((28, -0.5), (29, -1.25))),
               TokenLogprobs(token_id=30, logprob=float("-inf"), rank=49152, top=())]
    shown = prompt_logprobs(entries, smollm_tokenizer)
    assert shown[0] is None
    assert list(shown[1]) == [504, 28, 29] and [e.rank for e in shown[1].values()] == [4, 1, 2]  # type: ignore[union-attr]
    assert list(shown[2]) == [28, 29] and shown[2][28].rank == 1  # type: ignore[index]
    assert shown[3][30].logprob == LOWEST_LOGPROB  # type: ignore[index]
    assert shown[1][504].decoded_token == smollm_tokenizer.decode([504], skip_special_tokens=False)  # type: ignore[index]
    wire = json.loads(CompletionChoice(text="", prompt_logprobs=shown).model_dump_json())["prompt_logprobs"]
    assert wire[1]["504"] == {"logprob": -3.5, "rank": 4, "decoded_token": shown[1][504].decoded_token}  # type: ignore[index]
