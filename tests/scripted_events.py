"""A hand-scripted engine run as events, for the metrics and stats sink tests.

Three requests on a 64-block pool, published on a real EventBus whose clock the
script moves (0.5 s per step):

- r1: prompt 20, 4 output tokens, finishes ``length`` at step 3;
- r2: prompt 40 (16 tokens hit the prefix cache), preempted at step 2 after 2
  tokens, resumed at step 3 by a 42-token recompute that samples its 3rd token
  (no first-token event: only the finish can account for it), 4th token at step
  4, finishes ``stop``;
- r3: prompt 30, aborted while waiting at step 1 (never scheduled).

Within a step the order is the scheduler's: first-token and finish events
during ``update_from_output``, then the step event.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from engine.events import (
    EngineConfigEvent,
    EventBus,
    RequestArrived,
    RequestFinished,
    RequestFirstToken,
    RequestPreempted,
    RequestScheduled,
    StartupPhase,
    StepEvent,
)

STEP_S = 0.5
NUM_BLOCKS = 64
BLOCK_SIZE = 16
MAX_MODEL_LEN = 2048


@dataclass
class ScriptClock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class ScriptTotals:
    """What the script did, for the tests to compare against."""

    prompt_tokens: int = 0
    output_tokens: int = 0
    first_tokens: int = 0
    finished: dict[str, str] = field(default_factory=dict)
    inter_token_latencies: int = 0
    steps: int = 0
    iteration_tokens: int = 0
    preemptions: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    last_step: StepEvent | None = None


def new_bus() -> tuple[EventBus, ScriptClock]:
    clock = ScriptClock()
    return EventBus(clock=clock), clock


def run_script(
    bus: EventBus, clock: ScriptClock, after_step: Callable[[int], None] | None = None
) -> ScriptTotals:
    totals = ScriptTotals()

    def step(index: int, **kw: object) -> None:
        ev = StepEvent(index=index, kv_blocks_total=NUM_BLOCKS, **kw)  # type: ignore[arg-type]
        bus.publish(ev)
        totals.steps += 1
        totals.iteration_tokens += ev.num_prefill_tokens + ev.num_decode_tokens
        totals.preemptions += len(ev.preempted)
        totals.prefix_queries += ev.prefix_queries_tokens
        totals.prefix_hits += ev.prefix_hits_tokens
        totals.last_step = ev
        if after_step is not None:
            after_step(index)
        clock.now += STEP_S

    def finish(ev: RequestFinished) -> None:
        bus.publish(ev)
        totals.finished[ev.request_id] = ev.reason
        totals.output_tokens += ev.output_tokens
        totals.inter_token_latencies += len(ev.inter_token_latencies_s)
        if ev.ttft_s is not None:
            totals.prompt_tokens += ev.prompt_tokens

    config = {
        "block_size": BLOCK_SIZE,
        "enable_prefix_caching": True,
        "gpu_memory_utilization": 0.9,
        "kv_cache_dtype": "auto",
        "max_model_len": MAX_MODEL_LEN,
        "device": "cpu",
    }
    bus.publish(EngineConfigEvent(config=config, model={"max_position_embeddings": 8192}))
    bus.publish(StartupPhase(phase="E", name="kv_cache", status="begin"))
    bus.publish(
        StartupPhase(
            phase="E",
            name="kv_cache",
            status="end",
            data={
                "num_blocks": NUM_BLOCKS,
                "block_size": BLOCK_SIZE,
                "kv_cache_tokens": NUM_BLOCKS * BLOCK_SIZE,
            },
        )
    )
    bus.publish(RequestArrived(request_id="r1", prompt_tokens=20, max_tokens=4))
    bus.publish(RequestArrived(request_id="r2", prompt_tokens=40, max_tokens=8))
    bus.publish(RequestScheduled(request_id="r1"))
    bus.publish(RequestScheduled(request_id="r2", prefix_hit_tokens=16))
    # step 0: both prompts (r2's first block from the prefix cache), both sample
    bus.publish(RequestFirstToken(request_id="r1", ttft_s=0.5))
    bus.publish(RequestFirstToken(request_id="r2", ttft_s=0.5))
    totals.first_tokens += 2
    step(0, scheduled={"r1": [20, "prefill"], "r2": [24, "prefill"]}, num_prefill_tokens=44,
         num_running=2, num_waiting=0, kv_blocks_used=5, new=["r1", "r2"],
         prefix_queries_tokens=60, prefix_hits_tokens=16)  # fmt: skip
    # step 1: r3 arrives and is aborted while waiting; both decode
    bus.publish(RequestArrived(request_id="r3", prompt_tokens=30, max_tokens=8))
    finish(
        RequestFinished(
            request_id="r3", reason="abort", prompt_tokens=30, ttft_s=None, e2e_s=0.1, queue_time_s=0.1
        )
    )
    step(1, scheduled={"r1": [1, "decode"], "r2": [1, "decode"]}, num_decode_tokens=2,
         num_running=2, num_waiting=0, kv_blocks_used=5, finished={"r3": "abort"})  # fmt: skip
    # step 2: r2 preempted (2 tokens so far), r1 decodes its 3rd
    bus.publish(RequestPreempted(request_id="r2", computed_tokens_lost=42, blocks_freed=3, num_preemptions=1))
    step(2, scheduled={"r1": [1, "decode"]}, num_decode_tokens=1, num_running=1, num_waiting=1,
         kv_blocks_used=2, preempted=["r2"])  # fmt: skip
    # step 3: r1's 4th token finishes it (length); r2 resumes: recompute samples its 3rd token
    finish(RequestFinished(request_id="r1", reason="length", prompt_tokens=20, output_tokens=4, ttft_s=0.5,
                           e2e_s=2.0, queue_time_s=0.0, prefill_time_s=0.5, decode_time_s=1.5,
                           inference_time_s=2.0, inter_token_latencies_s=[0.5, 0.5, 0.5]))  # fmt: skip
    step(3, scheduled={"r1": [1, "decode"], "r2": [42, "prefill"]}, num_prefill_tokens=42, num_decode_tokens=1,
         num_running=1, num_waiting=0, kv_blocks_used=3, resumed=["r2"], finished={"r1": "length"},
         prefix_queries_tokens=42, prefix_hits_tokens=32)  # fmt: skip
    # step 4: r2's 4th token, a stop token
    finish(RequestFinished(request_id="r2", reason="stop", prompt_tokens=40, output_tokens=4, ttft_s=0.5,
                           prefix_hit_tokens=16, num_preemptions=1, e2e_s=2.5, queue_time_s=0.0,
                           prefill_time_s=0.5, decode_time_s=2.0, inference_time_s=2.5,
                           inter_token_latencies_s=[0.5, 1.0, 0.5]))  # fmt: skip
    step(4, scheduled={"r2": [1, "decode"]}, num_decode_tokens=1, num_running=0, num_waiting=0,
         kv_blocks_used=0, finished={"r2": "stop"})  # fmt: skip
    return totals
