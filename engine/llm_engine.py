"""The engine: startup, then a step loop of schedule → run → update.

Every step publishes one ``step`` event (decisions, block deltas, time split);
the scheduler publishes the ``request.*`` lifecycle. The JSONL recording, the
Prometheus metrics, the stats line and the monitor are all subscribers of the
same bus; nothing reads engine internals to observe it.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.config import EngineConfig
from engine.core.request import FINISH_REASONS, Request, RequestStatus
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler, SchedulerOutput, finished_event
from engine.core.step_loop import ExecutedStep, run_step
from engine.detokenizers import Detokenizers
from engine.errors import UserError
from engine.events import EventBus
from engine.events.exporters.observers import ObserverFlags, attach_observers
from engine.events.request_records import ABORT_CLIENT_DISCONNECT
from engine.gc_policy import thaw_heap
from engine.heartbeat import DETOKENIZE, FORWARD, UPDATE, Heartbeat
from engine.model.loading.tokenizer import IncrementalDetokenizer
from engine.model.memory.device import device_word
from engine.model.runner import ScheduledSeq
from engine.model.sampler import TokenLogprobs
from engine.prompt_logprobs import PromptLogprobs
from engine.startup.phases import StartupResult, start_engine
from engine.workers import WorkerGroup

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from engine.pipeline import PipelineRunner


@dataclass(slots=True)
class RequestOutput:
    """What a caller sees of a request after a step: the new tokens and text."""

    request_id: str
    prompt_token_ids: list[int]
    new_token_ids: list[int]
    delta_text: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # finish_reason "error": what failed (this request only)
    # with SamplingParams.logprobs: new_token_ids' log-probabilities (and alternatives), in order
    logprobs: list[TokenLogprobs] | None = None
    # with SamplingParams.prompt_logprobs, on the request's first output only: vLLM's list, None
    # for the first prompt token (nothing precedes it), then each prompt token's log-probability
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True, slots=True)
class CheckedPrompt:
    """A prompt that passed :meth:`LLMEngine.check_prompt` for ``params``: its token ids
    and the max_tokens they leave. ``add_request`` takes it without checking again (the
    server checks on a worker thread, the offline API before any compute); a raw prompt
    is checked there. Trusted only with the params it was checked for (equal ones)."""

    token_ids: list[int]
    params: SamplingParams
    max_tokens: int


def one_engine_config(config: EngineConfig) -> EngineConfig:
    """``config`` as one engine runs it: refused under ``--data-parallel-size`` outside a
    data-parallel core (``engine serve`` runs those); under pipeline parallelism checked
    against the model, with float weights for ``--quantization auto`` (the stages hold
    float weights, engine/pipeline.py)."""
    if (config.data_parallel_size or 1) > 1 and config.data_parallel_rank is None:
        raise UserError(f"--data-parallel-size {config.data_parallel_size} runs engine cores behind "
                        "`engine serve`; this command runs one engine: drop the flag")
    if (config.pipeline_parallel_size or 1) > 1:
        from engine.modelspec.readers import load_model_config
        from engine.pipeline import check_pipeline

        check_pipeline(config, load_model_config(config.model))
        if config.quantization == "auto":
            config = dataclasses.replace(config, quantization=None)
    return config


class LLMEngine:
    """Owns the bus, the scheduler and the model runner. Not thread-safe: one
    thread calls ``add_request`` / ``abort`` / ``step`` (the server funnels its
    calls through the engine thread)."""

    def __init__(self, config: EngineConfig, bus: EventBus | None = None,
                 progress: Callable[[int, int], None] | None = None,
                 metrics_registry: CollectorRegistry | None = None, heartbeat: Heartbeat | None = None) -> None:
        """``metrics_registry``: where sinks that count their own losses register those
        counters (the server's ``/metrics``); None keeps them private. ``heartbeat``: where the
        steps beat (engine/heartbeat.py; a data-parallel core's is in the server's shared memory)."""
        config = one_engine_config(config)
        stages = config.pipeline_parallel_size or 1
        self.config = config
        self.bus = bus or EventBus()
        self.heartbeat = heartbeat or Heartbeat()  # what the stall detector reads of this core's steps
        profile_listener = self.bus.subscribe(self.heartbeat.on_event)  # phase D's step time: the limit's yardstick
        # ranks 1..N-1 under --tensor-parallel-size N; this host's stages 1.. under --pipeline-parallel-size
        self.workers: WorkerGroup | None = None
        self.pipeline: PipelineRunner | None = None  # stages 1..P-1 under --pipeline-parallel-size P
        # the header's started_unix lets a replay put spans at their original times
        self.observers = attach_observers(
            self.bus, ObserverFlags(events_path=config.events_path, kv_events_config=config.kv_events_config,
                                    progress=True, stats_interval=config.stats_interval),
            recording_config=config.to_dict(), model_name=config.served_model_name or config.model,
            registry=metrics_registry, data_parallel_rank=config.data_parallel_rank or 0)
        try:
            if config.tensor_parallel_size > 1 or stages > 1:
                self.workers = WorkerGroup(config)
                self.workers.relay_to(self.bus)
            self.startup: StartupResult = start_engine(
                config, self.bus, progress, rank=self.workers.driver_layout if self.workers else None,
                stage=self.workers.driver_stage if self.workers else None)
            if self.workers is not None:
                self.workers.parallel = self.startup.parallel
                self.workers.wait_ready()
            if stages > 1:
                from engine.pipeline import PipelineRunner

                assert self.workers is not None
                self.pipeline = PipelineRunner.start(self.startup, self.workers.driver_stage, self.bus)
        except Exception as exc:
            failure = self.workers.failure(exc) if self.workers is not None else exc
            self.close()
            if failure is not exc:
                raise failure from exc
            raise
        except BaseException:
            self.close()
            raise
        finally:
            self.observers.end_startup()
            self.bus.unsubscribe(profile_listener)
        self.tokenizer = self.startup.tokenizer
        self.runner = self.pipeline or self.startup.runner
        self.scheduler = Scheduler(self.startup.scheduler_config, self.bus)
        self.observers.start_stats(device_word(self.startup.device))
        self.detokenizers = Detokenizers()
        self._step_logprobs: dict[str, TokenLogprobs] = {}  # the last step's, for requests that ask
        self.prompt_logprobs = PromptLogprobs()
        self._ids = itertools.count()
        self._clock_start = time.monotonic()
        self.eos_token_ids = self._eos_ids()

    # --------------------------------------------------------------- helpers
    def now(self) -> float:
        return self.bus.now()

    def kv_event_sources(self) -> dict[str, dict[str, Any]]:
        """vLLM's ``GET /kv_event_sources``: this engine's KVEventsConfig as bound, under its
        data-parallel rank (a string key, as JSON has them); empty without a ZMQ publisher."""
        sink = self.observers.kv_events
        return {} if sink is None else {str(self.config.data_parallel_rank or 0): sink.resolved.to_dict()}

    def _eos_ids(self) -> set[int]:
        ids = set(getattr(self.tokenizer, "eos_token_ids", None) or [])
        eos = getattr(self.tokenizer, "eos_token_id", None) or self.startup.model_config.eos_token_id
        if eos is not None:
            ids.add(int(eos))
        return ids

    @property
    def max_model_len(self) -> int:
        return self.startup.scheduler_config.max_model_len

    def encode_prompt(self, prompt: str | Sequence[int], add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``prompt``. Text gets the BOS token when the tokenizer says the model
        wants one (a GGUF's ``tokenizer.ggml.add_bos_token``: Gemma yes, SmolLM2 no), as
        vLLM's completion path encodes with ``add_special_tokens=True``; a rendered chat
        template already holds its BOS, so the chat paths pass False (vLLM does too).
        Text too long to fit ``--max-model-len`` even at the vocabulary's longest token is
        refused before tokenising (a 10 MB prompt would otherwise cost seconds of tokeniser
        time to learn the same thing)."""
        if isinstance(prompt, str):
            size, longest = len(prompt.encode("utf-8", errors="surrogatepass")), self.tokenizer.max_token_bytes
            if size > self.max_model_len * longest:
                raise UserError(
                    f"the prompt is {size:,} bytes: at least {-(-size // longest):,} tokens (no token covers more "
                    f"than {longest} bytes), over --max-model-len {self.max_model_len:,}; shorten the prompt")
            return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        return [int(t) for t in prompt]

    def check_prompt(self, prompt_ids: Sequence[int], params: SamplingParams) -> int:
        """Validate lengths before any compute; returns the effective max_tokens."""
        n = len(prompt_ids)
        limit = self.max_model_len
        if n == 0:
            raise UserError("the prompt is empty; give at least one token", param="prompt")
        if n >= limit:
            raise UserError(
                f"the prompt is {n:,} tokens but --max-model-len is {limit:,}; it leaves no room for output "
                f"(shorten the prompt or raise --max-model-len)", param="prompt"
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - n
        if n + max_tokens > limit:
            raise UserError(
                f"prompt ({n:,} tokens) + max_tokens ({max_tokens:,}) = {n + max_tokens:,} exceeds "
                f"--max-model-len {limit:,}; lower max_tokens to {limit - n:,} or shorten the prompt",
                param="max_tokens")
        vocab = self.startup.model_config.vocab_size
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise UserError(f"prompt token id {bad} is outside the vocabulary (0..{vocab - 1})", param="prompt")
        bad = next((t for t in params.stop_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise UserError(f"stop_token_ids: {bad} is outside the vocabulary (0..{vocab - 1})",
                            param="stop_token_ids")
        bad = next((t for t in params.logit_bias if not 0 <= t < vocab), None)
        if bad is not None:
            raise UserError(f"logit_bias: token id {bad} is outside the vocabulary (0..{vocab - 1})",
                            param="logit_bias")
        return max_tokens

    def prepare_prompt(self, prompt: str | Sequence[int], params: SamplingParams,
                       add_special_tokens: bool = True) -> CheckedPrompt:
        """Encode and check ``prompt`` once: ``add_request`` does not check it again."""
        prompt_ids = self.encode_prompt(prompt, add_special_tokens=add_special_tokens)
        return CheckedPrompt(prompt_ids, params, self.check_prompt(prompt_ids, params))

    # ------------------------------------------------------------ requests
    def add_request(self, prompt: str | Sequence[int] | CheckedPrompt, params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0, arrival_time: float | None = None) -> str:
        """Queue a request. ``arrival_time`` (the bus clock): when it was received, if
        earlier than now (the server's HTTP receipt); its TTFT and e2e count from it and
        ``request.arrived`` says how long it took to get here (``preprocess_s``)."""
        checked = prompt if isinstance(prompt, CheckedPrompt) else None
        if checked is None or params not in (None, checked.params):  # raw, or checked for other params
            raw = prompt.token_ids if isinstance(prompt, CheckedPrompt) else prompt
            checked = self.prepare_prompt(raw, params or SamplingParams())
        params, prompt_ids, max_tokens = checked.params, checked.token_ids, checked.max_tokens
        if params.prompt_logprobs is not None and self.pipeline is not None:
            raise UserError("prompt_logprobs is not served under --pipeline-parallel-size (the last stage computes "
                            "only the sampled rows' logits); omit it or run one stage", param="prompt_logprobs")
        rid = request_id or f"req-{next(self._ids)}"
        eos = None if params.ignore_eos else min(self.eos_token_ids) if len(self.eos_token_ids) == 1 else None
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos and len(self.eos_token_ids) > 1:
            stop_ids |= self.eos_token_ids
        req = Request(rid, prompt_ids, max_tokens, stop_token_ids=stop_ids, eos_token_id=eos,
                      ignore_eos=params.ignore_eos, priority=priority, sampling=params,
                      arrival_time=self.now() if arrival_time is None else arrival_time)
        if self.config.log_prompts:
            req.prompt_text = prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt_ids)
        # Everything that can fail is built before the scheduler holds the request: a
        # failure here leaves no state behind.
        detok = IncrementalDetokenizer(
            self.tokenizer, stop=params.stop, include_stop=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens, prompt_ids=prompt_ids,
        )
        rejected = self.scheduler.submit(req, self.now())
        if rejected is not None:
            raise UserError(f"request {rid} rejected: {rejected}")
        self.detokenizers.add(rid, detok)
        if params.prompt_logprobs is not None:
            self.prompt_logprobs.expect(rid, len(prompt_ids))
        return rid

    def abort(self, request_id: str, cause: str = ABORT_CLIENT_DISCONNECT) -> bool:
        """Abort a request; ``cause`` (engine/events/request_records.py ABORT_CAUSES) goes on its finish event."""
        self.detokenizers.drop(request_id)
        self.prompt_logprobs.drop(request_id)
        return self.scheduler.abort(request_id, self.now(), cause)

    def fail_unfinished(self, error: str) -> int:
        """The engine loop stopped: every request still in it finishes with reason ``error`` (one
        ``request.finished`` each, so every arrival stays accounted for). Its blocks are not freed:
        the engine's state is unknown and it is closing. Returns how many there were."""
        now = self.now()
        requests = list(self.scheduler.requests.values())
        for req in requests:
            req.status, req.error, req.finished_time = RequestStatus.FINISHED_ERROR, error, now
            self.bus.publish(finished_event(req))
        self.scheduler.requests.clear()
        return len(requests)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        scheduler, beat = self.scheduler, self.heartbeat
        beat.begin_step(scheduler.num_waiting, scheduler.num_running)
        result = run_step(scheduler, self, self.bus, self.now(), host_clock=time.perf_counter)
        beat.end_step(scheduler.num_waiting, scheduler.num_running, len(result.output.scheduled))
        return self._outputs(result.output, result.executed, result.finished)

    def execute(self, out: SchedulerOutput, now: float) -> ExecutedStep:
        """The model executor (engine/core/step_loop.py): the runner samples one token per
        sampling sequence, then the detokenisers find stop strings, which the scheduler's
        update needs to decide who finished."""
        # every request carries one table per KV cache group (one with full attention everywhere)
        batch = [ScheduledSeq(s.request_id, s.token_ids, s.start_position, s.block_ids, s.samples,
                              s.request.sampling, s.block_tables, self.prompt_logprobs.targets(s))
                 for s in out.scheduled]
        self.heartbeat.scheduled(len(batch))
        self.heartbeat.phase(FORWARD)
        collectives: dict[str, float] = {}
        if self.workers is not None and batch:  # the collectives' cost, or each stage's bubble and bytes sent
            sampled_ids, collectives = self.workers.execute(self.runner, batch)
        else:
            sampled_ids = self.runner.execute(batch) if batch else {}
        self.heartbeat.phase(DETOKENIZE)
        timings = self.runner.last_timings
        failed = dict(self.runner.last_failed)
        self._step_logprobs = getattr(self.runner, "last_logprobs", {})
        found: dict[str, list[TokenLogprobs]] = getattr(self.runner, "last_prompt_logprobs", {})
        if found:
            self.prompt_logprobs.keep(out, found)
        deltas, stopped_by_string = self.detokenizers.decode(sampled_ids, failed)
        if self.config.log_prompts:
            for rid in deltas:
                self.scheduler.requests[rid].output_text = self.detokenizers.text(rid)
        self.heartbeat.phase(UPDATE)
        return ExecutedStep(
            {rid: [tok] for rid, tok in sampled_ids.items() if rid not in failed}, self.now(), stopped_by_string,
            deltas, {"forward_s": timings.prepare_s + timings.forward_s, "sample_s": timings.sample_s,
                     **collectives, **self._runner_counts()}, failed=failed,
        )

    def _runner_counts(self) -> dict[str, Any]:
        """For the step event: a MoE model's tokens per expert per layer in the step just run, and
        the prompt positions the LM head ran on for prompt logprobs."""
        counts = self.runner.last_expert_counts
        rows = getattr(self.runner, "last_prompt_logprob_rows", 0)
        return {**({"expert_counts": counts} if counts else {}), **({"prompt_logprob_rows": rows} if rows else {})}

    def _outputs(self, out: SchedulerOutput, executed: ExecutedStep, finished: list[Request]) -> list[RequestOutput]:
        sampled, deltas = executed.sampled, executed.text
        finished_by_id = {r.request_id: r for r in finished}
        results: list[RequestOutput] = []
        for s in out.scheduled:
            rid = s.request_id
            if rid not in sampled and rid not in executed.failed:
                continue
            req = s.request
            detok = self.detokenizers.get(rid)
            delta = deltas.get(rid, "")
            done = rid in finished_by_id
            if done and detok is not None:
                delta += self.detokenizers.release(req)
            results.append(RequestOutput(
                request_id=rid,
                prompt_token_ids=req.prompt_token_ids,
                new_token_ids=sampled.get(rid, []),
                delta_text=delta,
                token_ids=req.output_token_ids,
                text=detok.text if detok is not None else "",
                finished=done,
                finish_reason=FINISH_REASONS.get(req.status) if done else None,
                num_cached_tokens=max(req.num_cached_tokens, 0),
                error=req.error if done else None,
                logprobs=[self._step_logprobs[rid]] if rid in self._step_logprobs and rid in sampled else None,
                prompt_logprobs=self.prompt_logprobs.take(rid) if rid in sampled or done else None,
            ))
        return results

    # ------------------------------------------------------------- shutdown
    def close(self) -> None:
        if self.workers is not None:  # first: no worker outlives the replica, whatever else fails
            self.workers.close()
        self.observers.close()  # the last stats line, then the recording and the KV publisher
        thaw_heap()  # startup froze the heap (engine/gc_policy.py): what this engine leaves is collectable

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
