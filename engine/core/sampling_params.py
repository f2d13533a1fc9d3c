"""A request's sampling parameters (OpenAI's and vLLM's names), checked once when made.

Pure data: the scheduler and the request carry it, the torch sampler
(:mod:`engine.model.sampler`) reads it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.errors import UserError

_GREEDY_EPS = 1e-5

# logit_bias: OpenAI's range for a bias, and the most entries one request may carry. The
# sampler turns a row's map into index and value tensors every step (one index_add per
# batch), so its cost follows the entries; 1024 covers banning or boosting any realistic
# set of words (a word is a few tokens) at a cost of microseconds, where the vocabulary
# size (49,152 for SmolLM2, 128,256 for Llama 3) would let one request make every step
# build a vocabulary-sized tensor.
LOGIT_BIAS_LIMIT = 100.0
MAX_LOGIT_BIAS_ENTRIES = 1024
# logprobs: the most alternatives a token may list (vLLM's default --max-logprobs, OpenAI's top_logprobs).
MAX_LOGPROBS = 20


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = no limit
    seed: int | None = None
    max_tokens: int | None = 16  # None = up to the model length
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # token id -> bias added to its logit before sampling (greedy too), as OpenAI's
    # logit_bias; the engine checks the ids against the vocabulary (LLMEngine.check_prompt)
    logit_bias: dict[int, float] = field(default_factory=dict)
    # the sampled token's log-probability and this many alternatives (0: none) with each token; None: off
    logprobs: int | None = None
    # vLLM's prompt_logprobs: each prompt token's log-probability after the tokens before it,
    # with this many alternatives (0: the token alone); None: off. Such a request reads no
    # prefix-cache hit (every prompt position's logits are computed), as in vLLM.
    prompt_logprobs: int | None = None
    # vLLM's cache_salt: mixed into the hash of the request's first KV block, so its prompt shares
    # prefix-cache blocks only with requests sending the same salt (a tenant's cache is not
    # probed by another's timing); None: the shared cache
    cache_salt: str | None = None
    # the conversation this request continues (engine/events/folds/sessions.py): observed on its
    # request.arrived event, never scheduled by; None: no session
    session: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.temperature < 0:
            raise UserError(f"temperature {self.temperature}: must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise UserError(f"top_p {self.top_p}: must be in (0, 1]")
        if self.top_k < -1:
            raise UserError(f"top_k {self.top_k}: must be -1, 0 (no limit) or a positive count")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise UserError(f"max_tokens {self.max_tokens}: must be at least 1")
        if self.min_tokens < 0:
            raise UserError(f"min_tokens {self.min_tokens}: must be >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise UserError(f"min_tokens {self.min_tokens}: must be <= max_tokens ({self.max_tokens})")
        if not all(math.isfinite(v) for v in (self.temperature, self.top_p)):
            raise UserError(f"temperature {self.temperature} / top_p {self.top_p}: must be finite numbers")
        if any(s == "" for s in self.stop):
            raise UserError(f"stop {self.stop!r}: an empty stop string would end every request at once; remove it")
        bad = next((t for t in self.stop_token_ids if t < 0), None)
        if bad is not None:
            raise UserError(f"stop_token_ids {bad}: token ids are >= 0")
        self._check_logit_bias()
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise UserError(f"logprobs {self.logprobs}: must be in 0..{MAX_LOGPROBS}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise UserError(f"prompt_logprobs {self.prompt_logprobs}: must be in 0..{MAX_LOGPROBS}")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise UserError(f"cache_salt {str(self.cache_salt)[:60]!r}: must be a non-empty string if given "
                            "(omit it to share the prefix cache)")

    def _check_logit_bias(self) -> None:
        if self.logit_bias is None:
            self.logit_bias = {}
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise UserError(f"logit_bias has {len(self.logit_bias):,} entries; at most {MAX_LOGIT_BIAS_ENTRIES:,} "
                            "are accepted")
        for token, bias in self.logit_bias.items():
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise UserError(f"logit_bias key {token!r}: keys are token ids (integers >= 0)")
            if isinstance(bias, bool) or not isinstance(bias, int | float) or not math.isfinite(bias) \
                    or not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                raise UserError(f"logit_bias value {bias!r} for token {token}: biases are finite numbers in "
                                f"[{-LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS
