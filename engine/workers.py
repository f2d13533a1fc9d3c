"""The worker processes of one replica (``--distributed-executor-backend mp``): the
tensor-parallel ranks, or this host's pipeline stages.

``--tensor-parallel-size N`` starts N-1 workers with ``torch.multiprocessing``'s spawn
context; the engine's own process is rank 0, which runs the scheduler, samples and
publishes every event. Each worker runs startup phases A–G itself
(:func:`engine.startup.phases.start_engine` with its :class:`~engine.model.parallel.RankLayout`),
then serves steps until rank 0 says stop. ``--pipeline-parallel-size P`` starts this
host's stages the same way, each with its :class:`~engine.pipeline.StageLayout` (host 0
holds stage 0 in the engine's process; a host beyond 0 runs its stages headless,
:meth:`WorkerGroup.run_headless`), and a stage serves its part of each step
(:func:`engine.pipeline.serve_stage`).

Control plane: each step's batch (the scheduler's :class:`~engine.model.runner.ScheduledSeq`
list: token ids, positions, block ids, which are the same on every rank) is broadcast
from rank 0 over the replica's own torch.distributed group. Chosen over a queue because
it is the transport the layers' all-reduces already use: one channel, the step's inputs
ordered with its collectives by construction, and a dead peer surfaces as an error in
the same call instead of as a second channel's timeout. The payload is a pickle of a
few hundred bytes per sequence; its time is part of the step's forward time.

Events: a worker's ``startup.phase`` events (each with its ``rank``) travel to rank 0
over a multiprocessing queue and are published on rank 0's bus right after rank 0's
own phase ends, so the recording, /metrics and the monitor see every rank's startup.

Failure: a rank that dies or fails makes rank 0's next collective fail (gloo reports a
closed peer at once); rank 0 then names the rank, how it ended and its last phase, stops
the other workers (terminate, then kill) and raises :class:`~engine.errors.ReplicaError`.
Workers die with rank 0 too (``PR_SET_PDEATHSIG`` on Linux, and a failed broadcast
anywhere else), so no process outlives its replica.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import queue
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig
from engine.errors import ReplicaError, UserError
from engine.events import PHASES, EventBus, LogEvent, StartupPhase
from engine.events.schema import event_from_dict

# How long rank 0 waits, once a collective failed, for the culprit to show itself
# (its exit, or its own failure message) before naming the ranks it cannot reach.
FAILURE_WAIT_S = 5.0
# How long a worker gets to leave by itself after rank 0 says stop, before terminate/kill.
SHUTDOWN_WAIT_S = 5.0


@dataclass(slots=True)
class RankState:
    """What rank 0 knows of one worker: its process and the last phase event it sent."""

    rank: int
    process: Any  # multiprocessing's SpawnProcess
    label: str = ""  # how a failure names it: "tensor-parallel rank 1", "pipeline stage 1 (host 0, layers 15-29)"
    phase: str | None = None
    phase_status: str | None = None
    failure: str | None = None  # the worker's own account, when it could send one
    ready: bool = False

    def last_phase(self) -> str:
        if self.phase is None:
            return "none (it died before phase A began)"
        words = f"{self.phase} ({PHASES[self.phase]}) {self.phase_status}"
        return words + ", then serving steps" if self.phase == "G" and self.phase_status == "end" else words

    def how_it_ended(self) -> str | None:
        code = self.process.exitcode
        if self.failure is not None:
            return f"failed: {self.failure}"
        if code is None:
            return None
        if code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with code {code}"


class WorkerGroup:
    """Rank 0's side of a replica: starts the workers, relays their events, sends each
    step, explains a failure, and stops every worker on close."""

    def __init__(self, config: EngineConfig, rendezvous: Any = None) -> None:
        """The workers of ``config``'s tensor-parallel replica, or under
        ``--pipeline-parallel-size`` the stages of this host (``rendezvous``: where the
        stages meet; by default :meth:`engine.pipeline.Rendezvous.of` the flags)."""
        import torch.multiprocessing as mp

        from engine.model.parallel import RankLayout, free_init_method

        context = mp.get_context("spawn")
        self._messages = context.Queue()
        self.driver_layout: RankLayout | None = None  # rank 0's, under tensor parallelism
        self.driver_stage: Any = None  # rank 0's StageLayout on host 0, under pipeline parallelism
        self.rendezvous: Any = None
        layouts: list[tuple[Any, str, str]] = []  # (layout, process name, how a failure names it)
        if (config.pipeline_parallel_size or 1) > 1:
            from engine.modelspec.readers import load_model_config
            from engine.pipeline import Rendezvous, StageLayout

            stages, tp = config.pipeline_parallel_size or 1, config.tensor_parallel_size
            self.rendezvous = rendezvous or Rendezvous.of(config)
            num_layers = load_model_config(config.model).num_layers
            for stage in self.rendezvous.stages_of(self.rendezvous.node_rank, stages):
                for rank in range(stage * tp, (stage + 1) * tp):  # vLLM's rank = pp_rank x T + tp_rank
                    layout = StageLayout(rank, stages, self.rendezvous, tp)
                    if rank == 0:
                        self.driver_stage = dataclasses.replace(layout, watch=self.ended_before_ready)
                        continue
                    layouts.append((layout, f"kvscope-pp-rank{rank}", layout.describe(num_layers)))
        else:
            size = config.tensor_parallel_size
            init_method = free_init_method()
            self.driver_layout = RankLayout(0, size, init_method)
            layouts = [(RankLayout(rank, size, init_method), f"kvscope-tp-rank{rank}", f"tensor-parallel rank {rank}")
                       for rank in range(1, size)]
        self.ranks = [RankState(layout.rank, context.Process(target=worker_main, name=name, daemon=True,
                                                             args=(layout, config, self._messages, os.getpid())),
                                label)
                      for layout, name, label in layouts]
        for state in self.ranks:
            state.process.start()
        self.parallel: Any = None  # rank 0's TensorParallel, set once startup has joined the group
        self._bus: EventBus | None = None
        self._closed = False
        self.steps_sent = 0

    # ------------------------------------------------------------------ events
    def relay_to(self, bus: EventBus) -> None:
        """Publish the workers' phase events on ``bus`` after each of rank 0's own phases ends."""
        self._bus = bus

        def after_own_phase(event: Any) -> None:
            if isinstance(event, StartupPhase) and event.rank == 0 and event.status != "begin":
                self.drain()

        bus.subscribe(after_own_phase)

    def drain(self, timeout: float = 0.0) -> bool:
        """Handle the messages waiting (or the first within ``timeout`` seconds); True if any came."""
        got = False
        while True:
            try:
                message = self._messages.get(timeout=timeout) if timeout and not got else self._messages.get_nowait()
            except (queue.Empty, OSError, EOFError):
                return got
            got = True
            self._handle(message)

    def _handle(self, message: tuple[Any, ...]) -> None:
        kind, rank = message[0], message[1]
        state = next(s for s in self.ranks if s.rank == rank)
        if kind == "event":
            event = event_from_dict(message[2])
            if isinstance(event, StartupPhase):
                state.phase, state.phase_status = event.phase, event.status
            if self._bus is not None:
                self._bus.publish(event)
        elif kind == "ready":
            state.ready = True
        elif kind == "failed":
            state.failure = message[2]

    def ended_before_ready(self) -> ReplicaError | None:
        """The error naming a worker that ended during startup, or None (rank 0 polls it
        while it waits for the pipeline's ranks to arrive)."""
        self.drain()
        for state in self.ranks:
            if not state.ready and state.how_it_ended() is not None:
                return self._error(state, "during startup")
        return None

    def wait_ready(self) -> None:
        """Block until every worker finished phase G; raise ReplicaError if one ends first."""
        while not all(state.ready for state in self.ranks):
            self.drain(timeout=0.2)
            for state in self.ranks:
                if not state.ready and not state.process.is_alive():
                    self.drain()
                    raise self._error(state, "during startup")

    # ------------------------------------------------------------------- steps
    def execute(self, runner: Any, batch: Sequence[Any]) -> tuple[dict[str, int], dict[str, Any]]:
        """One step on every rank: broadcast the batch, run rank 0's slice (its collectives
        meet the workers'), return the sampled tokens and what the collectives cost. Under
        pipeline parallelism ``runner`` (engine/pipeline.py's PipelineRunner) broadcasts the
        batch itself, and the step's fields are each stage's bubble and bytes."""
        parallel, pipelined = self.parallel, self.rendezvous is not None
        if parallel is not None:
            parallel.take_stats()
        try:
            if parallel is not None and not pipelined:
                parallel.broadcast_from_driver(list(batch))
            sampled = runner.execute(batch)
        except RuntimeError as exc:  # gloo/NCCL: a peer closed its connection or timed out
            raise self.failure(exc) from exc
        self.steps_sent += 1
        fields = runner.step_fields() if pipelined else {}
        if parallel is not None:  # rank 0's own stage's collectives under T x P
            stats = parallel.take_stats()
            fields.update(collective_s=stats.seconds, collective_bytes=stats.bytes, collective_calls=stats.calls)
        return sampled, fields

    # ----------------------------------------------------------------- failure
    def failure(self, exc: BaseException) -> BaseException:
        """The error to raise after rank 0's own work failed with ``exc``: rank 0's own
        refusal (a UserError every rank reaches alike) as it is; a failed collective as a
        ReplicaError naming the rank that ended, how, and its last phase."""
        if isinstance(exc, UserError):
            return exc
        deadline = time.monotonic() + FAILURE_WAIT_S
        elsewhere = self._ended_elsewhere()
        remote: list[str] = []
        while True:
            self.drain(timeout=0.1)
            ended = [s for s in self.ranks if s.how_it_ended() is not None]
            remote = elsewhere.read() if elsewhere is not None and not ended else []
            if ended or remote or time.monotonic() > deadline:
                break
        # The culprit first: a rank that failed on its own, then one that vanished without a
        # word, before ranks whose collectives merely failed because of it.
        ended.sort(key=lambda s: 0 if s.failure and not s.failure.startswith("RuntimeError")
                   else 1 if s.failure is None else 2)
        when = f"during step {self.steps_sent + 1}" if all(s.ready for s in self.ranks) else "during startup"
        if not ended and remote:
            who, _, phase = remote[0].partition("\n")
            error = ReplicaError(f"{who} {when}; its last phase: {phase}. The replica is stopped")
        elif not ended and self.rendezvous is not None:
            maybe = (f"; a stage on another host (hosts 1..{self.rendezvous.nnodes - 1}) may have stopped"
                     if self.rendezvous.nnodes > 1 else "")
            error = ReplicaError(f"pipeline stage exchange failed {when} with every stage on this host still running"
                                 f"{maybe} ({type(exc).__name__}: {exc}); the replica is stopped")
        elif not ended:
            error = ReplicaError(f"tensor-parallel collective failed {when} with every worker still running "
                                 f"({type(exc).__name__}: {exc}); the replica is stopped")
        else:
            error = self._error(ended[0], when)
        if self._bus is not None:  # the recording and the monitor say why the replica stopped
            self._bus.publish(LogEvent(level="error", message=str(error),
                                       data={"rank": ended[0].rank if ended else None}))
        return error

    def _ended_elsewhere(self) -> Any:
        """Under pipeline parallelism over hosts, the reader of the other hosts' reports."""
        if self.rendezvous is None or self.rendezvous.nnodes == 1 or self.driver_stage is None:
            return None
        from engine.pipeline import EndedElsewhere

        stage = self.driver_stage
        return EndedElsewhere(self.rendezvous, stage.stages, stage.tensor_parallel_size)

    def _error(self, state: RankState, when: str) -> ReplicaError:
        others = [s.rank for s in self.ranks if s is not state]
        return ReplicaError(
            f"{state.label} (pid {state.process.pid}) {state.how_it_ended()} {when}; its last "
            f"phase: {state.last_phase()}. The replica is stopped: rank 0"
            + (f" and rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))}" if others else "")
            + " shut down")

    # ------------------------------------------------------------------- close
    def close(self) -> None:
        """Stop every worker: ask (a None batch) when the group is healthy, then terminate
        and kill what is left, so no process outlives the replica."""
        if self._closed:
            return
        self._closed = True
        import torch.distributed as dist

        # rank 0 has joined the group (phase A) and every worker serves steps: ask them to stop
        healthy = dist.is_initialized() and all(s.ready and s.process.is_alive() for s in self.ranks)
        if healthy:
            with contextlib.suppress(RuntimeError):
                dist.broadcast_object_list([None], src=0)  # the control plane's stop (a None batch)
        deadline = time.monotonic() + (SHUTDOWN_WAIT_S if healthy else 0.0)
        for state in self.ranks:
            state.process.join(max(0.0, deadline - time.monotonic()))
        for state in self.ranks:
            if state.process.is_alive():
                state.process.terminate()
                state.process.join(2.0)
            if state.process.is_alive():
                state.process.kill()
                state.process.join(2.0)
        if dist.is_initialized():  # also when startup failed before self.parallel was set
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        with contextlib.suppress(Exception):
            self.drain()
        self._messages.close()

    def pids(self) -> list[int]:
        return [s.process.pid for s in self.ranks]

    def run_headless(self) -> int:
        """A host beyond 0: let its stages run until host 0 stops them (their phase events
        are read and dropped: host 0's recording has its own stages'; each stage logs its
        phases here). 0 when every stage ended cleanly, else 1."""
        from engine.pipeline import report_ended

        reported: set[int] = set()
        while any(s.process.is_alive() for s in self.ranks):
            self.drain(timeout=0.5)
            for state in self.ranks:  # one that ended badly: rank 0 names it from the store's word
                if state.rank not in reported and state.process.exitcode not in (None, 0):
                    reported.add(state.rank)
                    report_ended(self.rendezvous, state.rank, f"{state.label} (pid {state.process.pid}) "
                                 f"{state.how_it_ended()}\n{state.last_phase()}")
        self.drain()
        return 0 if all(s.process.exitcode == 0 for s in self.ranks) else 1


def _die_with_parent(parent_pid: int) -> None:
    """Linux: the kernel sends this process SIGKILL when rank 0's process ends. Rank 0 may
    have ended already, while this process was still importing (seconds on a busy
    machine): then no signal will come, so leave now."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:
        os._exit(1)


def worker_main(layout: Any, config: EngineConfig, messages: Any, parent_pid: int) -> None:
    """A worker: phases A–G on its rank (events to rank 0), then steps until told to stop.
    ``layout``: a tensor-parallel RankLayout, or a pipeline StageLayout."""
    _die_with_parent(parent_pid)
    from engine.logs import configure_logging
    from engine.stacks import register_stack_signal

    configure_logging(level="warning")  # rank 0 logs the replica; a worker's events carry its numbers
    stacks = register_stack_signal()  # the stall detector's dump asks every rank for its stacks
    from engine.model.parallel import RankLayout
    from engine.startup.phases import start_engine

    bus = EventBus()
    bus.subscribe(lambda e: messages.put(("event", layout.rank, e.to_dict())) if isinstance(e, StartupPhase) else None)
    code = 0
    try:
        if not isinstance(layout, RankLayout):  # a pipeline stage: rank 0's flags, then its phases and steps
            from engine.pipeline import Stage, relay_remote_phases, serve_stage

            phases: list[dict[str, Any]] = []  # for rank 0 when this host is not its own
            bus.subscribe(lambda e: phases.append(e.to_dict()) if isinstance(e, StartupPhase) else None)
            config = layout.join()
            result = start_engine(config, bus, stage=layout)
            messages.put(("ready", layout.rank))
            relay_remote_phases(layout, phases)
            serve_stage(Stage.of(result.runner, layout, result.model_config.num_layers))
        else:
            result = start_engine(config, bus, rank=layout)
            messages.put(("ready", layout.rank))
            runner, parallel = result.runner, result.parallel
            assert parallel is not None  # a tensor-parallel rank's start joined its group
            while (batch := parallel.broadcast_from_driver()) is not None:
                runner.execute(batch)
        # No destroy_process_group: it would wait on rank 0, which is joining this process.
    except BaseException as exc:
        messages.put(("failed", layout.rank, str(exc) if isinstance(exc, UserError) else f"{type(exc).__name__}: {exc}"))
        code = 1
    finally:
        messages.close()
        messages.join_thread()  # every message is in the pipe before the process ends
        stacks.unlink(missing_ok=True)
    # os._exit, not sys.exit: the interpreter's teardown of the gloo group waits seconds on
    # peers that are leaving too; nothing is left to flush.
    os._exit(code)


def run_node(config: EngineConfig) -> int:
    """A host other than 0 (``--node-rank n``): run its pipeline stages until host 0 stops
    them. Exit status 0 when every stage ended cleanly, else 1."""
    from engine.pipeline import Rendezvous

    stages = config.pipeline_parallel_size or 1
    rendezvous = Rendezvous.of(config)
    if stages == 1:
        raise UserError(f"--node-rank {rendezvous.node_rank}: hosts beyond 0 run pipeline stages; give "
                        "--pipeline-parallel-size (a multiple of --nnodes)")
    group = WorkerGroup(config, rendezvous)
    try:
        return group.run_headless()
    finally:
        group.close()
