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
from engine.budget.config import gemma3_270m_path

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
    from engine.model.startup_cache import cached_tokenizer

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
