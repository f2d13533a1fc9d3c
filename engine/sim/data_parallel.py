"""``engine simulate --data-parallel-size D``: D engine cores on the cost model (issue 37).

Each rank is a replica of the setup (its own :class:`~engine.core.scheduler.Scheduler`
and KV pool, its own GPU(s): with ``--pipeline-parallel-size`` each rank is a pipeline)
with its own simulated clock. Requests arrive in time order and go where vLLM's DP load
balancer sends them (``DPLBAsyncMPClient``: the lowest ``4 x waiting + running``, ties
to the lowest rank, engine/serve/data_parallel.py's rule), read from each rank's
scheduler at the arrival (vLLM's coordinator reports the same two counts every 100 ms;
here they are exact). The rank whose clock is earliest steps next, so the ranks run side
by side on one time axis.

Every rank publishes on the one bus through a :class:`RankBus` that stamps ``dp_rank``
on the events that carry it, as the real cores' forwarders do, so one recording holds
every rank and the doctor, the monitor and :class:`~engine.events.folds.dp_balance.DataParallelLoad`
read it unchanged. Within a rank events are in time order; across ranks a step's events
carry its end time, so two ranks' events interleave within one step's length.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.core.step_loop import run_step
from engine.errors import UserError
from engine.events import Event, EventBus
from engine.events.folds.dp_balance import WAITING_WEIGHT, DataParallelLoad
from engine.sim.simulate import (
    LIMITS,
    CostModelExecutor,
    SimResult,
    SimSetup,
    Simulation,
    clocked_bus,
    mm_inputs,
    publish_startup,
)
from engine.sim.workload import TokenIdSource, WorkloadRequest


class RankBus(EventBus):
    """One rank's view of the shared bus: stamps ``dp_rank`` and publishes there."""

    def __init__(self, shared: EventBus, rank: int) -> None:
        super().__init__(clock=shared.now)
        self.shared = shared
        self.rank = rank

    @property
    def has_subscribers(self) -> bool:  # type: ignore[override]
        return self.shared.has_subscribers

    def publish(self, event: Event) -> Event:
        if self.rank and hasattr(event, "dp_rank"):
            event.dp_rank = self.rank  # type: ignore[attr-defined]
        return self.shared.publish(event)


@dataclass(slots=True)
class RankSim:
    """One rank: its scheduler, its clock and the executor that advances it."""

    rank: int
    scheduler: Scheduler
    sim: Simulation  # holds this rank's clock (``now``) for its CostModelExecutor
    executor: CostModelExecutor

    @property
    def score(self) -> int:
        return WAITING_WEIGHT * len(self.scheduler.waiting) + len(self.scheduler.running)


@dataclass(slots=True)
class DataParallelResult(SimResult):
    """The whole run's tally (every rank's events) plus each rank's balance."""

    balance: DataParallelLoad = field(default_factory=DataParallelLoad)

    def summary(self) -> dict[str, Any]:
        return {**SimResult.summary(self), "data_parallel": self.balance.summary()}


def least_loaded(ranks: Sequence[RankSim]) -> RankSim:
    return min(ranks, key=lambda r: (r.score, r.rank))


class DataParallelSimulation:
    """``size`` ranks of ``setup`` behind vLLM's balancer, on one bus and one time axis."""

    def __init__(self, setup: SimSetup, bus: EventBus | None = None, *, stats_interval: float = 0.0) -> None:
        self.setup = setup
        self.now = 0.0
        self.bus = clocked_bus(bus, self.clock, stats_interval)
        self.limit_steps = dict.fromkeys(LIMITS, 0)  # steps with requests waiting, by what held them (all ranks)
        self.ranks: list[RankSim] = []
        for rank in range(setup.data_parallel_size):
            rank_bus = RankBus(self.bus, rank)
            sim = Simulation(setup, rank_bus)
            sim.bus.set_clock(self.clock)  # Simulation points its bus at its own clock; the shared one rules
            self.ranks.append(RankSim(rank, sim.scheduler, sim, CostModelExecutor(sim, self.limit_steps)))

    def clock(self) -> float:
        return self.now

    def run(self, workload: Sequence[WorkloadRequest], *, startup: bool = True,
            max_steps: int = 50_000_000) -> DataParallelResult:
        if any(w.arrival_step for w in workload):  # step 0 is "all at once", which is time 0 too
            raise UserError("--data-parallel-size with arrivals by step: each rank steps on its own clock, so "
                            "give arrivals in seconds (--arrival-unit s) or all at once")
        wall_start = time.perf_counter()
        if startup and self.bus.has_subscribers:
            publish_startup(self.bus, self.setup)
        result = DataParallelResult(num_blocks=self.setup.scheduler.num_blocks, limit_steps=self.limit_steps)
        result.balance.declared_size = len(self.ranks)
        pending = deque(sorted(workload, key=lambda w: w.arrival_time))
        ids = TokenIdSource()
        self.bus.subscribe(result)
        self.bus.subscribe(result.balance)
        try:
            while result.steps < max_steps:
                busy = [r for r in self.ranks if r.scheduler.has_unfinished()]
                nxt = min(busy, key=lambda r: (r.sim.now, r.rank)) if busy else None
                if pending and (nxt is None or pending[0].arrival_time <= nxt.sim.now):
                    spec = pending.popleft()
                    target = least_loaded(self.ranks)
                    target.sim.now = max(target.sim.now, spec.arrival_time)  # an idle rank waits for it
                    self.now = spec.arrival_time
                    req = Request(spec.request_id, ids.prompt(spec), spec.output_tokens, ignore_eos=True,
                                  arrival_time=spec.arrival_time, priority=spec.priority, mm_inputs=mm_inputs(spec))
                    target.scheduler.add_request(req, spec.arrival_time)
                    continue
                if nxt is None:
                    break
                self.now = nxt.sim.now
                run_step(nxt.scheduler, nxt.executor, nxt.sim.bus, nxt.sim.now)
                self.now = nxt.sim.now  # the executor moved the rank's clock to the step's end
        finally:
            self.bus.unsubscribe(result)
            self.bus.unsubscribe(result.balance)
        result.completed = not pending and not any(r.scheduler.has_unfinished() for r in self.ranks)
        result.sim_seconds = max((r.sim.now for r in self.ranks), default=0.0)
        self.now = result.sim_seconds
        result.wall_seconds = time.perf_counter() - wall_start
        return result
