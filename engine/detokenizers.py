"""Each unfinished request's incremental detokeniser: the text each sampled token adds, the stop
strings it finds, and the text it held back, released when the request finishes."""

from __future__ import annotations

import structlog

from engine.core.request import Request, RequestStatus
from engine.logs import log_failure
from engine.model.loading.tokenizer import IncrementalDetokenizer


class Detokenizers:
    """The engine's detokenisers by request id. A request's text failing to decode ends that
    request only (reason ``error``); the rest of the batch goes on."""

    def __init__(self) -> None:
        self._by_id: dict[str, IncrementalDetokenizer] = {}

    def add(self, request_id: str, detok: IncrementalDetokenizer) -> None:
        self._by_id[request_id] = detok

    def drop(self, request_id: str) -> None:
        self._by_id.pop(request_id, None)

    def get(self, request_id: str) -> IncrementalDetokenizer | None:
        return self._by_id.get(request_id)

    def text(self, request_id: str) -> str:
        """The request's text so far."""
        return self._by_id[request_id].text

    def decode(self, sampled_ids: dict[str, int], failed: dict[str, str]) -> tuple[dict[str, str], set[str]]:
        """Each sampled token's text by request id, and the requests whose text matched a stop
        string; a request whose detokeniser raised goes into ``failed`` with why."""
        deltas: dict[str, str] = {}
        stopped_by_string: set[str] = set()
        for rid, token in sampled_ids.items():
            detok = self._by_id.get(rid)
            if detok is None:
                continue
            try:
                deltas[rid] = detok.add(token)
            except Exception as exc:  # this request's text only: the batch goes on
                failed[rid] = f"detokenising failed: {type(exc).__name__}: {exc}"
                with structlog.contextvars.bound_contextvars(request_id=rid):  # the engine thread's record too
                    log_failure("kvscope.engine", f"detokenising request {rid} failed; it ends with "
                                "finish_reason 'error' and the rest of the batch goes on")
                continue
            if detok.stop_reason is not None:
                stopped_by_string.add(rid)
        return deltas, stopped_by_string

    def release(self, req: Request) -> str:
        """A finished request's detokeniser is let go: the text it held back (none for a request
        that failed). A failure here loses only that tail, logged (the request already finished
        with its tokens)."""
        detok = self._by_id.pop(req.request_id)
        if req.status is RequestStatus.FINISHED_ERROR:
            return ""
        try:
            return detok.finish()
        except Exception:
            log_failure("kvscope.engine", f"releasing the last text of request {req.request_id} failed")
            return ""
