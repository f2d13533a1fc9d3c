"""--pipeline-parallel-size (issue 37): a Llama's layers in contiguous stages, one process
each, activations passed with torch.distributed send/recv over gloo.

Default suite: the layer split (vLLM's get_pp_indices) and the refusals. Under ``slow``:
the bundled SmolLM2 (30 layers) in two stages against one rank (each start loads the
GGUF; ~30-60 s on two cores), and a killed stage.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Sequence

import psutil
import pytest
import torch

from engine.budget.config import EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.errors import ReplicaError, UserError
from engine.events import Event, EventBus, StepEvent
from engine.modelspec.presets import MODEL_PRESETS
from engine.pipeline import check_pipeline, stage_layer_ranges

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def test_layers_split_as_vllms_get_pp_indices_the_remainder_before_the_last_stage() -> None:
    assert stage_layer_ranges(30, 2) == [(0, 15), (15, 30)]
    assert stage_layer_ranges(30, 4) == [(0, 7), (7, 15), (15, 23), (23, 30)]
    assert stage_layer_ranges(22, 4) == [(0, 5), (5, 11), (11, 17), (17, 22)]  # vLLM: [5, 6, 6, 5]
    with pytest.raises(UserError, match="--pipeline-parallel-size 31: the model has 30 layers; give at most 30"):
        stage_layer_ranges(30, 31)


def test_what_the_stages_do_not_run_yet_is_refused_before_anything_loads() -> None:
    smollm = MODEL_PRESETS["smollm2-135m"]
    with pytest.raises(UserError, match="T x P ranks are not composed yet"):
        check_pipeline(EngineConfig(pipeline_parallel_size=2, tensor_parallel_size=3), smollm)
    check_pipeline(EngineConfig(pipeline_parallel_size=2), smollm)


def test_data_parallel_outside_serve_is_refused() -> None:
    from engine.llm_engine import LLMEngine

    with pytest.raises(UserError, match="--data-parallel-size 2 runs engine cores behind `engine serve`"):
        LLMEngine(EngineConfig(data_parallel_size=2))


# ------------------------------------------------------------- real stages
def _config(stages: int) -> EngineConfig:
    return EngineConfig(model="smollm2-135m", dtype="float32", quantization="none", max_model_len=256,
                        max_num_batched_tokens=64, max_num_seqs=8, stats_interval=0.0, kv_cache_memory_bytes=32 << 20,
                        pipeline_parallel_size=stages if stages > 1 else None)


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(100, 40000, (9 + 7 * i,), generator=generator).tolist() for i in range(3)]


def _generate(config: EngineConfig, prompts: Sequence[Sequence[int]]) -> tuple[list[list[int]], list[Event]]:
    from engine.llm_engine import LLMEngine

    events: list[Event] = []
    bus = EventBus()
    bus.subscribe(events.append)
    with LLMEngine(config, bus=bus) as engine:
        ids = [engine.add_request(list(p), GREEDY) for p in prompts]
        done: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.token_ids
    return [done[i] for i in ids], events


@pytest.mark.slow
def test_pp2_on_the_bundled_model_generates_one_ranks_greedy_tokens_and_steps_carry_each_stage() -> None:
    prompts = _prompts()
    one, _ = _generate(_config(1), prompts)
    two, events = _generate(_config(2), prompts)
    assert two == one
    hidden = MODEL_PRESETS["smollm2-135m"].hidden_size
    steps = [e for e in events if isinstance(e, StepEvent) and e.scheduled]
    for step in steps:
        tokens = step.num_prefill_tokens + step.num_decode_tokens
        assert len(step.pipeline_bubble_s) == 2 and all(b >= 0 for b in step.pipeline_bubble_s)
        # each stage sends every token's fp32 hidden state once: stage 0 to 1, stage 1 back to 0
        assert step.pipeline_bytes == [tokens * hidden * 4] * 2


@pytest.mark.slow
def test_a_killed_stage_stops_the_replica_naming_it_and_leaves_no_process() -> None:
    from engine.llm_engine import LLMEngine

    engine = LLMEngine(_config(2))
    try:
        assert engine.workers is not None
        pids = engine.workers.pids()
        for prompt in _prompts():
            engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
        engine.step()
        os.kill(pids[0], signal.SIGKILL)
        with pytest.raises(ReplicaError, match=r"pipeline stage 1 \(host 0, layers 15-29\) \(pid \d+\) was killed "
                                               r"by SIGKILL during step \d+; its last phase: G \(ready\) end, then "
                                               r"serving steps\. The replica is stopped"):
            for _ in range(60):
                engine.step()
    finally:
        engine.close()
    deadline = time.monotonic() + 5
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
        assert time.monotonic() < deadline, "a stage outlived its replica"
        time.sleep(0.1)


def test_the_plan_gives_each_stage_its_layers_weights_and_kv_and_the_replica_the_fewest_blocks() -> None:
    from engine.budget.memory import GiB
    from engine.budget.stages import plan_stages

    llama70 = MODEL_PRESETS["llama-3.1-70b"]
    pipeline = plan_stages(llama70, 2, total_bytes=int(79.22 * GiB), gpu_memory_utilization=0.9,
                           max_model_len=32768, dtype="bfloat16", tensor_parallel_size=4)
    embedding = llama70.vocab_size * llama70.hidden_size
    for stage in pipeline.stages:
        # 40 layers each; stage 0 adds the embedding, stage 1 the norm and the (untied) head: the same
        # count here; 2 bytes over 4 ranks; every token's KV for 40 layers x 2 of the 8 KV heads per GPU
        assert stage.plan.bytes_per_token == 2 * 40 * 2 * 128 * 2
        layers = (llama70.num_parameters - 2 * embedding - llama70.hidden_size) // 2
        assert abs(stage.plan.weights_bytes - (layers + embedding) * 2 / 4) <= llama70.hidden_size
    assert pipeline.num_blocks == min(s.plan.num_blocks for s in pipeline.stages)
    # SmolLM2's 30 layers in 4 stages: [7, 8, 8, 7]; a tied head is the last stage's own copy, so
    # the last stage holds more weights than a middle one with more layers and gets fewer blocks
    smollm = plan_stages(MODEL_PRESETS["smollm2-135m"], 4, total_bytes=8 * GiB, gpu_memory_utilization=0.1,
                         max_model_len=2048, dtype="bfloat16")
    assert [s.layers for s in smollm.stages] == [(0, 7), (7, 15), (15, 23), (23, 30)]
    last, middle = smollm.stages[3].plan, smollm.stages[2].plan
    assert last.weights_bytes > middle.weights_bytes
    assert smollm.num_blocks == min(s.plan.num_blocks for s in smollm.stages)
