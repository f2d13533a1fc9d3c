"""The attention-backend interface shared by the torch (CPU) and Triton (GPU) paths.

Paged KV cache layout, one tensor per layer: ``[num_blocks, 2, block_size,
num_kv_heads, head_dim]`` (index 0 of dim 1 is K, 1 is V). Keeping K and V of a
block adjacent means one block id addresses both, which is what the block
tables of the scheduler hand out; token ``slot = block_id * block_size + offset``.

The batch is one flattened run of tokens from many sequences: sequence ``i``
owns query rows ``query_start_loc[i]:query_start_loc[i+1]``; those are its last
``q_len`` positions out of ``seq_lens[i]`` (cached context + new tokens), so a
prefill chunk attends causally to its cached context and to itself, and a
decode is simply ``q_len == 1``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from engine.model.attention.kv_quant import kv_cache_shape


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64; -1 = do not write
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [num_seqs] int32, context length including the new tokens
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    # Host copies, so CPU code can plan without device syncs.
    query_lens_cpu: list[int] | None = None
    seq_lens_cpu: list[int] | None = None
    # A backend's plan of this step's rows, made by its first layer and read by the others.
    layout: Any = field(default=None, compare=False, repr=False)

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> list[torch.Tensor]:
    """Zeroed per-layer caches; a quantized ``dtype`` gets its layout from
    :func:`engine.model.attention.kv_quant.kv_cache_shape` (int8 rows carry their scale)."""
    shape = kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]


class AttentionBackend(Protocol):
    """What a model layer needs from attention. Implementations: torch (CPU
    reference and fast path), triton (GPU; tested on CPU via TRITON_INTERPRET=1)."""

    name: str

    def check_kv_cache_dtype(self, dtype: torch.dtype) -> None:
        """Raise a UserError when this backend cannot use a cache stored in ``dtype``."""
        ...

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Store ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` at their slots."""
        ...

    def forward(
        self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """``query`` ``[num_tokens, num_heads, head_dim]`` -> output of the same shape.
        GQA: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.
        ``sliding_window`` W (a sliding-window layer): a query at position p sees the keys at
        positions p - W + 1 ... p only (transformers' and vLLM's rule); None: every earlier key."""
        ...
