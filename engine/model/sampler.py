"""The batched sampler (logit bias, greedy, temperature, top-k, top-p, seeds).

One call samples every row of the batch: OpenAI's ``logit_bias`` added first (to the
rows that have one: a copy of those rows and one ``index_add_`` for the whole batch;
greedy rows take their argmax after it), temperature scaling, one descending
sort shared by top-k and top-p, then the "exponential race" (argmax of
``p / q`` with ``q ~ Exp(1)``, as vLLM does), which draws from ``p`` without a
per-row ``multinomial``. Only rows with a seed get their own noise, from a
generator seeded by ``(seed, position)``: the same request reproduces the same
tokens whatever batch it lands in, and after a preemption's recompute too.

Stop tokens, stop strings and max tokens belong to whoever owns the request;
see :class:`engine.model.loading.tokenizer.IncrementalDetokenizer` for stop strings.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.core.sampling_params import SamplingParams


def _biased_rows(logits: torch.Tensor, params: Sequence[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(rows, their logits + bias)`` for the rows whose request has a ``logit_bias``;
    ``(empty, None)`` when none has. The caller's ``logits`` are not written (a failed
    batch is sampled again row by row from them)."""
    rows = [row for row, p in enumerate(params) if p.logit_bias]
    if not rows:
        return torch.empty(0, dtype=torch.long), None
    device, vocab = logits.device, logits.shape[1]
    row_index = torch.tensor(rows, device=device)
    biased = logits.index_select(0, row_index)  # a copy of the biased rows only
    tokens = torch.cat([torch.tensor(list(params[row].logit_bias), dtype=torch.long) + i * vocab
                        for i, row in enumerate(rows)])
    values = torch.cat([torch.tensor(list(params[row].logit_bias.values()), dtype=logits.dtype) for row in rows])
    biased.view(-1).index_add_(0, tokens.to(device), values.to(device))
    return row_index, biased


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """One sampled token's log-probability under the model (vLLM's raw logprobs: the
    logits' fp32 log-softmax before bias, temperature, top-k or top-p), its rank (1: the
    most likely) and the ``top`` alternatives, most likely first."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...]


def token_logprobs(logits: torch.Tensor, rows: Sequence[int], tokens: Sequence[int],
                   num_top: Sequence[int]) -> list[TokenLogprobs]:
    """``rows``' sampled ``tokens`` with their log-probabilities and ``num_top`` best
    alternatives each, from one fp32 log-softmax of just those rows (a batch that asks
    for none never calls this)."""
    return _ranked(logits[list(rows)].float().log_softmax(dim=-1), tokens, num_top)


def prompt_token_logprobs(logits: torch.Tensor, tokens: Sequence[int], num_top: int) -> list[TokenLogprobs]:
    """vLLM's prompt logprobs for a run of prompt positions: row ``i`` of ``logits`` (the
    position before ``tokens[i]``) gives ``tokens[i]``'s log-probability, rank and ``num_top``
    alternatives, from one fp32 log-softmax of every row."""
    return _ranked(logits.float().log_softmax(dim=-1), tokens, [num_top] * len(tokens))


def _ranked(logprobs: torch.Tensor, tokens: Sequence[int], num_top: Sequence[int]) -> list[TokenLogprobs]:
    """Row ``i``'s ``tokens[i]`` with its log-probability, rank and ``num_top[i]`` best alternatives."""
    index = torch.tensor(list(tokens), dtype=torch.long, device=logprobs.device)
    chosen = logprobs.gather(1, index[:, None])[:, 0]
    ranks = (logprobs > chosen[:, None]).sum(dim=-1) + 1
    width = max(num_top, default=0)
    top_values, top_ids = logprobs.topk(width, dim=-1) if width else (logprobs[:, :0], logprobs[:, :0].long())
    ids, values = top_ids.tolist(), top_values.tolist()  # one conversion each, not one per row
    return [TokenLogprobs(int(token), logprob, rank, tuple(zip(ids[i][:n], values[i][:n], strict=True)))
            for i, (token, n, logprob, rank) in enumerate(zip(tokens, num_top, chosen.tolist(), ranks.tolist(),
                                                                strict=True))]


def _seed_for(seed: int, position: int) -> int:
    return (seed * 0x9E3779B1 + position * 0x85EBCA77) & 0x7FFF_FFFF_FFFF_FFFF


class Sampler:
    """``sample(logits [n, vocab] float32, params, positions) -> token ids [n]``."""

    def __init__(self, seed: int = 0) -> None:
        self._generator = torch.Generator(device="cpu").manual_seed(seed)
        self._row_generator = torch.Generator(device="cpu")

    @torch.inference_mode()
    def sample(
        self, logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int] | None = None
    ) -> torch.Tensor:
        """``positions[i]`` is the position of the token being sampled (seeds mix it in)."""
        vocab = logits.shape[1]
        device = logits.device
        biased_rows, biased = _biased_rows(logits, params)
        greedy_tokens = logits.argmax(dim=-1)
        if biased is not None:
            greedy_tokens[biased_rows] = biased.argmax(dim=-1)
        if all(p.greedy for p in params):
            return greedy_tokens
        temperature = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=device)
        logits = logits / temperature[:, None]
        if biased is not None:
            logits[biased_rows] = biased / temperature[biased_rows, None]

        # A top_k past the vocabulary means no limit (vLLM clamps it too): never a wider tensor than the logits.
        top_k = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]
        top_p = [p.top_p for p in params]
        if min(top_k) < vocab or min(top_p) < 1.0:
            # When every row has a top-k limit, only the first max(k) ranks can
            # survive: a partial top-k is O(vocab) where a full sort is O(vocab log vocab).
            width = max(top_k)
            if width < vocab:
                sorted_logits, sorted_index = logits.topk(width, dim=-1, sorted=True)
            else:
                sorted_logits, sorted_index = logits.sort(dim=-1, descending=True)
            ranks = torch.arange(width, device=device)[None, :]
            drop = ranks >= torch.tensor(top_k, device=device)[:, None]
            if min(top_p) < 1.0:
                sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
                # Drop a token once the mass before it already reaches top_p (the top one always stays).
                mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
                drop |= mass_before >= torch.tensor(top_p, device=device)[:, None]
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter_(-1, sorted_index, sorted_logits)

        probs = logits.softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_(generator=self._generator)
        for row, p in enumerate(params):
            if p.seed is not None and not p.greedy:
                position = positions[row] if positions is not None else 0
                self._row_generator.manual_seed(_seed_for(p.seed, position))
                noise[row].exponential_(generator=self._row_generator)
        sampled = (probs / noise).argmax(dim=-1)
        is_greedy = torch.tensor([p.greedy for p in params], device=device)
        return torch.where(is_greedy, greedy_tokens, sampled)
