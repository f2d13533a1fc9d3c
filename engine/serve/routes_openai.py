"""OpenAI's routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` and
``GET /v1/models``, and the SSE bodies of their ``stream=true`` answers. A route
validates, tokenises on a worker thread, submits through
:class:`~engine.serve.async_engine.AsyncEngine` and either streams the outputs or
collects the last one; it never touches the engine loop itself."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any

import anyio
import structlog
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from engine.core.sampling_params import SamplingParams
from engine.errors import UserError
from engine.llm_engine import CheckedPrompt, RequestOutput
from engine.logs import get_logger
from engine.model.loading.tokenizer import StopMatcher
from engine.model.sampler import TokenLogprobs
from engine.serve.async_engine import EngineDead, Overloaded, RequestFailed, RequestStream
from engine.serve.host import EngineHost
from engine.serve.logprobs import Decoder, chat_logprobs, completion_logprobs, prompt_logprobs
from engine.serve.protocol import (
    IGNORED_FIELDS_SHOWN,
    SESSION_HEADER,
    APIError,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ModelCard,
    ModelList,
    PromptLogprobs,
    UsageInfo,
    new_id,
)
from engine.serve.route_support import KEYED, arrival_of, host_of, sse, streaming, unless_disconnected

OVERLOAD_RETRY_AFTER_S = 1

router = APIRouter()

MetricsOf = Callable[[str], "dict[str, Any] | None"]  # request id -> its per-request metrics

STREAMED = {200: {"description": "The completion (JSON), or with stream=true its chunks as server-sent events",
                  "content": {"text/event-stream": {"schema": {}}}}}


# ---------------------------------------------------------------- routes
@router.post("/v1/completions", dependencies=KEYED, response_model=None, responses=STREAMED)  # type: ignore[arg-type]
async def completions(request: Request, body: CompletionRequest) -> Response:
    host = host_of(request)
    body.check_supported()
    _check_model(host, body.model)
    _warn_ignored(body)
    metrics_of = _metrics_of(host, body)
    params = body.sampling_params(body.max_tokens, request.headers.get(SESSION_HEADER))
    checked = await _prepare(host, body.single_prompt(), params)
    stream = await _submit(host, checked, params, "cmpl", body.priority, arrival_of(request))
    model = host.settings.served_model_name
    if body.stream:
        return streaming(_completion_chunks(stream, model, body.include_usage,
                                            body.stream_options is not None
                                            and body.stream_options.continuous_usage_stats, metrics_of))
    return await unless_disconnected(request, _collect_completion(stream, model, metrics_of))


@router.post("/v1/chat/completions", dependencies=KEYED, response_model=None, responses=STREAMED)  # type: ignore[arg-type]
async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
    host = host_of(request)
    body.check_supported()
    _check_model(host, body.model)
    _warn_ignored(body)
    metrics_of = _metrics_of(host, body)
    params = body.sampling_params(body.effective_max_tokens(), request.headers.get(SESSION_HEADER))
    try:
        prompt = await anyio.to_thread.run_sync(partial(
            host.llm.tokenizer.apply_chat_template, body.conversation(),
            add_generation_prompt=body.add_generation_prompt, chat_template=host.settings.chat_template))
    except UserError as exc:
        raise APIError(400, str(exc), param="messages") from None
    # the rendered template holds the BOS already: no second one (vLLM's add_special_tokens=False)
    checked = await _prepare(host, str(prompt), params, param="messages", add_special_tokens=False)
    stream = await _submit(host, checked, params, "chatcmpl", body.priority, arrival_of(request))
    model = host.settings.served_model_name
    if body.stream:
        return streaming(_chat_chunks(stream, model, body.include_usage,
                                      body.stream_options is not None
                                      and body.stream_options.continuous_usage_stats, metrics_of))
    return await unless_disconnected(request, _collect_chat(stream, model, metrics_of))


@router.get("/v1/models", dependencies=KEYED)
async def models(request: Request) -> dict[str, Any]:
    host = host_of(request)
    llm = host.llm
    card = ModelCard(id=host.settings.served_model_name, root=str(llm.config.model), max_model_len=llm.max_model_len)
    return ModelList(data=[card]).model_dump()


# -------------------------------------------------------------- requests
def _log_request(host: EngineHost, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
    """vLLM's request line (``Received request ...``), cut to ``--max-log-len``."""
    limit = host.settings.max_log_len
    ids = prompt_ids if limit is None else prompt_ids[:limit]
    get_logger("kvscope.requests").info(f"Received request {request_id}: params: {params!r}, prompt_token_ids: {ids}"
                      f"{'' if len(ids) == len(prompt_ids) else f' ... ({len(prompt_ids):,} in all)'}, "
                      "lora_request: None.")


def _warn_ignored(body: CompletionRequest | ChatCompletionRequest) -> None:
    """vLLM's warning for the fields it ignores, one line per request."""
    names = body.ignored_fields()
    if names:
        shown = ", ".join(repr(n[:40]) for n in names[:IGNORED_FIELDS_SHOWN])
        more = f", ... ({len(names):,} in all)" if len(names) > IGNORED_FIELDS_SHOWN else ""
        get_logger("kvscope.serve").warning(
            f"The following fields were present in the request but ignored: {{{shown}{more}}}")


def _check_model(host: EngineHost, name: str | None) -> None:
    served = host.settings.served_model_name
    if name is not None and name != served:
        raise APIError(404, f"the model {name!r} does not exist; this server serves "
                            f"{served!r}", param="model", code="model_not_found")


async def _prepare(host: EngineHost, prompt: str | list[int], params: SamplingParams,
                   param: str = "prompt", add_special_tokens: bool = True) -> CheckedPrompt:
    """Tokenise and check on a worker thread: a long prompt must not stall the event
    loop (and with it /health, /metrics and every stream). The engine thread takes the
    checked prompt without checking it again."""
    llm = host.llm

    def encode_and_check() -> CheckedPrompt:
        checked = llm.prepare_prompt(prompt, params, add_special_tokens=add_special_tokens)
        if params.stop:  # build the stop strings' automaton here; the engine thread finds it cached
            StopMatcher(params.stop)
        return checked

    try:
        return await anyio.to_thread.run_sync(encode_and_check)
    except UserError as exc:
        # "prompt" errors name the chat route's field ("messages"); others name their own
        named = param if exc.param in (None, "prompt") else exc.param
        raise APIError(400, str(exc), param=named) from None


async def _submit(host: EngineHost, prompt: CheckedPrompt, params: SamplingParams, prefix: str,
                  priority: int = 0, arrival_time: float | None = None) -> RequestStream:
    if priority != 0 and host.llm.startup.scheduler_config.policy != "priority":
        raise APIError(400, f"priority {priority}: priority scheduling is not enabled; start the server with "
                            "--scheduling-policy priority, or send 0", param="priority")
    request_id = new_id(prefix)
    structlog.contextvars.bind_contextvars(request_id=request_id)  # on every log record of this request
    if host.settings.log_requests:
        _log_request(host, request_id, prompt.token_ids, params)
    try:
        return await host.engine.add_request(prompt, params, request_id, priority=priority,
                                             arrival_time=arrival_time)
    except Overloaded as exc:
        if host.engine.draining:
            raise APIError(503, str(exc), type_="service_unavailable") from None
        # 429, not 5xx: the server is healthy, the client should back off (Retry-After).
        raise APIError(429, str(exc), type_="rate_limit_exceeded", code="too_many_waiting_requests",
                       headers={"Retry-After": str(OVERLOAD_RETRY_AFTER_S)}) from None
    except UserError as exc:
        raise APIError(400, str(exc)) from None
    except EngineDead as exc:
        raise APIError(503, str(exc), type_="service_unavailable") from None
    except RequestFailed as exc:  # this request only: the engine serves the others on
        raise APIError(500, str(exc), type_="internal_error") from None


# --------------------------------------------------------- whole answers
async def _final_output(stream: RequestStream) -> RequestOutput:
    last: RequestOutput | None = None
    logprobs: list[TokenLogprobs] = []  # every output's, when the request asked
    prompt: list[TokenLogprobs | None] | None = None  # the first output's, when the request asked
    try:
        async with contextlib.aclosing(stream.outputs()) as outputs:
            async for output in outputs:
                last = output
                logprobs.extend(output.logprobs or ())
                prompt = output.prompt_logprobs if prompt is None else prompt
    except RequestFailed as exc:  # this request only: the engine serves the others on
        raise APIError(500, str(exc), type_="internal_error") from None
    except EngineDead as exc:  # the cause /health names; the engine's stop was logged once, where it happened
        raise APIError(503, str(exc), type_="service_unavailable", code="engine_dead") from None
    assert last is not None and last.finished
    last.logprobs = logprobs if stream.params.logprobs is not None else None
    last.prompt_logprobs = prompt
    return last


def _prompt_logprobs(stream: RequestStream, out: RequestOutput) -> PromptLogprobs | None:
    return None if out.prompt_logprobs is None else prompt_logprobs(out.prompt_logprobs, _tokenizer(stream))


def _tokenizer(stream: RequestStream) -> Decoder:
    # a stream exists only once the engine is up; under data parallelism the front's (rank 0's)
    tokenizer: Decoder = stream.engine.wait_ready().tokenizer
    return tokenizer


def _metrics_of(host: EngineHost, body: CompletionRequest | ChatCompletionRequest) -> MetricsOf | None:
    """Where a request that asked for ``include_metrics`` gets them (the server's lifecycle
    fold); refused when the server was not started with --enable-per-request-metrics."""
    if not body.include_metrics:
        return None
    if not host.settings.per_request_metrics:
        raise APIError(400, "include_metrics: per-request metrics are off; start the server with "
                            "--enable-per-request-metrics", param="include_metrics")
    return host.lifecycle.metrics


def _answer(response: CompletionResponse | ChatCompletionResponse, request_id: str,
            metrics_of: MetricsOf | None) -> Response:
    body = response.model_dump()
    if metrics_of is not None:  # the engine published its finish and last step before this output
        body["metrics"] = metrics_of(request_id)
    return JSONResponse(body)


async def _collect_completion(stream: RequestStream, model: str, metrics_of: MetricsOf | None = None) -> Response:
    out = await _final_output(stream)
    response = CompletionResponse(
        id=stream.request_id, model=model,
        choices=[CompletionChoice(text=out.text, finish_reason=out.finish_reason,
                                  logprobs=None if out.logprobs is None else
                                  completion_logprobs(out.logprobs, _tokenizer(stream)),
                                  prompt_logprobs=_prompt_logprobs(stream, out))],
        usage=_usage(stream, out),
    )
    return _answer(response, stream.request_id, metrics_of)


async def _collect_chat(stream: RequestStream, model: str, metrics_of: MetricsOf | None = None) -> Response:
    out = await _final_output(stream)
    response = ChatCompletionResponse(
        id=stream.request_id, model=model,
        choices=[ChatChoice(message=AssistantMessage(content=out.text), finish_reason=out.finish_reason,
                            logprobs=None if out.logprobs is None else chat_logprobs(out.logprobs, _tokenizer(stream)))],
        usage=_usage(stream, out),
        prompt_logprobs=_prompt_logprobs(stream, out),
    )
    return _answer(response, stream.request_id, metrics_of)


# ------------------------------------------------------------ stream bodies
# A chunk carries "usage" only when it has one (vLLM's exclude_unset), not "usage": null;
# a completion chunk's choice never carries prompt_logprobs (vLLM's stream choice has none).
_NO_USAGE = {"usage"}
_STREAM_CHOICE_LEAVES_OUT = {"choices": {"__all__": {"prompt_logprobs"}}}


def _usage(stream: RequestStream, out: RequestOutput) -> UsageInfo:
    """OpenAI's usage with ``prompt_tokens_details.cached_tokens``: the prompt's prefix-cache hit."""
    return UsageInfo.of(len(stream.prompt_ids), len(out.token_ids), cached_tokens=out.num_cached_tokens)


async def _stream_chunks(stream: RequestStream, include_usage: bool, continuous_usage: bool,
                         chunk: Callable[[RequestOutput | None, UsageInfo | None], str],
                         first: Callable[[UsageInfo | None], str] | None = None,
                         metrics_of: MetricsOf | None = None) -> AsyncIterator[str]:
    """The shared SSE framing of both endpoints: one chunk per output with text or a
    finish reason, the usage chunk, ``[DONE]``. ``first`` (chat's role chunk) goes out
    with the first output, as vLLM sends it: a client that times the first chunk
    (``vllm bench serve --backend openai-chat``) measures the prefill, not the
    connection. ``metrics_of`` (``include_metrics``): the request's metrics ride on the
    usage chunk, as vLLM sends them, or without one on the chunk with the finish reason."""
    metrics_on_finish = metrics_of if not include_usage else None
    last: RequestOutput | None = None
    pending: list[TokenLogprobs] = []  # logprobs of tokens whose text is still held back
    try:
        async with contextlib.aclosing(stream.outputs()) as outputs:
            async for out in outputs:
                if first is not None:
                    yield sse(first(UsageInfo.of(len(stream.prompt_ids), 0) if continuous_usage else None))
                    first = None
                last = out
                pending.extend(out.logprobs or ())
                if out.delta_text or out.finished:
                    if stream.params.logprobs is not None:  # this chunk carries every token since the last
                        out.logprobs, pending = pending, []
                    data = chunk(out, _usage(stream, out) if continuous_usage else None)
                    yield sse(_with_metrics(data, stream, metrics_on_finish) if out.finished else data)
        if include_usage and last is not None:
            yield sse(_with_metrics(chunk(None, _usage(stream, last)), stream, metrics_of))
    except (EngineDead, RequestFailed, UserError) as exc:
        yield sse(json.dumps(APIError(500, str(exc), type_="internal_error").body()))
    yield "data: [DONE]\n\n"


def _with_metrics(data: str, stream: RequestStream, metrics_of: MetricsOf | None) -> str:
    """A chunk's JSON with ``metrics`` added (the request finished: its events are folded)."""
    if metrics_of is None:
        return data
    return json.dumps({**json.loads(data), "metrics": metrics_of(stream.request_id)}, separators=(",", ":"))


def _completion_chunks(stream: RequestStream, model: str, include_usage: bool,
                       continuous_usage: bool, metrics_of: MetricsOf | None = None) -> AsyncIterator[str]:
    sent_text = 0  # where the next token's text starts (logprobs' text_offset)

    def chunk(out: RequestOutput | None, usage: UsageInfo | None) -> str:
        nonlocal sent_text
        logprobs = None if out is None or out.logprobs is None else \
            completion_logprobs(out.logprobs, _tokenizer(stream), sent_text)
        if out is not None:
            sent_text += len(out.delta_text)
        choices = [] if out is None else [CompletionChoice(text=out.delta_text, finish_reason=out.finish_reason,
                                                           logprobs=logprobs)]
        left_out: dict[str, Any] = {**_STREAM_CHOICE_LEAVES_OUT, **({"usage": True} if usage is None else {})}
        return CompletionResponse(id=stream.request_id, model=model, choices=choices,
                                  usage=usage).model_dump_json(exclude=left_out)

    return _stream_chunks(stream, include_usage, continuous_usage, chunk, metrics_of=metrics_of)


def _chat_chunks(stream: RequestStream, model: str, include_usage: bool,
                 continuous_usage: bool, metrics_of: MetricsOf | None = None) -> AsyncIterator[str]:
    def chunk(out: RequestOutput | None, usage: UsageInfo | None) -> str:
        choices = [] if out is None else [
            ChatChunkChoice(delta=DeltaMessage(content=out.delta_text), finish_reason=out.finish_reason,
                            logprobs=None if out.logprobs is None else chat_logprobs(out.logprobs, _tokenizer(stream)))
        ]
        return ChatCompletionChunk(id=stream.request_id, model=model, choices=choices,
                                   usage=usage).model_dump_json(exclude=_NO_USAGE if usage is None else None)

    def role_chunk(usage: UsageInfo | None) -> str:
        return ChatCompletionChunk(id=stream.request_id, model=model, usage=usage, choices=[
            ChatChunkChoice(delta=DeltaMessage(role="assistant", content=""))]).model_dump_json(
                exclude=_NO_USAGE if usage is None else None)

    return _stream_chunks(stream, include_usage, continuous_usage, chunk, first=role_chunk, metrics_of=metrics_of)
