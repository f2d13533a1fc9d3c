"""A request still in the engine when the engine loop dies is accounted for: it gets its one
``request.finished`` with reason ``error`` naming the cause, before ``engine.stopped``. A real
in-process AsyncEngine on the bundled SmolLM2; the fault is injected by patching
``LLMEngine.step`` in this test (no request can kill the engine on purpose)."""

from __future__ import annotations

import asyncio

import pytest

from engine.core.sampling_params import SamplingParams
from engine.events import EngineStopped, Event, EventBus, RequestFinished
from engine.events.folds.accounting import RequestLedger
from engine.llm import engine_config
from engine.llm_engine import LLMEngine
from engine.modelspec.presets import bundled_gguf_path
from engine.serve.async_engine import AsyncEngine, EngineDead

pytestmark = [pytest.mark.skipif(bundled_gguf_path() is None, reason="the bundled SmolLM2 GGUF is not installed"),
              pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")]

FAULT = "injected fault: the engine's own state is unknown"


def test_requests_in_a_dying_engine_finish_with_reason_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def step(self: LLMEngine) -> list[object]:
        raise RuntimeError(FAULT)

    events: list[Event] = []
    bus = EventBus()
    bus.subscribe(events.append)
    engine = AsyncEngine(engine_config("smollm2-135m", max_model_len=256, kv_cache_memory_bytes=16 << 20,
                                       dtype="float32", stats_interval=0.0), bus)
    engine.start()
    engine.wait_ready(timeout=300)
    monkeypatch.setattr(LLMEngine, "step", step)  # from now on the first step kills the loop

    async def submit() -> None:
        stream = await engine.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=4), "doomed")
        with pytest.raises(EngineDead, match="injected fault"):
            async for _ in stream:
                pass

    asyncio.run(asyncio.wait_for(submit(), 120))
    engine.shutdown(drain_timeout_s=0)
    finished = [e for e in events if isinstance(e, RequestFinished)]
    assert [(e.request_id, e.reason) for e in finished] == [("doomed", "error")]
    assert FAULT in (finished[0].error or "")
    stopped = next(i for i, e in enumerate(events) if isinstance(e, EngineStopped))
    assert events.index(finished[0]) < stopped  # the recording ends with every request accounted for
    ledger = RequestLedger()
    for event in events:
        ledger(event)
    assert ledger.balanced and ledger.by_kind == {"error": 1}
