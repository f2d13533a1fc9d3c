"""Experts made observable, end to end on the tiny Qwen3-MoE checkpoint (tests/model/tiny_moe.py):
the whole engine's step events carry per-layer expert counts whose fold
(engine/events/folds/expert_load.py, as the EngineView and the doctor fold them) equals
transformers' own router top-k over every token the engine computed; the EngineView
snapshot keeps them; the doctor's hot-expert rule reads them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from doctor.facts import RunFacts
from doctor.rules.parallelism import HOT_EXPERT_IMBALANCE, hot_expert
from engine.events import StepEvent
from engine.events.folds.expert_load import ExpertLoad
from engine.events.folds.view import EngineView
from tests.model.tiny_moe import MOE_SHAPES, save_tiny_moe

PROMPTS = ["the quick brown fox", "hello world, how are you today? the lazy dog jumps over"]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("tiny-moe-engine") / "qwen3moe"
    return folder, save_tiny_moe("qwen3moe", folder)


def _router_counts(hf_model, ids: list[int]) -> list[list[int]]:
    """transformers' router top-k over ``ids`` (one forward), per layer per expert."""
    with torch.inference_mode():
        out = hf_model(torch.tensor([ids]), output_router_logits=True)
    k, n = MOE_SHAPES["num_experts_per_tok"], MOE_SHAPES["num_experts"]
    return [torch.bincount(logits.reshape(len(ids), -1).topk(k, dim=-1).indices.reshape(-1), minlength=n).tolist()
            for logits in out.router_logits]


@pytest.mark.slow  # the whole engine's startup and 2 requests: ~20 s on a shared 2-core machine
def test_step_events_fold_to_the_routers_own_counts(tiny_folder) -> None:
    from engine.core.sampling_params import SamplingParams
    from engine.events import EventBus
    from engine.llm import LLM

    folder, hf_model = tiny_folder
    bus = EventBus()
    steps: list[StepEvent] = []
    view = EngineView()
    facts = RunFacts()
    bus.subscribe(lambda e: steps.append(e) if isinstance(e, StepEvent) else None)
    bus.subscribe(view.apply)
    bus.subscribe(facts)
    with LLM(str(folder), bus=bus, dtype="float32", max_model_len=64, stats_interval=0.0,
             kv_cache_memory_bytes=8 * 2**20) as llm:  # a pool of its own: no share of the host's free memory
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    assert all(len(s.expert_counts) == 2 and len(s.expert_counts[0]) == 8 for s in steps)
    for s in steps:  # each step's rows: its computed tokens x top-2
        assert [sum(row) for row in s.expert_counts] == [2 * (s.num_prefill_tokens + s.num_decode_tokens)] * 2
    whole = ExpertLoad(window=None)
    for s in steps:
        whole.add(s.expert_counts)
    # every token the engine computed: each prompt and its generated tokens but the last (never fed back)
    expected = [[0] * 8, [0] * 8]
    for output in outputs:
        routed = _router_counts(hf_model, output.prompt_token_ids + output.token_ids[:-1])
        expected = [[a + b for a, b in zip(x, y, strict=True)] for x, y in zip(expected, routed, strict=True)]
    assert whole.totals == expected
    assert facts.experts.totals == expected
    window = view.experts
    assert window.totals == expected  # fewer steps than the view's window
    again = EngineView.from_snapshot(view.snapshot())
    assert again.experts.totals == expected and again.experts.imbalance() == pytest.approx(window.imbalance())


def _facts_with(counts: list[list[int]], steps: int) -> RunFacts:
    facts = RunFacts()
    for index in range(steps):
        facts(StepEvent(index=index, num_decode_tokens=sum(counts[0]) // 2, expert_counts=counts))
    return facts


def test_the_doctor_flags_a_hot_expert_with_its_numbers() -> None:
    even = [[10] * 8, [10] * 8]
    assert list(hot_expert(_facts_with(even, 10))) == []
    hot = [[10] * 8, [50, 5, 5, 5, 5, 5, 0, 5]]  # layer 1: expert 0 takes 50 of 80 slots
    (finding,) = hot_expert(_facts_with(hot, 10))
    assert (finding.numbers["layer"], finding.numbers["expert"]) == (1, 0)
    assert finding.numbers["imbalance"] == pytest.approx(50 / 10) and finding.numbers["imbalance"] >= HOT_EXPERT_IMBALANCE
    assert "62.5%" in finding.title and "12.5% each if even" in finding.evidence[0]
    assert (finding.first_step, finding.last_step) == (0, 9)
    assert list(hot_expert(_facts_with(hot, 1))) == []  # 10 slots per expert: too few to judge


def test_a_moe_model_says_why_it_runs_op_by_op_and_refuses_block_quantization(tiny_folder) -> None:
    """The family's refusals name it (the fused decode layer's status, --quantization's error)."""
    from engine.model.runner import ModelRunner
    from engine.modelspec.readers import load_model_config

    folder, _ = tiny_folder
    runner = ModelRunner(load_model_config(str(folder)), dtype="float32", block_size=16)
    model = runner.model
    assert model.fused_layer_refusal == ("the fused C++ layer is Llama's dense shape (Qwen3-MoE runs its layers "
                                         "op by op)")
    assert model.quantization_refusal is not None and "Qwen3-MoE's experts in float" in model.quantization_refusal
