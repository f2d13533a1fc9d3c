"""Gemma 3 270M on vLLM's hybrid KV cache, end to end on the real model: six KV cache
groups (five sliding of three layers, one full), three shared KV tensors, one block table
per group from the scheduler to the attention backend, a prompt past the 512-token window.

One recorded hybrid run and one run of the same requests on one full-attention table
(``disable_hybrid_kv_cache_manager``: the layout before) per module: greedy tokens equal,
transformers' greedy words where they are known, blocks freed by the window, the null block
never written, the pool holding more of the run than full attention would, and
``engine replay --verify`` on the recording."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.core.kv_cache_groups import FULL_ATTENTION, SLIDING_WINDOW_KIND
from engine.core.sampling_params import SamplingParams
from engine.events import EngineConfigEvent, Event, EventBus, StartupPhase, StepEvent
from engine.llm import engine_config
from engine.llm_engine import LLMEngine
from tests.model.gemma3_fixtures import GEMMA3, gemma3_gguf_or_skip


def facts(n: int) -> str:
    """A prompt whose continuation needs only its last few hundred tokens: "... Fact n:"."""
    return " ".join(f"Fact {i}: the number {i} comes after {i - 1}." for i in range(1, n)) + f" Fact {n}:"


# A prompt past the window (570 tokens with its BOS), and a short one whose greedy words
# transformers gives (fp32, same file).
LONG = facts(38)
FRANCE = "The capital of France is"
FRANCE_GREEDY = " the capital of the country of France."  # transformers' Gemma3ForCausalLM, greedy
FLAGS = dict(max_model_len=1024, kv_cache_memory_bytes=64 * 2**20, max_num_batched_tokens=512, max_num_seqs=4,
             stats_interval=0.0, num_threads=2)
DECODE = 8


def _run(disable: bool, events_path: Path | None = None, long: str = LONG, **overrides: object,
         ) -> tuple[LLMEngine, list[Event], dict[str, list[int]]]:
    """Both prompts, greedy, through a real engine (hybrid, or one full-attention table)."""
    events: list[Event] = []
    bus = EventBus()
    bus.subscribe(events.append)
    flags = dict(FLAGS, **overrides)
    if events_path is not None:
        flags["events"] = str(events_path)
    engine = LLMEngine(engine_config(GEMMA3, **flags, disable_hybrid_kv_cache_manager=disable or None), bus=bus)
    if not disable:
        # block 0 is the null block: NaN there would poison any attention that read it, even
        # masked (0 x NaN); the paged-decode kernel and the chunk path read only the window
        for tensor in engine.runner.kv_tensors:
            tensor[0].fill_(float("nan"))
    greedy = SamplingParams(temperature=0.0, max_tokens=DECODE, ignore_eos=True)
    ids = {"long": engine.add_request(long, greedy), "france": engine.add_request(FRANCE, greedy)}
    done: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                assert out.prompt_token_ids[0] == 2 and out.prompt_token_ids[1] != 2  # one BOS
                done[out.request_id] = out.token_ids
    return engine, events, {name: done[rid] for name, rid in ids.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory):
    """The recorded hybrid run (default suite: one engine, one prefill past the window)."""
    gemma3_gguf_or_skip()
    path = tmp_path_factory.mktemp("gemma3") / "hybrid.jsonl"
    hybrid, hybrid_events, hybrid_tokens = _run(False, path)
    hybrid.close()  # the recording is whole; the runner and its tensors stay readable
    return dict(hybrid=hybrid, events=hybrid_events, tokens=hybrid_tokens, path=path)


@pytest.fixture(scope="module")
def single(runs):
    """The same requests on one full-attention table (the layout before): a second engine
    and prefill, so only the slow tests ask for it."""
    engine, events, tokens = _run(True)
    engine.close()
    return dict(single=engine, single_events=events, single_tokens=tokens)


def test_six_groups_on_three_shared_tensors(runs) -> None:
    engine = runs["hybrid"]
    runner, plan = engine.runner, engine.startup.plan
    groups = runner.kv_cache_groups
    assert [g.spec.sliding_window for g in groups] == [512] * 5 + [None]
    assert [g.layers for g in groups] == [(0, 6, 12), (1, 7, 13), (2, 8, 14), (3, 9, 15), (4, 10, 16), (5, 11, 17)]
    assert engine.scheduler.kv.groups == groups  # the scheduler's hybrid manager has the same groups
    assert len(runner.kv_tensors) == 3 == runner.layers_per_group
    for tensor in runner.kv_tensors:
        assert tuple(tensor.shape) == (plan.num_blocks, 2, 16, 1, 256)
    for index, layer in enumerate(runner.model.layers):
        group = layer.kv_cache_group
        assert index in groups[group].layers
        assert runner.kv_caches[index] is runner.kv_tensors[groups[group].layers.index(index)]
    # one pool of num_blocks blocks, each a page in each of the 3 tensors: phase E's bytes exactly
    allocated = sum(t.nbytes for t in runner.kv_tensors)
    assert allocated == plan.num_blocks * plan.block_bytes <= plan.kv_pool_bytes < allocated + plan.block_bytes


def test_greedy_words_past_the_window_and_transformers_greedy(runs) -> None:
    tokenizer = runs["hybrid"].tokenizer
    assert tokenizer.decode(runs["tokens"]["france"]) == FRANCE_GREEDY  # transformers' greedy, 8 tokens
    assert tokenizer.decode(runs["tokens"]["long"]).startswith(" the number 38 comes after")


@pytest.mark.slow
def test_greedy_tokens_equal_the_single_table_path(runs, single) -> None:
    assert runs["tokens"] == single["single_tokens"]
    one_table = single["single"].runner
    assert one_table.kv_cache_groups == () and len(one_table.kv_tensors) == 18
    # the same bytes: 18 tensors of a sixth of the blocks (each rounded down)
    assert 0 <= runs["hybrid"].startup.plan.num_blocks - one_table.num_blocks * 6 < 6
    assert not any(e.freed_by_window for e in single["single_events"] if isinstance(e, StepEvent))


def test_the_window_frees_blocks_while_the_request_runs(runs) -> None:
    steps = [e for e in runs["events"] if isinstance(e, StepEvent)]
    freed = [b for step in steps for blocks in step.freed_by_window.values() for b in blocks]
    # the long request passes its 512-token window: each of the five sliding groups frees the
    # blocks wholly before the window of the last token it computes (position prompt + decode - 2,
    # window 511 tokens back)
    prompt_len = len(runs["hybrid"].tokenizer.encode(LONG, add_special_tokens=True))
    expected = (prompt_len + DECODE - 2 - 511) // 16 * 5
    assert len(freed) == expected > 0 and len(set(freed)) == len(freed)
    long_id = next(rid for step in steps for rid in step.freed_by_window)
    per_group = [sum(step.freed_by_window_groups[rid][g] for step in steps for rid in step.freed_by_window_groups)
                 for g in range(6)]
    assert per_group == [expected // 5] * 5 + [0]  # the full-attention group keeps every block
    assert all(set(step.freed_by_window) <= {long_id} for step in steps)
    assert 0 not in freed and not any(0 in blocks for step in steps for blocks in step.allocated.values())


def test_the_null_block_is_never_written_or_read(runs) -> None:
    """_run filled block 0 with NaN before the requests: still all NaN, so no token wrote it,
    and the greedy words above are right, so no attention read it."""
    assert runs["hybrid"].runner.backend.decode_kernel is not None  # phase F's kernel: it reads the window only
    for tensor in runs["hybrid"].runner.kv_tensors:
        assert tensor[0].isnan().all(), "block 0 is the null block: no token may write it"


def _long_last_step(events: list[Event]) -> StepEvent:
    steps = [e for e in events if isinstance(e, StepEvent)]
    return next(s for s in steps if "req-0" in s.finished)


def test_the_pool_holds_more_than_full_attention(runs) -> None:
    """At the long request's last step the hybrid pool holds every group's blocks of both
    requests but the ones the window gave back; one full-attention table would hold every
    layer's page of every token, the bytes of 6 hybrid blocks per block."""
    plan = runs["hybrid"].startup.plan
    last = _long_last_step(runs["events"])
    tokenizer = runs["hybrid"].tokenizer
    resident = [len(tokenizer.encode(text, add_special_tokens=True)) + DECODE - 1 for text in (LONG, FRANCE)]
    one_table_blocks = sum(-(-n // 16) for n in resident)
    freed = sum(len(b) for e in runs["events"] if isinstance(e, StepEvent) for b in e.freed_by_window.values())
    assert last.kv_blocks_used_forward == 6 * one_table_blocks - freed
    assert plan.block_bytes * 6 == plan.full_attention_bytes_per_token * 16  # 6 hybrid blocks = 1 full block
    assert last.kv_blocks_used_forward * plan.block_bytes < one_table_blocks * plan.full_attention_bytes_per_token * 16
    phase_e = next(e for e in runs["events"] if isinstance(e, StartupPhase) and e.phase == "E" and e.status == "end")
    assert phase_e.data["kv_cache_layout"] == "hybrid"
    assert phase_e.data["other_layout"]["kv_cache_layout"] == "full_attention"


@pytest.mark.slow
def test_a_long_prompt_keeps_half_the_pages_and_the_same_tokens(tmp_path: Path) -> None:
    """1,402 tokens (the window passed by 890): greedy equal to one table's and right, and
    at the end the hybrid pool holds under half the pages one table holds."""
    long, flags = facts(90), dict(max_model_len=2048, kv_cache_memory_bytes=128 * 2**20)
    hybrid, events, tokens = _run(False, tmp_path / "long.jsonl", long=long, **flags)
    hybrid.close()
    single, single_events, single_tokens = _run(True, long=long, **flags)
    single.close()
    assert tokens == single_tokens
    assert hybrid.tokenizer.decode(tokens["long"]).startswith(" the number 90 comes after")
    plan, single_plan = hybrid.startup.plan, single.startup.plan
    used = _long_last_step(events).kv_blocks_used_forward * plan.block_bytes
    one_table = _long_last_step(single_events).kv_blocks_used_forward * single_plan.block_bytes
    assert used < 0.5 * one_table, (used, one_table)
    from engine.sim.replay import verify_recording

    assert verify_recording(tmp_path / "long.jsonl")[1].ok


def test_engine_config_records_the_groups_and_replay_verifies(runs) -> None:
    from engine.sim.replay import verify_recording

    config = next(e for e in runs["events"] if isinstance(e, EngineConfigEvent)).config
    kinds = [g["kind"] for g in config["kv_cache_groups"]]
    assert kinds == [SLIDING_WINDOW_KIND] * 5 + [FULL_ATTENTION]
    _, report = verify_recording(runs["path"])
    assert report.ok, report.divergence
    assert report.steps_replayed == report.steps_recorded > DECODE


def test_completion_prompts_get_the_bos_and_chat_prompts_only_the_template_s(runs) -> None:
    engine = runs["hybrid"]
    tokenizer = engine.tokenizer
    assert tokenizer.add_bos_token and tokenizer.bos_token_id == 2
    assert engine.encode_prompt(FRANCE) == [2, *tokenizer.encode(FRANCE)]
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    ids = engine.encode_prompt(str(rendered), add_special_tokens=False)
    assert ids[0] == 2 and ids[1] != 2 and ids.count(2) == 1
    assert engine.encode_prompt([5, 6]) == [5, 6]  # token ids are taken as given
