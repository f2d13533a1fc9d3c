"""--pipeline-parallel-size (issue 37): a model's layers in contiguous stages, one process
per rank, activations passed with torch.distributed send/recv over gloo; composed with
--tensor-parallel-size (T x P ranks, vLLM's rank = pp_rank x T + tp_rank).

Default suite: the layer split (vLLM's get_pp_indices), the rank layout and the refusals.
Under ``slow``: the bundled SmolLM2 (30 layers) in two stages against one rank (each start
loads the GGUF; ~30-60 s on two cores), a killed stage, and TP=2 x PP=2 on a tiny
dummy-weight Llama against one rank (four processes). Every family in stages:
tests/test_pipeline_families.py.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import time
from collections.abc import Sequence
from pathlib import Path

import psutil
import pytest
import torch

from engine.config import EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.errors import ReplicaError, UserError
from engine.events import PHASES, Event, EventBus, StartupPhase, StepEvent
from engine.modelspec.presets import MODEL_PRESETS
from engine.pipeline import check_pipeline, stage_layer_ranges
from tests.processes import wait_gone

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def test_layers_split_as_vllms_get_pp_indices_the_remainder_before_the_last_stage() -> None:
    assert stage_layer_ranges(30, 2) == [(0, 15), (15, 30)]
    assert stage_layer_ranges(30, 4) == [(0, 7), (7, 15), (15, 23), (23, 30)]
    assert stage_layer_ranges(22, 4) == [(0, 5), (5, 11), (11, 17), (17, 22)]  # vLLM: [5, 6, 6, 5]
    with pytest.raises(UserError, match="--pipeline-parallel-size 31: the model has 30 layers; give at most 30"):
        stage_layer_ranges(30, 31)


def test_what_the_stages_do_not_run_yet_is_refused_before_anything_loads() -> None:
    smollm = MODEL_PRESETS["smollm2-135m"]
    with pytest.raises(UserError, match=r"--compile with --pipeline-parallel-size 2: .* drop --compile"):
        check_pipeline(EngineConfig(pipeline_parallel_size=2, compile=True), smollm)
    check_pipeline(EngineConfig(pipeline_parallel_size=2), smollm)
    check_pipeline(EngineConfig(pipeline_parallel_size=2, tensor_parallel_size=2), smollm)


def test_t_x_p_ranks_are_laid_out_as_vllm_each_stage_a_tensor_parallel_group() -> None:
    from engine.pipeline import Rendezvous, StageLayout

    hosts = Rendezvous("127.0.0.1", 1, nnodes=2)
    # T=2, P=4 over two hosts: rank = pp_rank x 2 + tp_rank; each host holds two whole stages
    layouts = [StageLayout(rank, 4, hosts, 2) for rank in range(8)]
    assert [(x.pp_rank, x.tp_rank) for x in layouts] == [(p, t) for p in range(4) for t in range(2)]
    assert [x.host for x in layouts] == [0, 0, 0, 0, 1, 1, 1, 1] and layouts[5].ranks_on_host == 4
    # activations go to the next stage's rank at the same tp_rank; the last stage's back to stage 0
    assert [layouts[3].peer(p) for p in (0, 2)] == [1, 5] and layouts[7].peer(4) == 1
    assert layouts[5].describe(30) == "pipeline stage 2 tensor-parallel rank 1 (rank 5, host 1, layers 15-22)"
    assert StageLayout(1, 2, hosts).describe(30) == "pipeline stage 1 (host 1, layers 15-29)"


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
    wait_gone(pids, "a stage outlived its replica")


@pytest.mark.slow
def test_a_killed_rank_of_a_t_x_p_replica_is_named_by_stage_and_tp_rank_and_no_process_is_left(
        tmp_path: Path) -> None:
    import json

    from engine.llm_engine import LLMEngine
    from tests.test_tensor_parallel import TINY_LLAMA

    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    engine = LLMEngine(EngineConfig(model=str(tmp_path), load_format="dummy", dtype="float32", max_model_len=128,
                                    max_num_batched_tokens=64, max_num_seqs=8, stats_interval=0.0,
                                    kv_cache_memory_bytes=4 << 20, tensor_parallel_size=2, pipeline_parallel_size=2))
    try:
        assert engine.workers is not None
        pids = engine.workers.pids()
        victim = next(s.process.pid for s in engine.workers.ranks if s.rank == 3)  # stage 1, TP rank 1
        engine.add_request([5, 17, 29, 31], SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
        engine.step()
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(ReplicaError, match=rf"pipeline stage 1 tensor-parallel rank 1 \(rank 3, host 0, layers "
                                               rf"1-1\) \(pid {victim}\) was killed by SIGKILL during step \d+"):
            for _ in range(60):
                engine.step()
    finally:
        engine.close()
    wait_gone(pids, "a rank outlived its replica")


@pytest.mark.slow
def test_a_stage_killed_during_startup_is_named_at_once_and_leaves_no_process() -> None:
    """Killed as soon as it is spawned (before it can join): rank 0 names it instead of
    waiting out --rendezvous-timeout for it; killed later, rank 0's next collective fails
    and names it the same way."""
    import threading

    from engine.llm_engine import LLMEngine

    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    failure: list[BaseException] = []

    def start() -> None:
        try:
            LLMEngine(dataclasses.replace(_config(2), rendezvous_timeout_s=200)).close()
        except BaseException as exc:  # the test reads it
            failure.append(exc)

    thread = threading.Thread(target=start)
    started = time.monotonic()
    thread.start()
    stage = None
    while stage is None and thread.is_alive():
        stage = next((p for p in me.children(recursive=True) if p.pid not in before
                      and "spawn_main" in " ".join(p.cmdline())), None)
        time.sleep(0.05)
    assert stage is not None, failure
    stage.send_signal(signal.SIGKILL)
    thread.join(150)
    assert not thread.is_alive() and time.monotonic() - started < 150  # not the 200 s rendezvous timeout
    assert len(failure) == 1 and isinstance(failure[0], ReplicaError), failure
    assert re.search(rf"pipeline stage 1 \(host 0, layers 15-29\) \(pid {stage.pid}\) was killed by SIGKILL "
                     r"during startup", str(failure[0])), failure[0]
    deadline = time.monotonic() + 5
    while any(p.pid not in before and p.status() != psutil.STATUS_ZOMBIE and "spawn_main" in " ".join(p.cmdline())
              for p in me.children(recursive=True)):
        assert time.monotonic() < deadline, "a stage outlived its replica"
        time.sleep(0.1)


@pytest.mark.slow
def test_each_stage_budgets_its_own_layers_kv_and_every_stage_takes_the_fewest_blocks(tmp_path: Path) -> None:
    """3 layers in 2 stages: [2, 1] (vLLM's split). Each stage sizes its pool from the same
    --kv-cache-memory-bytes (per GPU, as vLLM's) at its own layers' bytes per token; stage 1
    could hold twice stage 0's blocks, and both take stage 0's, the fewest."""
    import json

    from engine.budget.memory import bytes_per_kv_token
    from engine.budget.stages import stage_model
    from engine.events.phase_data import KvCacheData, read_phase
    from engine.modelspec.readers import load_model_config
    from tests.test_tensor_parallel import TINY_LLAMA

    (tmp_path / "config.json").write_text(json.dumps({**TINY_LLAMA, "num_hidden_layers": 3}))
    pool = 4 << 20
    config = EngineConfig(model=str(tmp_path), load_format="dummy", dtype="float32", max_model_len=128,
                          max_num_batched_tokens=64, max_num_seqs=8, stats_interval=0.0, kv_cache_memory_bytes=pool,
                          pipeline_parallel_size=2)
    _, events = _generate(config, _prompts()[:1])
    model = load_model_config(str(tmp_path))
    per_token = [bytes_per_kv_token(stage_model(model, layers), "auto", 1, "float32") for layers in ((0, 2), (2, 3))]
    assert per_token[0] == 2 * per_token[1]
    pools = {e.pp_rank: read_phase(e, KvCacheData) for e in events
             if isinstance(e, StartupPhase) and e.phase == "E" and e.status == "end"}
    fewest = pool // (16 * per_token[0])
    for stage in (0, 1):
        record = pools[stage]
        assert record is not None and record.bytes_per_token == per_token[stage]
        assert record.num_blocks == fewest
    assert pools[1].kv_pool_bytes == fewest * 16 * per_token[1]  # type: ignore[union-attr]


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


@pytest.mark.slow
def test_tp2_x_pp2_four_ranks_generate_one_ranks_greedy_tokens_and_name_their_stage_and_rank(
        tmp_path: Path) -> None:
    import json

    from tests.test_tensor_parallel import TINY_LLAMA

    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))

    def config(tp: int, pp: int) -> EngineConfig:
        return EngineConfig(model=str(tmp_path), load_format="dummy", dtype="float32", max_model_len=128,
                            max_num_batched_tokens=64, max_num_seqs=8, stats_interval=0.0,
                            kv_cache_memory_bytes=4 << 20, tensor_parallel_size=tp,
                            pipeline_parallel_size=pp if pp > 1 else None)

    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 49152, (n,), generator=generator).tolist() for n in (9, 30, 41)]
    one, _ = _generate(config(1, 1), prompts)
    four, events = _generate(config(2, 2), prompts)
    assert four == one
    ended = [e for e in events if isinstance(e, StartupPhase) and e.status == "end"]
    for rank in range(4):  # every rank ran A-G, its events naming its stage and its rank within it
        own = [e for e in ended if e.rank == rank]
        assert [e.phase for e in own] == list(PHASES)
        assert {(e.pp_rank, e.tp_rank) for e in own} == {(rank // 2, rank % 2)}
    steps = [e for e in events if isinstance(e, StepEvent) and e.scheduled]
    hidden = TINY_LLAMA["hidden_size"]
    for step in steps:
        tokens = step.num_prefill_tokens + step.num_decode_tokens
        # each of a stage's two ranks sends every token's fp32 hidden state to its peer
        assert step.pipeline_bytes == [2 * tokens * hidden * 4] * 2
        assert step.collective_calls > 0  # stage 0's all-reduces and its LM head's gather
