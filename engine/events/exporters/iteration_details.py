"""vLLM's ``--enable-logging-iteration-details``: one log line per engine step,
written from the ``step`` events in vLLM's words (``EngineCore.log_iteration_details``,
``vllm/v1/engine/core.py``)::

    Iteration(12): 1 context requests, 96 context tokens, 7 generation requests, 7 generation tokens, iteration elapsed time: 41.27 ms

As in vLLM: a *context* request is one that has not produced a token yet (a new
request, or a later chunk of its prefill), every other scheduled request is a
*generation* request (a request resumed after preemption with tokens out counts
here, even while it recomputes); steps that schedule no token are not logged and do
not advance the iteration number; the elapsed time is the model's execution and
sampling (``forward_s + sample_s``; vLLM times the wait for the model's output).

Which requests have a token out is folded from ``request.first_token`` and
``request.finished``; both are published while a step is updated, before its step
event, so they take effect once that step is logged. No engine state is read.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.events.record import Event
from engine.events.request_records import RequestFinished, RequestFirstToken
from engine.events.step_records import StepEvent


def iteration_details_line(iteration: int, context: tuple[int, int], generation: tuple[int, int],
                           elapsed_s: float) -> str:
    """vLLM's line: ``context`` and ``generation`` are (requests, tokens)."""
    return (f"Iteration({iteration}): {context[0]} context requests, {context[1]} context tokens, "
            f"{generation[0]} generation requests, {generation[1]} generation tokens, "
            f"iteration elapsed time: {elapsed_s * 1000:.2f} ms")


class IterationDetailsLog:
    """Bus subscriber: :func:`iteration_details_line` for each step that computed
    tokens, handed to ``log`` (``get_logger(...).info`` in the engine)."""

    __slots__ = ("_finished_this_step", "_generating", "_iteration", "_log", "_started_this_step")

    def __init__(self, log: Callable[[str], None]) -> None:
        self._log = log
        self._iteration = 0
        self._generating: set[str] = set()  # requests with a token out before the current step
        self._started_this_step: list[str] = []
        self._finished_this_step: list[str] = []

    def __call__(self, event: Event) -> None:
        if isinstance(event, StepEvent):
            self._on_step(event)
        elif isinstance(event, RequestFirstToken):
            self._started_this_step.append(event.request_id)
        elif isinstance(event, RequestFinished):
            self._finished_this_step.append(event.request_id)

    def _on_step(self, event: StepEvent) -> None:
        generating = self._generating
        context_requests = context_tokens = generation_requests = generation_tokens = 0
        for request_id, (num_tokens, _kind) in event.scheduled.items():
            if request_id in generating:
                generation_requests += 1
                generation_tokens += num_tokens
            else:
                context_requests += 1
                context_tokens += num_tokens
        generating.update(self._started_this_step)
        generating.difference_update(self._finished_this_step)
        self._started_this_step.clear()
        self._finished_this_step.clear()
        if not context_tokens + generation_tokens:
            return
        self._log(iteration_details_line(self._iteration, (context_requests, context_tokens),
                                         (generation_requests, generation_tokens), event.forward_s + event.sample_s))
        self._iteration += 1

    def close(self) -> None:
        """Nothing to flush: each line is logged as its step arrives (the exporters' sink protocol)."""
