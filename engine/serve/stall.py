"""The stall detector: an engine core that has work and finishes no step within the limit is
caught, named and dumped; when it steps again it is said to have recovered.

It reads each core's step heartbeat (engine/heartbeat.py: the step under way, since when,
its phase) and, for what the core holds, the server's own folds of the core's events (its
:class:`~engine.serve.shared_folds.LockedView` and last ``step`` event). A core is *busy* when it is
in a step, the scheduler reported requests waiting or running, or the server gave it
requests it has not answered; a busy core whose last sign of progress (the start of the
step under way, else the last beat) is older than the limit is *stalled*. Then, once per
stall:

* ``/health`` answers 503 with :meth:`StallDetector.health` (``engine_stalled``, the rank,
  the phase, the last step, the requests it holds);
* an ``engine.stalled`` event is published on the core's bus (and rank 0's);
* a dump is written beside the recording (engine/serve/stall_dump.py): every thread's
  stack of the core's process, its last step event, each request's state and blocks.

A completed step (or the work gone) publishes ``engine.recovered`` and ``/health`` is 200
again.

The limit is ``--stall-timeout`` when given (0: off); by default it is derived from this
machine's own step times, so a long prefill never trips it: ``max(FLOOR_S, STEP_FACTOR x
the longest of the profile run's worst-case step and the longest step seen)``. Phase D's
profile run times a step of the whole token budget (the longest prefill a step can hold);
a step that was itself called stalled does not count as "seen" (the heartbeat's cap).

The clock is injected (``time.monotonic``, the heartbeats' clock); :meth:`check` is one
judgement, which the tests call directly and :meth:`start`'s thread calls periodically.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.config import EngineConfig
from engine.events import Event, EventBus, RequestScheduled, StepEvent
from engine.events.engine_records import EngineRecovered, EngineStalled
from engine.heartbeat import Beat, Heartbeat
from engine.logs import get_logger, log_failure
from engine.serve.stall_dump import dump_path, request_rows, write_dump
from engine.stacks import core_stacks, thread_stacks

FLOOR_S = 30.0  # no default limit below this: a loaded machine's step varies by seconds
STEP_FACTOR = 10.0  # times the longest step this machine measured or ran
POLL_MAX_S = 1.0  # the detector's thread looks at least this often (and 4 times per limit)
HEALTH_REQUESTS = 32  # requests /health names (the dump has every one)


def derived_limit(beat: Beat, floor_s: float = FLOOR_S) -> float:
    """The default stall limit for a core whose heartbeat reads ``beat`` (module docstring)."""
    return max(floor_s, STEP_FACTOR * max(beat.expected_step_s, beat.longest_step_s))


class LastStep:
    """Bus subscriber: the core's last ``step`` event (the scheduler's last output, as published)
    and the requests admitted since (``request.scheduled``: in the step under way, which the
    view still shows waiting until that step's event)."""

    sink_name = "stall detector (last step)"

    def __init__(self) -> None:
        self.event: StepEvent | None = None
        self.admitted: list[str] = []

    def __call__(self, event: Event) -> None:
        if isinstance(event, StepEvent):
            self.event, self.admitted = event, []
        elif isinstance(event, RequestScheduled):
            self.admitted.append(event.request_id)


@dataclass(eq=False)
class CoreWatch:
    """One engine core as the detector sees it. ``pending``: requests the server gave it and
    it has not answered; ``snapshot``: its view's snapshot (requests and blocks); ``publish``:
    publish on its bus(es), from the detector's thread; ``stacks``: every thread's stack of
    its process, as text; ``events_path``: its recording, beside which the dump goes;
    ``ready``: whether it finished startup (a core is judged only from then on)."""

    rank: int
    heartbeat: Heartbeat
    pending: Callable[[], int]
    snapshot: Callable[[], dict[str, Any]]
    publish: Callable[[Event], Any]
    stacks: Callable[[], dict[str, str]]
    events_path: str | None = None
    ready: Callable[[], bool] = lambda: True
    last_step: LastStep = field(default_factory=LastStep)
    record: dict[str, Any] | None = None  # the stall under way, as /health answers it
    stalled_at: float = 0.0  # the clock when the stall began (its step's start, or the last beat)
    steps_at_stall: int = 0


class StallDetector:
    """Watches every engine core of a server (module docstring)."""

    def __init__(self, cores: Sequence[CoreWatch], limit_s: float | None, *,
                 clock: Callable[[], float] = time.monotonic, floor_s: float = FLOOR_S) -> None:
        """``limit_s``: ``--stall-timeout`` (None: derived; 0: off)."""
        self.cores = list(cores)
        self.limit_s = limit_s
        self.clock = clock
        self.floor_s = floor_s
        self._lock = threading.Lock()  # the records, read by /health on the event loop
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._log = get_logger("kvscope.serve")

    @property
    def enabled(self) -> bool:
        return self.limit_s is None or self.limit_s > 0

    def limit(self, beat: Beat) -> float:
        return self.limit_s if self.limit_s else derived_limit(beat, self.floor_s)

    # -------------------------------------------------------------- judging
    def check(self) -> list[Event]:
        """One judgement of every core; the events it published (stalled, recovered)."""
        published: list[Event] = []
        if not self.enabled:
            return published
        for core in self.cores:
            event = self._check(core)
            if event is not None:
                published.append(event)
        return published

    def _check(self, core: CoreWatch) -> Event | None:
        if not core.ready():
            return None
        beat = core.heartbeat.read()
        limit = self.limit(beat)
        core.heartbeat.set_cap(limit)
        now = self.clock()
        busy = beat.in_step or beat.waiting + beat.running > 0 or core.pending() > 0
        if core.record is None:
            if busy and now - beat.since() > limit:
                return self._stalled(core, beat, now, limit)
            return None
        if beat.steps > core.steps_at_stall or not busy:
            return self._recovered(core, beat, now)
        return None

    def _stalled(self, core: CoreWatch, beat: Beat, now: float, limit: float) -> Event:
        since = beat.since()
        last = core.last_step.event
        state = _quietly(core.snapshot, {})
        rows = request_rows(state, core.last_step.admitted)
        record: dict[str, Any] = {"error": "engine_stalled", "rank": core.rank, "phase": beat.phase,
                  "message": (f"engine core {core.rank} has finished no step for {now - since:,.1f} s (limit "
                              f"{limit:,.1f} s) with work pending; it was in {beat.phase}"),
                  "stalled_s": round(now - since, 3), "limit_s": round(limit, 3),
                  "last_step": {"index": last.index if last is not None else None, **beat.to_dict(now)},
                  "requests": rows[:HEALTH_REQUESTS], "num_requests": len(rows), "dump": None}
        path = dump_path(core.events_path, core.rank)
        try:
            write_dump(path, record, _quietly(core.stacks, {}), last.to_dict() if last is not None else None, state)
            record["dump"] = str(path)
        except OSError as exc:
            self._log.warning(f"the stall dump could not be written to {path}: {exc}")
        with self._lock:
            core.record, core.stalled_at, core.steps_at_stall = record, since, beat.steps
        self._log.error(f"{record['message']}; /health answers 503"
                        + (f"; stacks, last step and requests in {record['dump']}" if record["dump"] else ""))
        event = EngineStalled(rank=core.rank, phase=beat.phase, stalled_s=record["stalled_s"], limit_s=limit,
                              last_step=record["last_step"]["index"], num_waiting=beat.waiting,
                              num_running=beat.running, requests=[r["id"] for r in rows], dump=record["dump"])
        core.publish(event)
        return event

    def _recovered(self, core: CoreWatch, beat: Beat, now: float) -> Event:
        with self._lock:
            core.record = None
        last = core.last_step.event
        event = EngineRecovered(rank=core.rank, stalled_s=round(now - core.stalled_at, 3),
                                last_step=last.index if last is not None else None)
        self._log.info(f"engine core {core.rank} steps again after {event.stalled_s:,.1f} s; /health answers 200")
        core.publish(event)
        return event

    def health(self) -> dict[str, Any] | None:
        """The first stalled core's record with its age now (``/health``'s 503 body), or None."""
        with self._lock:
            stalled = [c for c in self.cores if c.record is not None]
            if not stalled:
                return None
            core = stalled[0]
            record = {**core.record, "stalled_s": round(self.clock() - core.stalled_at, 3)}  # type: ignore[dict-item]
        if len(stalled) > 1:
            record["stalled_ranks"] = [c.rank for c in stalled]
        return record

    # --------------------------------------------------------------- thread
    def start(self) -> StallDetector:
        if self.enabled and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvscope-stall-detector", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.check()
                period = min(POLL_MAX_S, min(self.limit(c.heartbeat.read()) for c in self.cores) / 4)
            except Exception:  # the detector must not take the server down; say so and go on
                log_failure("kvscope.serve", "the stall detector's check failed; it tries again")
                period = POLL_MAX_S
            self._stop.wait(max(0.01, period))


def _quietly(fn: Callable[[], Any], default: Any) -> Any:
    """``fn()``, or ``default`` when it raises: a dump with a part missing beats none."""
    with contextlib.suppress(Exception):
        return fn()
    return default


# ------------------------------------------------------------------ wiring
def one_core_detector(config: EngineConfig, bus: EventBus, engine: Any,
                      snapshot: Callable[[], dict[str, Any]]) -> StallDetector:
    """The detector of a server with one engine core (``engine``: its AsyncEngine, whose
    thread is in this process: its stacks are this process's). The bus is guarded, since the
    detector publishes from its own thread."""
    if config.stall_timeout_s != 0:
        bus.guard()

    def stacks() -> dict[str, str]:  # this process's threads, then each tensor-parallel worker rank's
        found = thread_stacks()
        workers = getattr(engine.engine, "workers", None)
        for pid in workers.pids() if workers is not None else []:
            found.update(core_stacks(pid))
        return found

    core = CoreWatch(0, engine.heartbeat, engine.num_waiting, snapshot, bus.publish, stacks,
                     config.events_path, ready=lambda: engine.ready)
    bus.subscribe(core.last_step)
    return StallDetector([core], config.stall_timeout_s)


def data_parallel_detector(config: EngineConfig, engine: Any) -> StallDetector:
    """The detector of a ``--data-parallel-size`` server (``engine``: its DataParallelEngine):
    one watch per core, on the heartbeat it shares with the server; each core's stall is
    published on its bus and rank 0's (which ``/events`` and the dashboard follow), and sent
    to the core, whose recording (``run.dpR.jsonl``) holds it once the core reads it: a
    stopped core's once it runs again."""
    from engine.dp_core import rank_events_path

    def publisher(core: Any) -> Callable[[Event], None]:
        def publish(event: Event) -> None:
            core.publish(event)
            if core.rank != 0:
                engine.cores[0].publish(type(event)(**{f: getattr(event, f) for f in _fields(event)}))
            core.send(("note", event.to_dict()))  # the core records it in its own recording when it runs
        return publish

    watches = []
    for core in engine.cores:
        watch = CoreWatch(core.rank, core.heartbeat, functools.partial(engine.pending_on, core),
                          core.view.snapshot, publisher(core), functools.partial(core_stacks, core.process.pid),
                          rank_events_path(config.events_path, core.rank),
                          ready=functools.partial(_started, core))
        core.bus.subscribe(watch.last_step)
        watches.append(watch)
    return StallDetector(watches, config.stall_timeout_s)


def _started(core: Any) -> bool:
    return core.facts is not None  # a data-parallel core that sent its ready message


def _fields(event: Event) -> list[str]:
    return [f.name for f in dataclasses.fields(event) if f.name not in ("seq", "t")]
