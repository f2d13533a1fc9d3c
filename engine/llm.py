"""The offline API: ``LLM(model=..., **flags).generate(prompts, SamplingParams(...))``.

It is the same engine as the server's, stepped in the caller's thread until
every request is done; pass ``events="run.jsonl"`` to record the run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from engine.gc_policy import defer_collections

defer_collections()  # before torch loads: see engine/gc_policy.py

from engine.config import EngineConfig, parse_dtype  # noqa: E402
from engine.core.sampling_params import SamplingParams  # noqa: E402
from engine.errors import UserError  # noqa: E402
from engine.events import EventBus  # noqa: E402
from engine.llm_engine import LLMEngine, RequestOutput  # noqa: E402
from engine.model.sampler import TokenLogprobs  # noqa: E402
from engine.modelspec.presets import BUNDLED_MODEL_NAME  # noqa: E402

ChatMessages = Sequence[dict[str, str]]


def engine_config(model: str = BUNDLED_MODEL_NAME, **flags: Any) -> EngineConfig:
    """An EngineConfig from vLLM-style keyword flags (``max_model_len=2048``, ``events="x.jsonl"``)."""
    cfg = EngineConfig(model=model)
    aliases = {"events": "events_path", "device_memory": "device_memory_gib", "threads": "num_threads"}
    for key, value in flags.items():
        name = aliases.get(key, key)
        if not hasattr(cfg, name):
            raise UserError(f"unknown engine option {key!r}")
        setattr(cfg, name, value)
    cfg.dtype = parse_dtype(cfg.dtype)
    return cfg


class LLM:
    def __init__(self, model: str = BUNDLED_MODEL_NAME, bus: EventBus | None = None, **flags: Any) -> None:
        self.engine = LLMEngine(engine_config(model, **flags), bus=bus)
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs in prompt order."""
        if isinstance(prompts, str):
            prompts = [prompts]
        params_list = (
            list(sampling_params) if isinstance(sampling_params, Sequence)
            else [sampling_params or SamplingParams()] * len(prompts)
        )
        if len(params_list) != len(prompts):
            raise UserError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        # Check every prompt before any compute, so a bad one costs nothing; add_request
        # takes the checked prompts without checking them again.
        checked = [self.engine.prepare_prompt(p, params) for p, params in zip(prompts, params_list, strict=True)]
        order = [self.engine.add_request(prompt) for prompt in checked]
        finals: dict[str, RequestOutput] = {}
        # engine.step()'s outputs carry each step's logprobs (and the prompt's, once): the final
        # output carries the whole request's, as vLLM's LLM.generate returns them
        logprobs: dict[str, list[TokenLogprobs]] = {}
        prompt_logprobs: dict[str, list[TokenLogprobs | None]] = {}
        progress = _progress(len(order)) if use_tqdm and len(order) > 1 else None
        task = progress.add_task("generate", total=len(order)) if progress else None
        if progress:
            progress.start()
        try:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.logprobs:
                        logprobs.setdefault(out.request_id, []).extend(out.logprobs)
                    if out.prompt_logprobs is not None:
                        prompt_logprobs[out.request_id] = out.prompt_logprobs
                    if out.finished:
                        out.logprobs = logprobs.pop(out.request_id, None)
                        out.prompt_logprobs = prompt_logprobs.pop(out.request_id, None)
                        finals[out.request_id] = out
                        if progress is not None and task is not None:
                            progress.advance(task)
        finally:
            if progress:
                progress.stop()
        return [finals[rid] for rid in order]

    def chat(self, messages: ChatMessages | Sequence[ChatMessages], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)  # type: ignore[index]
        self.tokenizer.warn_chat_template_once()  # a GGUF with no template of its own: one line per LLM
        prompts = [self.tokenizer.apply_chat_template(list(c), add_generation_prompt=True) for c in conversations]
        # the rendered template holds the BOS already: no second one (vLLM's add_special_tokens=False)
        encoded = [self.engine.encode_prompt(p, add_special_tokens=False) for p in prompts]
        return self.generate(encoded, sampling_params, use_tqdm=use_tqdm)

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if TYPE_CHECKING:
    from rich.progress import Progress


def _progress(total: int) -> Progress:
    # Imported here: rich.progress is ~90 ms of every start, and only generate() with a bar needs it.
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    transient=True)
