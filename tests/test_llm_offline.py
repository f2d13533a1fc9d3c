"""The offline API's outputs hold the whole request, as vLLM's ``LLM.generate`` returns it:
``engine.step()`` hands out each step's logprobs (and the prompt's once), and the final output
must carry all of them, not the last step's alone."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from engine.core.sampling_params import SamplingParams
from engine.llm import LLM


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with LLM(load_format="dummy", max_model_len=256, kv_cache_memory_bytes=1 << 24, stats_interval=0.0,
             dtype="float32", max_num_batched_tokens=8) as engine:  # 8: the 20-token prompt over three steps
        yield engine


def test_the_final_output_carries_every_generated_tokens_logprobs(llm: LLM) -> None:
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
    prompts = [list(range(10, 30)), list(range(40, 45))]
    for out in llm.generate(prompts, params):
        assert len(out.token_ids) == 6 and out.logprobs is not None
        assert [entry.token_id for entry in out.logprobs] == out.token_ids
        assert all(len(entry.top) == 2 for entry in out.logprobs)


def test_the_final_output_carries_the_prompt_logprobs_of_a_chunked_prompt(llm: LLM) -> None:
    prompt = list(range(100, 120))
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=1))
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
    assert out.prompt_logprobs[0] is None
    assert [entry.token_id for entry in out.prompt_logprobs[1:] if entry is not None] == prompt[1:]
