"""vLLM's own routes beside OpenAI's, in vLLM 0.32's shapes, for the tools that call
them: ``POST /tokenize`` and ``/detokenize`` (``vllm bench serve`` aligns prompt lengths
with them), ``GET /server_info`` (guidellm records it with a benchmark), ``GET /load``
(the requests in flight), ``GET /kv_event_sources`` (where the KV events are published)
and ``POST /start_profile`` / ``/stop_profile`` (``vllm bench serve --profile``: the
torch profiler on the engine thread, bounded by steps or seconds, engine/profiling.py)."""

from __future__ import annotations

import json
import os
import platform
import sys
from functools import partial
from typing import Any, Literal

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, StrictBool

from engine.errors import UserError
from engine.profiling import ProfileLimits
from engine.serve.host import EngineHost
from engine.serve.protocol import APIError, ChatMessage
from engine.serve.route_support import KEYED, host_of

router = APIRouter()

# Environment variables /server_info shows (names with a secret in them never).
ENV_PREFIXES = ("KVSCOPE_", "VLLM_")
SECRET_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD")


class TokenizeRequest(BaseModel):
    """vLLM's CompletionTokenizeRequest (``prompt``) or ChatTokenizeRequest (``messages``)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: StrictBool = True
    add_special_tokens: StrictBool | None = None  # vLLM's defaults: True for a prompt, False for messages
    return_token_strs: StrictBool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


def _check_model(host: EngineHost, name: str | None) -> None:
    if name is not None and name != host.settings.served_model_name:
        raise APIError(404, f"the model {name!r} does not exist; this server serves "
                            f"{host.settings.served_model_name!r}", param="model", code="model_not_found")


@router.post("/tokenize", dependencies=KEYED)
async def tokenize(request: Request, body: TokenizeRequest) -> dict[str, Any]:
    """``{"count", "max_model_len", "tokens", "token_strs"}`` as vLLM answers."""
    host = host_of(request)
    _check_model(host, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give either prompt (text) or messages (a chat), not both or neither", param="prompt")
    llm = host.llm
    tokenizer = llm.tokenizer

    def encode() -> list[int]:
        if body.messages is not None:
            text = tokenizer.apply_chat_template([{"role": m.role, "content": m.text()} for m in body.messages],
                                                 add_generation_prompt=body.add_generation_prompt,
                                                 chat_template=host.settings.chat_template)
            return llm.encode_prompt(str(text), add_special_tokens=bool(body.add_special_tokens))
        assert body.prompt is not None
        return llm.encode_prompt(body.prompt, add_special_tokens=body.add_special_tokens is not False)

    try:
        tokens = await anyio.to_thread.run_sync(encode)
    except UserError as exc:
        raise APIError(400, str(exc), param="messages" if body.messages is not None else "prompt") from None
    strs = [tokenizer.id_to_token(t) or "" for t in tokens] if body.return_token_strs else None
    return {"count": len(tokens), "max_model_len": llm.max_model_len, "tokens": tokens, "token_strs": strs}


@router.post("/detokenize", dependencies=KEYED)
async def detokenize(request: Request, body: DetokenizeRequest) -> dict[str, Any]:
    """``{"prompt": text}`` as vLLM answers; an id outside the vocabulary is a 400 naming it."""
    host = host_of(request)
    _check_model(host, body.model)
    llm = host.llm
    vocab = llm.startup.model_config.vocab_size
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is outside the vocabulary (0..{vocab - 1})", param="tokens")
    text = await anyio.to_thread.run_sync(partial(llm.tokenizer.decode, body.tokens))
    return {"prompt": text}


@router.get("/server_info", dependencies=KEYED)
async def server_info(request: Request, config_format: str = "text") -> dict[str, Any]:
    """vLLM's ``{"vllm_config", "vllm_env", "system_env"}``: the engine's configuration
    (text or, with ``?config_format=json``, an object), the KVSCOPE_/VLLM_ environment
    and the system's versions."""
    if config_format not in ("text", "json"):
        raise APIError(400, f"config_format {config_format!r}: use text or json", param="config_format")
    config = effective_config(host_of(request).llm)
    shown: Any = config if config_format == "json" else ", ".join(f"{k}={v!r}" for k, v in config.items())
    env = {k: v for k, v in sorted(os.environ.items())
           if k.startswith(ENV_PREFIXES) and not any(word in k for word in SECRET_WORDS)}
    return {"vllm_config": shown, "vllm_env": env, "system_env": _system_env()}


# The scheduler's limits in force, under the flags' names: startup may derive them (on CPU the
# step budget is vLLM-CPU's 2,048 or the kernel plan's, not the flag's GPU default of 8,192).
_SCHEDULER_LIMITS = ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "block_size",
                     "enable_prefix_caching", "long_prefill_token_threshold")


def effective_config(llm: Any) -> dict[str, Any]:
    """The engine's flags as it runs: startup's resolved config (every ``auto`` and device
    default filled in; under data parallelism rank 0's) with the scheduler's limits in
    force, the step budget for decodes (None: every step's) and the KV pool's
    ``num_gpu_blocks``, as vLLM's cache config reports it."""
    resolved = getattr(llm.startup, "config", None) or llm.config
    limits = llm.startup.scheduler_config
    config = resolved.to_dict()
    config.update({name: getattr(limits, name) for name in _SCHEDULER_LIMITS})
    config["max_decode_step_tokens"] = limits.max_decode_step_tokens or None
    config["num_gpu_blocks"] = limits.num_blocks
    return config


def _system_env() -> dict[str, Any]:
    import torch

    return {"python_version": sys.version.split()[0], "torch_version": torch.__version__,
            "os": platform.platform(), "machine": platform.machine(), "cpu_count": os.cpu_count(),
            "cuda_available": torch.cuda.is_available()}


@router.get("/load", dependencies=KEYED)
async def load(request: Request) -> dict[str, int]:
    """vLLM's ``{"server_load": N}``: the completion and chat requests in flight (received,
    not yet answered in full)."""
    return {"server_load": host_of(request).in_flight.count}


@router.get("/kv_event_sources", dependencies=KEYED)
async def kv_event_sources(request: Request) -> JSONResponse:
    """vLLM's discovery map: each data-parallel rank (a string key) to its KVEventsConfig
    as resolved (``publisher``, ``endpoint``, ``replay_endpoint``, ``topic``,
    ``enable_kv_cache_events``, ``hwm``, ``buffer_steps``, ``max_queue_size``), the
    endpoints as bound (the port the OS picked for ``:0``, a wildcard host as this
    node's address); ``{}`` without a ZMQ publisher."""
    return JSONResponse(host_of(request).llm.kv_event_sources())


@router.post("/start_profile", dependencies=KEYED)
async def start_profile(request: Request) -> dict[str, Any]:
    """Start the torch profiler where the steps run: the engine thread, or under
    ``--data-parallel-size`` every rank's engine core (vLLM's route; 200 once it runs).
    ``max_steps`` / ``max_seconds`` (query parameters or a JSON body) stop it by itself;
    without either the default caps do (engine/profiling.py)."""
    limits = await _profile_limits(request)
    return {"status": "profiling", "trace_dir": (await _profiler_call(request, "start", limits))[0],
            "limits": limits.to_dict()}


async def _profile_limits(request: Request) -> ProfileLimits:
    body = await request.body()
    try:
        values = json.loads(body) if body.strip() else {}
    except ValueError:
        values = None
    if not isinstance(values, dict):
        raise APIError(400, "the /start_profile body is a JSON object such as {\"max_steps\": 50}, or empty")
    try:
        return ProfileLimits.parse({**values, **request.query_params})
    except UserError as exc:
        raise APIError(400, str(exc)) from None


@router.post("/stop_profile", dependencies=KEYED)
async def stop_profile(request: Request) -> dict[str, Any]:
    """Stop it and write the trace (Chrome trace JSON, which ui.perfetto.dev opens) next
    to kvscope's own Perfetto output; the answer says where: ``trace`` (rank 0's under data
    parallelism) and ``traces``, one per engine core in rank order."""
    traces = await _profiler_call(request, "stop")
    return {"status": "stopped", "trace": traces[0], "traces": traces}


async def _profiler_call(request: Request, action: Literal["start", "stop"],
                         limits: ProfileLimits | None = None) -> list[str]:
    """The profiler's ``start`` or ``stop`` run where the steps run; its refusal (a UserError) is a 400."""
    host = host_of(request)
    try:
        return await host.engine.profile(host.profiler, action, limits)
    except UserError as exc:
        raise APIError(400, str(exc)) from None
