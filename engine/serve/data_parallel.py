"""``--data-parallel-size D``: D engine cores behind one API server, as vLLM runs them.

Each rank is an engine core in its own process (engine/dp_core.py: its own scheduler,
KV pool, model, tensor-parallel workers and recording). This process keeps the HTTP
front end and :class:`DataParallelEngine`, which has :class:`~engine.serve.async_engine.AsyncEngine`'s
interface, so the routes and the server run unchanged:

* **Balancing** is vLLM's ``DPLBAsyncMPClient.get_core_engine_for_request``: the rank with
  the lowest ``4 x waiting + running`` (ties to the lowest rank), from the counts each
  rank's latest ``step`` event reported (vLLM's coordinator publishes the same two counts
  every 100 ms), and the chosen rank's waiting count raised by one at once so a burst
  between two reports spreads out.
* **Events**: every rank's events are folded on a bus of that rank in this process: its
  :class:`~engine.events.exporters.metrics.PrometheusMetrics` with ``engine`` = the rank (``/metrics``
  merges the ranks' families, so each family has an ``engine="0"`` … series as vLLM's
  do), its view and its requests' lifecycle. ``/events`` streams rank 0's events and every
  other rank's step and request events (each with its ``dp_rank``); the dashboard and the
  exporters follow rank 0's bus; the snapshot (``/debug/state``, the first ``/events``
  event) is rank 0's state plus ``data_parallel``: each rank's pid, queue, KV use and the
  requests routed to it; ``/debug/state?dp_rank=R`` is rank R's. ``/debug/requests`` and
  ``include_metrics`` read every rank's lifecycle.
* **Profiling**: ``/start_profile`` / ``/stop_profile`` run the torch profiler in every
  rank's engine core (where the steps run), each writing its own trace into the one trace
  folder (engine/profiling.py); ``/stop_profile`` lists them in rank order.
* **Failure**: a core that dies or fails after startup stops the server as a dead engine
  thread does (``error`` names the rank, its pid and how it ended; ``/health`` 503, exit
  1), after the other cores are stopped; a core that fails during startup fails
  ``wait_ready`` the same way. Cores die with this process (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import os
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric

from engine.config import EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.dp_core import RANKED_EVENTS, CoreFacts, core_main, rank_events_path
from engine.errors import ReplicaError, UserError
from engine.events import EngineStopped, Event, EventBus, StepEvent, event_from_dict
from engine.events.exporters.metrics import PrometheusMetrics
from engine.events.folds.dp_balance import WAITING_WEIGHT
from engine.events.recording import event_line
from engine.events.request_records import ABORT_CLIENT_DISCONNECT, RequestFinished
from engine.heartbeat import Heartbeat
from engine.llm_engine import CheckedPrompt, LLMEngine, RequestOutput
from engine.logs import get_logger
from engine.profiling import ProfileLimits, TorchProfiler
from engine.serve.async_engine import EngineDead, EngineFront, RequestFailed, RequestStream, _aborted_output
from engine.serve.host import EngineHost, EventHub
from engine.serve.settings import ServerSettings
from engine.serve.shared_folds import LockedLifecycle, LockedView, subscribe_observers
from engine.serve.stall import data_parallel_detector

STOP_WAIT_S = 5.0  # a core's time to leave by itself after "stop", before terminate/kill
NOTED = ("engine.stalled", "engine.recovered")  # published here by the stall detector, then sent to the core
EXIT_WAIT_S = 5.0  # how long a core that closed its pipe gets to show its exit status


@dataclass(eq=False)
class CoreClient:
    """This process's side of one rank: its process, pipe, bus and view, and the counts it balances on."""

    rank: int
    process: Any  # multiprocessing's SpawnProcess
    conn: Any  # the duplex Pipe's end
    bus: EventBus
    view: LockedView
    facts: CoreFacts | None = None
    failure: tuple[str, bool] | None = None  # the core's own account: (message, is a UserError)
    waiting: int = 0
    running: int = 0
    routed: int = 0
    kv_used: int = 0
    kv_total: int = 0
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    publish_lock: threading.Lock = field(default_factory=threading.Lock)
    reader: threading.Thread | None = None
    heartbeat: Heartbeat = field(default_factory=Heartbeat)  # the core writes it in shared memory; stall.py reads

    def send(self, command: tuple[Any, ...]) -> None:
        with self.send_lock, contextlib.suppress(OSError, ValueError):  # a dead core: its reader reports it
            self.conn.send(command)

    def publish(self, event: Event) -> None:
        with self.publish_lock:
            self.bus.publish(event)

    def publish_rows(self, rows: list[dict[str, Any]], counts_lock: threading.Lock) -> None:
        """The core's events, sent as rows, published on its bus; a step event's queue and KV
        counts kept (under ``counts_lock``) for the balancer."""
        for row in rows:
            if row.get("type") in NOTED:  # the stall detector's own verdict, back from the core's recording
                continue
            event = event_from_dict(row)
            if isinstance(event, StepEvent):
                with counts_lock:  # the counts vLLM's coordinator reports: the scheduler's own
                    self.waiting, self.running = event.num_waiting, event.num_running
                    self.kv_used, self.kv_total = event.kv_blocks_used, event.kv_blocks_total
            self.publish(event)

    def how_it_ended(self) -> str:
        if self.failure is not None:
            return f"failed: {self.failure[0]}"
        code = self.process.exitcode
        if code is None:
            return "closed its pipe"
        if code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with code {code}"


class ReplicaFrontend:
    """``host.llm`` under data parallelism: what the routes ask of an engine before they
    submit (the tokenizer, the limits, the prompt checks), from rank 0's facts; every
    rank runs the same model and flags. The prompt checks are LLMEngine's own."""

    encode_prompt = LLMEngine.encode_prompt
    check_prompt = LLMEngine.check_prompt
    prepare_prompt = LLMEngine.prepare_prompt

    def __init__(self, config: EngineConfig, cores: Sequence[CoreFacts]) -> None:
        facts = cores[0]
        self.config = config
        self.tokenizer = facts.tokenizer
        self.startup = facts  # .config, .scheduler_config and .model_config, as LLMEngine.startup has them
        # each rank's KVEventsConfig as it bound it (its ready message), by rank as vLLM's frontend keeps them
        self._kv_event_sources = {str(rank): core.kv_events for rank, core in enumerate(cores)
                                  if core.kv_events is not None}

    @property
    def max_model_len(self) -> int:
        return int(self.startup.scheduler_config.max_model_len)

    def kv_event_sources(self) -> dict[str, dict[str, Any]]:
        """LLMEngine.kv_event_sources over every rank."""
        return dict(self._kv_event_sources)


class MergedRegistry(CollectorRegistry):
    """The ranks' registries as one: each family once, with every rank's samples (a
    family repeated in the exposition is a scrape error for Prometheus)."""

    def __init__(self, registries: Sequence[CollectorRegistry]) -> None:
        super().__init__()
        self.registries = registries

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for registry in self.registries:
            for metric in registry.collect():
                merged = families.get(metric.name)
                if merged is None:
                    merged = families[metric.name] = Metric(metric.name, metric.documentation, metric.type,
                                                            metric.unit)
                merged.samples.extend(metric.samples)
        yield from families.values()


class DataParallelMetrics:
    """``host.metrics``: each rank's PrometheusMetrics, rendered as one exposition."""

    def __init__(self, ranks: Sequence[PrometheusMetrics]) -> None:
        self.ranks = list(ranks)
        self.registry = self.ranks[0].registry

    def render(self) -> bytes:
        return generate_latest(MergedRegistry([m.registry for m in self.ranks]))


class DataParallelView:
    """``host.view``: rank 0's view, plus each rank's queue and KV use under ``data_parallel``."""

    def __init__(self, engine: DataParallelEngine) -> None:
        self.engine = engine

    def __call__(self, event: Event) -> None:  # rank 0's view is subscribed itself
        pass

    def snapshot(self) -> dict[str, Any]:
        return self.snapshot_of_rank(0)

    def snapshot_of_rank(self, rank: int) -> dict[str, Any]:
        cores = self.engine.cores
        if not 0 <= rank < len(cores):
            raise UserError(f"dp_rank {rank}: this server's ranks are 0..{len(cores) - 1}")
        state = cores[rank].view.snapshot()
        state["data_parallel"] = {**self.engine.balance_state(), "rank_shown": rank}
        return state


class DataParallelLifecycle:
    """``host.lifecycle``: each rank's requests, folded on its own bus (the ranks' steps are
    their own), read as one: a request lives on one rank, its rows say which (``dp_rank``)."""

    def __init__(self, ranks: Sequence[LockedLifecycle]) -> None:
        self.ranks = list(ranks)

    def life(self, request_id: str) -> dict[str, Any] | None:
        for rank, fold in enumerate(self.ranks):
            life = fold.life(request_id)
            if life is not None:
                return {**life, "dp_rank": rank}
        return None

    def metrics(self, request_id: str) -> dict[str, Any] | None:
        return next((m for fold in self.ranks if (m := fold.metrics(request_id)) is not None), None)

    def rows(self, state: str | None, now: float) -> list[dict[str, Any]]:
        """Every rank's rows, oldest first (the ranks' buses tick in this process: one clock)."""
        rows = [{**row, "dp_rank": rank} for rank, fold in enumerate(self.ranks) for row in fold.rows(state, now)]
        return sorted(rows, key=lambda row: -(row["age_s"] or 0.0))


class CoreProfiling:
    """The profile commands sent to the cores and not answered yet: each core's answer settles
    the future its ``profile`` call awaits, on that call's loop."""

    def __init__(self, tokens: Iterator[int], lock: threading.Lock) -> None:
        self._tokens = tokens
        self._lock = lock
        # token -> (its rank, the loop and future awaiting it)
        self._waiting: dict[int, tuple[int, asyncio.AbstractEventLoop, asyncio.Future[Any]]] = {}

    async def ask(self, cores: Sequence[CoreClient], profiler: TorchProfiler, action: Literal["start", "stop"],
                  limits: ProfileLimits | None) -> list[str]:
        """Every core's answer, in rank order; a rank's refusal is raised after every rank answered."""
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[Any]] = []
        for core in cores:
            future: asyncio.Future[Any] = loop.create_future()
            with self._lock:
                token = next(self._tokens)
                self._waiting[token] = (core.rank, loop, future)
            core.send(("profile", token, action, profiler.trace_dir, (limits or ProfileLimits.capped()).to_dict()))
            futures.append(future)
        answers = await asyncio.gather(*futures, return_exceptions=True)
        failed = next((a for a in answers if isinstance(a, BaseException)), None)
        if failed is not None:
            raise failed
        return [str(a) for a in answers]

    def answered(self, token: int, result: Any, refusal: str | None) -> None:
        """A core's ``profiled`` message: the result, or its refusal raised as a UserError."""
        with self._lock:
            waiting = self._waiting.pop(token, None)
        if waiting is not None:
            _, loop, future = waiting
            error = None if refusal is None else UserError(refusal)
            with contextlib.suppress(RuntimeError):  # the loop closed at shutdown
                loop.call_soon_threadsafe(_settle, future, result, error)

    def fail_all(self, error: BaseException) -> None:
        """A core died: no answer is coming; every call still waiting raises ``error``."""
        with self._lock:
            unanswered, self._waiting = list(self._waiting.values()), {}
        for _, loop, future in unanswered:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_settle, future, None, error)


class DataParallelEngine(EngineFront):
    """D engine-core processes behind AsyncEngine's interface (module docstring)."""

    def __init__(self, config: EngineConfig, buses: Sequence[EventBus], views: Sequence[LockedView],
                 max_waiting_requests: int | None = None) -> None:
        self.config = config
        self.bus = buses[0]
        self.max_waiting_requests = max_waiting_requests
        self._buses, self._views = list(buses), list(views)
        self.cores: list[CoreClient] = []
        self._lock = threading.Lock()  # the streams, the waiting set and the balancing counts
        self._streams: dict[str, tuple[CoreClient, RequestStream]] = {}
        self._waiting: set[str] = set()
        self._waiting_lock = self._lock
        self._ready = threading.Event()
        self._closing = False
        self._draining = False
        self._startup_error: BaseException | None = None
        self._error: BaseException | None = None
        self._frontend: ReplicaFrontend | None = None
        self._ids = itertools.count(1)
        self._profiling = CoreProfiling(self._ids, self._lock)  # its tokens and the request ids: one count
        self._log = get_logger("kvscope.serve")

    # ------------------------------------------------------------- lifecycle
    def start(self) -> DataParallelEngine:
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        for rank, (bus, view) in enumerate(zip(self._buses, self._views, strict=True)):
            ours, theirs = context.Pipe(duplex=True)
            beat = Heartbeat(Heartbeat.shared_buffer())  # the core's steps, readable here while it is stuck
            # Not a daemon: a core starts its own tensor-parallel workers; it dies with this
            # process through PR_SET_PDEATHSIG instead (engine/workers.py).
            process = context.Process(target=core_main, name=f"kvscope-dp-rank{rank}",
                                      args=(rank, self.config, theirs, os.getpid(), beat.buffer))
            process.start()
            theirs.close()
            core = CoreClient(rank, process, ours, bus, view, heartbeat=beat)
            self.cores.append(core)
            self._log.info(f"data-parallel rank {rank}: engine core pid {process.pid}")
        # The cores are not daemons: at interpreter exit multiprocessing would wait for them, so
        # an exit that skipped shutdown() (a failure in the caller) stops them first (atexit is LIFO).
        atexit.register(self._stop_cores)
        for core in self.cores:
            core.reader = threading.Thread(target=self._read, args=(core,), name=f"kvscope-dp-reader{core.rank}",
                                           daemon=True)
            core.reader.start()
        return self

    def wait_ready(self, timeout: float | None = None) -> ReplicaFrontend:
        self._await_startup(timeout, "the engine cores")
        assert self._frontend is not None
        return self._frontend

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self._frontend is not None and self._error is None and not self._closing

    @property
    def alive(self) -> bool:
        return self.ready

    def shutdown(self, drain_timeout_s: float = 10.0) -> None:
        """AsyncEngine.shutdown's contract: refuse new requests, let those in flight finish
        for up to ``drain_timeout_s``, abort the rest, stop every core."""
        self.stop_accepting()
        deadline = time.monotonic() + drain_timeout_s
        while self.ready and time.monotonic() < deadline:
            with self._lock:
                if not self._streams and not self._waiting:
                    break
            time.sleep(0.02)
        self._stop_cores()
        with self._lock:
            left, self._streams = list(self._streams.items()), {}
        for rid, (_, stream) in left:
            stream.post(_aborted_output(rid, stream))

    def _stop_cores(self, dead: CoreClient | None = None) -> None:
        """Ask every core to stop, then terminate and kill what is left: no process outlives the server."""
        if self._closing and dead is None and all(not c.process.is_alive() for c in self.cores):
            return  # stopped already (atexit after shutdown)
        self._closing = True
        for core in self.cores:
            if core is not dead:
                core.send(("stop",))
        deadline = time.monotonic() + STOP_WAIT_S
        for core in self.cores:
            core.process.join(max(0.0, deadline - time.monotonic()))
        for core in self.cores:
            if core.process.is_alive():
                core.process.terminate()
                core.process.join(2.0)
            if core.process.is_alive():
                core.process.kill()
                core.process.join(2.0)
        for core in self.cores:
            if core.reader is not None and core.reader is not threading.current_thread():
                core.reader.join(2.0)
            with contextlib.suppress(OSError):
                core.conn.close()

    # -------------------------------------------------------------- requests
    def next_request_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}"

    def pending_on(self, core: CoreClient) -> int:
        """Requests given to ``core`` and not answered in full (the stall detector's "has work")."""
        with self._lock:
            return sum(1 for owner, _ in self._streams.values() if owner is core)

    def choose(self) -> CoreClient:
        """vLLM's rule (module docstring); call with ``self._lock`` held."""
        best = min(self.cores, key=lambda c: (WAITING_WEIGHT * c.waiting + c.running, c.rank))
        best.waiting += 1
        best.routed += 1
        return best

    async def add_request(self, prompt: Sequence[int] | CheckedPrompt, params: SamplingParams, request_id: str,
                          priority: int = 0, arrival_time: float | None = None) -> RequestStream:
        """AsyncEngine.add_request on the least loaded rank. ``arrival_time`` (this process's
        bus clock) travels as an age plus the send time, since each core has its own clock:
        the core's TTFT and e2e count from the HTTP receipt, as one engine's do."""
        self._refuse_unless_accepting(f"the engine is not running{f': {self._error}' if self._error else ''}")
        stream = RequestStream(self, request_id, prompt, params, asyncio.get_running_loop(), priority)
        with self._lock:
            self._count_waiting(request_id)
            core = self.choose()
            self._streams[request_id] = (core, stream)
        age = None if arrival_time is None else max(0.0, self.bus.now() - arrival_time)
        # a checked prompt travels as checked (every rank runs the same model and limits); the
        # send time lets the core count the wait in the pipe too (it reads between steps)
        core.send(("add", request_id, stream.prompt, params, priority, age, time.monotonic()))
        return await self._await_accepted(stream)

    def abort(self, request_id: str, cause: str = ABORT_CLIENT_DISCONNECT) -> None:
        with self._lock:
            self._waiting.discard(request_id)
            entry = self._streams.pop(request_id, None)
        if entry is not None:
            entry[0].send(("abort", request_id, cause))

    def abort_all(self) -> None:
        with self._lock:
            left, self._streams = list(self._streams.items()), {}
        for core in self.cores:
            core.send(("abort_all",))
        for rid, (_, stream) in left:
            stream.post(_aborted_output(rid, stream))

    async def profile(self, profiler: TorchProfiler, action: Literal["start", "stop"],
                      limits: ProfileLimits | None = None) -> list[str]:
        """The torch profiler in every rank's engine core, each within ``limits`` counted on its
        own steps; each answer in rank order (the trace folder, or each core's trace). A rank's
        refusal is raised after every rank answered."""
        if not self.alive:
            raise EngineDead("the engine cores are not running")
        return await self._profiling.ask(self.cores, profiler, action, limits)

    def balance_state(self) -> dict[str, Any]:
        """Each rank's queue as the balancer sees it, and what it was given."""
        with self._lock:
            ranks = [{"rank": c.rank, "pid": c.process.pid, "alive": c.process.is_alive(), "waiting": c.waiting,
                      "running": c.running, "score": WAITING_WEIGHT * c.waiting + c.running,
                      "routed": c.routed, "kv_blocks_used": c.kv_used, "kv_blocks_total": c.kv_total}
                     for c in self.cores]
        return {"size": len(self.cores), "rule": "least 4 x waiting + running (vLLM's DP load balancer)",
                "ranks": ranks}

    # ----------------------------------------------------------- core pipes
    def _read(self, core: CoreClient) -> None:
        """One core's messages until its pipe closes (module docstring of engine/dp_core.py)."""
        try:
            while True:
                message = core.conn.recv()
                kind = message[0]
                if kind == "events":
                    core.publish_rows(message[1], self._lock)
                elif kind == "ready":
                    core.facts = message[1]
                    self._maybe_ready()
                elif kind == "failed":
                    core.failure = (message[1], message[2])
                elif kind == "step":
                    _, events, outputs, accepted = message
                    core.publish_rows(events, self._lock)
                    self._accepted(accepted)
                    self._dispatch(outputs)
                elif kind == "profiled":
                    self._profiling.answered(*message[1:])
        except (EOFError, OSError):
            pass
        self._ended(core)

    def _accepted(self, accepted: list[tuple[str, str | None]]) -> None:
        for request_id, refusal in accepted:
            with self._lock:
                entry = self._streams.get(request_id)
                if entry is not None and refusal is not None:
                    del self._streams[request_id]
            if entry is not None:
                entry[1].post_accepted(None if refusal is None else UserError(refusal))

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            with self._lock:
                entry = self._streams.get(output.request_id)
                if entry is not None and output.finished:
                    del self._streams[output.request_id]
            if entry is None:
                continue
            entry[1].post(RequestFailed(f"the request failed in the engine ({output.error}); other requests "
                                        "are unaffected") if output.error is not None else output)

    def _maybe_ready(self) -> None:
        if all(core.facts is not None for core in self.cores) and not self._ready.is_set():
            self._frontend = ReplicaFrontend(self.config, [core.facts for core in self.cores if core.facts])
            self._log.info(f"data parallelism: {len(self.cores)} engine cores ready, requests to the least loaded "
                           f"({WAITING_WEIGHT} x waiting + running)")
            self._ready.set()

    def _ended(self, core: CoreClient) -> None:
        """A core's pipe closed: at shutdown, nothing to do; otherwise the server stops,
        naming the rank, after every other core is stopped."""
        if self._closing:
            return
        core.process.join(EXIT_WAIT_S)
        when = "during startup" if not self._ready.is_set() else "while serving"
        others = [c.rank for c in self.cores if c is not core]
        error: BaseException
        if core.failure is not None and core.failure[1] and not self._ready.is_set():
            error = UserError(core.failure[0])  # a refusal every rank reaches alike: as a one-rank start says it
        else:
            error = ReplicaError(
                f"data-parallel rank {core.rank} (pid {core.process.pid}) {core.how_it_ended()} {when}. The server "
                f"stops: rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} shut down")
        self._log.error(str(error))
        self._stop_cores(dead=core)
        with self._lock:
            left, self._streams = list(self._streams.items()), {}
        dead = EngineDead(f"the engine stopped: {error}")
        for _, (_, stream) in left:
            stream.post_accepted(dead)  # a request the core took but had not yet acknowledged waits on this
            stream.post(dead)
        self._profiling.fail_all(dead)
        stopped = EngineStopped(error=f"{type(error).__name__}: {error}")
        # What the dead core held ends here (it cannot say so itself): on its bus and in its recording.
        ends = [RequestFinished(request_id=request_id, reason="error", error=stopped.error, dp_rank=core.rank)
                for request_id in core.view.request_ids()]
        for end in ends:
            core.publish(end)
        _append_to_recording(rank_events_path(self.config.events_path, core.rank), ends)
        for each in {id(c.bus): c for c in (core, self.cores[0])}.values():  # the dead rank's bus and rank 0's
            each.publish(EngineStopped(error=stopped.error))
        if self._ready.is_set():
            self._error = error
        else:
            self._startup_error = error
            self._ready.set()


def _append_to_recording(path: str | None, events: list[RequestFinished]) -> None:
    """``events`` appended to a dead core's recording (its process wrote every line whole and
    flushed it; a line cut by the kill is dropped first, so the file stays readable)."""
    if path is None or not events or not os.path.exists(path):
        return
    with contextlib.suppress(OSError), open(path, "rb+") as f:
        end = f.seek(0, os.SEEK_END)
        tail_at = f.seek(max(0, end - (1 << 20)))  # the last MiB holds the last newline (lines are events)
        last_newline = f.read().rfind(b"\n")
        f.truncate(tail_at + last_newline + 1 if last_newline >= 0 else end)
        f.seek(0, os.SEEK_END)
        f.write("".join(event_line(e) + "\n" for e in events).encode("utf-8", "surrogatepass"))


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if not future.done():
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)


def data_parallel_host(config: EngineConfig, settings: ServerSettings, registry: CollectorRegistry | None = None,
                       bus: EventBus | None = None, lifecycle: LockedLifecycle | None = None) -> EngineHost:
    """EngineHost.create for ``--data-parallel-size D`` > 1: a bus, view, lifecycle and
    metrics per rank (``engine`` = the rank); rank 0's bus the one the dashboard and the
    exporters follow, every rank's step and request events on /events."""
    size = config.data_parallel_size or 1
    buses = [bus or EventBus()] + [EventBus() for _ in range(1, size)]
    views = [LockedView() for _ in range(size)]
    metrics = [PrometheusMetrics(registry if rank == 0 and registry is not None else CollectorRegistry(),
                                 settings.served_model_name, engine_index=str(rank), max_model_len=config.max_model_len,
                                 kv_cache_metrics=settings.kv_cache_metrics,
                                 scheduling_policy=config.scheduling_policy, shared_view=views[rank])
               for rank in range(size)]
    hub = EventHub()
    # rank 0's: the one the exporters on its bus may read already
    lifecycles = [lifecycle or LockedLifecycle()] + [LockedLifecycle() for _ in range(1, size)]
    for rank in range(size):
        # rank 0's hub: every event; the others' startup and stats events would read as rank 0's
        subscribe_observers(buses[rank], (metrics[rank], views[rank], lifecycles[rank],
                                          hub if rank == 0 else hub.feed(rank, RANKED_EVENTS)))
    engine = DataParallelEngine(config, buses, views, max_waiting_requests=settings.max_waiting_requests)
    host = EngineHost(settings=settings, bus=buses[0], engine=engine, view=DataParallelView(engine),
                      metrics=DataParallelMetrics(metrics), hub=hub, lifecycle=DataParallelLifecycle(lifecycles),
                      profiler=TorchProfiler(settings.profile_dir or os.getcwd()))
    engine.start()  # last: nothing above may fail with engine cores left running
    host.stall = data_parallel_detector(config, engine).start()
    return host
