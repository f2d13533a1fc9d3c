"""A run's totals, peaks and per-request times, folded from its events.

The model-free executors (the driver and the simulator) report what a run did
by subscribing a :class:`RunTally` to their bus, so their summaries count what
the recording, the monitor and the metrics count: the same step and request
events, nothing read from the scheduler's internals. The block peak is the
high-water mark of the forward passes (``kv_blocks_used_forward``: before the
step's finished requests free their blocks), which is what the KV pool must hold;
``kv_blocks_used`` after the step, what vLLM's ``kv_cache_usage_perc`` gauge shows,
can be a few blocks lower.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.events.record import Event
from engine.events.request_records import RequestFinished, RequestFirstToken, RequestRejected
from engine.events.step_records import EncoderStepEvent, StepEvent


@dataclass(slots=True)
class RunTally:
    """Subscribe it to a bus (it is a callable) and read the fields afterwards.

    ``first_token_step`` and ``finish_step`` map request id -> the index of the
    step (``StepEvent.index``) in which the request got its first token or
    finished; ``step_*`` are per-step series in step order."""

    steps: int = 0
    preemptions: int = 0
    peak_running: int = 0
    peak_waiting: int = 0
    peak_blocks_used: int = 0
    finished: int = 0
    rejected: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    prompt_tokens: int = 0  # of finished requests
    output_tokens: int = 0  # of finished requests
    first_token_step: dict[str, int] = field(default_factory=dict)
    finish_step: dict[str, int] = field(default_factory=dict)
    ttft_s: dict[str, float] = field(default_factory=dict)
    itl_s: list[float] = field(default_factory=list)
    step_prefill: list[int] = field(default_factory=list)
    step_decode: list[int] = field(default_factory=list)
    step_forward_s: list[float] = field(default_factory=list)
    # vision-language runs (encoder.step events): items and embeddings encoded, the cache's high-water mark
    encoder_items: int = 0
    encoder_tokens: int = 0
    encoder_items_freed: int = 0
    peak_encoder_cache_tokens: int = 0
    encoder_cache_capacity: int = 0
    # request events of a step are published during its update, before its step event
    _first_tokens: list[str] = field(default_factory=list)
    _finishes: list[str] = field(default_factory=list)

    def __call__(self, event: Event) -> None:
        if isinstance(event, StepEvent):
            self._step(event)
        elif isinstance(event, RequestFirstToken):
            self._first_tokens.append(event.request_id)
        elif isinstance(event, RequestFinished):
            self._finish(event)
        elif isinstance(event, RequestRejected):
            self.rejected += 1
        elif isinstance(event, EncoderStepEvent):
            self.encoder_items += len(event.encoded)
            self.encoder_tokens += event.encoder_tokens
            self.encoder_items_freed += len(event.freed)
            self.encoder_cache_capacity = event.cache_capacity_tokens
            # the cache holds this step's items while the forward reads them, before any leave
            held = event.cache_used_tokens + sum(int(item[2]) for item in event.encoded if [item[0], item[1]] in event.freed)
            self.peak_encoder_cache_tokens = max(self.peak_encoder_cache_tokens, held)

    def _step(self, e: StepEvent) -> None:
        self.steps += 1
        self.preemptions += len(e.preempted)
        self.num_prefill_tokens += e.num_prefill_tokens
        self.num_decode_tokens += e.num_decode_tokens
        self.prefix_query_tokens += e.prefix_queries_tokens
        self.prefix_hit_tokens += e.prefix_hits_tokens
        self.peak_running = max(self.peak_running, e.num_running)
        self.peak_waiting = max(self.peak_waiting, e.num_waiting)
        self.peak_blocks_used = max(self.peak_blocks_used, e.kv_blocks_used_forward or e.kv_blocks_used)
        self.step_prefill.append(e.num_prefill_tokens)
        self.step_decode.append(e.num_decode_tokens)
        self.step_forward_s.append(e.forward_s)
        for request_id in self._first_tokens:
            self.first_token_step.setdefault(request_id, e.index)
        for request_id in self._finishes:
            self.finish_step[request_id] = e.index
        self._first_tokens.clear()
        self._finishes.clear()

    def _finish(self, e: RequestFinished) -> None:
        self.finished += 1
        self.prompt_tokens += e.prompt_tokens
        self.output_tokens += e.output_tokens
        if e.ttft_s is not None:
            self.ttft_s[e.request_id] = e.ttft_s
        self.itl_s.extend(e.inter_token_latencies_s)
        self._finishes.append(e.request_id)
