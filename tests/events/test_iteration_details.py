"""vLLM's iteration-details line, folded from events: context requests are those
with no token out yet (a later prefill chunk too); a request resumed after
preemption with tokens out is a generation request, as in vLLM."""

from __future__ import annotations

from engine.events import RequestFinished, RequestFirstToken, StepEvent
from engine.events.exporters.iteration_details import IterationDetailsLog


def test_context_and_generation_requests_step_by_step() -> None:
    lines: list[str] = []
    log = IterationDetailsLog(lines.append)
    log(StepEvent(scheduled={"a": [64, "prefill"]}, forward_s=0.010, sample_s=0.002))  # a's first chunk
    log(StepEvent(scheduled={}))  # nothing scheduled: not logged, not numbered
    # a's last chunk and b's whole prompt: both sample their first token (published during
    # the update, before the step event) and still count as context
    log(RequestFirstToken(request_id="a"))
    log(RequestFirstToken(request_id="b"))
    log(StepEvent(scheduled={"a": [16, "prefill"], "b": [30, "prefill"]}, forward_s=0.02))
    log(RequestFinished(request_id="b"))  # b finishes while decoding
    log(StepEvent(scheduled={"a": [1, "decode"], "b": [1, "decode"]}, finished={"b": "length"}))
    log(StepEvent(scheduled={"a": [81, "prefill"], "b": [5, "prefill"]}))  # a recomputes after preemption; b's id reused
    assert lines == [
        "Iteration(0): 1 context requests, 64 context tokens, 0 generation requests, 0 generation tokens, "
        "iteration elapsed time: 12.00 ms",
        "Iteration(1): 2 context requests, 46 context tokens, 0 generation requests, 0 generation tokens, "
        "iteration elapsed time: 20.00 ms",
        "Iteration(2): 0 context requests, 0 context tokens, 2 generation requests, 2 generation tokens, "
        "iteration elapsed time: 0.00 ms",
        "Iteration(3): 1 context requests, 5 context tokens, 1 generation requests, 81 generation tokens, "
        "iteration elapsed time: 0.00 ms",
    ]
