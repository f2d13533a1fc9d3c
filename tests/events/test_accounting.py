"""Every request and every token accounted for, under data parallelism (two ranks).

A property test drives two real schedulers (the fixed-token executor, engine/sim/driver.py's
loop) behind vLLM's least-loaded rule, each rank publishing on one shared bus through the
simulator's RankBus. One request in five is aborted by its client, some mid-prefill (chunked
prefill cut between chunks, or while waiting) and some mid-decode, with every cause. At the
end every arrival has exactly one ``request.finished`` with its typed reason, and each rank's
Prometheus families add up: the per-request token histograms' sums equal the token counters,
which equal the tokens the requests themselves hold (read from the Request objects, not the
events).
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from engine.core.request import Request
from engine.core.scheduler import Scheduler, SchedulerConfig
from engine.core.step_loop import FixedTokenExecutor, run_step
from engine.events import Event, EventBus, RequestFinished
from engine.events.exporters.metrics import PrometheusMetrics
from engine.events.folds.accounting import RequestLedger, finish_kind
from engine.events.folds.dp_balance import WAITING_WEIGHT
from engine.events.request_records import ABORT_CAUSES, ABORT_CLIENT_DISCONNECT
from engine.sim.data_parallel import RankBus

RANKS = 2
EXECUTOR = FixedTokenExecutor(7)
SHARED_PREFIX = list(range(1000, 1040))  # 40 tokens: some prompts share it, so prefix hits happen


@dataclass(slots=True)
class Spec:
    prompt_len: int
    output_tokens: int
    arrival_step: int
    shared: bool
    abort: str | None  # None, "prefill" or "decode"
    abort_after: int  # decode: output tokens before the abort
    cause: str


specs = st.builds(
    Spec,
    prompt_len=st.integers(1, 160),
    output_tokens=st.integers(1, 24),
    arrival_step=st.integers(0, 40),
    shared=st.booleans(),
    abort=st.sampled_from(["prefill", "decode"]),  # kept for one request in five (see the test)
    abort_after=st.integers(1, 20),
    cause=st.sampled_from(ABORT_CAUSES),
)


class Harness:
    """Two ranks on one bus, each with its own metrics (engine label = the rank)."""

    def __init__(self, num_blocks: int, budget: int) -> None:
        self.now = 0.0
        self.budget = budget
        self.bus = EventBus(clock=lambda: self.now)
        config = SchedulerConfig(num_blocks=num_blocks, block_size=16, max_num_seqs=8,
                                 max_num_batched_tokens=budget, max_model_len=256)
        self.ranks = [Scheduler(config, RankBus(self.bus, rank)) for rank in range(RANKS)]
        self.metrics = [PrometheusMetrics(CollectorRegistry(), "m", engine_index=str(rank), max_model_len=256)
                        for rank in range(RANKS)]
        self.ledger = RequestLedger()
        self.events: list[Event] = []
        self.bus.subscribe(self._route)
        self.requests: dict[tuple[int, str], Request] = {}
        self.aborted: dict[tuple[int, str], tuple[str, int]] = {}  # -> (cause, computed prompt tokens if no token)

    def _route(self, event: Event) -> None:
        self.events.append(event)
        self.ledger(event)
        self.metrics[getattr(event, "dp_rank", 0)](event)

    def add(self, request_id: str, spec: Spec) -> None:
        rank = min(range(RANKS), key=lambda r: (WAITING_WEIGHT * len(self.ranks[r].waiting)
                                                + len(self.ranks[r].running), r))
        prompt = (SHARED_PREFIX if spec.shared else []) + [(int(request_id[1:]) * 31 + i * 7) % 900 for i in range(spec.prompt_len)]
        req = Request(request_id, prompt[:200], spec.output_tokens, ignore_eos=True, arrival_time=self.now)
        self.ranks[rank].add_request(req, self.now)
        self.requests[(rank, request_id)] = req

    def maybe_abort(self, key: tuple[int, str], spec: Spec) -> None:
        req = self.requests[key]
        if req.is_finished or key in self.aborted:
            return
        # mid-chunk; a prompt one step's budget holds (no chunk to cut) while it still waits
        cut_prefill = spec.abort == "prefill" and req.num_computed_tokens < req.num_prompt_tokens and (
            req.num_computed_tokens > 0 or (req.num_prompt_tokens <= self.budget and self.now >= spec.arrival_step + 3))
        cut_decode = spec.abort == "decode" and len(req.output_token_ids) >= min(spec.abort_after,
                                                                                 spec.output_tokens - 1)
        if not (cut_prefill or cut_decode) or (spec.abort == "decode" and spec.output_tokens < 2):
            return
        computed = min(req.num_computed_tokens, req.num_prompt_tokens) if not req.output_token_ids else 0
        assert self.ranks[key[0]].abort(key[1], self.now, spec.cause)
        self.aborted[key] = (spec.cause, computed)

    def run(self, workload: list[Spec]) -> None:
        ids = {f"r{i}": spec for i, spec in enumerate(workload)}
        by_step: dict[int, list[str]] = {}
        for rid, spec in ids.items():
            by_step.setdefault(spec.arrival_step, []).append(rid)
        last = max(by_step)
        step = 0
        while step <= last or any(s.has_unfinished() for s in self.ranks):
            assert step < 20_000, "the run did not end"
            self.now = float(step)
            for rid in by_step.get(step, ()):
                self.add(rid, ids[rid])
            for key in list(self.requests):  # aborts arrive between steps, as the servers apply them
                if ids[key[1]].abort:
                    self.maybe_abort(key, ids[key[1]])
            for sched in self.ranks:
                if sched.has_unfinished():
                    run_step(sched, EXECUTOR, sched.bus, self.now)
            step += 1


def sample(metrics: PrometheusMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, {"model_name": "m", "engine": metrics.engine_index, **labels})
    return value or 0.0


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(workload=st.lists(specs, min_size=150, max_size=300), num_blocks=st.integers(24, 80),
       budget=st.sampled_from([32, 48, 64]))
def test_every_request_and_token_accounted_for_with_two_ranks(workload: list[Spec], num_blocks: int,
                                                              budget: int) -> None:
    for i, spec in enumerate(workload):  # one client in five aborts: mid-prefill or mid-decode as drawn
        if i % 5:
            spec.abort = None
    run = Harness(num_blocks, budget)
    run.run(workload)
    ledger = run.ledger

    # exactly one typed finish per arrival, on each rank
    assert ledger.balanced, ledger.summary()
    assert ledger.arrived == len(workload) == len(ledger.finished)
    finishes = [e for e in run.events if isinstance(e, RequestFinished)]
    assert len({(e.dp_rank, e.request_id) for e in finishes}) == len(finishes) == len(workload)
    expected_kinds = {key: (f"abort:{cause}" if key in run.aborted else "length")
                      for key, (cause, _) in ((k, run.aborted.get(k, ("", 0))) for k in run.requests)}
    assert {(e.dp_rank, e.request_id): finish_kind(e) for e in finishes} == expected_kinds

    # the tokens the requests hold, read from the Request objects (not the events)
    reqs = run.requests.values()
    held_prompt = sum(r.num_prompt_tokens for r in reqs if r.first_token_time is not None)
    held_output = sum(len(r.output_token_ids) for r in reqs)
    discarded = sum(computed for _, computed in run.aborted.values())
    assert (ledger.prompt_tokens, ledger.output_tokens, ledger.discarded_prompt_tokens) == (
        held_prompt, held_output, discarded)

    totals = {"prompt": 0.0, "generation": 0.0, "discarded": 0.0}
    for rank, metrics in enumerate(run.metrics):
        on_rank = [k for k in run.requests if k[0] == rank]
        prompt = sample(metrics, "vllm:prompt_tokens_total")
        generation = sample(metrics, "vllm:generation_tokens_total")
        # the per-request histograms include every finished request, aborted ones too, and add up exactly
        assert sample(metrics, "vllm:request_prompt_tokens_count") == len(on_rank)
        assert sample(metrics, "vllm:request_generation_tokens_count") == len(on_rank)
        assert sample(metrics, "vllm:request_prompt_tokens_sum") == prompt
        assert sample(metrics, "vllm:request_generation_tokens_sum") == generation
        successes = sum(sample(metrics, "vllm:request_success_total", finished_reason=r)
                        for r in ("stop", "length", "abort", "error"))
        assert successes == len(on_rank)
        aborted_here = [run.aborted[k][0] for k in on_rank if k in run.aborted]
        assert sample(metrics, "vllm:request_success_total", finished_reason="abort") == len(aborted_here)
        for cause in ABORT_CAUSES:
            assert sample(metrics, "kvscope:request_abort_total", cause=cause) == aborted_here.count(cause)
        totals["prompt"] += prompt
        totals["generation"] += generation
        totals["discarded"] += sample(metrics, "kvscope:prompt_tokens_discarded_total")
    assert totals == {"prompt": held_prompt, "generation": held_output, "discarded": discarded}
    assert run.aborted, "the workload aborted nothing: the property was not exercised"


def test_aborts_cut_mid_prefill_and_mid_decode_are_both_exercised() -> None:
    """A fixed workload where one request is cut mid-prefill (between chunks) and one mid-decode:
    the first bills no prompt token but says what its prefill computed; the second bills its
    prompt and the tokens it got."""
    run = Harness(num_blocks=64, budget=32)
    long = Spec(prompt_len=150, output_tokens=10, arrival_step=0, shared=False, abort="prefill", abort_after=1,
                cause=ABORT_CLIENT_DISCONNECT)
    decode = Spec(prompt_len=20, output_tokens=10, arrival_step=0, shared=False, abort="decode", abort_after=4,
                  cause="shutdown")
    run.run([long, decode])
    finishes = {e.request_id: e for e in run.events if isinstance(e, RequestFinished)}
    cut = finishes["r0"]
    assert (cut.reason, cut.abort_cause, cut.ttft_s) == ("abort", "client_disconnect", None)
    assert 0 < cut.computed_prompt_tokens < 150
    late = finishes["r1"]
    assert (late.reason, late.abort_cause, late.output_tokens, late.computed_prompt_tokens) == (
        "abort", "shutdown", 4, 0)
    ranks = {e.request_id: e.dp_rank for e in finishes.values()}
    assert sorted(ranks.values()) == [0, 1]  # the balancer spread them
    totals = [sample(m, "vllm:prompt_tokens_total") for m in run.metrics]
    assert sum(totals) == 20  # only the decoded one's prompt is billed
    assert sum(sample(m, "kvscope:prompt_tokens_discarded_total") for m in run.metrics) == cut.computed_prompt_tokens
