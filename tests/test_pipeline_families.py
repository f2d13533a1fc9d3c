"""--pipeline-parallel-size 2 for every family the single-rank engine serves (issue 37): each
tiny random-weight checkpoint (tests/model/tiny_hf.py, tests/model/tiny_moe.py: 2 layers, so
one per stage) generates, through the whole engine (scheduler, chunked prefill, two
micro-batches, the stages' send/recv), the greedy tokens one rank generates; a MoE
model's per-expert counts in the step events are one rank's (each stage counts its own
layers'); and both stages' startup phases reach rank 0's bus, each naming its stage.

Default suite: the per-stage KV cache groups (vLLM's get_kv_cache_configs split) and the
plan of a hybrid model's stages. Under ``slow``: one engine start per rank count and
family (~20-40 s each on two loaded cores: a stage is a spawned process that imports
torch and loads the model)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from engine.budget.stages import plan_stages, stage_kv_cache_groups
from engine.config import EngineConfig
from engine.core.kv_cache_groups import FULL, KVCacheGroup, KVCacheSpec
from engine.core.sampling_params import SamplingParams
from engine.events import PHASES, Event, EventBus, StartupPhase, StepEvent
from engine.modelspec.presets import MODEL_PRESETS

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
DENSE = ("qwen2-tied", "qwen3-untied", "gemma3-tied", "mistral-sliding", "phi3-sliding", "llama3-scaled")
MOE = ("qwen3moe-mixed", "mixtral", "qwen2moe")


def test_each_stage_keeps_the_whole_models_groups_holding_its_own_layers_renumbered() -> None:
    window = KVCacheSpec(512)
    # Gemma 3 270M's 18 layers: five sliding groups of 3 and one full group (5, 11, 17)
    groups = (*(KVCacheGroup(window, (i, i + 6, i + 12)) for i in range(5)), KVCacheGroup(FULL, (5, 11, 17)))
    first, second = stage_kv_cache_groups(groups, (0, 9)), stage_kv_cache_groups(groups, (9, 18))
    assert [g.layers for g in first] == [(0, 6), (1, 7), (2, 8), (3,), (4,), (5,)]
    assert [g.layers for g in second] == [(3,), (4,), (5,), (0, 6), (1, 7), (2, 8)]
    assert [g.spec for g in first] == [g.spec for g in groups] == [g.spec for g in second]
    # a group with none of a stage's layers stays: its blocks still name pages in the shared pool
    assert stage_kv_cache_groups((KVCacheGroup(window, (0,)), KVCacheGroup(FULL, (1,))), (1, 2))[0].layers == ()


def test_a_hybrid_models_stages_are_planned_on_the_whole_models_groups() -> None:
    gemma = MODEL_PRESETS["gemma-3-270m"]
    pipeline = plan_stages(gemma, 2, total_bytes=8 << 30, gpu_memory_utilization=0.1, max_model_len=2048,
                           dtype="bfloat16")
    for stage in pipeline.stages:
        plan = stage.plan
        assert plan.layers_per_group == 2  # 9 layers: the largest group holds 2 of them
        assert plan.kv_cache_groups is not None and len(plan.kv_cache_groups) == 6  # the whole model's groups
    assert pipeline.num_blocks == min(s.plan.num_blocks for s in pipeline.stages)


# ------------------------------------------------------------- real stages
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    pytest.importorskip("transformers")
    from tests.model.tiny_hf import save_tiny_checkpoint
    from tests.model.tiny_moe import save_tiny_moe

    root = tmp_path_factory.mktemp("pp-families")
    out = {}
    for variant in DENSE:
        save_tiny_checkpoint(variant, root / variant)
        out[variant] = root / variant
    for variant in MOE:
        save_tiny_moe(variant, root / variant)
        out[variant] = root / variant
    return out


def _generate(folder: Path, stages: int) -> tuple[list[list[int]], list[Event], list[list[float]]]:
    from engine.llm_engine import LLMEngine

    config = EngineConfig(model=str(folder), dtype="float32", quantization="none", max_model_len=128,
                          max_num_batched_tokens=32, max_num_seqs=4, stats_interval=0.0,
                          kv_cache_memory_bytes=1 << 20, pipeline_parallel_size=stages if stages > 1 else None)
    events: list[Event] = []
    bus = EventBus()
    bus.subscribe(events.append)
    generator = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 320, (n,), generator=generator).tolist() for n in (9, 23, 37)]
    with LLMEngine(config, bus=bus) as engine:
        ids = [engine.add_request(p, GREEDY) for p in prompts]
        done: dict[str, list[int]] = {}
        logprobs: dict[str, list[float]] = {i: [] for i in ids}
        while engine.has_unfinished():
            for out in engine.step():
                logprobs[out.request_id] += [entry.logprob for entry in out.logprobs or ()]
                if out.finished:
                    done[out.request_id] = out.token_ids
    return [done[i] for i in ids], events, [logprobs[i] for i in ids]


def _steps(events: Sequence[Event]) -> list[StepEvent]:
    return [e for e in events if isinstance(e, StepEvent) and e.scheduled]


@pytest.mark.slow
@pytest.mark.parametrize("variant", DENSE + MOE)
def test_two_stages_generate_one_ranks_greedy_tokens_for_every_family(checkpoints: dict[str, Path],
                                                                       variant: str) -> None:
    one, one_events, one_logprobs = _generate(checkpoints[variant], 1)
    two, events, logprobs = _generate(checkpoints[variant], 2)
    assert two == one
    # rank 0 samples through ModelRunner's sampling: the tokens' logprobs too (other batch shapes: float32 order)
    assert [len(x) for x in logprobs] == [len(x) for x in one_logprobs] == [GREEDY.max_tokens] * 3
    assert torch.allclose(torch.tensor(logprobs), torch.tensor(one_logprobs), atol=1e-4)
    steps = _steps(events)
    assert steps and all(len(s.pipeline_bytes) == 2 and len(s.pipeline_bubble_s) == 2 for s in steps)
    # the same batches routed the same tokens: the stages' counts summed are one rank's
    assert [s.expert_counts for s in steps] == [s.expert_counts for s in _steps(one_events)]
    if variant in MOE:
        assert all(s.expert_counts for s in steps)
    # both stages ran every phase, each event naming its stage; each stage's pool is its own layer's
    phases = [e for e in events if isinstance(e, StartupPhase) and e.status == "end"]
    for stage in (0, 1):
        own = [e for e in phases if e.pp_rank == stage]
        assert [e.phase for e in own] == list(PHASES)
        assert all(e.rank == stage and e.tp_rank == 0 for e in own)
    blocks = {e.pp_rank: e.data["num_blocks"] for e in phases if e.phase == "E"}
    assert blocks[0] == blocks[1] > 0  # the fewest of the two
