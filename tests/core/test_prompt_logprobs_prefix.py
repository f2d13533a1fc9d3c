"""vLLM's rule for prompt_logprobs and the prefix cache (its ``skip_reading_prefix_cache``):
a request owed its prompt logprobs needs every prompt position computed, so it reads no
hit and counts no lookup; its own blocks are still cached for others, and once it has
output tokens (a resume after preemption) it reads hits again. Model-free."""

from __future__ import annotations

from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler, SchedulerConfig, reads_prefix_cache
from engine.core.step_loop import FixedTokenExecutor, run_step
from engine.events import EventBus

PROMPT = list(range(10, 42))  # 8 blocks of 4


def _run(sched: Scheduler, req: Request) -> list[tuple[int, int, dict[str, list[object]]]]:
    """Serve ``req`` alone to its end: each step's (prefix hit tokens, query tokens, lookups)."""
    sched.add_request(req, 0.0)
    seen = []
    while sched.has_unfinished():
        out = run_step(sched, FixedTokenExecutor(7), None, 0.0).output
        seen.append((out.prefix_hit_tokens, out.prefix_query_tokens, out.prefix_lookups))
    return seen


def test_a_prompt_logprobs_request_reads_no_hit_and_counts_no_lookup() -> None:
    bus = EventBus(clock=lambda: 0.0)
    bus.subscribe(lambda event: None)  # a listener: the scheduler explains its lookups
    sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                                      max_model_len=128), bus)
    _run(sched, Request("first", PROMPT, 2))
    again = _run(sched, Request("plain", PROMPT, 2))
    assert again[0][:2] == (28, len(PROMPT))  # 7 full blocks hit (the last token is always computed)
    assert again[0][2]["plain"][0] == 28  # and the lookup explained
    asks = Request("asks", PROMPT, 2, sampling=SamplingParams(prompt_logprobs=1))
    assert not reads_prefix_cache(asks)
    steps = _run(sched, asks)
    assert steps[0] == (0, 0, {}) and asks.num_cached_tokens == 0
    assert reads_prefix_cache(asks)  # it has output tokens now: a resume would read hits
    assert reads_prefix_cache(Request("quiet", PROMPT, 2, sampling=SamplingParams()))
