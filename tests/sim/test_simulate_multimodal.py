"""The simulator with a vision-language model: the encoder cache is a second budget
the scheduler respects, and ``encoder.step`` events show it fill and free."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.events import EventBus, read_events
from engine.events.record import Event
from engine.events.step_records import EncoderStepEvent, StepEvent
from engine.sim.simulate import Simulation, build_setup
from engine.sim.workload import WorkloadRequest, with_mm_items

IMAGE = 1196  # a 1280x720 image in Qwen2.5-VL


def run_vl(max_num_batched_tokens: int, num_requests: int) -> tuple[list[Event], object]:
    setup = build_setup("qwen2.5-vl-7b", "h100-80gb",
                        EngineConfig(max_model_len=8192, max_num_batched_tokens=max_num_batched_tokens),
                        multimodal={"limit_mm_per_prompt": "image=2", "image_size": (1280, 720)})
    assert setup.plan.multimodal is not None
    workload = with_mm_items([WorkloadRequest(f"r{i}", 100, 20) for i in range(num_requests)],
                             setup.plan.multimodal.prompt_items())
    bus = EventBus()
    events: list[Event] = []
    bus.subscribe(events.append)
    result = Simulation(setup, bus).run(workload)
    assert result.finished == num_requests and result.prompt_tokens == num_requests * (100 + 2 * IMAGE)
    return events, setup


def test_encoder_cache_fills_and_frees_with_the_expected_counts() -> None:
    # 512-token chunks and an encoder budget of one image (max(512, 1,196) tokens): an image's
    # embeddings stay parked while three chunks read them, then leave; the next image (and
    # the next request) waits for the room
    events, _ = run_vl(512, 2)
    enc = [e for e in events if isinstance(e, EncoderStepEvent)]
    steps = [e for e in events if isinstance(e, StepEvent)]
    assert len(enc) == len(steps) and [e.index for e in enc] == [s.index for s in steps]
    assert {e.cache_capacity_tokens for e in enc} == {IMAGE}
    encoded = [tuple(x) for e in enc for x in e.encoded]
    freed = [tuple(x) for e in enc for x in e.freed]
    assert encoded == [("r0", 0, IMAGE), ("r0", 1, IMAGE), ("r1", 0, IMAGE), ("r1", 1, IMAGE)]
    assert [r[:2] for r in encoded] == freed  # each item encoded once, freed once, in order
    used = [e.cache_used_tokens for e in enc]
    assert max(used) == IMAGE and used[-1] == 0
    # held from its encoder step until the chunk that reaches its end: 512 + 512 + 172 tokens
    first_freed = next(i for i, e in enumerate(enc) if e.freed)
    assert used[:first_freed] == [IMAGE] * first_freed and first_freed == 2
    assert steps[2].scheduled["r0"] == [1196 - 2 * 512, "prefill"]  # the chunk stops at the image's end
    assert all("r1" not in s.scheduled for s in steps[:6])  # r1's first image waits for the room
    assert enc[0].encode_s > 0 and enc[1].encode_s == 0.0
    assert steps[0].forward_s < steps[0].duration_s  # the encoder's seconds are in the step's


def test_a_larger_budget_encodes_several_items_in_a_step(tmp_path) -> None:
    events, _ = run_vl(4096, 3)
    enc = [e for e in events if isinstance(e, EncoderStepEvent)]
    assert enc[0].encoder_tokens == 3 * IMAGE  # 4,096 // 1,196 = 3 images in the first step
    assert sum(len(e.encoded) for e in enc) == sum(len(e.freed) for e in enc) == 6
    assert max(e.cache_used_tokens for e in enc) <= 4096
    # text runs publish no encoder events, so their recordings stay as they were
    text = build_setup("qwen2.5-7b", "h100-80gb", EngineConfig(max_model_len=8192))
    bus = EventBus()
    seen: list[Event] = []
    bus.subscribe(seen.append)
    Simulation(text, bus).run([WorkloadRequest("t", 100, 4)])
    assert not [e for e in seen if isinstance(e, EncoderStepEvent)]
    from engine.events import JsonlSink

    path = tmp_path / "vl.jsonl"
    sink = JsonlSink(str(path), config={})
    for ev in events:
        sink(ev)
    sink.close()
    back = [e for e in read_events(str(path)).events if isinstance(e, EncoderStepEvent)]
    assert [e.to_dict() for e in back] == [e.to_dict() for e in enc]
    # engine replay cannot rebuild the images' placeholder runs: it says so instead of diverging
    from engine.errors import UserError
    from engine.sim.replay import load_recording, scheduler_config_from_recording

    with pytest.raises(UserError, match="vision-language model"):
        scheduler_config_from_recording(load_recording(path))


def test_engine_simulate_takes_the_multimodal_flags(capsys) -> None:
    import json

    from engine.cli.main import main

    args = ["simulate", "--model", "qwen2.5-vl-7b", "--limit-mm-per-prompt", "image=2", "--mm-image-size", "1280x720",
            "--num-prompts", "6", "--random-input-len", "100", "--random-output-len", "8", "--max-model-len", "8192",
            "--max-num-batched-tokens", "2048", "--json"]
    assert main(args) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["finished"] == 6 and s["prompt_tokens"] == 6 * (100 + 2 * IMAGE)
    assert (s["encoder_items"], s["encoder_tokens"]) == (12, 12 * IMAGE)
    assert s["peak_encoder_cache_tokens"] == IMAGE and s["encoder_cache_capacity"] == 2048
