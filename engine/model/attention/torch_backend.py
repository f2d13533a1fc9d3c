"""Paged attention in plain torch, for CPU (and as the reference for other backends).

No per-sequence Python loop: each layer gathers every sequence's context through
its block table in one gather (``gather_blocks``: ``kv_cache[block_tables]``), pads the
queries to ``[num_seqs, max_query_len]``, and makes ONE
``scaled_dot_product_attention`` call with a boolean mask (causal within the
new tokens, all cached context visible, padding hidden).

GQA without repeating K/V: the ``group`` query heads that share a KV head are
folded into the query-length axis, so SDPA sees ``[seqs, kv_heads, group *
q_len, head_dim]`` against ``[seqs, kv_heads, context, head_dim]``.

The masks and index tensors depend only on the batch and the layer's sliding
window (None for full attention), so they are built once per
:class:`AttentionMetadata` and window and reused by all layers of that kind. A
sliding-window layer (``sliding_window`` W) hides the keys older than its window:
a query at position p sees positions p - W + 1 ... p, as in transformers and vLLM.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.model.attention.base import AttentionMetadata
from engine.model.attention.kv_quant import (
    FP8_DTYPES,
    dequantize_from_cache,
    is_quantized,
    quantize_for_cache,
)


def gather_blocks(kv_cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``kv_cache[table]`` (the blocks a block table names, in its shape) by one ``index_select`` on
    the first dim: advanced indexing runs a slower, parallel kernel (Zen 4, a 10,922-block float32
    cache, 2 threads: 128 blocks 296 against 55 µs, one block 5.8 against 2.9 µs; on a loaded machine
    the indexing kernel's threads took up to 388 µs for one block)."""
    flat = kv_cache.index_select(0, table.reshape(-1).to(torch.int64))
    return flat.view(*table.shape, *kv_cache.shape[1:])


@dataclass(slots=True)
class _BatchPlan:
    num_blocks: int  # context blocks gathered per sequence
    mask: torch.Tensor  # [seqs, 1, group * max_q, context] bool, True = attend
    seq_index: torch.Tensor | None  # [tokens] sequence of each query row (None: pure decode)
    row_index: torch.Tensor | None  # [tokens] row within the sequence


class TorchAttentionBackend:
    name = "torch"

    def __init__(self) -> None:
        # Set by ModelRunner.enable_cpu_decode_kernel() (startup phase F): a
        # compiled kernel that reads the paged cache in place for pure decodes.
        self.decode_kernel: Callable[..., torch.Tensor] | None = None
        # Set with decode_kernel: the C++ kernels that attend every prefill chunk of a step over the
        # paged cache in one call, by plan name: "paged" (cpu_decode.paged_prefill, float32 sums) and,
        # over a bf16 cache on AVX512-BF16, "paged_bf16" (paged_prefill_bf16), where the plan chose them.
        self.prefill_kernels: dict[str, Callable[..., torch.Tensor]] = {}
        # Set by the kernel plan (engine/model/layers/kernel_routing.py KernelRouting.install_plan): per step-size class,
        # (chunk rows up to, how a chunk attends: "torch" SDPA in float32, "bf16" SDPA on q, K, V
        # rounded to bf16, or a prefill kernel's name). Empty: "torch".
        self.prefill_attention: tuple[tuple[int, str], ...] = ()
        self.kv_cache_dtype: torch.dtype | None = None  # the runner's cache dtype (check_kv_cache_dtype)
        self._plan_meta: AttentionMetadata | None = None
        self._plans: dict[tuple[int, int | None], _BatchPlan] = {}  # (group, window) -> plan of _plan_meta
        # slot_mapping -> (the mapping itself, its valid rows or None, K rows, V rows): one entry per
        # KV cache group of the step (a hybrid cache's groups alternate layer by layer)
        self._slot_cache: dict[int, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]] = {}

    def check_kv_cache_dtype(self, dtype: torch.dtype) -> None:
        """Every storage dtype works here: quantized caches are dequantized in torch
        (and read in place by the CPU decode kernel). Kept: the kernel plan times the prefill
        kernels over a cache of this dtype."""
        self.kv_cache_dtype = dtype

    # ------------------------------------------------------------------ cache writes
    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Store each token's K and V rows at its slot. Every layer of a step (of a KV cache
        group, with a hybrid cache) passes the same ``slot_mapping``, so the flat row indices
        (and the check for padding slots, a host sync) are computed once per mapping, and
        each write is one ``index_copy_``."""
        entry = self._slot_cache.get(id(slot_mapping))
        if entry is None or entry[0] is not slot_mapping:
            if len(self._slot_cache) >= 16:  # mappings of earlier steps
                self._slot_cache.clear()
            block_size = kv_cache.shape[2]
            valid = slot_mapping >= 0
            valid_rows = None if bool(valid.all()) else valid
            slots = slot_mapping if valid_rows is None else slot_mapping[valid]
            # Row of slot s in the cache viewed as [blocks * 2 * block_size, heads, width]:
            # block b's K rows start at 2*b*block_size, its V rows block_size later.
            k_rows = slots + torch.div(slots, block_size, rounding_mode="floor") * block_size
            entry = self._slot_cache[id(slot_mapping)] = (slot_mapping, valid_rows, k_rows, k_rows + block_size)
        _, valid_rows, k_rows, v_rows = entry
        if valid_rows is not None:
            key, value = key[valid_rows], value[valid_rows]
        rows = kv_cache.view(-1, *kv_cache.shape[3:])
        k_stored, v_stored = quantize_for_cache(key, kv_cache.dtype), quantize_for_cache(value, kv_cache.dtype)
        if kv_cache.dtype in FP8_DTYPES:  # index_copy_ has no fp8 kernel on CPU: copy the bytes
            rows, k_stored, v_stored = rows.view(torch.uint8), k_stored.view(torch.uint8), v_stored.view(torch.uint8)
        rows.index_copy_(0, k_rows, k_stored)
        rows.index_copy_(0, v_rows, v_stored)

    # ------------------------------------------------------------------ attention
    def _plan_for(self, meta: AttentionMetadata, group: int, block_size: int,
                  window: int | None = None) -> _BatchPlan:
        last = self._plan_meta
        # A plan reads only the query and sequence tensors, which a hybrid cache's group metadata share.
        if meta is not last and (last is None or meta.seq_lens is not last.seq_lens
                                 or meta.query_start_loc is not last.query_start_loc):
            self._plan_meta, self._plans = meta, {}
        plan = self._plans.get((group, window))
        if plan is None:
            plan = self._plans[(group, window)] = self._build_plan(meta, group, block_size, window)
        return plan

    @staticmethod
    def _build_plan(meta: AttentionMetadata, group: int, block_size: int, window: int | None) -> _BatchPlan:
        device = meta.seq_lens.device
        seq_lens = meta.seq_lens.to(torch.int64)
        num_blocks = -(-meta.max_seq_len // block_size)
        context = torch.arange(num_blocks * block_size, device=device)
        if meta.is_pure_decode:
            mask = context[None, :] < seq_lens[:, None]
            if window is not None:  # the query sits at seq_len - 1
                mask &= context[None, :] >= seq_lens[:, None] - window
            plan = _BatchPlan(num_blocks, mask[:, None, None, :], None, None)
        else:
            starts = meta.query_start_loc.to(torch.int64)
            query_lens = starts[1:] - starts[:-1]
            num_tokens = int(starts[-1])
            seq_index = torch.repeat_interleave(torch.arange(len(query_lens), device=device), query_lens)
            row_index = torch.arange(num_tokens, device=device) - starts[seq_index]
            # Row i of sequence b sits at absolute position (seq_len - q_len + i).
            row_pos = (seq_lens - query_lens)[:, None] + torch.arange(meta.max_query_len, device=device)[None, :]
            mask = (context[None, None, :] <= row_pos[:, :, None]) & (context[None, None, :] < seq_lens[:, None, None])
            if window is not None:
                mask &= context[None, None, :] > row_pos[:, :, None] - window
            mask = mask[:, None].expand(-1, group, -1, -1).reshape(len(query_lens), 1, group * meta.max_query_len, -1)
            plan = _BatchPlan(num_blocks, mask, seq_index, row_index)
        return plan

    def forward(
        self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        num_tokens, num_heads, head_dim = query.shape
        block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
        group = num_heads // num_kv_heads
        seqs = meta.num_seqs
        out_dtype = query.dtype
        if self.decode_kernel is not None:
            if meta.is_pure_decode:
                return self._decode(query, kv_cache, meta.block_tables, meta.seq_lens, scale,
                                    sliding_window).to(out_dtype)
            if meta.query_lens_cpu is not None and meta.seq_lens_cpu is not None:
                return self._mixed_with_kernel(query, kv_cache, meta, scale, group, sliding_window).to(out_dtype)
        plan = self._plan_for(meta, group, block_size, sliding_window)

        # [seqs, blocks, 2, block_size, kv_heads, width] -> K, V as [seqs, kv_heads, context, head_dim]
        gathered = gather_blocks(kv_cache, meta.block_tables[:, : plan.num_blocks])
        if is_quantized(kv_cache.dtype):  # attend in the model's dtype over the dequantized copy
            gathered = dequantize_from_cache(gathered, out_dtype)
        context_len = plan.num_blocks * block_size
        key = gathered[:, :, 0].reshape(seqs, context_len, num_kv_heads, head_dim).transpose(1, 2)
        value = gathered[:, :, 1].reshape(seqs, context_len, num_kv_heads, head_dim).transpose(1, 2)
        query = query.to(key.dtype)

        if plan.seq_index is None:  # pure decode: one query row per sequence, no padding
            q = query.view(seqs, num_kv_heads, group, head_dim)
            out = F.scaled_dot_product_attention(q, key, value, attn_mask=plan.mask, scale=scale)
            return out.reshape(num_tokens, num_heads, head_dim).to(out_dtype)

        max_q = meta.max_query_len
        padded = query.new_zeros(seqs, max_q, num_heads, head_dim)
        padded[plan.seq_index, plan.row_index] = query
        q = padded.view(seqs, max_q, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
        q = q.reshape(seqs, num_kv_heads, group * max_q, head_dim)
        out = F.scaled_dot_product_attention(q, key, value, attn_mask=plan.mask, scale=scale)
        out = out.view(seqs, num_kv_heads, group, max_q, head_dim).permute(0, 3, 1, 2, 4)
        out = out.reshape(seqs, max_q, num_heads, head_dim)
        return out[plan.seq_index, plan.row_index].to(out_dtype)

    def _prefill_choice(self, rows: int) -> str:
        """How a prefill chunk of ``rows`` tokens attends (the kernel plan's choice; "torch" without
        one). A prefill kernel this backend does not have (a stored plan's bf16 kernel over another
        cache dtype) falls back to the float32 one, or to SDPA."""
        choice = next((choice for limit, choice in self.prefill_attention if rows <= limit), "torch")
        if choice.startswith("paged") and choice not in self.prefill_kernels:
            return "paged" if "paged" in self.prefill_kernels else "torch"
        return choice

    def _decode(self, query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                seq_lens: torch.Tensor, scale: float, sliding_window: int | None) -> torch.Tensor:
        """The decode kernel, told the window only when there is one (a kernel set by a test
        may take the five arguments of full attention alone)."""
        assert self.decode_kernel is not None
        if sliding_window is None:
            return self.decode_kernel(query, kv_cache, block_tables, seq_lens, scale)
        return self.decode_kernel(query, kv_cache, block_tables, seq_lens, scale, sliding_window)

    def _mixed_with_kernel(
        self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float, group: int,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """A batch with prefill chunks: decodes go through the kernel together; the chunks
        the kernel plan gave to the paged prefill kernel go through it together, in place over
        the cache; every other chunk gets its own SDPA over exactly its context, so no
        padded [seqs, max_q, max_context] mask is built (causal within the chunk,
        all cached context visible; a sliding-window layer reads only the blocks
        its window reaches and masks the older keys of those)."""
        assert self.decode_kernel is not None and meta.query_lens_cpu is not None and meta.seq_lens_cpu is not None
        if not is_quantized(kv_cache.dtype) and query.dtype != torch.float32:  # a float32 query keeps its dtype over any cache
            query = query.to(kv_cache.dtype)
        out = torch.empty_like(query)
        layout = meta.layout
        if not isinstance(layout, _MixedLayout) or layout.owner is not self:  # once a step: the layers' rows match
            layout = meta.layout = _MixedLayout.of(self, meta.query_lens_cpu, self._prefill_choice,
                                                   set(self.prefill_kernels), query.device)
        starts, chunks, choices = layout.starts, layout.chunks, layout.choices
        if layout.decode_rows is not None:
            decode_index = layout.decode_index
            out[layout.decode_rows] = self._decode(query[layout.decode_rows], kv_cache, meta.block_tables[decode_index],
                                                   meta.seq_lens[decode_index], scale, sliding_window)
        for name, taken in layout.paged.items():  # each kernel's chunks in one call, reading the cache in place
            out[taken.rows] = self.prefill_kernels[name](
                query[taken.rows], kv_cache, meta.block_tables[taken.index], meta.seq_lens[taken.index],
                taken.offsets, scale, sliding_window).to(out.dtype)
        for i in chunks:
            if choices[i] in layout.paged:
                continue
            n = meta.query_lens_cpu[i]
            o = self._chunk_sdpa(query[starts[i] : starts[i] + n], kv_cache, meta.block_tables[i],
                                 meta.seq_lens_cpu[i], choices[i] == "bf16", scale, group, sliding_window)
            out[starts[i] : starts[i] + n] = o
        return out

    @staticmethod
    def _chunk_sdpa(q_rows: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, context: int,
                    bf16: bool, scale: float, group: int, sliding_window: int | None) -> torch.Tensor:
        """One prefill chunk's attention (``q_rows``: its ``[n, heads, head_dim]`` rows, the last
        ``n`` of ``context`` positions) by SDPA over exactly the blocks its rows see, gathered
        from the cache through ``block_table`` (its sequence's row); ``bf16``: q, K and V rounded
        to bf16 (the kernel plan's choice) when the rows are float32."""
        block_size, num_kv_heads, head_dim = kv_cache.shape[2], kv_cache.shape[3], q_rows.shape[2]
        n = q_rows.shape[0]
        # The first key any row of the chunk sees: 0, or the first row's window start.
        first = 0 if sliding_window is None else max(0, context - n - sliding_window + 1)
        first_block = first // block_size
        kv = gather_blocks(kv_cache, block_table[first_block : -(-context // block_size)])  # [blocks, 2, bs, kv, w]
        if is_quantized(kv_cache.dtype):
            kv = dequantize_from_cache(kv, q_rows.dtype)
        elif kv.dtype != q_rows.dtype:  # a bf16 cache under float32 queries: widened exactly
            kv = kv.to(q_rows.dtype)
        skipped = first_block * block_size  # positions before the gathered blocks
        # 4-D [1, heads, len, head_dim] with enable_gqa: torch's fused CPU kernel takes only
        # 4-D inputs; 3-D ones fall back to the math path (AVX2 Zen 3, 512 new rows over a
        # 1,024-token context, 9 heads: 54.5 -> 13.0 ms; causal 512 x 512: 14.1 -> 6.5 ms).
        key = kv[:, 0].reshape(-1, num_kv_heads, head_dim)[: context - skipped].transpose(0, 1)[None]
        value = kv[:, 1].reshape(-1, num_kv_heads, head_dim)[: context - skipped].transpose(0, 1)[None]
        q = q_rows.transpose(0, 1)[None]  # [1, heads, n, head_dim]
        if q.dtype == torch.float32 and bf16:  # torch's flash SDPA in bf16
            q, key, value = q.to(torch.bfloat16), key.to(torch.bfloat16), value.to(torch.bfloat16)
        if context == n and (sliding_window is None or n <= sliding_window):
            o = F.scaled_dot_product_attention(q, key, value, is_causal=True, scale=scale, enable_gqa=group > 1)
        else:  # row r sits at absolute position context - n + r and sees everything up to it (in its window)
            rows_pos = torch.arange(context - n, context, device=q_rows.device)[:, None]
            key_pos = torch.arange(skipped, context, device=q_rows.device)[None, :]
            mask = key_pos <= rows_pos
            if sliding_window is not None:
                mask &= key_pos > rows_pos - sliding_window
            o = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scale, enable_gqa=group > 1)
        return o[0].transpose(0, 1)


@dataclass(slots=True)
class _PagedChunks:
    """The chunks one prefill kernel takes together in a step."""

    index: torch.Tensor  # their sequences
    rows: slice | torch.Tensor  # their query rows
    offsets: torch.Tensor  # each one's first row within ``rows`` (and the total last)


@dataclass(slots=True)
class _MixedLayout:
    """Where a mixed step's decode rows and prefill chunks sit, and how each chunk attends:
    the same for every layer of the step, so made once (``AttentionMetadata.layout``)."""

    owner: object  # the backend whose prefill choices these are
    starts: list[int]  # row offset of each sequence's rows (and the total last)
    chunks: list[int]  # sequences with more than one new row
    choices: dict[int, str]  # chunk -> the kernel plan's prefill choice
    paged: dict[str, _PagedChunks]  # prefill kernel name -> the chunks it takes
    decode_index: torch.Tensor | None = None
    decode_rows: torch.Tensor | None = None

    @classmethod
    def of(cls, owner: object, query_lens: list[int], choice: Callable[[int], str], kernels: set[str],
           device: torch.device) -> _MixedLayout:
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        chunks = [i for i, n in enumerate(query_lens) if n > 1]
        choices = {i: choice(query_lens[i]) for i in chunks}
        paged = {}
        for name in sorted(kernels):
            taken = [i for i in chunks if choices[i] == name]
            if not taken:
                continue
            offsets = [0]
            for i in taken:
                offsets.append(offsets[-1] + query_lens[i])
            rows = (slice(starts[taken[0]], starts[taken[0] + 1]) if len(taken) == 1  # one chunk: a slice
                    else torch.cat([torch.arange(starts[i], starts[i + 1], device=device) for i in taken]))
            paged[name] = _PagedChunks(torch.tensor(taken, device=device), rows, torch.tensor(offsets))
        layout = cls(owner, starts, chunks, choices, paged)
        decodes = [i for i, n in enumerate(query_lens) if n == 1]
        if decodes:
            layout.decode_index = torch.tensor(decodes, device=device)
            layout.decode_rows = torch.tensor([starts[i] for i in decodes], device=device)
        return layout
