"""vLLM's prompt_logprobs and streamed include_metrics against a real `engine serve`
(bundled SmolLM2, fp32 unquantized, loopback; issues 33 and 35), driven by the openai SDK and httpx.

A prompt over two prefill chunks (``--max-num-batched-tokens 64``) gets each token's
log-probability equal to a log-softmax of the model's own full-sequence fp32 logits,
computed here through the engine's model API; the step events say the LM head ran on
those prompt rows for that request and on none for a request that did not ask; such a
request reads no prefix-cache hit (vLLM's rule)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import torch

from bench.bench_server import free_port, start_server, stop_server
from engine.core.sampling_params import SamplingParams
from engine.model.runner import ModelRunner, ScheduledSeq
from engine.modelspec.presets import bundled_gguf_path
from tests.serve.test_vllm_dropin import MODEL, Server

# slow: the module starts its own server (30-70 s on the loaded shared 2-core Zen 4)
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(bundled_gguf_path() is None, reason="the bundled SmolLM2 GGUF is not installed")]

CHUNK_TOKENS = 64  # --max-num-batched-tokens: the prompt below takes more than one prefill step
PROMPT = ("The history of the printing press begins in the fifteenth century, when movable type changed how "
          "books were made, sold and read across Europe. Within fifty years presses worked in more than two "
          "hundred cities, and the price of a book fell so far that ordinary merchants could own several. "
          "Scholars argue about which of these changes mattered most.")
TOLERANCE = 1e-4  # fp32 on both sides; the server's paged attention sums in another order


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("prompt-logprobs")
    port = free_port()
    events_path, log_path = tmp / "events.jsonl", tmp / "serve.log"
    proc = start_server(
        port, "--max-model-len", "512", "--kv-cache-memory-bytes", "64Mi", "--dtype", "float32", "-q", "none",
        "--max-num-batched-tokens", str(CHUNK_TOKENS), "--max-num-seqs", "4", "--events", str(events_path),
        "--enable-per-request-metrics", "--shutdown-timeout", "3", log_path=log_path,
    )  # fmt: skip
    yield Server(f"http://127.0.0.1:{port}", events_path, log_path)
    stop_server(proc)


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def prompt_ids(server: Server) -> list[int]:
    ids: list[int] = server.post("/tokenize", {"prompt": PROMPT}).json()["tokens"]
    assert len(ids) > CHUNK_TOKENS
    return ids


@torch.inference_mode()
def _full_sequence_logprobs(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """Row i: the log-softmax of the fp32 logits after ``ids[: i + 1]``, in one forward."""
    blocks = list(range(runner.num_blocks - (len(ids) + 15) // 16, runner.num_blocks))  # blocks no other test uses
    prepared = runner.prepare([ScheduledSeq("whole", ids, 0, blocks, True, SamplingParams())])
    hidden = runner.model(prepared.input_ids, prepared.positions, runner.kv_caches, prepared.model_meta)
    return runner.model.compute_logits(hidden).float().log_softmax(dim=-1)


def _steps_of(server: Server, request_id: str) -> list[Any]:
    return [e for e in server.events("step") if request_id in e.scheduled]


def test_completion_prompt_logprobs_equal_the_models_full_sequence_log_softmax(
        server: Server, client: openai.OpenAI, prompt_ids: list[int], smollm_runner_fp32: ModelRunner,
        smollm_tokenizer: Any) -> None:
    answer = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0,
                                       extra_body={"prompt_logprobs": 2})
    found = answer.choices[0].model_extra["prompt_logprobs"]  # type: ignore[index]
    assert len(found) == len(prompt_ids) and found[0] is None
    expected = _full_sequence_logprobs(smollm_runner_fp32, prompt_ids)
    for position in range(1, len(prompt_ids)):
        token, row, entries = prompt_ids[position], expected[position - 1], found[position]
        assert str(token) in entries, position
        own = entries[str(token)]
        assert abs(own["logprob"] - float(row[token])) < TOLERANCE, (position, own, float(row[token]))
        assert own["decoded_token"] == smollm_tokenizer.decode([token], skip_special_tokens=False)
        by_rank = {e["rank"]: (int(t), e["logprob"]) for t, e in entries.items() if int(t) != token or e["rank"] <= 2}
        best = row.topk(2)
        for rank in (1, 2):  # the alternatives: the two most likely, in order
            assert abs(by_rank[rank][1] - float(best.values[rank - 1])) < TOLERANCE, (position, entries)
    # the prompt went in more than one prefill step, and the LM head ran on each prompt row once
    steps = _steps_of(server, answer.id)
    prefills = [s for s in steps if s.scheduled[answer.id][1] == "prefill"]
    assert len(prefills) >= 2
    assert sum(s.prompt_logprob_rows for s in steps) == len(prompt_ids) - 1


def test_a_request_without_prompt_logprobs_runs_the_head_on_no_prompt_row(
        server: Server, client: openai.OpenAI) -> None:
    # a prompt of its own (no prefix-cache hit): its prefill takes two steps too
    answer = client.completions.create(model=MODEL, prompt="In short: " + PROMPT, max_tokens=2, temperature=0)
    assert answer.choices[0].model_extra.get("prompt_logprobs") is None  # type: ignore[union-attr]
    steps = _steps_of(server, answer.id)
    assert sum(s.scheduled[answer.id][1] == "prefill" for s in steps) >= 2
    assert all(s.prompt_logprob_rows == 0 for s in steps)


def test_a_prompt_logprobs_request_reads_no_prefix_cache_hit(server: Server, client: openai.OpenAI,
                                                              prompt_ids: list[int]) -> None:
    prompt = PROMPT + " Once more."
    plain = [client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0) for _ in range(2)]
    assert plain[1].usage.prompt_tokens_details.cached_tokens > 0  # type: ignore[union-attr]
    asks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                     extra_body={"prompt_logprobs": 0})
    assert asks.usage.prompt_tokens_details.cached_tokens == 0  # type: ignore[union-attr]
    steps = _steps_of(server, asks.id)
    assert sum(s.prompt_logprob_rows for s in steps) == asks.usage.prompt_tokens - 1  # type: ignore[union-attr]
    assert all(asks.id not in s.prefix_lookups for s in steps)  # no lookup was made
    entries = asks.choices[0].model_extra["prompt_logprobs"]  # type: ignore[index]
    assert all(len(e) == 1 for e in entries[1:])  # 0 alternatives: the prompt token alone


def test_chat_carries_prompt_logprobs_at_the_top_level(server: Server) -> None:
    r = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name a colour."}],
                                             "max_tokens": 2, "temperature": 0, "prompt_logprobs": 1})
    assert r.status_code == 200, r.text
    body = r.json()
    found = body["prompt_logprobs"]
    assert len(found) == body["usage"]["prompt_tokens"] and found[0] is None
    assert all(1 <= len(entry) <= 2 and {"logprob", "rank", "decoded_token"} <= set(next(iter(entry.values())))
               for entry in found[1:])


def test_a_stream_refuses_prompt_logprobs_as_vllm_does(server: Server) -> None:
    refused = server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 1, "stream": True, "prompt_logprobs": 1})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs"
    assert server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 1, "stream": True,
                                           "prompt_logprobs": 0}).status_code == 200


def _chunks(server: Server, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", server.url + path, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        frames = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    return [json.loads(f) for f in frames[:-1]]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_streamed_request_gets_its_metrics_on_the_last_chunk(server: Server, path: str) -> None:
    body: dict[str, Any] = {"max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True,
                            "include_metrics": True}
    body |= {"prompt": "Count: one"} if path == "/v1/completions" else {"messages": [{"role": "user",
                                                                                       "content": "Count: one"}]}
    chunks = _chunks(server, path, body)
    with_metrics = [c for c in chunks if "metrics" in c]
    assert with_metrics == [chunks[-1]] and chunks[-1]["choices"][0]["finish_reason"] == "length"
    metrics = chunks[-1]["metrics"]
    assert metrics["time_to_first_token_ms"] > 0 and metrics["tokens_per_second"] > 0
    # with include_usage, vLLM's place: the usage chunk, after the finish
    chunks = _chunks(server, path, body | {"stream_options": {"include_usage": True}})
    assert [c for c in chunks if "metrics" in c] == [chunks[-1]] and chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 4 and set(chunks[-1]["metrics"]) == set(metrics)
