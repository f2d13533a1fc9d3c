"""The OpenAI wire format the server speaks: request bodies, responses,
streaming chunks, usage and errors, as pydantic models.

Only what kvscope implements is accepted with a value that changes anything;
fields OpenAI clients commonly send at their neutral value (``n=1``,
``presence_penalty=0``, ``logprobs=null``, ``user``) are accepted so unmodified
clients work, and a non-neutral value is a 400 that names the field.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, StrictBool, model_serializer

from engine.core.sampling_params import SamplingParams
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
class StreamOptions(BaseModel):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class _SamplingFields(BaseModel):
    """The sampling fields shared by completions and chat completions.

    Floats refuse NaN and infinity (``1e400`` parses to infinity), booleans are
    strict (``"stream": "yes"`` is a 400, not True): a value kvscope would have to
    guess at is refused with its field named."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

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
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: Any = None
    user: str | None = None
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
        if self.logprobs not in (None, False, 0):
            raise APIError(400, "logprobs are not supported; omit the field", param="logprobs")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        """A :class:`SamplingParams`; its validation errors become HTTP 400."""
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
            )
        except UserError as exc:
            raise APIError(400, str(exc), param=str(exc).split(" ", 1)[0]) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: StrictBool = False
    suffix: str | None = None

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

    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


# --------------------------------------------------------------------- responses
class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


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
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


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
    logprobs: None = None
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
