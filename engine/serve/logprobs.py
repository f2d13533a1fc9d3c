"""The sampled tokens' log-probabilities (:class:`~engine.model.sampler.TokenLogprobs`)
in OpenAI's two answer shapes: the legacy completions ``{tokens, token_logprobs,
top_logprobs, text_offset}`` and chat's ``{content: [{token, logprob, bytes,
top_logprobs}]}``; and the prompt's, in vLLM's ``prompt_logprobs`` shape (``None``, then
``{token id: {logprob, rank, decoded_token}}`` per prompt token). A token is shown as its
own decoded text, special tokens included, as vLLM shows it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from engine.model.sampler import TokenLogprobs
from engine.serve.protocol import (
    ChatLogprobs,
    ChatLogprobToken,
    ChatLogprobTop,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
)

# vLLM's clamp_prompt_logprobs: -inf (a masked token) is not JSON; it is sent as this
LOWEST_LOGPROB = -9999.0


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


def _text(tokenizer: Decoder, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(entries: Sequence[TokenLogprobs], tokenizer: Decoder,
                        text_offset: int = 0) -> CompletionLogprobs:
    """``text_offset``: where the first token's text starts in the completion (a stream's
    later chunks go on from the text sent before them)."""
    out = CompletionLogprobs()
    for entry in entries:
        token = _text(tokenizer, entry.token_id)
        out.tokens.append(token)
        out.token_logprobs.append(entry.logprob)
        out.text_offset.append(text_offset)
        text_offset += len(token)
        # vLLM lists the sampled token among the alternatives too
        top = {_text(tokenizer, t): lp for t, lp in entry.top}
        top.setdefault(token, entry.logprob)
        out.top_logprobs.append(top if entry.top else None)
    return out


def chat_logprobs(entries: Sequence[TokenLogprobs], tokenizer: Decoder) -> ChatLogprobs:
    content = []
    for entry in entries:
        token = _text(tokenizer, entry.token_id)
        content.append(ChatLogprobToken(
            token=token, logprob=entry.logprob, bytes=list(token.encode("utf-8")),
            top_logprobs=[ChatLogprobTop(token=(text := _text(tokenizer, t)), logprob=lp,
                                         bytes=list(text.encode("utf-8"))) for t, lp in entry.top]))
    return ChatLogprobs(content=content)


def prompt_logprobs(entries: Sequence[TokenLogprobs | None], tokenizer: Decoder) -> PromptLogprobs:
    """vLLM's list: the prompt token's own entry first (its rank may be past the top), then
    the alternatives in rank order; a prompt token among them is listed once."""
    out: PromptLogprobs = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        ranked = {entry.token_id: PromptLogprob(logprob=max(entry.logprob, LOWEST_LOGPROB), rank=entry.rank,
                                                decoded_token=_text(tokenizer, entry.token_id))}
        for rank, (token, logprob) in enumerate(entry.top, 1):
            ranked.setdefault(token, PromptLogprob(logprob=max(logprob, LOWEST_LOGPROB), rank=rank,
                                                   decoded_token=_text(tokenizer, token)))
        out.append(ranked)
    return out
