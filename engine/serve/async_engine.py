"""The bridge between asyncio handlers and the (not thread-safe) engine.

One engine thread owns the :class:`~engine.llm_engine.LLMEngine`: it builds it
(startup phases A–G), then loops: take commands (add, abort, stop) from a
thread-safe queue, run one step, hand each request's outputs to the asyncio
queue of its :class:`RequestStream` with ``loop.call_soon_threadsafe``. The
HTTP event loop never waits on the engine; the engine never waits on a client.

Overload is bounded: ``max_waiting_requests`` caps the requests accepted but
without a first token yet (queued here or in the scheduler's waiting queue);
beyond it :meth:`AsyncEngine.add_request` raises :class:`Overloaded` at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from prometheus_client import CollectorRegistry

from engine.config import EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.errors import UserError
from engine.events import EngineStopped, EventBus
from engine.events.request_records import ABORT_CLIENT_DISCONNECT, ABORT_SHUTDOWN
from engine.heartbeat import Heartbeat
from engine.llm_engine import CheckedPrompt, LLMEngine, RequestOutput
from engine.logs import log_failure

if TYPE_CHECKING:
    from engine.profiling import ProfileLimits, TorchProfiler

IDLE_WAIT_S = 0.05  # how long an idle engine thread blocks on its command queue


class Overloaded(Exception):
    """Too many requests are waiting (or the server is shutting down)."""


class EngineDead(Exception):
    """The engine thread stopped (a crash or shutdown)."""


class RequestFailed(Exception):
    """This request failed inside the engine (its sampling or detokenising raised);
    the engine goes on with every other request."""


class RequestStream:
    """One request's outputs, delivered on the event loop that submitted it.

    Iterate it with ``async for``; leaving the loop early (client disconnect,
    cancellation) aborts the request in the engine.
    """

    def __init__(self, engine: EngineFront, request_id: str, prompt: Sequence[int] | CheckedPrompt,
                 params: SamplingParams, loop: asyncio.AbstractEventLoop, priority: int = 0,
                 arrival_time: float | None = None) -> None:
        self.engine = engine
        self.request_id = request_id
        self.priority = priority
        self.arrival_time = arrival_time  # the bus clock at the HTTP receipt (None: when the engine takes it)
        # what the engine thread submits: a checked prompt is not checked again there
        self.prompt_ids: list[int] = prompt.token_ids if isinstance(prompt, CheckedPrompt) else list(prompt)
        self.prompt: list[int] | CheckedPrompt = prompt if isinstance(prompt, CheckedPrompt) else self.prompt_ids
        self.params = params
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.accepted: asyncio.Future[None] = loop.create_future()
        self.finished = False
        self.got_first = False

    # ---- engine-thread side: schedule a call on the owning loop
    def post(self, item: RequestOutput | BaseException) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody is listening any more
            self.loop.call_soon_threadsafe(self._deliver, item)

    def post_accepted(self, error: BaseException | None) -> None:
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self._accept, error)

    # ---- loop side
    def _accept(self, error: BaseException | None) -> None:
        if self.accepted.done():
            return
        if error is None:
            self.accepted.set_result(None)
        else:
            self.engine._left_waiting(self)
            self.finished = True
            self.accepted.set_exception(error)

    def _deliver(self, item: RequestOutput | BaseException) -> None:
        if not self.got_first:
            self.got_first = True
            self.engine._left_waiting(self)
        self.queue.put_nowait(item)

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self.outputs()

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """The outputs until the finished one; use under ``contextlib.aclosing``
        so an early exit aborts the request at once rather than at GC time."""
        try:
            while not self.finished:
                item = await self.queue.get()
                if isinstance(item, BaseException):
                    self.finished = True
                    raise item
                if item.finished:
                    self.finished = True
                yield item
        finally:
            if not self.finished:
                self.finished = True
                self.engine.abort(self.request_id)


@dataclass(slots=True)
class _Add:
    stream: RequestStream


@dataclass(slots=True)
class _Abort:
    request_id: str
    cause: str = ABORT_CLIENT_DISCONNECT


@dataclass(slots=True)
class _AbortAll:
    pass


@dataclass(slots=True)
class _Stop:
    pass


@dataclass(slots=True)
class _Call:
    """Run ``fn(engine)`` on the engine thread between steps (the profiler, which must
    start and stop there); its result or exception goes to ``future`` on ``loop``."""

    fn: Callable[[LLMEngine], Any]
    future: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop

    def settle(self, engine: LLMEngine) -> None:
        try:
            result, error = self.fn(engine), None
        except Exception as exc:  # the caller hears it; the engine goes on
            result, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            self.loop.call_soon_threadsafe(_settle_future, self.future, result, error)


def _settle_future(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


class EngineFront:
    """What the routes submit through, shared by :class:`AsyncEngine` (one engine thread) and
    the data-parallel engine (engine/serve/data_parallel.py): the waiting set that
    ``--max-waiting-requests`` bounds, draining, and the request path around a stream.
    A subclass sets ``_waiting_lock`` (the lock that guards ``_waiting``) and supplies
    ``alive``, ``add_request`` and ``abort``."""

    max_waiting_requests: int | None
    _waiting: set[str]  # accepted by add_request, no first token yet
    _waiting_lock: threading.Lock
    _draining: bool
    _ready: threading.Event  # set when startup ended, well or not
    _startup_error: BaseException | None
    _error: BaseException | None

    @property
    def alive(self) -> bool:
        raise NotImplementedError

    @property
    def ready(self) -> bool:
        """Started well and still running (``/health``, the routes' 503 before it)."""
        raise NotImplementedError

    def shutdown(self, drain_timeout_s: float = 10.0) -> None:
        raise NotImplementedError

    def next_request_id(self, prefix: str) -> str:
        raise NotImplementedError

    def abort_all(self) -> None:
        raise NotImplementedError

    @property
    def error(self) -> BaseException | None:
        """What stopped the engine after startup (None while it runs or after a clean stop)."""
        return self._error

    @property
    def draining(self) -> bool:
        return self._draining

    def stop_accepting(self) -> None:
        """New requests get :class:`Overloaded` from now on (graceful shutdown)."""
        self._draining = True

    def num_waiting(self) -> int:
        with self._waiting_lock:
            return len(self._waiting)

    async def add_request(self, prompt: Sequence[int] | CheckedPrompt, params: SamplingParams,
                          request_id: str, priority: int = 0, arrival_time: float | None = None) -> RequestStream:
        raise NotImplementedError

    def abort(self, request_id: str, cause: str = ABORT_CLIENT_DISCONNECT) -> None:
        raise NotImplementedError

    def wait_ready(self, timeout: float | None = None) -> Any:
        """The engine once started (LLMEngine, or the data-parallel front's stand-in): its
        tokenizer and limits."""
        raise NotImplementedError

    async def profile(self, profiler: TorchProfiler, action: Literal["start", "stop"],
                      limits: ProfileLimits | None = None) -> list[str]:
        """``POST /start_profile`` / ``/stop_profile``: ``profiler.start`` (within ``limits``) /
        ``stop`` where the steps run; the trace folder (start) or the traces written (stop), one
        per engine core."""
        raise NotImplementedError

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        stream = await self.add_request(prompt_ids, params, request_id)
        async with contextlib.aclosing(stream.outputs()) as outputs:
            async for output in outputs:
                yield output

    def _await_startup(self, timeout: float | None, what: str) -> None:
        """wait_ready's wait: until startup ended, re-raising its failure; ``what`` names
        the engine in the time-out's message."""
        if not self._ready.wait(timeout):
            raise TimeoutError(f"{what} did not finish startup within {timeout} s")
        if self._startup_error is not None:
            raise self._startup_error

    def _refuse_unless_accepting(self, not_running: str) -> None:
        """add_request's first check: :class:`EngineDead` (with ``not_running``) or, while
        draining, :class:`Overloaded`."""
        if not self.alive:
            raise EngineDead(not_running)
        if self._draining:
            raise Overloaded("the server is shutting down")

    def _count_waiting(self, request_id: str) -> None:
        """Count ``request_id`` as waiting, or raise :class:`Overloaded` at
        ``--max-waiting-requests``; call with ``_waiting_lock`` held."""
        limit = self.max_waiting_requests
        if limit is not None and len(self._waiting) >= limit:
            raise Overloaded(f"{len(self._waiting)} requests are already waiting "
                             f"(--max-waiting-requests {limit}); retry later")
        self._waiting.add(request_id)

    async def _await_accepted(self, stream: RequestStream) -> RequestStream:
        """The stream once the engine accepted it; a cancelled caller aborts the request."""
        try:
            await stream.accepted
        except asyncio.CancelledError:
            self.abort(stream.request_id)
            raise
        return stream

    def _left_waiting(self, stream: RequestStream) -> None:
        with self._waiting_lock:
            self._waiting.discard(stream.request_id)


class AsyncEngine(EngineFront):
    """Owns the engine thread. ``start()`` begins startup; ``wait_ready()``
    blocks until phase G (re-raising a startup failure)."""

    def __init__(self, config: EngineConfig, bus: EventBus, max_waiting_requests: int | None = None,
                 metrics_registry: CollectorRegistry | None = None) -> None:
        self.config = config
        self.bus = bus
        self.metrics_registry = metrics_registry  # the engine's sinks register their own counters there
        self.max_waiting_requests = max_waiting_requests
        self.engine: LLMEngine | None = None
        self._commands: queue.SimpleQueue[_Add | _Abort | _AbortAll | _Stop | _Call] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._waiting: set[str] = set()  # accepted by add_request, no first token yet
        self._waiting_lock = threading.Lock()
        self._ready = threading.Event()
        self._stopped = threading.Event()
        self._startup_error: BaseException | None = None
        self._error: BaseException | None = None
        self._draining = False
        self._thread = threading.Thread(target=self._run, name="kvscope-engine", daemon=True)
        self.heartbeat = Heartbeat()  # the engine's steps, for the stall detector (engine/serve/stall.py)
        self._ids = 0
        self._ids_lock = threading.Lock()

    # ------------------------------------------------------------- lifecycle
    def start(self) -> AsyncEngine:
        self._thread.start()
        return self

    def wait_ready(self, timeout: float | None = None) -> LLMEngine:
        self._await_startup(timeout, "the engine")
        assert self.engine is not None
        return self.engine

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self.engine is not None and not self._stopped.is_set()

    @property
    def alive(self) -> bool:
        return self.ready and self._thread.is_alive()

    def shutdown(self, drain_timeout_s: float = 10.0) -> None:
        """Refuse new requests, let in-flight ones finish for up to
        ``drain_timeout_s``, abort the rest, stop the thread and close the
        engine (which flushes the event log)."""
        self.stop_accepting()
        deadline = time.monotonic() + drain_timeout_s
        while self._thread.is_alive() and self.engine is not None and time.monotonic() < deadline:
            with self._waiting_lock:
                pending = len(self._waiting)
            if pending == 0 and not self.engine.has_unfinished():
                break
            time.sleep(0.02)
        self._commands.put(_Stop())
        self._thread.join(timeout=30)

    # -------------------------------------------------------------- requests
    def next_request_id(self, prefix: str) -> str:
        with self._ids_lock:
            self._ids += 1
            return f"{prefix}-{self._ids}"

    async def add_request(self, prompt: Sequence[int] | CheckedPrompt, params: SamplingParams,
                          request_id: str, priority: int = 0, arrival_time: float | None = None) -> RequestStream:
        """Queue a request (token ids, or a prompt ``LLMEngine.prepare_prompt`` checked);
        returns once the engine accepted it. ``arrival_time`` (the
        bus clock): when the server received it; its TTFT counts from there. Raises
        :class:`Overloaded` (too many waiting / shutting down), :class:`UserError`
        (the engine refused it: the message says why) or :class:`EngineDead`."""
        self._refuse_unless_accepting("the engine is not running")
        stream = RequestStream(self, request_id, prompt, params, asyncio.get_running_loop(), priority,
                               arrival_time)
        with self._waiting_lock:
            self._count_waiting(request_id)
        self._commands.put(_Add(stream))
        return await self._await_accepted(stream)

    def abort(self, request_id: str, cause: str = ABORT_CLIENT_DISCONNECT) -> None:
        """Abort a request (the engine thread frees its blocks at the next step boundary);
        ``cause`` goes on its ``request.finished`` event (a stream left early: the client's).
        A request abandoned before its first token leaves the waiting count here: left
        in it, a few client time-outs would hold ``--max-waiting-requests`` shut for good."""
        with self._waiting_lock:
            self._waiting.discard(request_id)
        self._commands.put(_Abort(request_id, cause))

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """``fn(engine)``'s result, run on the engine thread between two steps."""
        if not self.alive:
            raise EngineDead("the engine is not running")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._commands.put(_Call(fn, future, loop))
        return await future

    def abort_all(self) -> None:
        """Abort every request in the engine; each stream ends with finish_reason "abort"."""
        self._commands.put(_AbortAll())

    async def profile(self, profiler: TorchProfiler, action: Literal["start", "stop"],
                      limits: ProfileLimits | None = None) -> list[str]:
        """The profiler on the engine thread, which runs the steps (and tells it each one)."""
        if action == "stop":
            return [await self.call(profiler.stop)]
        return [await self.call(lambda engine: profiler.start(engine, limits))]

    # ---------------------------------------------------------- engine thread
    def _run(self) -> None:
        try:
            self.engine = LLMEngine(self.config, bus=self.bus, metrics_registry=self.metrics_registry,
                                    heartbeat=self.heartbeat)
        except BaseException as exc:  # re-raised by wait_ready in the caller's thread
            self._startup_error = exc
            self._stopped.set()
            self._ready.set()
            return
        self._ready.set()
        engine = self.engine
        try:
            self._loop(engine)
        except BaseException as exc:
            self._error = exc
            for stream in list(self._streams.values()):
                stream.post(EngineDead(f"the engine stopped: {exc}"))
            with contextlib.suppress(Exception):  # each request still in it finishes, reason error
                engine.fail_unfinished(f"the engine stopped: {type(exc).__name__}: {exc}")
            # the recording, the dashboard and the metrics hear why (before close() ends the recording)
            self.bus.publish(EngineStopped(error=f"{type(exc).__name__}: {exc}"))
            raise
        finally:
            self._stopped.set()
            engine.close()

    def _loop(self, engine: LLMEngine) -> None:
        flush_step = False  # aborts freed blocks: publish one step so the event stream shows it
        while True:
            engine.heartbeat.idle()  # a turn of the loop: alive between steps
            idle = not engine.has_unfinished()
            try:
                command = self._commands.get(timeout=IDLE_WAIT_S) if idle and not flush_step else \
                    self._commands.get_nowait()
            except queue.Empty:
                command = None
            while command is not None:
                if isinstance(command, _Stop):
                    self._abort_all(engine)
                    if flush_step or engine.has_unfinished():
                        engine.step()
                    return
                flush_step |= self._handle(engine, command)
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = None
            if engine.has_unfinished() or flush_step:
                flush_step = False
                self._dispatch(engine.step())

    def _handle(self, engine: LLMEngine, command: _Add | _Abort | _AbortAll | _Call) -> bool:
        """Apply one command; True when it freed blocks without a step."""
        if isinstance(command, _Call):
            command.settle(engine)
            return False
        if isinstance(command, _AbortAll):
            self._abort_all(engine)
            return True
        if isinstance(command, _Add):
            stream = command.stream
            try:
                engine.add_request(stream.prompt, stream.params, request_id=stream.request_id,
                                   priority=stream.priority, arrival_time=stream.arrival_time)
            except UserError as exc:
                stream.post_accepted(exc)
                return False
            except Exception as exc:  # a bug this request's input reached: it fails, the engine goes on
                log_failure("kvscope.engine", f"adding request {stream.request_id} failed; the engine goes on")
                stream.post_accepted(RequestFailed(f"the request could not be added: {type(exc).__name__}: {exc}"))
                return False
            self._streams[stream.request_id] = stream
            stream.post_accepted(None)
            return False
        self._streams.pop(command.request_id, None)
        return engine.abort(command.request_id, command.cause)

    def _abort_all(self, engine: LLMEngine) -> None:
        for rid, stream in list(self._streams.items()):
            engine.abort(rid, ABORT_SHUTDOWN)
            stream.post(_aborted_output(rid, stream))
        self._streams.clear()

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
            stream.post(RequestFailed(f"the request failed in the engine ({output.error}); other requests "
                                      "are unaffected") if output.error is not None else output)


def _aborted_output(request_id: str, stream: RequestStream) -> RequestOutput:
    """The last output of a request the shutdown aborted: no new tokens."""
    return RequestOutput(request_id=request_id, prompt_token_ids=stream.prompt_ids, new_token_ids=[],
                         delta_text="", token_ids=[], text="", finished=True, finish_reason="abort")
