"""A run's events as a Chrome / Perfetto trace (Trace Event Format JSON).

:class:`PerfettoTrace` is an event subscriber like the JSONL sink: it folds the
events it sees into trace records and :meth:`~PerfettoTrace.write` saves them as a
file that opens in ui.perfetto.dev and chrome://tracing. ``engine replay run.jsonl
--trace-out trace.json`` folds a recording the same way. Timestamps are the bus
clock's seconds (since engine start; simulated seconds for ``engine simulate``) in
microseconds, as the format wants.

Tracks (pid/tid and their names as ``M`` metadata records, so the UI shows words):

- process "kvscope engine": thread "startup phases" (one ``X`` slice per phase
  A–G, with vLLM's span name, status and memory), thread "steps" (one ``X`` slice
  per step, named by its mix: prefill, decode or mixed; token counts, running,
  waiting and KV blocks as args), and counter tracks (``C``): KV cache usage %,
  running, waiting, prefill tokens, decode tokens, preemptions (running total);
- process "requests": one thread per request, in arrival order: ``preprocess``
  from the server's receipt to the scheduler (when it was received earlier), ``queued`` until
  its first step, a ``prefill`` slice per chunk, one ``decode`` slice over its
  consecutive decode steps, ``preempted`` / ``first token`` / ``finished`` instants
  (``i``), ``queued (preempted)`` until it runs again;
- flow arrows (``s`` / ``f``, category ``step``): from each request's slice to every
  step that served it (a prefill chunk or a decode token), so selecting a request's
  slice in the UI follows it to the steps and selecting a step lists its requests.

Only complete slices (``X``) are written, so there is no begin/end pairing to get
wrong; each track's records are in time order. The records stay in memory until the
file is written (roughly 100-200 bytes per step and per request slice): meant for a
run of bounded length (a workload, a replay, a serve session under test), not for a
server left up for days.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.events.folds.request_record import RequestRecord, SharedRequests, request_fold_for
from engine.events.phase_names import span_name
from engine.events.record import Event
from engine.events.request_records import RequestArrived, RequestFinished, RequestFirstToken, RequestPreempted
from engine.events.startup_records import StartupPhase
from engine.events.step_records import StepEvent

ENGINE_PID = 1
REQUESTS_PID = 2
STARTUP_TID = 1
STEPS_TID = 2
PREPROCESS = "preprocess"
QUEUED = "queued"
QUEUED_AFTER_PREEMPTION = "queued (preempted)"
DECODE = "decode"
FLOW = "served by step"
FLOW_CATEGORY = "step"

COUNTERS = ("KV cache usage %", "running", "waiting", "prefill tokens", "decode tokens", "preemptions")
# a step slice's args, in the order the fold stores them
STEP_ARGS = ("index", "prefill_tokens", "decode_tokens", "running", "waiting", "kv_blocks_used", "kv_blocks_total",
             "preempted", "finished")


def _us(seconds: float) -> float:
    """Trace Event Format timestamps are microseconds; 3 decimals keep nanoseconds."""
    return round(seconds * 1e6, 3)


@dataclass(slots=True)
class _OpenSlice:
    name: str
    start: float
    end: float
    args: dict[str, Any] = field(default_factory=dict)
    tokens: int = 0  # a decode slice's tokens, counted as it grows


@dataclass(slots=True)
class _RequestTrack:
    """One request's track while it is followed: its record (the shared fold's: its
    arrival, and a finish that waits for the step that carried its last token), its
    track id and the slice still growing."""

    record: RequestRecord
    tid: int
    open: _OpenSlice | None = None

    def finish_args(self) -> dict[str, Any]:
        finished = self.record.finished
        assert finished is not None
        return {"reason": finished.reason, "output_tokens": finished.output_tokens, "e2e_s": finished.e2e_s}


class PerfettoTrace:
    """Event subscriber that folds events into Trace Event Format records; with a
    ``path``, :meth:`close` writes them there (the file is written once, at the end)."""

    def __init__(self, path: str | Path | None = None, shared_requests: SharedRequests | None = None) -> None:
        self.path = path
        self._records: list[tuple[Any, ...]] = []
        self._counter_values: dict[str, float] = {}
        self._metadata: list[dict[str, Any]] = []
        self._phase_begin: dict[str, StartupPhase] = {}
        self._startup_end = 0.0
        # every request's record, read by its track: the server's fold when given (one fold of
        # each event for every reader), else a private one
        self.requests, self._fold_requests = request_fold_for(shared_requests)
        self._requests: dict[str, _RequestTrack] = {}  # followed now: arrived, not finished
        self._tracks = 0
        self._finishing: list[str] = []
        self._preemptions = 0
        self._last_step_end = 0.0
        # per step: (a time inside it, the tracks of the requests it served); the arrows'
        # records are made once, in trace(), so the step's fold only appends track ids
        self._flow_steps: list[tuple[float, list[int]]] = []
        self.steps = 0
        self._name_process(ENGINE_PID, "kvscope engine", 0)
        self._name_thread(ENGINE_PID, STARTUP_TID, "startup phases")
        self._name_thread(ENGINE_PID, STEPS_TID, "steps")
        self._name_process(REQUESTS_PID, "requests", 1)

    # ------------------------------------------------------------ metadata
    def _name_process(self, pid: int, name: str, order: int) -> None:
        self._metadata.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}})
        self._metadata.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                               "args": {"sort_index": order}})

    def _name_thread(self, pid: int, tid: int, name: str) -> None:
        self._metadata.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
        self._metadata.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                               "args": {"sort_index": tid}})

    # -------------------------------------------------------------- records
    # Records are kept as tuples in seconds, (start, ph, name, pid, tid, duration,
    # args), and become the format's dicts (microseconds) only in trace(): the fold
    # runs on the engine thread once per event, the conversion once per file.
    def _slice(self, pid: int, tid: int, name: str, start: float, end: float, args: dict[str, Any]) -> None:
        self._records.append((start, "X", name, pid, tid, max(end - start, 0.0), args))

    def _instant(self, tid: int, name: str, t: float, args: dict[str, Any]) -> None:
        self._records.append((t, "i", name, REQUESTS_PID, tid, None, args))

    def _counter(self, name: str, t: float, value: float) -> None:
        """A counter holds its value until the next sample: one only when it changes."""
        if self._counter_values.get(name) != value:
            self._counter_values[name] = value
            self._records.append((t, "C", name, ENGINE_PID, 0, None, {"value": value}))

    @staticmethod
    def _record(start: float, ph: str, name: str, pid: int, tid: int, duration: float | None,
                args: dict[str, Any] | tuple[int, ...] | int) -> dict[str, Any]:
        record: dict[str, Any] = {"ph": ph, "name": name, "pid": pid, "tid": tid, "ts": _us(start)}
        if isinstance(args, int):  # a flow arrow's end: args is its id; "f" binds to the enclosing step slice
            record.update({"cat": FLOW_CATEGORY, "id": args} | ({"bp": "e"} if ph == "f" else {}))
            return record
        if duration is not None:
            record["dur"] = _us(duration)
        if ph == "i":
            record["s"] = "t"  # an instant on its thread's track
        record["args"] = dict(zip(STEP_ARGS, args, strict=True)) if isinstance(args, tuple) else args
        return record

    # ------------------------------------------------------------- the fold
    def __call__(self, event: Event) -> None:
        self._fold_requests(event)
        if isinstance(event, StepEvent):
            self._step(event)
        elif isinstance(event, RequestArrived):
            self._arrived(event.request_id)
        elif isinstance(event, RequestPreempted):
            self._preempted(event)
        elif isinstance(event, RequestFirstToken):
            track = self._requests.get(event.request_id)
            if track is not None:
                self._instant(track.tid, "first token", event.t, {"ttft_s": event.ttft_s})
        elif isinstance(event, RequestFinished):
            self._finished(event)
        elif isinstance(event, StartupPhase):
            self._phase(event)

    def _phase(self, event: StartupPhase) -> None:
        if event.status == "begin":
            self._phase_begin[event.phase] = event
            return
        begin = self._phase_begin.pop(event.phase, None)
        # Phases run one after another; simulated ones all sit at t=0 with their
        # modelled durations, so each starts where the one before ended.
        start = max(begin.t if begin is not None else event.t - (event.duration_s or 0.0), self._startup_end)
        end = max(event.t, start + (event.duration_s or 0.0))
        args: dict[str, Any] = {"phase": event.phase, "status": event.status, "vllm_span": span_name(event.phase),
                                "duration_s": event.duration_s}
        memory_before = event.memory_before or (begin.memory_before if begin is not None else None)
        for label, memory in (("before", memory_before), ("after", event.memory_after)):
            if memory:
                args[f"allocated_bytes_{label}"] = memory.get("allocated")
                args[f"free_bytes_{label}"] = memory.get("free")
        if event.reason:
            args["reason"] = event.reason
        self._slice(ENGINE_PID, STARTUP_TID, f"{event.phase} {event.name}", start, end, args)
        self._startup_end = end

    def _arrived(self, request_id: str) -> None:
        record = self.requests.record(request_id)
        t = record.arrived_t or 0.0
        track = self._track(request_id, t, {"prompt_tokens": record.prompt_tokens, "max_tokens": record.max_tokens})
        preprocess_s = record.arrival.preprocess_s if record.arrival is not None else 0.0
        if preprocess_s:  # received earlier: parsing, tokenising, the queue to the engine thread
            self._slice(REQUESTS_PID, track.tid, PREPROCESS, t - preprocess_s, t, {"preprocess_s": preprocess_s})

    def _track(self, request_id: str, t: float, args: dict[str, Any]) -> _RequestTrack:
        track = self._requests.get(request_id)
        if track is None:
            self._tracks += 1  # a track per request, never reused
            track = self._requests[request_id] = _RequestTrack(self.requests.record(request_id), self._tracks)
            self._name_thread(REQUESTS_PID, track.tid, request_id)
            track.open = _OpenSlice(QUEUED, t, t, args)
        return track

    def _close(self, track: _RequestTrack, end: float | None = None) -> float:
        """Write the track's growing slice (ending at ``end``, or where it last grew)
        and return where it ended."""
        piece = track.open
        if piece is None:
            return 0.0
        track.open = None
        stop = piece.end if end is None else max(end, piece.start)
        args = {**piece.args, "tokens": piece.tokens} if piece.tokens else piece.args
        self._slice(REQUESTS_PID, track.tid, piece.name, piece.start, stop, args)
        return stop

    def _preempted(self, event: RequestPreempted) -> None:
        self._preemptions += 1
        track = self._requests.get(event.request_id)
        if track is None:
            return
        self._close(track)
        self._instant(track.tid, "preempted", event.t, {"computed_tokens_lost": event.computed_tokens_lost,
                                                         "num_preemptions": event.num_preemptions})
        track.open = _OpenSlice(QUEUED_AFTER_PREEMPTION, event.t, event.t)

    def _finished(self, event: RequestFinished) -> None:
        track = self._requests.get(event.request_id)
        if track is None:
            return
        track.record = self.requests.record(event.request_id)  # now with its finish
        if track.open is not None and track.open.name in (QUEUED, QUEUED_AFTER_PREEMPTION):
            # never ran again (an abort while waiting): it ends here
            self._close(track, event.t)
            self._end(event.request_id, track, event.t)
            return
        # The step that sampled its last token is published after this event:
        # that step closes the decode slice.
        self._finishing.append(event.request_id)

    def _end(self, request_id: str, track: _RequestTrack, t: float) -> None:
        self._instant(track.tid, "finished", t, track.finish_args())
        del self._requests[request_id]

    def _step(self, event: StepEvent) -> None:
        self.steps += 1
        end = event.t
        # t - duration_s lands a float's breadth before the last step's end: clamp, so
        # slices on the steps track follow and never overlap
        start = min(max(end - event.duration_s, self._last_step_end), end)
        self._last_step_end = end
        requests = self._requests
        served: list[int] = []
        self._flow_steps.append(((start + end) / 2, served))  # inside the request's slice and the step's
        for request_id, (num_tokens, kind) in event.scheduled.items():
            track = requests.get(request_id) or self._track(request_id, start, {})
            served.append(track.tid)
            piece = track.open
            if piece is not None and kind == DECODE and piece.name == DECODE:  # most entries: one more token
                piece.end = end
                piece.tokens += num_tokens
                continue
            if piece is not None:
                self._close(track, start if piece.name != DECODE else None)
            if kind == DECODE:
                track.open = _OpenSlice(DECODE, start, end, tokens=num_tokens)
            else:
                self._slice(REQUESTS_PID, track.tid, "prefill", start, end, {"tokens": num_tokens})
        for request_id in self._finishing:
            finishing = self._requests.get(request_id)
            if finishing is not None:
                stop = self._close(finishing)
                self._end(request_id, finishing, max(end, stop))
        self._finishing.clear()
        mix = ("mixed" if event.num_prefill_tokens and event.num_decode_tokens
               else "prefill" if event.num_prefill_tokens else "decode" if event.num_decode_tokens else "idle")
        self._records.append((start, "X", mix, ENGINE_PID, STEPS_TID, end - start, (
            event.index, event.num_prefill_tokens, event.num_decode_tokens, event.num_running, event.num_waiting,
            event.kv_blocks_used, event.kv_blocks_total, len(event.preempted), len(event.finished))))
        usage = 100.0 * event.kv_blocks_used / event.kv_blocks_total if event.kv_blocks_total else 0.0
        for name, value in zip(COUNTERS, (round(usage, 3), event.num_running, event.num_waiting,
                                          event.num_prefill_tokens, event.num_decode_tokens, self._preemptions),
                               strict=True):
            self._counter(name, end, value)

    # --------------------------------------------------------------- output
    def trace(self) -> dict[str, Any]:
        """The Trace Event Format object: metadata first, then every record in time
        order (so each track's are too). Requests still open (a recording cut mid-run)
        end where they last grew."""
        for request_id in list(self._finishing):
            track = self._requests.get(request_id)
            if track is not None and track.record.finished is not None:
                stop = self._close(track)
                self._end(request_id, track, max(track.record.finished.t, stop))
        self._finishing.clear()
        for track in self._requests.values():
            self._close(track)
        self._requests.clear()
        flow_id = 0
        for middle, tids in self._flow_steps:
            for tid in tids:
                flow_id += 1
                self._records.append((middle, "s", FLOW, REQUESTS_PID, tid, None, flow_id))
                self._records.append((middle, "f", FLOW, ENGINE_PID, STEPS_TID, None, flow_id))
        self._flow_steps.clear()
        self._records.sort(key=lambda record: record[0])
        records = [self._record(*record) for record in self._records]
        return {"traceEvents": [*self._metadata, *records], "displayTimeUnit": "ms",
                "otherData": {"producer": "kvscope", "clock": "seconds since engine start, in microseconds"}}

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.trace(), separators=(",", ":")), encoding="utf-8")

    def close(self) -> None:
        """The sink's end (as JsonlSink's): write the file given to the constructor."""
        if self.path is not None:
            self.write(self.path)


def trace_of(events: Iterable[Event]) -> dict[str, Any]:
    """Fold ``events`` (a recording's) into one Trace Event Format object."""
    builder = PerfettoTrace()
    for event in events:
        builder(event)
    return builder.trace()
