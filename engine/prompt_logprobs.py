"""Prompt logprobs (``SamplingParams.prompt_logprobs``) gathered chunk by chunk over a request's
prefill steps, until its first output carries vLLM's whole list."""

from __future__ import annotations

from engine.core.scheduler import ScheduledRequest, SchedulerOutput
from engine.model.sampler import TokenLogprobs


class PromptLogprobs:
    """The requests still owed their prompt logprobs: one slot per prompt position (None for
    the first, which nothing precedes), filled as the chunks whose rows predict them run."""

    def __init__(self) -> None:
        self._kept: dict[str, list[TokenLogprobs | None]] = {}

    def expect(self, request_id: str, num_prompt_tokens: int) -> None:
        self._kept[request_id] = [None] * num_prompt_tokens

    def drop(self, request_id: str) -> None:
        self._kept.pop(request_id, None)

    def take(self, request_id: str) -> list[TokenLogprobs | None] | None:
        """The request's whole list, once (its first output carries it); None if it asked for none."""
        return self._kept.pop(request_id, None)

    def targets(self, s: ScheduledRequest) -> list[int] | None:
        """The prompt tokens ``s``'s rows predict, for a request still owed its prompt logprobs
        (the runner then runs the LM head on those rows); None for every other request."""
        if s.request_id not in self._kept:
            return None
        prompt = s.request.prompt_token_ids
        start = s.start_position  # a recompute after a preemption before the first token: the same rows again
        targets = prompt[start + 1:min(start + s.num_tokens, len(prompt) - 1) + 1]
        return targets or None

    def keep(self, out: SchedulerOutput, found: dict[str, list[TokenLogprobs]]) -> None:
        """File the step's prompt logprobs under their prompt positions (each chunk's first row
        predicts the token after its start)."""
        for s in out.scheduled:
            chunk, kept = found.get(s.request_id), self._kept.get(s.request_id)
            if chunk and kept is not None:
                first = s.start_position + 1
                kept[first:first + len(chunk)] = chunk
