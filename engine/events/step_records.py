"""An engine step as records: the ``step`` event (what was scheduled, the blocks, why a
waiting request was not admitted, why a prompt's prefix lookup stopped where it did), the
step-budget rule, and a vision-language step's encoder work."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from engine.events.record import Event

# Why a waiting request was not admitted in a step (a step event's ``waiting_reasons``:
# request id -> [code, details...]); what no fold of the other fields can tell.
WAIT_TOKEN_BUDGET = "token_budget"  # [code, the step's budget]: its token budget was spent (--max-num-batched-tokens, or --max-decode-step-tokens in a step with decodes)
WAIT_MAX_NUM_SEQS = "max_num_seqs"  # [code, max_num_seqs]: every sequence slot was taken
WAIT_BLOCKS = "blocks"  # [code, blocks needed, blocks free]: the pool is short for its next chunk now
WAIT_NEVER_FITS = "never_fits"  # [code, blocks needed, blocks in the pool]: it can never be admitted
WAIT_BEHIND = "behind"  # [code, head id]: an earlier request at the head of the queue could not be admitted
WAIT_PRIORITY = "priority"  # [code, head id]: a higher-priority request ahead could not be admitted
WAIT_ENCODER = "encoder_budget"  # [code, item tokens, encoder budget left]: its image/video does not fit
WAIT_PREEMPTING = "preempting"  # [code]: a running request was preempted this step, so nobody is admitted
WAIT_REASONS = (WAIT_TOKEN_BUDGET, WAIT_MAX_NUM_SEQS, WAIT_BLOCKS, WAIT_NEVER_FITS, WAIT_BEHIND, WAIT_PRIORITY,
                WAIT_ENCODER, WAIT_PREEMPTING)
WAITING_REASONS_CAP = 16  # requests explained per step, from the head of the queue; the rest are counted


def step_token_budget(max_num_batched_tokens: int, max_decode_step_tokens: int, decoding: int) -> int:
    """A step's token budget: ``max_num_batched_tokens``, or, with ``max_decode_step_tokens``
    set below it and ``decoding`` running requests decoding, that bound (at least one token per
    decoding request). The scheduler's rule (engine/core/scheduler.py) and the doctor's reading
    of a recorded step's budget (a ``token_budget`` wait names it): here, where both may import it."""
    if not decoding or not 0 < max_decode_step_tokens < max_num_batched_tokens:
        return max_num_batched_tokens
    return min(max_num_batched_tokens, max(max_decode_step_tokens, decoding))


# Where an admitted request's prefix-cache match stopped (a step event's ``prefix_lookups``:
# request id -> [hit tokens, cause, details...]).
PREFIX_SHORT_PROMPT = "short_prompt"  # the prompt is shorter than one block: nothing can be cached
PREFIX_LAST_TOKEN = "last_token"  # every block hit but the last, which holds the last prompt token (always recomputed)
PREFIX_COMPLETE = "complete"  # every full block hit; only the partial last block is computed
PREFIX_DIVERGED = "diverged"  # no cached chain continues at token k = hit tokens
PREFIX_EVICTED = "evicted"  # [hit, cause, step, block]: the next block was cached but evicted at that step
PREFIX_WINDOW = "sliding_window"  # [hit, cause, full-attention hit]: a sliding window lacked the blocks before it
PREFIX_CAUSES = (PREFIX_SHORT_PROMPT, PREFIX_LAST_TOKEN, PREFIX_COMPLETE, PREFIX_DIVERGED, PREFIX_EVICTED,
                 PREFIX_WINDOW)


@dataclass(slots=True)
class StepEvent(Event):
    """One scheduler step: decisions, block deltas and time split.

    ``scheduled`` maps request id -> [num_tokens, kind] with kind ``prefill`` or
    ``decode``. Block deltas, enough to rebuild the block table by folding:
    ``allocated`` request id -> block ids appended to its table this step (in
    order; includes prefix-cache hits on admission), ``freed`` request id -> block
    ids it released (finish, abort or preemption), ``cached`` block ids that became
    full and hashed this step, ``evicted`` block ids whose cached contents were
    dropped to be reused.

    With vLLM's ``enable_kv_cache_events`` (``--kv-events-config``) the step also says
    what the prefix cache gained and lost, the facts of vLLM's KV cache events:
    ``cached_runs`` the blocks of ``cached`` (same order) as runs of one request's
    consecutive blocks, ``{"block_ids", "hashes", "parent_hash", "token_ids"}``
    (``parent_hash``: the hash of the block before the run's first, null for a
    request's first block; ``token_ids``: block_size per block), and
    ``evicted_hashes`` the hash each block of ``evicted`` lost. Hashes are kvscope's
    (engine/core/kv_cache.py). Both are absent otherwise and in older recordings
    (read as empty).

    A KV cache of several groups, or with a sliding window
    (engine/core/kv_cache_coordinator.py), says which group each block change belongs to:
    ``allocated`` and ``freed`` list every group's blocks, group after group, and
    ``allocated_groups`` / ``freed_groups`` request id -> how many of them each group
    has; ``cached_groups`` / ``evicted_groups`` the group of each ``cached`` /
    ``evicted`` block. ``freed_by_window`` request id -> the blocks a sliding-window
    group released because they left the window while the request ran (never in
    ``freed``), ``freed_by_window_groups`` their counts per group. A ``cached_runs``
    entry carries its ``group_idx``. All absent for one full-attention group.

    What no fold can derive (issue 33), written when there is something to say:
    ``waiting_reasons`` request id -> [code, details...] (:data:`WAIT_REASONS`) for the
    first :data:`WAITING_REASONS_CAP` requests left waiting after the step's admissions, in
    queue order, and ``waiting_reasons_omitted`` how many more waited; ``prefix_lookups``
    request id -> [hit tokens, cause, details...] (:data:`PREFIX_CAUSES`) for each request
    admitted (new or resumed) with prefix caching on. Absent in older recordings.
    """

    type: ClassVar[str] = "step"
    written_when_set: ClassVar[frozenset[str]] = frozenset({"cached_runs", "evicted_hashes", "collective_s", "dp_rank",
                                                            "pipeline_bubble_s", "pipeline_bytes",
                                                            "collective_bytes", "collective_calls", "expert_counts",
                                                            "allocated_groups", "freed_groups", "cached_groups",
                                                            "evicted_groups", "freed_by_window",
                                                            "freed_by_window_groups", "waiting_reasons",
                                                            "waiting_reasons_omitted", "prefix_lookups",
                                                            "prompt_logprob_rows"})
    index: int = 0
    scheduled: dict[str, list[Any]] = field(default_factory=dict)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0  # after the step: finished requests' blocks already freed
    kv_blocks_cached_free: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used_forward: int = 0  # held during the forward pass (0 in recordings before it existed)
    kv_tokens_read: int = 0  # KV entries attention read: each scheduled context to its new tokens' end (0: older recording)
    allocated: dict[str, list[int]] = field(default_factory=dict)
    freed: dict[str, list[int]] = field(default_factory=dict)
    cached: list[int] = field(default_factory=list)
    evicted: list[int] = field(default_factory=list)
    cached_runs: list[dict[str, Any]] = field(default_factory=list)
    evicted_hashes: list[int] = field(default_factory=list)
    new: list[str] = field(default_factory=list)
    resumed: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    finished: dict[str, str] = field(default_factory=dict)
    prefix_queries_tokens: int = 0
    prefix_hits_tokens: int = 0
    duration_s: float = 0.0
    schedule_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    update_s: float = 0.0
    # Tensor parallelism (rank 0's view): seconds in the layers' all-reduces and the
    # logits gather, the bytes rank 0 contributed to them, and how many there were
    # (2 per layer + the embedding's + the gather). Absent with one rank.
    collective_s: float = 0.0
    collective_bytes: int = 0
    collective_calls: int = 0
    # Pipeline parallelism (engine/pipeline.py): per stage, the seconds it waited on the stage
    # before it (stage 0: on the last stage's results) and the activation bytes it sent. Absent with one stage.
    pipeline_bubble_s: list[float] = field(default_factory=list)
    pipeline_bytes: list[int] = field(default_factory=list)
    # A hybrid KV cache's groups (see the docstring); absent with one full-attention group.
    allocated_groups: dict[str, list[int]] = field(default_factory=dict)
    freed_groups: dict[str, list[int]] = field(default_factory=dict)
    cached_groups: list[int] = field(default_factory=list)
    evicted_groups: list[int] = field(default_factory=list)
    freed_by_window: dict[str, list[int]] = field(default_factory=dict)
    freed_by_window_groups: dict[str, list[int]] = field(default_factory=dict)
    # A mixture-of-experts model (engine/model/layers/moe.py): per MoE layer, in the model's order, the
    # tokens the router sent to each expert in this step (a row sums to tokens x top-k;
    # folded by engine/events/folds/expert_load.py). Absent for a dense model.
    expert_counts: list[list[int]] = field(default_factory=list)
    dp_rank: int = 0  # the data-parallel rank whose engine core it is; written only when not 0
    # Why requests waited and where prefix matches stopped (see the docstring).
    waiting_reasons: dict[str, list[Any]] = field(default_factory=dict)
    waiting_reasons_omitted: int = 0
    prefix_lookups: dict[str, list[Any]] = field(default_factory=dict)
    # vLLM's prompt_logprobs: the prompt positions the LM head ran on for them this step, beyond
    # the one sampled row per sequence every step has. Absent (0) when no request asked.
    prompt_logprob_rows: int = 0


@dataclass(slots=True)
class EncoderStepEvent(Event):
    """A vision-language step's encoder work and encoder-cache occupancy, published
    just before the step's ``step`` event (``index`` is the same) and only by runs of a
    model with an encoder, so text recordings stay as they were. ``encoded``: [request
    id, item index, tokens] the encoder produced this step; ``freed``: [request id,
    item index] whose embeddings left the cache after it (consumed by the prefill,
    preempted or finished); ``cache_used_tokens`` of ``cache_capacity_tokens`` after
    the step (vLLM's encoder cache budget)."""

    type: ClassVar[str] = "encoder.step"
    index: int = 0
    encoded: list[list[Any]] = field(default_factory=list)
    freed: list[list[Any]] = field(default_factory=list)
    encoder_tokens: int = 0
    cache_used_tokens: int = 0
    cache_capacity_tokens: int = 0
    encode_s: float = 0.0
