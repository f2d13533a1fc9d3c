"""`engine serve --model gemma-3-270m` end to end with the openai client: chat (Gemma's
template) and completions, on a real server on loopback. The file is the pretrained (base)
Gemma 3 270M, not the instruction-tuned one: its chat answers are not checked for sense,
only that the template framed the prompt and no template token leaks into the text; the
completion is transformers' greedy continuation."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from bench.bench_server import free_port, start_server, stop_server
from engine.modelspec.presets import gemma3_270m_path
from tests.serve.vllm_shapes import KVCacheRuntimeInfo

pytestmark = pytest.mark.skipif(gemma3_270m_path() is None,
                                reason="Gemma 3 270M GGUF not assembled: run `make setup`")


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    port = free_port()
    log_path: Path = tmp_path_factory.mktemp("gemma3-serve") / "serve.log"
    proc = start_server(port, "--model", "gemma-3-270m", "--dtype", "float32", "--max-model-len", "1024",
                        "--kv-cache-memory-bytes", str(64 << 20), "--max-num-seqs", "4", log_path=log_path)
    try:
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
    finally:
        assert stop_server(proc) == 0, log_path.read_text()[-2000:]


@pytest.mark.slow  # 13 s warm on 2 cores (start-up with a 262,144-token vocabulary, both calls), more cold
def test_chat_and_completions(client: openai.OpenAI) -> None:
    from engine.model.loading.startup_cache import cached_tokenizer

    tokenizer = cached_tokenizer(gemma3_270m_path())
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model="gemma-3-270m", max_tokens=24, temperature=0.0, messages=messages)
    answer = chat.choices[0].message.content or ""
    assert answer.strip() and "<end_of_turn>" not in answer and "<start_of_turn>" not in answer, answer
    assert chat.choices[0].finish_reason in ("stop", "length")
    # <bos><start_of_turn>user\n...<end_of_turn>\n<start_of_turn>model\n: the template's tokens, <bos> once
    assert chat.usage is not None
    assert chat.usage.prompt_tokens == len(tokenizer.apply_chat_template(messages, tokenize=True)) == 16

    # a completion prompt gets the <bos> the GGUF asks for (tokenizer.ggml.add_bos_token), as vLLM's does
    completion = client.completions.create(model="gemma-3-270m", prompt="The capital of France is",
                                           max_tokens=8, temperature=0.0)
    assert completion.choices[0].text == " the capital of the country of France."
    assert completion.usage is not None and completion.usage.completion_tokens == 8
    assert completion.usage.prompt_tokens == len(tokenizer.encode("The capital of France is")) + 1 == 6


@pytest.mark.slow  # a second Gemma 3 server (~10 s warm)
def test_kv_events_metrics_and_events_name_the_hybrid_groups(tmp_path: Path) -> None:
    """Served Gemma 3 shows its hybrid KV cache to the tools around vLLM: vLLM's KV events
    name each stored run's group and spec (five sliding groups of window 512, one full), the
    /events snapshot carries the groups, and /metrics reads the pool's usage."""
    import json

    import httpx
    import msgspec
    import zmq
    from prometheus_client.parser import text_string_to_metric_families
    from zmq.utils.monitor import recv_monitor_message

    context = zmq.Context.instance()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    sub.bind("tcp://127.0.0.1:*")
    config = {"enable_kv_cache_events": True, "endpoint": sub.getsockopt_string(zmq.LAST_ENDPOINT),
              "topic": "kv-events"}
    port = free_port()
    proc = start_server(port, "--model", "gemma-3-270m", "--dtype", "float32", "--max-model-len", "1024",
                        "--kv-cache-memory-bytes", str(64 << 20), "--kv-events-config", json.dumps(config),
                        log_path=tmp_path / "serve.log")
    try:
        assert monitor.poll(60_000), "the server's PUB never connected"
        while monitor.poll(100):
            recv_monitor_message(monitor)
        sub.poll(200)
        url = f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        client.completions.create(model="gemma-3-270m", prompt="A long story. " * 60, max_tokens=4, temperature=0)
        stored: list[dict] = []
        while sub.poll(3000):
            _, _, payload = sub.recv_multipart()
            stored += [e for e in msgspec.msgpack.decode(payload)[1] if e["type"] == "BlockStored"]
        specs = {e["group_idx"]: (e["kv_cache_spec_kind"], e["kv_cache_spec_sliding_window"]) for e in stored}
        assert specs == {**{g: ("sliding_window", 512) for g in range(5)}, 5: ("full_attention", None)}, specs
        with httpx.stream("GET", f"{url}/events", timeout=10) as stream:
            first = next(line for line in stream.iter_lines() if line.startswith("data: "))
        groups = json.loads(first.removeprefix("data: "))["state"]["config"]["kv_cache_groups"]
        assert len(groups) == 6
        # vLLM's KVCacheRuntimeInfo (experimental route): five sliding groups of three layers, one full
        kv = KVCacheRuntimeInfo.model_validate(httpx.get(f"{url}/v1/server/kv-cache", timeout=10).json())
        assert [(g.spec_type, g.sliding_window) for g in kv.groups] == [("SlidingWindowSpec", 512)] * 5 + [
            ("FullAttentionSpec", None)]
        assert kv.groups[0].layer_names == [f"model.layers.{i}.self_attn" for i in (0, 6, 12)]
        assert kv.groups[5].layer_names == [f"model.layers.{i}.self_attn" for i in (5, 11, 17)]
        assert {(g.num_kv_heads, g.head_size, g.block_size) for g in kv.groups} == {(1, 256, 16)}
        assert kv.num_gpu_blocks and kv.kv_cache_size_tokens and kv.max_concurrency
        families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text)}
        assert "vllm:kv_cache_usage_perc" in families
    finally:
        monitor.close(linger=0)
        sub.close()
        assert stop_server(proc) == 0
