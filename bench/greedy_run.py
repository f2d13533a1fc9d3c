"""One engine run the parallelism benches share: start an engine on a config, add every
prompt greedy with a fixed output length, step to the end, and keep the events."""

from __future__ import annotations

import time
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.events import Event, EventBus


@dataclass(slots=True)
class GreedyRun:
    events: list[Event]
    generated: int  # output tokens
    startup_s: float  # launch to ready
    run_s: float  # first request to last token


def greedy_run(config: EngineConfig, prompts: list[list[int]], output_len: int) -> GreedyRun:
    from engine.core.sampling_params import SamplingParams
    from engine.llm_engine import LLMEngine

    events: list[Event] = []
    bus = EventBus()
    bus.subscribe(events.append)
    launched = time.perf_counter()
    with LLMEngine(config, bus=bus) as engine:
        ready = time.perf_counter()
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        for prompt in prompts:
            engine.add_request(prompt, params)
        generated = 0
        while engine.has_unfinished():
            generated += sum(len(out.new_token_ids) for out in engine.step())
        ran = time.perf_counter() - ready
    return GreedyRun(events, generated, ready - launched, ran)
