"""The OpenAI wire format the server speaks: request bodies, responses,
streaming chunks, usage and errors, as pydantic models.

Only what kvscope implements is accepted with a value that changes anything. Every
field of OpenAI's completions and chat completions requests (openai 3.57's
``completion_create_params``) and vLLM's extensions that change the output is either
implemented or accepted at its neutral value only (``n=1``, ``presence_penalty=0``,
``store=false``, ``min_p=0``: :data:`NEUTRAL_ONLY`), so unmodified clients work and a
client relying on something kvscope lacks gets a 400 that names the field. Fields
that only label or route a request (``user``, ``metadata``, ``safety_identifier``,
``prompt_cache_key``, ...) are accepted at any value: the answer is the same. A field
neither OpenAI nor kvscope defines is ignored, as vLLM ignores it, and named in one
warning line per request (:meth:`_SamplingFields.ignored_fields`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, StrictBool, model_serializer

from engine.core.sampling_params import MAX_LOGIT_BIAS_ENTRIES, MAX_LOGPROBS, SamplingParams
from engine.errors import UserError


# ------------------------------------------------------------------------ errors
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """``{"error": {"message", "type", "param", "code"}}``, as OpenAI returns."""

    error: ErrorInfo


class APIError(Exception):
    """An error the handler turns into an :class:`ErrorResponse` with ``status``."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.headers = headers
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()


# ---------------------------------------------------------------------- requests
# Bounds on what one request may ask the shared engine thread to do for every token.
# vLLM has none; there, 10,000 stop strings of 100 characters (a 1 MB body) slowed
# every other stream on the engine ~3.5x while the old matcher ran. The automaton
# (engine/model/loading/tokenizer.py::StopMatcher) makes a token's cost follow its text, but
# building it and its memory (~40 bytes per character) still grow with the list, and
# no client needs more: OpenAI accepts 4 stop strings; these are generous.
MAX_STOP_STRINGS = 256
MAX_STOP_STRING_CHARS = 256
# stop_token_ids become a set (an O(1) test per token); the bound keeps the validation
# and the request log line small.
MAX_STOP_TOKEN_IDS = 1024


class StreamOptions(BaseModel):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False
    include_obfuscation: StrictBool = True  # accepted: kvscope pads no chunk, the content is the same


def _neutral(*values: Any) -> Callable[[Any], bool]:
    # ``is`` for the singletons, so 0 does not pass for False nor 1 for True
    def test(value: Any) -> bool:
        return any(value is v if v is None or isinstance(v, bool) else
                   (value == v and not isinstance(value, bool)) for v in values)
    return test


# Fields kvscope does not implement, accepted only at the value that asks for nothing:
# name -> (is the value neutral, what kvscope lacks, what to send instead). OpenAI's
# request fields first, then vLLM's extensions that change the output.
NEUTRAL_ONLY: dict[str, tuple[Callable[[Any], bool], str, str]] = {
    "function_call": (_neutral(None, "none"), "function calling is not supported", "omit it"),
    "store": (_neutral(None, False), "kvscope does not store completions", "send false or omit it"),
    "audio": (_neutral(None), "audio output is not supported", "omit it"),
    "modalities": (_neutral(None, ["text"]), "only text output is supported", 'send ["text"] or omit it'),
    "prediction": (_neutral(None), "predicted outputs are not supported", "omit it"),
    "reasoning_effort": (_neutral(None), "this model does not reason", "omit it"),
    "verbosity": (_neutral(None), "verbosity control is not supported", "omit it"),
    "web_search_options": (_neutral(None), "web search is not supported", "omit it"),
    "service_tier": (_neutral(None, "auto", "default"), "kvscope has one service tier",
                     'send "auto", "default" or omit it'),
    "moderation": (_neutral(None), "moderation is not supported", "omit it"),
    # vLLM's sampling and output extensions
    "min_p": (_neutral(None, 0), "min_p is not supported", "send 0 or omit it"),
    "repetition_penalty": (_neutral(None, 1), "penalties are not supported", "send 1 or omit it"),
    "length_penalty": (_neutral(None, 1), "beam search is not supported", "send 1 or omit it"),
    "use_beam_search": (_neutral(None, False), "beam search is not supported", "send false or omit it"),
    "allowed_token_ids": (_neutral(None), "allowed_token_ids is not supported", "use logit_bias or omit it"),
    "bad_words": (_neutral(None, []), "bad_words is not supported", "use logit_bias or omit it"),
    "truncate_prompt_tokens": (_neutral(None), "prompts are never truncated", "shorten the prompt and omit it"),
    "guided_json": (_neutral(None), "structured output is not supported", "omit it"),
    "guided_regex": (_neutral(None), "structured output is not supported", "omit it"),
    "guided_choice": (_neutral(None), "structured output is not supported", "omit it"),
    "guided_grammar": (_neutral(None), "structured output is not supported", "omit it"),
    "structural_tag": (_neutral(None), "structured output is not supported", "omit it"),
    "structured_outputs": (_neutral(None), "structured output is not supported", "omit it"),
    "logits_processors": (_neutral(None, []), "logits processors are not supported", "omit it"),
    "return_tokens_as_token_ids": (_neutral(None, False), "tokens are shown as text", "omit it"),
    "spaces_between_special_tokens": (_neutral(None, True), "special tokens are always decoded without spaces "
                                      "between them", "send true or omit it"),
}
# Accepted at any value: they label, route or cache a request and change no answer
# (parallel_tool_calls: tools are refused, so there is nothing to run in parallel).
ANY_VALUE = ("user", "metadata", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
             "prompt_cache_options", "parallel_tool_calls")
IGNORED_FIELDS_SHOWN = 20  # names in the warning line; the rest are counted


class _SamplingFields(BaseModel):
    """The sampling fields shared by completions and chat completions.

    Floats refuse NaN and infinity (``1e400`` parses to infinity), booleans are
    strict (``"stream": "yes"`` is a 400, not True): a value kvscope would have to
    guess at is refused with its field named."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)  # unknown fields: see ignored_fields()

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: int = 0
    ignore_eos: StrictBool = False
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    n: int = 1
    best_of: int | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    include_metrics: StrictBool = False  # vLLM's per-request metrics (needs --enable-per-request-metrics)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: Any = None
    prompt_logprobs: Any = None  # vLLM's; checked by prompt_logprobs_count()
    cache_salt: Any = None  # vLLM's: this request's prefix-cache partition (SamplingParams checks it)
    logit_bias: dict[str, Any] | None = None
    user: str | None = None
    metadata: Any = None
    safety_identifier: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    parallel_tool_calls: Any = None
    # NEUTRAL_ONLY's fields: any JSON, so every non-neutral value is refused by name
    top_logprobs: Any = None
    function_call: Any = None
    store: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    service_tier: Any = None
    moderation: Any = None
    min_p: Any = None
    repetition_penalty: Any = None
    length_penalty: Any = None
    use_beam_search: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    truncate_prompt_tokens: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structural_tag: Any = None
    structured_outputs: Any = None
    logits_processors: Any = None
    return_tokens_as_token_ids: Any = None
    spaces_between_special_tokens: Any = None
    # vLLM's: lower runs first under --scheduling-policy priority (refused otherwise, as vLLM does)
    priority: int = Field(default=0, ge=-(2**63), le=2**63 - 1)
    # Accepted only at their neutral value, so a client relying on them hears so.
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def check_supported(self) -> None:
        if self.n != 1:
            raise APIError(400, f"n={self.n}: kvscope returns one choice per request; send n=1", param="n")
        if self.best_of not in (None, 1):
            raise APIError(400, f"best_of={self.best_of}: kvscope samples one sequence per request; send 1 or "
                                "omit it", param="best_of")
        for name in ("tools", "functions"):
            if getattr(self, name):
                raise APIError(400, f"{name}: tool calling is not supported; omit the field", param=name)
        if self.tool_choice not in (None, "none"):
            raise APIError(400, "tool_choice: tool calling is not supported; omit the field", param="tool_choice")
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            raise APIError(400, f"response_format {self.response_format.get('type')!r}: structured output is "
                                "not supported; omit it or send {\"type\": \"text\"}", param="response_format")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value not in (None, 0, 0.0):
                raise APIError(400, f"{name}={value}: penalties are not supported; send 0 or omit it", param=name)
        self.logprobs_count()  # refuses a malformed logprobs / top_logprobs by name
        self.prompt_logprobs_count()
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")
        for name, (is_neutral, lacks, instead) in NEUTRAL_ONLY.items():
            value = getattr(self, name)
            if not is_neutral(value):
                raise APIError(400, f"{name}={_shown(value)}: {lacks}; {instead}", param=name)
        self._check_bounds()

    def logprobs_count(self) -> int | None:
        """Chat's: ``logprobs`` (a boolean) with ``top_logprobs`` alternatives per token;
        None when not asked."""
        if self.logprobs not in (None, True, False):
            raise APIError(400, f"logprobs={_shown(self.logprobs)}: a boolean (top_logprobs says how many "
                                "alternatives)", param="logprobs")
        top = _count(self.top_logprobs, "top_logprobs")
        if top is not None and not self.logprobs and top > 0:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        return (top or 0) if self.logprobs else None

    def prompt_logprobs_count(self) -> int | None:
        """vLLM's ``prompt_logprobs``: alternatives per prompt token, None when not asked. As
        in vLLM, a stream cannot carry them (only 0, which asks for no alternatives, streams)
        and -1 (the whole vocabulary) is over the 20 alternatives --max-logprobs allows."""
        count = _count(self.prompt_logprobs, "prompt_logprobs")
        if count and self.stream:
            raise APIError(400, "prompt_logprobs are not available when stream=true; send a non-streaming "
                                "request or omit them", param="prompt_logprobs")
        return count

    def _check_bounds(self) -> None:
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        limits = (f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_STRING_CHARS} characters "
                  "each are accepted")
        if len(stops) > MAX_STOP_STRINGS:
            raise APIError(400, f"stop has {len(stops):,} strings; {limits}", param="stop")
        longest = max(stops, key=len, default="")
        if len(longest) > MAX_STOP_STRING_CHARS:
            raise APIError(400, f"stop has a string of {len(longest):,} characters; {limits}", param="stop")
        if self.stop_token_ids is not None and len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise APIError(400, f"stop_token_ids has {len(self.stop_token_ids):,} ids; at most "
                                f"{MAX_STOP_TOKEN_IDS:,} are accepted", param="stop_token_ids")

    def ignored_fields(self) -> list[str]:
        """The fields of the body neither OpenAI nor kvscope defines (vLLM ignores them
        too, with a warning; the route logs one)."""
        return sorted(self.model_extra or {})

    def _logit_bias(self) -> dict[int, float]:
        """OpenAI's map (token ids as JSON string keys) as ``{id: bias}``; the bias range
        is SamplingParams' check, the vocabulary the engine's."""
        raw = self.logit_bias or {}
        if len(raw) > MAX_LOGIT_BIAS_ENTRIES:
            raise APIError(400, f"logit_bias has {len(raw):,} entries; at most {MAX_LOGIT_BIAS_ENTRIES:,} are "
                                "accepted", param="logit_bias")
        bias: dict[int, float] = {}
        for key, value in raw.items():
            if not (key.isascii() and key.isdigit() and len(key) <= 12):
                raise APIError(400, f"logit_bias key {_shown(key)}: keys are token ids written as integers, "
                                    'as in {"28": -100}', param="logit_bias")
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise APIError(400, f"logit_bias value {_shown(value)} for token {key}: biases are numbers in "
                                    "[-100, 100]", param="logit_bias")
            bias[int(key)] = float(value)
        return bias

    def sampling_params(self, max_tokens: int | None, session_header: str | None = None) -> SamplingParams:
        """A :class:`SamplingParams`; its validation errors become HTTP 400. ``session_header``:
        the request's ``X-Session-Id`` (see :func:`session_key`)."""
        session = session_key(session_header, self.cache_salt, self.user)
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        try:
            return SamplingParams(
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=0 if self.top_k is None else self.top_k,
                seed=self.seed,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                stop=stop,
                stop_token_ids=list(self.stop_token_ids or []),
                ignore_eos=self.ignore_eos,
                include_stop_str_in_output=self.include_stop_str_in_output,
                skip_special_tokens=self.skip_special_tokens,
                logit_bias=self._logit_bias(),
                logprobs=self.logprobs_count(),
                prompt_logprobs=self.prompt_logprobs_count(),
                cache_salt=self.cache_salt,
                session=session,
            )
        except UserError as exc:
            raise APIError(400, str(exc), param=str(exc).split(" ", 1)[0]) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


SESSION_HEADER = "X-Session-Id"
MAX_SESSION_KEY = 256  # characters: a key is recorded on every request's arrival event


def session_key(header: str | None, cache_salt: Any, user: str | None) -> str | None:
    """The conversation a request continues (engine/events/folds/sessions.py): its ``X-Session-Id``
    header, else its ``cache_salt`` (a tenant's or conversation's cache partition), else its
    ``user``; None when it names none. HTTP 400 for a key over :data:`MAX_SESSION_KEY` characters."""
    for name, value in ((SESSION_HEADER, header), ("cache_salt", cache_salt), ("user", user)):
        if isinstance(value, str) and value:
            if len(value) > MAX_SESSION_KEY:
                raise APIError(400, f"{name}: {len(value):,} characters; a session key is at most "
                                    f"{MAX_SESSION_KEY} (send a shorter id, or a hash of it)", param=name)
            return value
    return None


def _count(value: Any, name: str) -> int | None:
    """A logprobs count: an integer in 0..MAX_LOGPROBS, or None."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS:
        raise APIError(400, f"{name}={_shown(value)}: a whole number in 0..{MAX_LOGPROBS}", param=name)
    return int(value)


def _shown(value: Any) -> str:
    """A refused value in a message: its JSON-ish repr, cut to 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: StrictBool = False
    suffix: str | None = None

    def logprobs_count(self) -> int | None:
        # completions' logprobs is a count, and 0 asks for the sampled token's logprob alone
        if self.top_logprobs not in (None, 0):
            raise APIError(400, "top_logprobs is the chat API's; on completions logprobs is the count of "
                                "alternatives", param="top_logprobs")
        return _count(self.logprobs, "logprobs")

    def single_prompt(self) -> str | list[int]:
        """kvscope serves one prompt per request; a one-element batch is unwrapped."""
        if self.echo:
            raise APIError(400, "echo=true is not supported; omit it", param="echo")
        if self.suffix:
            raise APIError(400, "suffix is not supported; omit it", param="suffix")
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise APIError(400, f"got {len(prompt)} prompts; send one prompt per request", param="prompt")
            prompt = prompt[0]  # type: ignore[assignment]
        if isinstance(prompt, list) and not prompt:
            raise APIError(400, "the prompt is empty; give at least one token", param="prompt")
        return prompt  # type: ignore[return-value]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts: list[str] = []
        for part in self.content:
            if part.get("type") != "text":
                raise APIError(400, f"content part type {part.get('type')!r}: only text parts are supported",
                               param="messages")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None: up to --max-model-len, as vLLM
    max_completion_tokens: int | None = None
    add_generation_prompt: StrictBool = True
    # vLLM's chat extensions, neutral only
    echo: Any = None
    continue_final_message: Any = None
    chat_template: Any = None
    chat_template_kwargs: Any = None
    documents: Any = None

    def check_supported(self) -> None:
        super().check_supported()
        for name, is_neutral, lacks in (
            ("echo", _neutral(None, False), "echo is not supported"),
            ("continue_final_message", _neutral(None, False), "continuing the last message is not supported"),
            ("chat_template", _neutral(None), "a request's own chat template is not accepted (the server's "
                                              "--chat-template is)"),
            ("chat_template_kwargs", _neutral(None, {}), "chat template arguments are not supported"),
            ("documents", _neutral(None, []), "documents are not supported"),
        ):
            value = getattr(self, name)
            if not is_neutral(value):
                raise APIError(400, f"{name}={_shown(value)}: {lacks}; omit it", param=name)

    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


# --------------------------------------------------------------------- responses
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (aiperf reads it)


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> UsageInfo:
        details = None if cached_tokens is None else PromptTokensDetails(cached_tokens=cached_tokens)
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens, prompt_tokens_details=details)


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completions logprobs, token by token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class ChatLogprobTop(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(ChatLogprobTop):
    top_logprobs: list[ChatLogprobTop] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobToken] | None = None


class PromptLogprob(BaseModel):
    """vLLM's ``Logprob``: one entry of a prompt position's ``{token id: ...}`` map."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's prompt_logprobs: None for the first prompt token, then {token id: PromptLogprob}
# holding the prompt's own token and the top alternatives
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, at the top level on chat


class DeltaMessage(BaseModel):
    """A chunk's delta carries only what it has: the role once, then content."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kvscope"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
