"""prompt_logprobs under tensor parallelism and preemption (issue 35): every rank runs the
LM head on the same prompt rows (its gather is a collective), so TP=2 gives TP=1's prompt
logprobs; both equal a log-softmax of the model's own full-sequence fp32 logits, through
chunked prefills (64-token budget) in a pool small enough to preempt. The tiny dummy-weight
Llama of tests/test_tensor_parallel.py; slow (a worker process per extra rank)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.core.sampling_params import SamplingParams
from engine.events import Event, EventBus, StepEvent
from engine.model.runner import ModelRunner, ScheduledSeq
from engine.modelspec.readers import load_model_config
from tests.test_tensor_parallel import _config, _pool_bytes, _prompts, _tiny_model

pytestmark = pytest.mark.slow

ASKS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=2)
TOLERANCE = 1e-4


def _prompt_logprobs(config: Any, prompts: list[list[int]]) -> tuple[list[list[Any]], list[Event]]:
    from engine.llm_engine import LLMEngine

    events: list[Event] = []
    bus = EventBus()
    bus.subscribe(events.append)
    found: dict[str, list[Any]] = {}
    with LLMEngine(config, bus=bus) as engine:
        ids = [engine.add_request(p, ASKS) for p in prompts]
        while engine.has_unfinished():
            for out in engine.step():
                if out.prompt_logprobs is not None:
                    assert out.request_id not in found, "the prompt logprobs come once"
                    found[out.request_id] = out.prompt_logprobs
    return [found[i] for i in ids], events


@torch.inference_mode()
def _expected(model: str, prompt: list[int]) -> torch.Tensor:
    runner = ModelRunner(load_model_config(model), dtype="float32", load_format="dummy", attention_backend="torch")
    runner.load_weights()
    runner.allocate_kv_cache(8)
    prepared = runner.prepare([ScheduledSeq("whole", prompt, 0, list(range(4)), True, SamplingParams())])
    hidden = runner.model(prepared.input_ids, prepared.positions, runner.kv_caches, prepared.model_meta)
    return runner.model.compute_logits(hidden).float().log_softmax(dim=-1)


def test_tp2_prompt_logprobs_are_tp1s_and_the_models_under_chunking_and_preemption(tmp_path: Path) -> None:
    model = _tiny_model(tmp_path / "tiny-llama")
    prompts = _prompts(4, 40)
    runs = {tp: _prompt_logprobs(_config(model, tp, kv_cache_memory_bytes=_pool_bytes(model, tp),
                                         load_format="dummy", max_model_len=128), prompts) for tp in (1, 2)}
    steps = [e for e in runs[2][1] if isinstance(e, StepEvent)]
    assert any(s.preempted for s in steps), "the pool was meant to force preemptions"
    # each prompt row once: the preemptions here come once the requests decode, when their
    # prompt logprobs were sent (a resume computes none again)
    assert sum(s.prompt_logprob_rows for s in steps) == sum(len(p) - 1 for p in prompts)
    for prompt, one, two in zip(prompts, runs[1][0], runs[2][0], strict=True):
        expected = _expected(model, prompt)
        assert one[0] is None and two[0] is None and len(one) == len(two) == len(prompt)
        for position in range(1, len(prompt)):
            a, b, row = one[position], two[position], expected[position - 1]
            assert a.token_id == b.token_id == prompt[position]
            assert abs(a.logprob - float(row[prompt[position]])) < TOLERANCE, position
            assert abs(b.logprob - a.logprob) < TOLERANCE and [t for t, _ in b.top] == [t for t, _ in a.top]
