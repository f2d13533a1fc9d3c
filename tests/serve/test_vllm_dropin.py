"""kvscope as a drop-in for vLLM to the tools around it (issue 35): the clock every
request's latencies count from, the SSE framing of streaming chat, the endpoints and
fields `vllm bench`, aiperf and guidellm call. One real server (bundled SmolLM2) for
the module, driven by httpx and the openai SDK."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from bench.bench_server import free_port, start_server, stop_server
from engine.events import read_events
from engine.modelspec.presets import bundled_gguf_path

MODEL = "smollm2-135m"
# The client and the server share a loaded 2-core machine: the client's own reading of
# its first chunk lags by tens of ms under load (idle: a few ms).
TTFT_TOLERANCE_S = 0.15

# slow: the module's own server start alone (~10 s idle, 30-70 s on the loaded shared 2-core
# Zen 4) is over the default suite's budget for new tests; the wire formats' unit tests
# (tests/events, tests/monitor, tests/model/test_logprobs.py) run by default
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(bundled_gguf_path() is None, reason="the bundled SmolLM2 GGUF is not installed")]


class Server:
    def __init__(self, url: str, events_path: Path, log_path: Path) -> None:
        self.url = url
        self.events_path = events_path
        self.log_path = log_path

    def post(self, path: str, body: Any) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=60)

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, timeout=30)

    def events(self, type_: str) -> list[Any]:
        return [e for e in read_events(self.events_path).events if e.type == type_]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("dropin")
    port = free_port()
    events_path, log_path = tmp / "events.jsonl", tmp / "serve.log"
    proc = start_server(
        port, "--max-model-len", "1024", "--kv-cache-memory-bytes", "64Mi", "--dtype", "float32",
        "--max-num-batched-tokens", "512", "--max-num-seqs", "16", "--events", str(events_path),
        "--shutdown-timeout", "3", "--enable-log-requests", log_path=log_path,
    )  # fmt: skip
    yield Server(f"http://127.0.0.1:{port}", events_path, log_path)
    stop_server(proc)


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def _frames(body: bytes) -> list[bytes]:
    """An SSE body split into its ``data: ...`` frames, byte for byte."""
    assert body.endswith(b"\n\n"), body[-40:]
    return [frame + b"\n\n" for frame in body[:-2].split(b"\n\n")]


def _long_prompt(i: int, words: int) -> str:
    return f"Reader {i} asks: " + " ".join(f"token{(i * 7 + j) % 50}" for j in range(words))


# ------------------------------------------------------- 1. the request clock
def test_request_clock_starts_at_receipt(server: Server, client: openai.OpenAI) -> None:
    """request.arrived says how long before the scheduler the server received it, the
    finished request's TTFT counts that time (queue time does not), and /metrics has
    its histogram."""
    out = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0)
    arrived = {e.request_id: e for e in server.events("request.arrived")}[out.id]
    finished = {e.request_id: e for e in server.events("request.finished")}[out.id]
    assert arrived.preprocess_s > 0
    # TTFT = preprocess + queue + prefill, every piece from its own clock reading
    assert finished.ttft_s == pytest.approx(arrived.preprocess_s + finished.queue_time_s + finished.prefill_time_s,
                                            abs=1e-6)
    assert finished.e2e_s > finished.ttft_s
    metrics = server.get("/metrics").text
    count = [line for line in metrics.splitlines() if line.startswith("kvscope:request_preprocess_time_seconds_count")]
    assert count and float(count[0].split()[-1]) >= 1


async def _timed_stream(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> tuple[str, float]:
    """(request id, seconds from sending to the first frame with text) as a client measures it."""
    start = time.monotonic()
    async with http.stream("POST", url, json=body) as response:
        assert response.status_code == 200
        first: float | None = None
        request_id = ""
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            request_id = chunk["id"]
            choice = chunk["choices"][0] if chunk["choices"] else {}
            text = choice.get("text") or choice.get("delta", {}).get("content")
            if first is None and text:
                first = time.monotonic() - start
    assert first is not None
    return request_id, first


def test_server_ttft_matches_the_client_under_load(server: Server) -> None:
    """Eight streams at once with long prompts (each prefill a 512-token step on two
    cores): most wait for the engine thread to finish a step before the scheduler sees
    them. The server's TTFT (request.finished) agrees with what each client measured
    within TTFT_TOLERANCE_S; counted from the scheduler's admission it would be short by
    each request's preprocess time, which the test checks is far larger for some
    (measured on the shared 2-core AVX-512 BF16 Zen 4 at load 8-10: gaps 0.04-0.10 s,
    preprocess 0.65 s for completions, 22 s for the chat requests behind them)."""

    async def load() -> list[tuple[str, float]]:
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=16)) as http:
            tasks = []
            for i in range(8):
                if i % 2:
                    url, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": _long_prompt(i, 60)}]}
                else:
                    url, body = "/v1/completions", {"prompt": _long_prompt(i, 60)}
                body |= {"model": MODEL, "max_tokens": 4, "temperature": 0, "stream": True, "ignore_eos": True}
                tasks.append(_timed_stream(http, server.url + url, body))
            return list(await asyncio.gather(*tasks))

    measured = dict(asyncio.run(load()))
    finished = {e.request_id: e for e in server.events("request.finished") if e.request_id in measured}
    preprocess = {e.request_id: e.preprocess_s for e in server.events("request.arrived") if e.request_id in measured}
    assert set(finished) == set(measured)
    gaps = {rid: measured[rid] - finished[rid].ttft_s for rid in measured}
    shown = {rid[-6:]: (round(gaps[rid], 4), round(preprocess[rid], 3)) for rid in measured}
    assert all(abs(gap) < TTFT_TOLERANCE_S for gap in gaps.values()), f"(client - server TTFT, preprocess) s: {shown}"
    # Counted from the scheduler's admission, the server's TTFT would be short by this much, so the
    # check above tells the two apart once a wait exceeds the tolerance (with a margin for the
    # clients' lag). How long the waits are follows the machine's step time: 0.65 s at load 8-10 on
    # Zen 4, 0.30 s on a quieter AVX2 Zen 3.
    assert max(preprocess.values()) > 1.5 * TTFT_TOLERANCE_S, shown


# ------------------------------------------------- 2. streaming chat framing
def test_chat_stream_sends_the_role_with_the_first_output(server: Server) -> None:
    """vLLM's framing: the role chunk (``{"role": "assistant", "content": ""}``) is sent
    when the first output arrives, immediately followed by that output's content; so
    when the client holds the role frame, the engine has produced the first token."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": _long_prompt(0, 100)}], "max_tokens": 12,
            "temperature": 0, "ignore_eos": True, "stream": True}
    raw = b""
    seen_first_token: bool | None = None
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        for piece in response.iter_bytes():
            if seen_first_token is None and b"\n\n" in raw + piece:
                state = server.get("/debug/state").json()
                request_id = json.loads((raw + piece).split(b"\n\n")[0][6:])["id"]
                request = state["requests"].get(request_id)
                seen_first_token = request is None or request["ttft_s"] is not None
            raw += piece
    assert seen_first_token, "the role chunk arrived before the engine produced the first token"
    frames = _frames(raw)
    assert frames[-1] == b"data: [DONE]\n\n"
    chunks = [json.loads(f[len(b"data: "):]) for f in frames[:-1]]
    assert all(f.startswith(b"data: {") for f in frames[:-1])
    role, first, *rest = chunks
    assert role["object"] == "chat.completion.chunk" and "usage" not in role
    assert role["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None}]
    assert first["choices"][0]["delta"] == {"content": first["choices"][0]["delta"]["content"]}
    assert first["choices"][0]["delta"]["content"]
    assert all("role" not in c["choices"][0]["delta"] for c in rest)
    assert rest[-1]["choices"][0]["finish_reason"] == "length"
    assert len({c["id"] for c in chunks}) == 1


# ------------------------------------------------- 4. vLLM's endpoints and fields
def test_tokenize_and_detokenize_as_vllm_answers(server: Server) -> None:
    prompt = server.post("/tokenize", {"model": MODEL, "prompt": "The capital of France is",
                                       "return_token_strs": True}).json()
    assert set(prompt) == {"count", "max_model_len", "tokens", "token_strs"}
    assert prompt["count"] == len(prompt["tokens"]) == 5 and prompt["max_model_len"] == 1024
    assert "".join(prompt["token_strs"]).replace("Ġ", " ") == "The capital of France is"
    assert server.post("/detokenize", {"model": MODEL, "tokens": prompt["tokens"]}).json() == {
        "prompt": "The capital of France is"}
    chat = server.post("/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}).json()
    out = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}).json()
    assert chat["count"] == out["usage"]["prompt_tokens"]  # the tokens the chat route counts
    bad = server.post("/detokenize", {"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert server.post("/tokenize", {"prompt": "x", "model": "other"}).status_code == 404


def test_server_info_load_and_kv_event_sources(server: Server) -> None:
    info = server.get("/server_info").json()
    assert set(info) == {"vllm_config", "vllm_env", "system_env"} and "max_model_len=1024" in info["vllm_config"]
    config = server.get("/server_info?config_format=json").json()["vllm_config"]
    assert config["max_model_len"] == 1024 and "torch_version" in info["system_env"]
    assert server.get("/load").json() == {"server_load": 0}
    assert server.get("/kv_event_sources").json() == {}  # no --kv-events-config: no rank publishes

    async def load_while_streaming() -> int:
        async with httpx.AsyncClient(timeout=60) as http:
            body = {"model": MODEL, "prompt": "Count:", "max_tokens": 200, "stream": True, "ignore_eos": True}
            async with http.stream("POST", server.url + "/v1/completions", json=body) as response:
                lines = response.aiter_lines()  # held: a dropped iterator closes the stream
                await lines.__anext__()  # the first chunk: this request is in flight
                load = int((await http.get(server.url + "/load")).json()["server_load"])
                await lines.aclose()
                return load

    assert asyncio.run(load_while_streaming()) == 1


def test_usage_names_the_cached_prompt_tokens(client: openai.OpenAI) -> None:
    prompt = _long_prompt(3, 40)  # over two 16-token blocks
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    assert first.usage is not None and again.usage is not None
    assert first.usage.prompt_tokens_details is not None and first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]
    assert cached > 0 and cached % 16 == 0 and cached < again.usage.prompt_tokens


def test_cache_salt_keeps_a_tenants_prefix_cache_its_own(server: Server, client: openai.OpenAI) -> None:
    """vLLM's cache_salt: the same prompt under another salt (or none) hits nothing of a salted
    request's blocks, under the same salt it hits them; an empty salt is a 400 naming the field."""
    prompt = _long_prompt(5, 40)

    def cached(salt: str | None) -> int:
        extra = {} if salt is None else {"cache_salt": salt}
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, extra_body=extra)
        return out.usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0 and cached(None) == 0
    assert cached("tenant-a") > 0 and cached(None) > 0
    refused = httpx.post(f"{server.url}/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "cache_salt": ""})
    assert refused.status_code == 400 and "cache_salt" in refused.text


def test_profile_endpoints_write_a_trace_that_loads(server: Server, client: openai.OpenAI) -> None:
    assert server.post("/stop_profile", {}).status_code == 400  # nothing to stop
    started = server.post("/start_profile", {})
    assert started.status_code == 200 and started.json()["trace_dir"] == str(server.events_path.parent)
    assert server.post("/start_profile", {}).status_code == 400  # one at a time
    client.completions.create(model=MODEL, prompt="Profile me", max_tokens=2, temperature=0)
    stopped = server.post("/stop_profile", {})
    assert stopped.status_code == 200
    trace = Path(stopped.json()["trace"])
    assert trace.parent == server.events_path.parent
    events = json.loads(trace.read_text())["traceEvents"]
    assert any("aten::" in str(e.get("name", "")) for e in events)  # the engine thread's torch ops


def test_profiles_are_bounded_and_each_keeps_its_own_file(server: Server, client: openai.OpenAI) -> None:
    traces = set()
    for _ in range(10):  # within a second or two: the names must still differ
        assert server.post("/start_profile", {}).status_code == 200
        traces.add(server.post("/stop_profile", {}).json()["trace"])
    assert len(traces) == 10 and all(Path(t).is_file() for t in traces)
    started = httpx.post(server.url + "/start_profile?max_steps=2", timeout=60)
    assert started.status_code == 200 and started.json()["limits"] == {"max_steps": 2, "max_seconds": None,
                                                                        "default": False}
    client.completions.create(model=MODEL, prompt="Bounded", max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    stopped = server.post("/stop_profile", {})  # it stopped itself: the answer is the trace it wrote
    assert stopped.status_code == 200 and Path(stopped.json()["trace"]).is_file()
    assert "torch profiler stopped itself: 2 steps reached its limit (max_steps=2)" in server.log_path.read_text()
    refused = server.post("/start_profile", {"max_seconds": "soon"})
    assert refused.status_code == 400 and "max_seconds='soon': give a number of seconds above 0" in refused.text


def test_logprobs_on_both_apis(client: openai.OpenAI) -> None:
    """Greedy answers: every token is its own best alternative, the lists line up with the
    tokens, and a stream carries the same log-probabilities as the whole answer."""
    prompt = "The capital of France is"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert lp is not None and len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5  # type: ignore[arg-type]
    assert "".join(lp.tokens) == out.choices[0].text and lp.text_offset[0] == 0  # type: ignore[arg-type,index]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):  # type: ignore[arg-type]
        assert value <= 0 and max(top.values()) == pytest.approx(value, abs=1e-6) and top[token] == value
    messages = [{"role": "user", "content": "Name a colour."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,  # type: ignore[arg-type]
                                          logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 4
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-6)
               and bytes(t.bytes or []).decode() == t.token for t in content)
    chunks = [c for c in client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2,  # type: ignore[arg-type]
        stream=True, extra_body={"ignore_eos": True}) if c.choices]
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.content or []]
    # the stream's chunks carry every token's entry, a held-back token's with the text that releases it
    # (a greedy rerun may pick another token: its prompt now hits the prefix cache, whose int4 kernels
    # round differently, and the two best here are 0.04 apart)
    assert len(streamed) == 4 and "".join(t.token for t in streamed) == "".join(
        c.choices[0].delta.content or "" for c in chunks)
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)  # type: ignore[arg-type]
    assert plain.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, top_logprobs=21,  # type: ignore[arg-type]
                                       logprobs=True)


# ------------------------------------------------- 5. signals for routers
def test_a_requests_log_records_carry_its_request_id_and_trace_id(server: Server) -> None:
    """JSON logs (the fixture's --log-format json): the request's records name it, and the
    W3C traceparent's trace id rides along (vllm#58171)."""
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    response = httpx.post(server.url + "/v1/completions", timeout=60,
                          headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"},
                          json={"model": MODEL, "prompt": "Hello", "max_tokens": 1})
    request_id = response.json()["id"]
    records = [json.loads(line) for line in server.log_path.read_text().splitlines() if line.startswith("{")]
    mine = [r for r in records if r.get("request_id") == request_id]
    assert mine and any(r["event"].startswith(f"Received request {request_id}") for r in mine)
    assert all(r.get("trace_id") == trace_id for r in mine)
    # the next request on a fresh context: no ids left over from this one
    other = httpx.post(server.url + "/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": "Bye", "max_tokens": 1}).json()["id"]
    records = [json.loads(line) for line in server.log_path.read_text().splitlines() if line.startswith("{")]
    assert all("trace_id" not in r for r in records if r.get("request_id") == other)
