"""Forward-pass metrics for routers and planners (Dynamo's planner reads them): one
message per scheduler step in the shape of vLLM's ``ForwardPassMetrics`` (open PR
#52061, ``vllm/v1/metrics/forward_pass_metrics.py``), over ZMQ as it sends them.

- A PUB socket bound at ``tcp://HOST:PORT`` (``--forward-pass-metrics-port``; vLLM's
  flag), each message three frames: the topic (empty), the sequence number (8 bytes,
  big-endian, from 0) and the msgpack-encoded struct, whose ``counter_id`` is that
  sequence number.
- After a step that leaves nothing running or waiting, one idle heartbeat: every
  count 0 and ``wall_time`` 0, as vLLM's scheduler sends it on going idle.

Everything is folded from the events the engine already publishes, through the one
per-request record (engine/events/folds/request_record.py): the server's request fold, shared
with ``/debug/requests`` and the trace exporters, or a fold of its own; no engine state is read. The
send runs on the thread that publishes the step with ``NOBLOCK`` on a PUB socket,
which drops for a slow or absent subscriber (at ``SEND_HWM`` queued messages) and never
waits, so no subscriber can slow a step.

Differences from vLLM's: ``wall_time`` is the step's duration on kvscope's clock
(schedule, forward, sample, update, on whatever device; ``timing_scope`` keeps vLLM's
value so its subscriber accepts the message); in a recording made before step events carried
``prefix_lookups``, a request resumed after a preemption counts its prompt as recomputed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from engine.events.folds.request_record import (
    WAITING,
    RequestFold,
    RequestRecord,
    SharedRequests,
    request_fold_for,
)
from engine.events.record import Event
from engine.events.step_records import StepEvent

FPM_VERSION = 1
FPM_TIMING_SCOPE = "execute_model_cuda"  # vLLM's; its subscriber drops any other scope
SEND_HWM = 10_000


class ScheduledRequestMetrics(msgspec.Struct, frozen=True, gc=False):
    num_prefill_requests: int = 0
    sum_prefill_tokens: int = 0  # computed this step (cached tokens excluded)
    var_prefill_length: float = 0.0  # population variance of the whole prompt lengths
    sum_prefill_kv_tokens: int = 0  # KV read, not computed: prefix hits and earlier chunks
    num_decode_requests: int = 0
    sum_decode_kv_tokens: int = 0  # KV context of the decodes
    var_decode_kv_tokens: float = 0.0


class QueuedRequestMetrics(msgspec.Struct, frozen=True, gc=False):
    num_prefill_requests: int = 0  # waiting, never run
    sum_prefill_tokens: int = 0
    var_prefill_length: float = 0.0
    num_decode_requests: int = 0  # preempted back to the queue
    sum_decode_kv_tokens: int = 0
    var_decode_kv_tokens: float = 0.0


class ForwardPassMetrics(msgspec.Struct, frozen=True, gc=False):
    version: int = FPM_VERSION
    worker_id: str = ""
    dp_rank: int = 0
    counter_id: int = 0
    timing_scope: str = FPM_TIMING_SCOPE
    wall_time: float = 0.0
    scheduled_requests: ScheduledRequestMetrics = ScheduledRequestMetrics()
    queued_requests: QueuedRequestMetrics = QueuedRequestMetrics()


def _sum_var(values: list[int]) -> tuple[int, float]:
    if not values:
        return 0, 0.0
    total = sum(values)
    mean = total / len(values)
    return total, sum((v - mean) ** 2 for v in values) / len(values)


def _has_run(record: RequestRecord) -> bool:
    """Whether any step has run it (a preempted one waits again)."""
    return bool(record.chunks or record.decode_runs)


@dataclass(slots=True)
class ForwardPassFold:
    """The per-step metrics from the events; :meth:`apply` returns a message after each
    step (and the idle heartbeat after the step that empties the engine). Each request's
    tokens are its record's (engine/events/folds/request_record.py): ``shared_requests``'s
    (the server's request fold, folded once for all its readers) or a fold of its own. A
    request finished in a step is still in the fold when the step is read, so its last
    decode counts, as vLLM counts every request the step scheduled."""

    worker_id: str = ""
    dp_rank: int = 0
    shared_requests: SharedRequests | None = None
    requests: RequestFold = field(init=False)
    _fold_requests: Callable[[Event], None] = field(init=False)
    active: bool = False

    def __post_init__(self) -> None:
        self.requests, self._fold_requests = request_fold_for(self.shared_requests)

    def apply(self, event: Event) -> list[ForwardPassMetrics]:
        self._fold_requests(event)  # the records after the event: a step's tokens already counted
        return self._step(event) if isinstance(event, StepEvent) else []

    def _step(self, step: StepEvent) -> list[ForwardPassMetrics]:
        prefill_lengths: list[int] = []
        decode_kv: list[int] = []
        prefill_tokens = prefill_kv = 0
        lives = self.requests.lives
        for rid, (num_tokens, kind, *_rest) in step.scheduled.items():
            record = lives.get(rid)
            if record is None or record.arrival is None:
                continue
            if kind == "prefill":
                prefill_lengths.append(record.prompt_tokens)
                prefill_tokens += num_tokens
                prefill_kv += record.computed_tokens - num_tokens  # before the step: hits and earlier chunks
            else:
                decode_kv.append(record.computed_tokens)
        queued_prefill: list[int] = []  # never run yet
        queued_decode: list[int] = []  # run, then preempted: waiting again
        for r in self.requests.waiting_now():
            if r.arrival is None or r.state != WAITING:  # a step that named no admissions ran it
                continue
            if _has_run(r):
                queued_decode.append(r.prompt_tokens + r.output_tokens)
            else:
                queued_prefill.append(r.prompt_tokens)
        scheduled_metrics = ScheduledRequestMetrics(len(prefill_lengths), prefill_tokens, _sum_var(prefill_lengths)[1],
                                                    prefill_kv, len(decode_kv), *_sum_var(decode_kv))
        queued = QueuedRequestMetrics(len(queued_prefill), *_sum_var(queued_prefill),
                                      len(queued_decode), *_sum_var(queued_decode))
        messages = [ForwardPassMetrics(worker_id=self.worker_id, dp_rank=self.dp_rank, wall_time=step.duration_s,
                                       scheduled_requests=scheduled_metrics, queued_requests=queued)]
        self.active = bool(step.num_running or step.num_waiting)
        if not self.active:  # the engine went idle: vLLM's heartbeat, all zeros
            messages.append(ForwardPassMetrics(worker_id=self.worker_id, dp_rank=self.dp_rank))
        return messages


class ForwardPassPublisher:
    """Bus subscriber: folds the events (:class:`ForwardPassFold`) and sends each message
    on a bound PUB socket without ever waiting (see the module docstring)."""

    def __init__(self, port: int, host: str = "127.0.0.1", worker_id: str = "", dp_rank: int = 0,
                 shared_requests: SharedRequests | None = None) -> None:
        import zmq

        from engine.errors import UserError

        self.fold = ForwardPassFold(worker_id=worker_id, dp_rank=dp_rank, shared_requests=shared_requests)
        self.sent = 0
        self.dropped = 0
        self._encode = msgspec.msgpack.Encoder().encode
        self._again = zmq.Again
        # plain ints: send_multipart's Flag arithmetic cost more than the sends, every step
        self._noblock = int(zmq.NOBLOCK)
        self._more = int(zmq.SNDMORE | zmq.NOBLOCK)
        self._pub: Any = zmq.Context.instance().socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.set_hwm(SEND_HWM)
        try:
            self._pub.bind(f"tcp://{host}:{port + dp_rank}")  # a DP rank on port + rank, as vLLM
        except zmq.ZMQError as exc:
            self._pub.close()
            raise UserError(f"--forward-pass-metrics-port {port}: {exc}; give a free port") from None
        self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)

    def __call__(self, event: Event) -> None:
        for message in self.fold.apply(event):
            payload = self._encode(msgspec.structs.replace(message, counter_id=self.sent))
            pub = self._pub
            try:  # the three frames send_multipart would send, in its order
                pub.send(b"", self._more)
                pub.send(self.sent.to_bytes(8, "big"), self._more)
                pub.send(payload, self._noblock)
            except self._again:  # never wait for a subscriber
                self.dropped += 1
                continue
            self.sent += 1

    def close(self) -> None:
        self._pub.close(linger=0)
