"""One data-parallel rank's engine core, in a process of its own (``--data-parallel-size D``).

vLLM's layout: the API server process holds the HTTP front end and a client per engine
core; each core is a process with its own scheduler, KV pool and model (and, under
``--tensor-parallel-size``, its own tensor-parallel workers: engine/workers.py). Here a
core is :func:`core_main`, started with multiprocessing's spawn context by
:class:`engine.serve.data_parallel.DataParallelEngine`, and a duplex ``Pipe`` joins the two.

Commands (server → core): ``("add", request_id, prompt_ids, params, priority, age, sent)``
(``age``: seconds since the server received it when it sent the command, or None; ``sent``:
the server's ``time.monotonic()`` then, so the time the command waited in the pipe while
the core ran a step counts too),
``("abort", request_id)``, ``("abort_all",)``, ``("stop",)``, ``("profile", token, "start" or
"stop", trace_dir, limits)`` (``POST /start_profile`` / ``/stop_profile``: the torch profiler in this
core's process, around its steps).

Messages (core → server):

* ``("events", [event dict, ...])``: during startup each event as it happens (the
  server's dashboard and /metrics see every rank's phases live);
* ``("ready", CoreFacts)`` after phase G; ``("failed", message, is_user_error)`` when
  startup or a step raised (the process then exits 1);
* ``("step", [event dict, ...], [RequestOutput, ...], [(request_id, refusal or None), ...])``
  after each loop turn that did something: the step's events (a ``step`` event carries
  the scheduler's waiting and running counts, which the server balances on), the
  outputs, and which adds were accepted;
* ``("profiled", token, result, refusal or None)``: a profile command's answer (the trace
  folder or the trace written).

Every step and request event is stamped with the core's ``dp_rank`` before any sink
sees it (the first subscriber), so the core's own recording (``--events run.jsonl``
becomes ``run.dp1.jsonl`` on rank 1) and the server's folds agree. KV cache events
publish on the endpoint's port + rank with ``data_parallel_rank`` in each batch, as
vLLM's ``ZmqEventPublisher.offset_endpoint_port`` does; with port 0 each rank binds a port
the OS picks and the ready message carries its config as bound (``/kv_event_sources``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.errors import UserError
from engine.events import (
    EventBus,
    RequestArrived,
    RequestFinished,
    RequestFirstToken,
    RequestPreempted,
    RequestRejected,
    RequestScheduled,
    StepEvent,
)
from engine.events.request_records import ABORT_SHUTDOWN

IDLE_POLL_S = 0.05  # how long an idle core waits on its pipe for the next command
# The events that say which rank's scheduler they come from.
RANKED_EVENTS = (StepEvent, RequestArrived, RequestScheduled, RequestFirstToken, RequestPreempted,
                 RequestFinished, RequestRejected)


@dataclass(frozen=True, slots=True)
class CoreFacts:
    """What the API server needs from a ready core to tokenise and check requests itself
    (every rank runs the same model and flags): the tokenizer and the resolved limits."""

    pid: int
    tokenizer: Any
    scheduler_config: Any  # engine.core.scheduler.SchedulerConfig
    model_config: Any  # engine.modelspec.config.ModelConfig
    num_blocks: int
    config: EngineConfig | None = None  # the flags this core resolved (/server_info's effective values)
    plan: Any = None  # its engine.budget.memory.MemoryPlan (/v1/server/kv-cache)
    kv_events: dict[str, Any] | None = None  # its KVEventsConfig as bound (/kv_event_sources); None: no publisher


def offset_endpoint(endpoint: str | None, rank: int) -> str | None:
    """vLLM's rule for rank ``rank``'s KV events address: a TCP port + rank (port 0 and a
    wildcard port stay as they are: each rank binds a port the OS picks and reports it),
    an ipc/inproc name + ``_dp{rank}``."""
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith(("inproc://", "ipc://")):
        return f"{endpoint}_dp{rank}"
    base, _, port = endpoint.rpartition(":")
    if not port.isdigit() or int(port) == 0:
        return endpoint
    if int(port) + rank > 65535:
        raise UserError(f"--kv-events-config: endpoint {endpoint!r} + data-parallel rank {rank} is past port 65535; "
                        "give a lower port")
    return f"{base}:{int(port) + rank}"


def transit_s(sent_monotonic: float) -> float:
    """Seconds since the server sent a command at ``sent_monotonic`` (its ``time.monotonic()``:
    CLOCK_MONOTONIC is one clock for every process of the host)."""
    return max(0.0, time.monotonic() - sent_monotonic)


def rank_events_path(path: str | None, rank: int) -> str | None:
    """``run.jsonl`` → ``run.dp1.jsonl``: each core records its own events."""
    if path is None:
        return None
    p = Path(path)
    suffixes = "".join(p.suffixes)
    stem = p.name[: len(p.name) - len(suffixes)] if suffixes else p.name
    return str(p.with_name(f"{stem}.dp{rank}{suffixes}"))


def core_config(config: EngineConfig, rank: int) -> EngineConfig:
    """Rank ``rank``'s own flags: its rank, its recording, its KV events addresses, and its
    share of the CPU cores (D cores of T ranks each would otherwise each start an all-core
    thread pool)."""
    size = config.data_parallel_size or 1
    threads = config.num_threads or max(1, (os.cpu_count() or 1) // (size * config.tensor_parallel_size))
    kv_events = config.kv_events_config
    if kv_events is not None:
        kv_events = dataclasses.replace(kv_events, endpoint=offset_endpoint(kv_events.endpoint, rank),
                                        replay_endpoint=offset_endpoint(kv_events.replay_endpoint, rank))
    return dataclasses.replace(config, data_parallel_rank=rank, events_path=rank_events_path(config.events_path, rank),
                               num_threads=threads, kv_events_config=kv_events)


class _Forwarder:
    """The core's bus subscribers: stamps ``dp_rank`` (subscribed first) and keeps every
    event's dict for the server, sent at once during startup and with each step after."""

    def __init__(self, rank: int, conn: Any) -> None:
        self.rank = rank
        self.conn = conn
        self.pending: list[dict[str, Any]] = []
        self.live = True  # startup: each event goes at once

    def stamp(self, event: Any) -> None:
        if isinstance(event, RANKED_EVENTS):
            event.dp_rank = self.rank

    def keep(self, event: Any) -> None:
        if self.live:
            self.conn.send(("events", [event.to_dict()]))
        else:
            self.pending.append(event.to_dict())

    def take(self) -> list[dict[str, Any]]:
        taken, self.pending = self.pending, []
        return taken


def core_main(rank: int, config: EngineConfig, conn: Any, parent_pid: int, heartbeat: Any = None) -> None:
    """The process of data-parallel rank ``rank``: startup, then commands and steps until stopped.
    ``heartbeat``: the shared buffer of its step heartbeat (engine/heartbeat.py), which the server reads."""
    from engine.workers import _die_with_parent

    _die_with_parent(parent_pid)
    from engine.logs import configure_logging

    configure_logging()
    code = 0
    from engine.stacks import register_stack_signal

    stacks = register_stack_signal()  # the server's stall detector asks for every thread's stack
    try:
        _serve(rank, config, conn, heartbeat)
    except BaseException as exc:
        code = 1
        with contextlib.suppress(OSError):  # the server has gone: nobody to tell
            conn.send(("failed", str(exc) if isinstance(exc, UserError) else f"{type(exc).__name__}: {exc}",
                       isinstance(exc, UserError)))
    finally:
        conn.close()
        stacks.unlink(missing_ok=True)
    os._exit(code)  # as engine/workers.py: no interpreter teardown waiting on gloo peers


def _serve(rank: int, config: EngineConfig, conn: Any, heartbeat: Any = None) -> None:
    from engine.heartbeat import Heartbeat
    from engine.llm_engine import LLMEngine

    bus = EventBus()
    forwarder = _Forwarder(rank, conn)
    bus.subscribe(forwarder.stamp)  # first: every later subscriber sees the rank
    bus.subscribe(forwarder.keep)
    engine = LLMEngine(core_config(config, rank), bus=bus,
                       heartbeat=Heartbeat(heartbeat) if heartbeat is not None else None)
    try:
        startup = engine.startup
        sources = engine.kv_event_sources()
        conn.send(("ready", CoreFacts(os.getpid(), engine.tokenizer, startup.scheduler_config, startup.model_config,
                                      startup.plan.num_blocks, startup.config, startup.plan,
                                      sources.get(str(rank)))))
        forwarder.live = False
        _loop(engine, conn, forwarder)
    finally:
        engine.close()


def _profile(profiler: Any, engine: Any, rank: int, command: tuple[Any, ...]) -> tuple[Any, tuple[Any, ...]]:
    """A profile command run here: (the profiler, made at the first, and the answer to send).
    A start carries its limits (``ProfileLimits.to_dict``); this core's steps count them."""
    from engine.profiling import ProfileLimits, TorchProfiler

    _, token, action, trace_dir, *limits = command
    profiler = profiler or TorchProfiler(trace_dir, label=f"dp{rank}")
    try:
        result = (profiler.start(engine, ProfileLimits.from_dict(limits[0] if limits else None))
                  if action == "start" else profiler.stop())
        return profiler, ("profiled", token, result, None)
    except UserError as exc:
        return profiler, ("profiled", token, None, f"data-parallel rank {rank}: {exc}")


def _loop(engine: Any, conn: Any, forwarder: _Forwarder) -> None:
    """AsyncEngine's loop (engine/serve/async_engine.py) with a pipe for its queue."""
    flush_step = False  # an abort freed blocks: publish one step so the events show it
    profiler = None  # the torch profiler, made at the first profile command
    while True:
        engine.heartbeat.idle()  # a turn of the loop: alive between steps
        busy = engine.has_unfinished() or flush_step
        accepted: list[tuple[str, str | None]] = []
        stop = False
        if conn.poll(0 if busy else IDLE_POLL_S):
            while conn.poll(0):
                command = conn.recv()
                kind = command[0]
                if kind == "stop":
                    stop = True
                    break
                if kind == "add":
                    _, request_id, prompt, params, priority, age, sent = command  # prompt: checked by the server
                    # the server's receipt, as an age when sent plus the time in the pipe since
                    # (time.monotonic is the host's one clock; this core's bus has its own zero)
                    arrival = {} if age is None else {"arrival_time": engine.now() - age - transit_s(sent)}
                    try:
                        engine.add_request(prompt, params, request_id=request_id, priority=priority, **arrival)
                        accepted.append((request_id, None))
                    except UserError as exc:
                        accepted.append((request_id, str(exc)))
                elif kind == "abort":  # ("abort", id, cause)
                    flush_step |= engine.abort(*command[1:])
                elif kind == "abort_all":  # the server's shutdown timer
                    for request_id in list(engine.scheduler.requests):
                        flush_step |= engine.abort(request_id, ABORT_SHUTDOWN)
                elif kind == "note":  # ("note", event dict): the server's stall detector's verdict on this core,
                    from engine.events import event_from_dict  # recorded here (this core's recording)

                    engine.bus.publish(event_from_dict(command[1]))
                elif kind == "profile":
                    profiler, answer = _profile(profiler, engine, forwarder.rank, command)
                    conn.send(answer)
        if accepted:  # the arrivals and acceptances go before a step that may be long, or this core's last
            conn.send(("step", forwarder.take(), [], accepted))
            accepted = []
        if stop:
            for request_id in list(engine.scheduler.requests):
                engine.abort(request_id, ABORT_SHUTDOWN)
            outputs = engine.step() if engine.has_unfinished() or flush_step else []
            conn.send(("step", forwarder.take(), outputs, accepted))
            return
        outputs = []
        if engine.has_unfinished() or flush_step:
            flush_step = False
            outputs = engine.step()
        events = forwarder.take()
        if events or outputs or accepted:
            conn.send(("step", events, outputs, accepted))
