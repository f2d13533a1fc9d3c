"""A step's sampling after the forward: the batched sampler over the rows that need a token,
each row alone when one row's parameters break the batch, the sampled tokens' logprobs, and
the prompt logprobs of the sequences that ask (the LM head on their prompt rows).

:class:`~engine.model.runner.ModelRunner` calls these with its sampler (read at each call: a
test may wrap it) and keeps the step's results (``last_failed``, ``last_logprobs``,
``last_prompt_logprobs``) where the engine loop and a pipeline's rank 0 read them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import structlog
import torch

from engine.logs import log_failure
from engine.model.sampler import Sampler, TokenLogprobs, prompt_token_logprobs, token_logprobs

if TYPE_CHECKING:
    from engine.model.runner import PreparedBatch, ScheduledSeq

# Prompt logprobs: the LM head runs on this many prompt positions at a time, so a long
# prefill chunk's logits never exist whole ([256, 49,152] fp32 is 48 MiB for SmolLM2).
PROMPT_LOGPROB_ROWS_AT_ONCE = 256


def sample_rows(sampler: Sampler, prepared: PreparedBatch, logits: torch.Tensor,
                failed: dict[str, str]) -> tuple[dict[str, int], dict[str, TokenLogprobs]]:
    """Sample ``prepared``'s sampled rows from their ``logits``: the tokens, and the
    logprobs of the rows that ask. A row whose parameters raise goes into ``failed``
    (request id -> the error in one line) and gets no token."""
    seqs = prepared.sample_seqs
    try:
        tokens = sampler.sample(logits, [s.sampling for s in seqs], prepared.sample_positions).tolist()
        sampled = {s.request_id: int(t) for s, t in zip(seqs, tokens, strict=True)}
    except Exception:  # one row's parameters broke the batch: find it, keep the others
        sampled = _rows_alone(sampler, logits, prepared, failed)
    return sampled, _logprobs(logits, seqs, sampled)


def _rows_alone(sampler: Sampler, logits: torch.Tensor, prepared: PreparedBatch,
                failed: dict[str, str]) -> dict[str, int]:
    """Sample each row by itself after the batched call raised: a row that raises alone
    goes into ``failed`` and gets no token; every other row is sampled as the batch would
    have sampled it."""
    sampled: dict[str, int] = {}
    for row, seq in enumerate(prepared.sample_seqs):
        try:
            token = sampler.sample(logits[row:row + 1], [seq.sampling],
                                   prepared.sample_positions[row:row + 1])
            sampled[seq.request_id] = int(token[0])
        except Exception as exc:
            failed[seq.request_id] = f"sampling failed: {type(exc).__name__}: {exc}"
            with structlog.contextvars.bound_contextvars(request_id=seq.request_id):
                log_failure("kvscope.engine", f"sampling request {seq.request_id} failed; it ends with "
                            "finish_reason 'error' and the rest of the batch goes on")
    return sampled


def _logprobs(logits: torch.Tensor, seqs: Sequence[ScheduledSeq],
              sampled: dict[str, int]) -> dict[str, TokenLogprobs]:
    """The sampled tokens' log-probabilities for the requests that ask (nothing to
    compute when none does)."""
    rows = [row for row, s in enumerate(seqs) if s.sampling.logprobs is not None and s.request_id in sampled]
    if not rows:
        return {}
    ids = [seqs[row].request_id for row in rows]
    found = token_logprobs(logits, rows, [sampled[rid] for rid in ids],
                           [seqs[row].sampling.logprobs or 0 for row in rows])
    return dict(zip(ids, found, strict=True))


def prompt_logprobs(model: Any, hidden: torch.Tensor,
                    batch: Sequence[ScheduledSeq]) -> tuple[dict[str, list[TokenLogprobs]], int]:
    """The LM head on every row of the sequences with ``prompt_targets`` (fp32 logits, a
    slice of rows at a time) and their prompt logprobs, with how many prompt rows the head
    ran on; nothing runs for a batch without. Every tensor-parallel rank runs the same
    slices (the head's gather is a collective); only rank 0 gets logits."""
    if not any(s.prompt_targets for s in batch):
        return {}, 0
    found: dict[str, list[TokenLogprobs]] = {}
    first_row = rows = 0
    for seq in batch:
        query_len = len(seq.token_ids)
        targets = seq.prompt_targets or []
        if len(targets) > query_len:
            raise ValueError(f"request {seq.request_id}: {len(targets)} prompt targets for {query_len} rows")
        num_top = seq.sampling.prompt_logprobs or 0
        for lo in range(0, len(targets), PROMPT_LOGPROB_ROWS_AT_ONCE):
            part = targets[lo:lo + PROMPT_LOGPROB_ROWS_AT_ONCE]
            logits = model.compute_logits(hidden[first_row + lo:first_row + lo + len(part)])
            if logits is not None:
                found.setdefault(seq.request_id, []).extend(prompt_token_logprobs(logits, part, num_top))
        rows += len(targets)
        first_row += query_len
    return found, rows
