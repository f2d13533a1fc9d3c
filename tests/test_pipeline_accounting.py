"""Every request and token accounted for under --pipeline-parallel-size 2: the bundled SmolLM2
in two real stages (one process per rank), requests aborted between steps while their work
is in the pipeline, one cut mid-prefill (a chunk of its long prompt computed) and one
mid-decode. Each arrival gets exactly one typed finish, and the metrics' per-request token
sums equal the counters, which equal the tokens the finishes report. Slow (the stages load
the GGUF: ~30-60 s on two cores)."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import CollectorRegistry

from engine.config import EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.events import Event, EventBus, RequestFinished, StepEvent
from engine.events.exporters.metrics import PrometheusMetrics
from engine.events.folds.accounting import RequestLedger
from engine.events.request_records import ABORT_CLIENT_DISCONNECT, ABORT_SHUTDOWN
from engine.modelspec.presets import bundled_gguf_path

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(bundled_gguf_path() is None, reason="the bundled SmolLM2 GGUF is not installed")]


def test_aborts_in_flight_through_two_stages_are_accounted_for() -> None:
    from engine.llm_engine import LLMEngine

    config = EngineConfig(model="smollm2-135m", dtype="float32", quantization="none", max_model_len=256,
                          max_num_batched_tokens=64, max_num_seqs=8, stats_interval=0.0,
                          kv_cache_memory_bytes=32 << 20, pipeline_parallel_size=2)
    events: list[Event] = []
    bus = EventBus()
    bus.subscribe(events.append)
    metrics = PrometheusMetrics(CollectorRegistry(), "m", max_model_len=256)
    bus.subscribe(metrics)
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(100, 40000, (n,), generator=generator).tolist() for n in (180, 12, 20, 30, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with LLMEngine(config, bus=bus) as engine:
        ids = [engine.add_request(p, params) for p in prompts]
        long_prompt, decoding = ids[0], ids[1]
        cut: dict[str, str] = {}
        while engine.has_unfinished():
            engine.step()
            req = engine.scheduler.requests.get(long_prompt)
            if long_prompt not in cut and req is not None and 0 < req.num_computed_tokens < req.num_prompt_tokens:
                assert engine.abort(long_prompt, ABORT_CLIENT_DISCONNECT)  # mid-prefill, a chunk in the pipe
                cut[long_prompt] = "abort:client_disconnect"
            req = engine.scheduler.requests.get(decoding)
            if decoding not in cut and req is not None and len(req.output_token_ids) >= 3:
                assert engine.abort(decoding, ABORT_SHUTDOWN)  # mid-decode
                cut[decoding] = "abort:shutdown"
    assert len(cut) == 2, f"the aborts did not land mid-prefill and mid-decode: {cut}"
    stepped = [e for e in events if isinstance(e, StepEvent) and e.scheduled]
    assert stepped and all(len(e.pipeline_bubble_s) == 2 for e in stepped)  # two stages ran every step
    ledger = RequestLedger()
    for event in events:
        ledger(event)
    assert ledger.balanced, ledger.summary()
    finishes = {e.request_id: e for e in events if isinstance(e, RequestFinished)}
    assert {rid: ("abort:" + e.abort_cause if e.reason == "abort" else e.reason) for rid, e in finishes.items()} \
        == {rid: cut.get(rid, "length") for rid in ids}
    assert finishes[long_prompt].ttft_s is None and 0 < finishes[long_prompt].computed_prompt_tokens < 180

    def value(name: str) -> float:
        return metrics.registry.get_sample_value(name, {"model_name": "m", "engine": "0"}) or 0.0

    assert value("vllm:request_prompt_tokens_sum") == value("vllm:prompt_tokens_total") == ledger.prompt_tokens
    assert value("vllm:request_generation_tokens_sum") == value("vllm:generation_tokens_total") \
        == ledger.output_tokens == 12 * 3 + finishes[decoding].output_tokens
    assert value("kvscope:prompt_tokens_discarded_total") == finishes[long_prompt].computed_prompt_tokens
