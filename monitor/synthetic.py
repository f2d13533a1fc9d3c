"""A deterministic synthetic event stream for monitor fixtures and benchmarks.

It publishes real :mod:`engine.events` records through a real :class:`EventBus`
with a simulated clock: startup phases A–G with a memory budget, then a paged
KV pool with an LRU free queue, prefix caching (shared blocks with several
owners), chunked prefill, decode, preemption under memory pressure and
finishes. It is a stand-in for the scheduler's deterministic driver, so the
dashboard and its tests can grow before the engine emits real steps; the
numbers are plausible, not a model of any GPU.

    python -m monitor.synthetic OUT.jsonl --steps 400 --blocks 256 --seed 7
"""

from __future__ import annotations

import argparse
import random
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path

from engine.events import (
    PHASES,
    EngineConfigEvent,
    EventBus,
    JsonlSink,
    RequestArrived,
    RequestFinished,
    RequestFirstToken,
    RequestPreempted,
    RequestScheduled,
    StartupPhase,
    StepEvent,
)

GiB = 1024**3


@dataclass(slots=True)
class _Req:
    rid: str
    prompt: int
    max_tokens: int
    group: int
    arrived_t: float
    computed: int = 0
    generated: int = 0
    blocks: list[int] = field(default_factory=list)
    preemptions: int = 0
    scheduled_once: bool = False
    first_token_t: float | None = None

    @property
    def context(self) -> int:
        return self.prompt + self.generated


class SyntheticEngine:
    """A tiny paged-KV scheduler that emits the events a real one would."""

    def __init__(self, bus: EventBus, num_blocks: int = 256, block_size: int = 16, seed: int = 7,
                 arrival_rate: float = 0.25, max_num_seqs: int = 32, token_budget: int = 512,
                 prefix_groups: int = 3, prefix_blocks: int = 4) -> None:
        self.bus = bus
        self.rng = random.Random(seed)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.arrival_rate = arrival_rate
        self.max_num_seqs = max_num_seqs
        self.token_budget = token_budget
        self.prefix_groups = prefix_groups
        self.prefix_blocks = prefix_blocks
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.refs = [0] * num_blocks
        self.hash_of: dict[int, tuple[int, int]] = {}
        self.block_of: dict[tuple[int, int], int] = {}
        self.waiting: deque[_Req] = deque()
        self.running: list[_Req] = []
        self.cached_free = 0  # kept incrementally so huge pools stay O(1) per step
        self.now = 0.0
        self.next_id = 0
        self.step_index = 0
        bus.set_clock(lambda: self.now)

    # ------------------------------------------------------------------ startup
    def startup(self) -> None:
        total = 80 * GiB
        util = 0.9
        weights = int(16.1 * GiB)
        act = int(4.2 * GiB)
        non_torch = int(0.3 * GiB)
        graphs = int(0.5 * GiB)
        pool = int(total * util) - weights - act - non_torch
        config = {"model": "synthetic", "gpu_memory_utilization": util, "block_size": self.block_size,
                  "max_num_seqs": self.max_num_seqs, "max_num_batched_tokens": self.token_budget}
        self.bus.publish(EngineConfigEvent(config=config, model={"name": "synthetic", "layers": 32}))
        allocated = 0
        data = {
            "A": {},
            "B": {"total_bytes": total, "gpu_memory_utilization": util},
            "C": {"weights_bytes": weights},
            "D": {"activation_peak_bytes": act, "non_torch_bytes": non_torch},
            "E": {"kv_pool_bytes": pool, "num_blocks": self.num_blocks, "block_size": self.block_size},
            "F": {"cuda_graph_bytes": graphs},
            "G": {},
        }
        growth = {"C": weights, "D": non_torch, "E": pool, "F": graphs}
        durations = {"A": 0.4, "B": 0.1, "C": 6.2, "D": 2.3, "E": 0.8, "F": 11.5, "G": 0.05}
        for phase, name in PHASES.items():
            before = {"total": total, "free": total - allocated, "allocated": allocated, "source": "synthetic"}
            self.bus.publish(StartupPhase(phase=phase, name=name, status="begin", memory_before=before))
            self.now += durations[phase]
            allocated += growth.get(phase, 0)
            after = {"total": total, "free": total - allocated, "allocated": allocated, "source": "synthetic"}
            self.bus.publish(StartupPhase(phase=phase, name=name, status="end", duration_s=durations[phase],
                                          memory_before=before, memory_after=after, data=data[phase]))
        self.now = 0.0 if self.now < 0 else self.now

    # ------------------------------------------------------------------- blocks
    def _take_block(self, evicted: list[int]) -> int | None:
        if not self.free:
            return None
        block, _ = self.free.popitem(last=False)
        key = self.hash_of.pop(block, None)
        if key is not None:
            self.cached_free -= 1
            del self.block_of[key]
            evicted.append(block)
        self.refs[block] = 1
        return block

    def _release(self, req: _Req) -> list[int]:
        freed = list(req.blocks)
        # Free in reverse so the tail (least likely to be shared) is reused first.
        for b in reversed(freed):
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free[b] = None
                self.cached_free += b in self.hash_of
        req.blocks = []
        return freed

    def _prefix_hit(self, req: _Req) -> list[int]:
        hits: list[int] = []
        for i in range(min(self.prefix_blocks, req.prompt // self.block_size)):
            block = self.block_of.get((req.group, i))
            if block is None:
                break
            hits.append(block)
        for b in hits:
            self.refs[b] += 1
            if b in self.free:
                del self.free[b]
                self.cached_free -= 1
        return hits

    # -------------------------------------------------------------------- steps
    def step(self) -> None:
        self.now += 0.02 + 0.0005 * len(self.running)
        for _ in range(self._arrivals()):
            rid = f"req-{self.next_id:05d}"
            self.next_id += 1
            req = _Req(rid, prompt=self.rng.randint(40, 400), max_tokens=self.rng.randint(8, 160),
                       group=self.rng.randrange(self.prefix_groups), arrived_t=self.now)
            self.waiting.append(req)
            self.bus.publish(RequestArrived(request_id=rid, prompt_tokens=req.prompt, max_tokens=req.max_tokens))

        scheduled: dict[str, list[object]] = {}
        allocated: dict[str, list[int]] = {}
        freed: dict[str, list[int]] = {}
        cached: list[int] = []
        evicted: list[int] = []
        new: list[str] = []
        resumed: list[str] = []
        preempted: list[str] = []
        budget = self.token_budget

        def grow(req: _Req, tokens: int) -> bool:
            need = -(-(req.computed + tokens) // self.block_size) - len(req.blocks)
            got: list[int] = []
            for _ in range(max(0, need)):
                b = self._take_block(evicted)
                if b is None:
                    for g in got:  # undo a partial grab
                        self.refs[g] = 0
                        self.free[g] = None
                    return False
                got.append(b)
            req.blocks.extend(got)
            if got:
                allocated.setdefault(req.rid, []).extend(got)
            return True

        # Decode the running requests first; preempt from the back when out of blocks.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            tokens = min(budget, req.context - req.computed) if req.computed < req.context else 1
            while not grow(req, tokens):
                victim = self.running.pop()
                fresh = set(allocated.pop(victim.rid, ()))  # never announced, so never freed
                released = [b for b in self._release(victim) if b not in fresh]
                freed.setdefault(victim.rid, []).extend(released)
                scheduled.pop(victim.rid, None)
                victim.computed = 0
                victim.preemptions += 1
                preempted.append(victim.rid)
                self.waiting.appendleft(victim)
                self.bus.publish(RequestPreempted(request_id=victim.rid, num_preemptions=victim.preemptions,
                                                  blocks_freed=len(freed[victim.rid])))
                if victim is req:
                    break
            else:
                caught_up = req.computed >= req.prompt and req.context - req.computed == 1
                kind = "decode" if caught_up else "prefill"
                scheduled[req.rid] = [tokens, kind]
                budget -= tokens
                i += 1
                continue
        # Admit waiting requests while blocks and budget last (not the ones preempted this step).
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            req = self.waiting[0]
            hits = self._prefix_hit(req)
            req.blocks = list(hits)
            req.computed = len(hits) * self.block_size
            if hits:
                allocated.setdefault(req.rid, []).extend(hits)
            tokens = min(budget, req.context - req.computed)
            if not grow(req, tokens):
                self._release(req)
                allocated.pop(req.rid, None)
                req.computed = 0
                break
            self.waiting.popleft()
            self.running.append(req)
            scheduled[req.rid] = [tokens, "prefill"]
            budget -= tokens
            if req.scheduled_once:
                resumed.append(req.rid)
            else:
                req.scheduled_once = True
                new.append(req.rid)
                self.bus.publish(RequestScheduled(request_id=req.rid, queue_time_s=self.now - req.arrived_t,
                                                  prefix_hit_tokens=len(hits) * self.block_size))

        # Apply the forward pass: computed tokens grow, full blocks become cached.
        finished: dict[str, str] = {}
        self._done: dict[str, _Req] = {}
        for req in list(self.running):
            if req.rid not in scheduled:
                continue
            tokens = int(scheduled[req.rid][0])  # type: ignore[call-overload]
            before_full = req.computed // self.block_size
            req.computed += tokens
            for j in range(before_full, min(req.computed // self.block_size, len(req.blocks))):
                block = req.blocks[j]
                if block in self.hash_of:
                    continue
                key = (req.group, j) if j < self.prefix_blocks else (-1, block * 1_000_003 + self.step_index)
                if key in self.block_of:
                    continue
                self.hash_of[block] = key
                self.block_of[key] = block
                cached.append(block)
            if req.computed >= req.context:
                req.generated += 1
                if req.first_token_t is None:
                    req.first_token_t = self.now + 0.02 + 0.0005 * len(scheduled)  # at the end of this step
                    self.bus.publish(RequestFirstToken(request_id=req.rid, ttft_s=req.first_token_t - req.arrived_t))
            if req.generated >= req.max_tokens:
                finished[req.rid] = "length"
        for rid in finished:
            req = next(r for r in self.running if r.rid == rid)
            self.running.remove(req)
            self._done[rid] = req
            freed.setdefault(rid, []).extend(self._release(req))

        used = self.num_blocks - len(self.free)
        step = StepEvent(
            index=self.step_index,
            scheduled=scheduled,
            num_prefill_tokens=sum(int(v[0]) for v in scheduled.values() if v[1] == "prefill"),  # type: ignore[call-overload]
            num_decode_tokens=sum(int(v[0]) for v in scheduled.values() if v[1] == "decode"),  # type: ignore[call-overload]
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_blocks_used=used,
            kv_blocks_cached_free=self.cached_free,
            kv_blocks_total=self.num_blocks,
            allocated=allocated,
            freed=freed,
            cached=cached,
            evicted=evicted,
            new=new,
            resumed=resumed,
            preempted=preempted,
            finished=finished,
            duration_s=0.02 + 0.0005 * len(scheduled),
        )
        self.bus.publish(step)
        for rid in finished:
            done = self._done[rid]
            self.bus.publish(RequestFinished(request_id=rid, reason="length", prompt_tokens=done.prompt,
                                             output_tokens=done.generated, num_preemptions=done.preemptions,
                                             ttft_s=(done.first_token_t or self.now) - done.arrived_t,
                                             e2e_s=self.now - done.arrived_t))
        self.step_index += 1

    def _arrivals(self) -> int:
        n = 0
        while self.rng.random() < self.arrival_rate / (n + 1):
            n += 1
        return n


def record(path: str | Path, steps: int = 400, num_blocks: int = 256, seed: int = 7, **kwargs: float) -> Path:
    """Write a synthetic recording of ``steps`` steps to ``path``."""
    path = Path(path)
    bus = EventBus()
    sink = JsonlSink(path, config={"source": "monitor.synthetic", "seed": seed, "steps": steps})
    bus.subscribe(sink)
    engine = SyntheticEngine(bus, num_blocks=num_blocks, seed=seed, **kwargs)  # type: ignore[arg-type]
    engine.startup()
    for _ in range(steps):
        engine.step()
    sink.close()
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--blocks", type=int, default=384)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--arrival-rate", type=float, default=0.25)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    args = parser.parse_args(argv)
    record(args.out, steps=args.steps, num_blocks=args.blocks, seed=args.seed,
           arrival_rate=args.arrival_rate, max_num_seqs=args.max_num_seqs)


if __name__ == "__main__":
    main()
