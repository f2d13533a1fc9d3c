"""ModelRunner: turns one step's plain batch description into model inputs, runs
the forward over the flattened tokens, and samples for the sequences that need it.

It knows nothing about the scheduler: a step is a list of :class:`ScheduledSeq`
(which tokens to compute, from which position, into which blocks).
"""

from __future__ import annotations

import contextlib
import math
import mmap
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from engine.core.kv_cache_groups import FULL, KVCacheGroup, config_groups
from engine.core.sampling_params import SamplingParams
from engine.errors import UserError
from engine.model import step_sampling
from engine.model.attention.base import AttentionBackend, AttentionMetadata, allocate_kv_cache
from engine.model.attention.kv_quant import kv_cache_shape, kv_cache_torch_dtype
from engine.model.attention.selector import get_attention_backend
from engine.model.cuda_graphs import DecodeGraphs
from engine.model.families.llama import LlamaForCausalLM
from engine.model.loading import weight_blocks
from engine.model.loading.gguf_blocks import read_gguf_blocks
from engine.model.loading.loader import LoadInfo, ProgressCallback, load_weights_into
from engine.model.parallel import TensorParallel
from engine.model.sampler import Sampler, TokenLogprobs
from engine.modelspec.config import CANONICAL_DTYPE, ModelConfig

if TYPE_CHECKING:
    from engine.model.cpu_caps import CpuCapabilities
    from engine.model.plan.kernel_plan import KernelPlan

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's share of a step."""

    request_id: str
    token_ids: list[int]  # the tokens computed this step (a prefill chunk, or the last token for a decode)
    start_position: int  # tokens already in the KV cache before this step
    block_ids: list[int]  # its whole block table when there is one KV cache group (else see block_tables)
    needs_sample: bool = True  # True when this step reaches the end of the known tokens
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # Its whole tables, one per KV cache group in the groups' order (the scheduler's
    # ``ScheduledRequest.block_tables``); what the runner reads. None: ``(block_ids,)``, the
    # one group of a caller that names one table.
    block_tables: Sequence[list[int]] | None = None
    # vLLM's prompt_logprobs (``sampling.prompt_logprobs`` alternatives): the prompt tokens this
    # chunk's rows predict, row i the token after position start_position + i (the prompt's
    # last position predicts an output token, so it has none). None: the LM head runs on the
    # sampled row only, as for every other request.
    prompt_targets: list[int] | None = None

    def __post_init__(self) -> None:
        if self.block_tables is None:
            self.block_tables = (self.block_ids,)


@dataclass(slots=True)
class StepTimings:
    prepare_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0


@dataclass(slots=True)
class PreparedBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    # One metadata per KV cache group: its block tables and slot mapping (the query and
    # sequence tensors are shared objects, so the backend plans a step once).
    metas: list[AttentionMetadata]
    sample_rows: torch.Tensor  # [num_sampled] index of each sampled sequence's last token
    sample_seqs: list[ScheduledSeq]
    sample_positions: list[int]  # position of the token each sampled row produces

    @property
    def meta(self) -> AttentionMetadata:
        """The first group's metadata (the only one with one group)."""
        return self.metas[0]

    @property
    def model_meta(self) -> AttentionMetadata | list[AttentionMetadata]:
        """What the model's forward takes: with one group its metadata serves every layer;
        with several, a layer reads ``meta[layer.kv_cache_group]``."""
        return self.metas[0] if len(self.metas) == 1 else self.metas


def zeroed_lazy_cpu_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor on anonymous mmap pages: the OS hands them out zeroed on first
    touch, so a 4 GiB KV pool costs nothing at startup (``torch.zeros`` writes
    every byte: ~12 s on this machine) and still never holds garbage (NaN in an
    unwritten slot would poison masked attention)."""
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with warnings.catch_warnings():  # "non-writable buffer": the mapping is writable; torch cannot tell
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buffer, dtype=dtype, count=numel).view(shape)


def _token_layout(batch: Sequence[ScheduledSeq],
                  query_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The flattened batch: its token ids, each sequence's start row (``starts``, one past
    the last too), each row's sequence (``seq_index``) and each row's position."""
    input_ids = torch.tensor([t for s in batch for t in s.token_ids], dtype=torch.int64)
    query_lens_t = torch.tensor(query_lens, dtype=torch.int64)
    starts = torch.zeros(len(batch) + 1, dtype=torch.int64)
    torch.cumsum(query_lens_t, 0, out=starts[1:])
    seq_index = torch.repeat_interleave(torch.arange(len(batch)), query_lens_t)
    start_positions = torch.tensor([s.start_position for s in batch], dtype=torch.int64)
    positions = start_positions[seq_index] + torch.arange(int(starts[-1])) - starts[seq_index]
    return input_ids, starts, seq_index, positions


def checked_block_tables(batch: Sequence[ScheduledSeq], seq_lens: list[int], num_groups: int,
                         block_size: int) -> list[Sequence[list[int]]]:
    """Each sequence's tables, one per KV cache group, checked to hold its tokens: groups share
    KV tensors, so one table for all would overwrite one group's pages with another's."""
    out: list[Sequence[list[int]]] = []
    for s, total in zip(batch, seq_lens, strict=True):
        tables = s.block_tables
        assert tables is not None  # __post_init__ made it
        if len(tables) != num_groups:
            raise ValueError(f"request {s.request_id}: {len(tables)} block tables for {num_groups} KV cache groups")
        for g, table in enumerate(tables):
            if len(table) * block_size < total:
                raise ValueError(f"request {s.request_id}: group {g}'s {len(table)} blocks cannot hold "
                                 f"{total} tokens")
        out.append(tables)
    return out


def torch_dtype(name: str) -> torch.dtype:
    canonical = CANONICAL_DTYPE.get(name.strip().lower(), "bfloat16" if name == "auto" else None)
    if canonical not in TORCH_DTYPES:
        raise UserError(f"--dtype {name!r}: use one of auto, bfloat16, float16, float32")
    return TORCH_DTYPES[canonical]


def build_model(model_config: ModelConfig, backend: AttentionBackend, parallel: TensorParallel | None,
                dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    """The model this rank runs: its family's class, or this rank's slice under tensor parallelism."""
    if parallel is not None and parallel.world_size > 1:
        from engine.model.families.parallel_llama import TensorParallelLlama

        return TensorParallelLlama(model_config, backend, parallel, dtype=dtype, device=device)
    from engine.modelspec.families import model_class_for

    return model_class_for(model_config)(model_config, backend, dtype=dtype, device=device)


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        dtype: str = "bfloat16",
        block_size: int = 16,
        device: str = "cpu",
        attention_backend: str = "torch",
        load_format: str = "auto",
        seed: int = 0,
        quantization: str | None = None,
        kv_cache_dtype: str = "auto",
        parallel: TensorParallel | None = None,
        kv_cache_groups: Sequence[KVCacheGroup] = (),
    ) -> None:
        """``parallel``: this rank's process group when ``--tensor-parallel-size`` > 1; the
        model is then this rank's slice and only rank 0 gets logits and samples.
        ``kv_cache_groups``: the KV cache groups (engine/core/kv_cache_groups.py; see
        :meth:`set_kv_cache_groups`); () is one full-attention group of every layer."""
        self.model_config = model_config
        self.parallel = parallel
        self.dtype = torch_dtype(dtype)
        # The cache's storage dtype (auto = the model's); int8/fp8 are dequantized by the attention backend.
        self.kv_cache_dtype = kv_cache_torch_dtype(kv_cache_dtype, self.dtype)
        self.block_size = block_size
        self.device = torch.device(device)
        self.load_format = load_format
        self.seed = seed
        if quantization is not None and quantization not in weight_blocks.QUANTIZATION_METHODS:
            raise UserError(f"--quantization {quantization!r}: use one of {', '.join(weight_blocks.QUANTIZATION_METHODS)} (or omit it)")
        self.quantization = quantization
        self.quantization_counts: dict[str, int] = {}  # "<format> <source>" -> weights (load_weights)
        self.backend = get_attention_backend(attention_backend, self.device)
        self.backend.check_kv_cache_dtype(self.kv_cache_dtype)  # a UserError before any weights load
        self.model = build_model(model_config, self.backend, parallel, self.dtype, self.device)
        self.sampler = Sampler(seed=seed)
        self.kv_caches: list[torch.Tensor] = []  # one per layer (layers may share a tensor)
        self.kv_tensors: list[torch.Tensor] = []  # the distinct KV tensors (one per layer, or per group slot)
        self.kv_cache_groups: tuple[KVCacheGroup, ...] = ()  # as a config names them: () for one full group
        self.block_table_groups: tuple[KVCacheGroup, ...] = ()  # the groups a step's tables come in
        self._layer_slots: list[int] = []
        self.set_kv_cache_groups(kv_cache_groups)
        self.last_timings = StepTimings()
        self.last_failed: dict[str, str] = {}  # request id -> why its sampling raised (the last execute)
        self.last_logprobs: dict[str, TokenLogprobs] = {}  # the last execute's, for requests that ask
        # the last forward's prompt logprobs (request id -> its chunk's, in position order) and how
        # many prompt rows the LM head ran on for them (0 when no request asked: the step event's
        # prompt_logprob_rows)
        self.last_prompt_logprobs: dict[str, list[TokenLogprobs]] = {}
        self.last_prompt_logprob_rows = 0
        self.decode_graphs: DecodeGraphs | None = None  # captured in phase F on CUDA
        self.kernel_plan: KernelPlan | None = None  # phase C on CPU (resolve_kernel_plan); None: the constants
        # A MoE model's tokens routed to each expert in the last forward, [MoE layer][expert];
        # None for a dense model. The step event carries it (expert_counts).
        self.last_expert_counts: list[list[int]] | None = None

    # ------------------------------------------------------------------ setup
    def load_weights(self, progress: ProgressCallback | None = None) -> LoadInfo:
        """Load (and quantize, with ``quantization``); ``weights_bytes`` counts every copy held.
        A GGUF whose own blocks the quantization takes is read as those blocks, mapped from
        the file, with no float copy (engine/model/loading/gguf_blocks.py)."""
        if self.reads_blocks():
            from engine.model.loading.gguf_blocks import load_as_blocks

            return load_as_blocks(self, progress)
        info = load_weights_into(self.model, self.model_config, self.load_format, progress, seed=self.seed)
        if self.quantization is not None:
            blocks = read_gguf_blocks(self.model_config, self.load_format) if self.device.type == "cpu" else {}
            self.quantization_counts = self.install_quantized(self.quantization, blocks, pack=True)
            info.weights_bytes = self.model.weights_bytes()
        return info

    def reads_blocks(self) -> bool:
        """Whether the weights load as the GGUF's own blocks: on CPU, one process holding the
        whole model, and a quantization that is the file's own (``--quantization auto``'s pick)."""
        from engine.model.loading.gguf_blocks import native_quantization

        if self.device.type != "cpu" or self.quantization is None or hasattr(self.model, "load_cached_slices"):
            return False
        return native_quantization(self.model_config, self.load_format)[0] == self.quantization

    def install_quantized(self, method: str, blocks: Mapping[str, tuple[str, torch.Tensor]],
                          pack: bool = True) -> dict[str, int]:
        """The quantized entries: from the startup cache when an int4/int8 layout (rows moved or
        interleaved at load) was stored for this shape (~0.3 s saved), else ``blocks`` (the
        GGUF's own) where the method takes their format, the rest packed from the floats
        (``pack``) or kept float."""
        from engine.model.kernels import cpu_gemv
        from engine.model.loading.loader import resolve_load_format, weights_location
        from engine.model.loading.startup_cache import (
            load_cached_tensors,
            quantized_path,
            save_cached_tensors,
        )

        on_cpu_gguf = self.device.type == "cpu" and resolve_load_format(self.model_config, self.load_format) == "gguf"
        entry = None
        if on_cpu_gguf and method in ("int4", "int8"):
            c = self.model.config
            layout = (f"x8={int(cpu_gemv.int8_activations_enabled())} heads={c.num_attention_heads}/{c.num_kv_heads} "
                      f"hidden={c.hidden_size} ffn={c.intermediate_size} vocab={c.vocab_size} pack={int(pack)}")
            entry = quantized_path(weights_location(self.model_config), self.dtype, method, layout)
        cached = load_cached_tensors(entry) if entry is not None else None
        if cached is not None:
            counts = weight_blocks.restore_quantized(self.model, *cached)
            if counts is not None:
                return counts
        counts = weight_blocks.quantize_weights(self.model, method, blocks, pack=pack)
        if entry is not None:
            with contextlib.suppress(OSError):  # a read-only cache folder: the next start quantizes again
                save_cached_tensors(entry, *weight_blocks.quantized_state(self.model, counts))
        return counts

    # ------------------------------------------------------------------ KV cache layout
    @property
    def hybrid_kv_cache(self) -> bool:
        """True when the layout is vLLM's hybrid one (several groups or a window: layers
        share KV tensors across groups); phase E then sizes the pool by the hybrid page
        (engine/budget/memory.py)."""
        return bool(self.kv_cache_groups)

    @property
    def layers_per_group(self) -> int:
        """KV tensors of the pool: the largest group's layer count (vLLM's uniform page)."""
        return max((len(g.layers) for g in self.block_table_groups), default=0)

    def set_kv_cache_groups(self, groups: Sequence[KVCacheGroup]) -> None:
        """Lay the KV cache out for ``groups`` (vLLM's layout): layer ``l`` of group ``g``
        reads and writes through group ``g``'s block tables and slot mapping, and the layers
        at the same position of every group share one KV tensor, so the pool is
        ``layers_per_group`` tensors of ``[num_blocks, 2, block_size, kv_heads, head_dim]``
        and one block id is one page in each. () is one full-attention group of every
        layer: one tensor per layer. A full-attention group may hold sliding-window layers
        (``disable_hybrid_kv_cache_manager``): they keep their whole past and mask it.
        Drops any allocated cache: call :meth:`allocate_kv_cache` after."""
        layers = self.model.layers
        named = config_groups(groups)
        resolved = named or (KVCacheGroup(FULL, tuple(range(len(layers)))),)
        if sorted(i for g in resolved for i in g.layers) != list(range(len(layers))):
            raise ValueError(f"KV cache groups {[g.layers for g in resolved]} do not cover the model's "
                             f"{len(layers)} layers exactly once")
        if len(resolved) > 1 and not all(hasattr(layer, "kv_cache_group") for layer in layers):
            raise UserError(f"{self.model_config.name}: its layers read one block table; the hybrid KV cache "
                            "serves models whose layers carry a KV cache group (Gemma 3)")
        slots = list(range(len(layers)))
        for g, group in enumerate(resolved):
            window = group.spec.sliding_window
            for slot, index in enumerate(group.layers):
                layer = layers[index]
                if window is not None and getattr(layer, "sliding_window", None) != window:
                    raise ValueError(f"layer {index} attends with window {getattr(layer, 'sliding_window', None)}, "
                                     f"its KV cache group {g} with {window}")
                if hasattr(layer, "kv_cache_group"):
                    layer.kv_cache_group = g
                slots[index] = slot
        self.kv_cache_groups = named
        self.block_table_groups = resolved
        self._layer_slots = slots
        self.kv_caches, self.kv_tensors = [], []

    @property
    def null_block_reserved(self) -> bool:
        """Whether the scheduler's pool keeps block 0 as the null block (a window group needs
        one): nothing outside a real request may write it."""
        return any(g.spec.is_sliding for g in self.block_table_groups)

    def allocate_kv_cache(self, num_blocks: int) -> list[torch.Tensor]:
        """The pool: one tensor per layer, or with KV cache groups one per position in a
        group (``layers_per_group``), shared by the layers at that position. Returns the
        per-layer list (shared tensors repeated)."""
        c = self.model.config  # this rank's KV heads under tensor parallelism
        count = self.layers_per_group
        if self.device.type == "cpu":
            shape = kv_cache_shape(num_blocks, self.block_size, c.num_kv_heads, c.head_dim, self.kv_cache_dtype)
            tensors = [zeroed_lazy_cpu_tensor(shape, self.kv_cache_dtype) for _ in range(count)]
        else:
            tensors = allocate_kv_cache(
                count, num_blocks, self.block_size, c.num_kv_heads, c.head_dim, self.kv_cache_dtype, self.device,
            )
        self.kv_tensors = tensors
        self.kv_caches = [tensors[slot] for slot in self._layer_slots]
        return self.kv_caches

    def enable_cpu_decode_kernel(self) -> str | None:
        """Route pure-decode attention through the compiled CPU kernel
        (engine/model/attention/cpu_decode.py). Returns None when enabled, else why not."""
        from engine.model.attention import cpu_decode
        from engine.model.attention.torch_backend import TorchAttentionBackend

        if self.device.type != "cpu" or not isinstance(self.backend, TorchAttentionBackend):
            return "only the torch backend on CPU uses it"
        if cpu_decode.load_kernel() is None:
            return cpu_decode.unavailable_reason() or "the kernel could not be built"
        self.backend.decode_kernel = cpu_decode.paged_decode
        if self.model.config.head_dim in cpu_decode.PREFILL_HEAD_DIMS:  # the kernel plan times them for prefill
            self.backend.prefill_kernels["paged"] = cpu_decode.paged_prefill
            if self.kv_cache_dtype == torch.bfloat16 and cpu_decode.bf16_prefill_available():
                self.backend.prefill_kernels["paged_bf16"] = cpu_decode.paged_prefill_bf16
        return None

    def resolve_kernel_plan(self, key: str, caps: CpuCapabilities, log: Any = None,
                            approximate: bool = True) -> KernelPlan | None:
        """The kernel plan for these weights on this CPU (pinned, stored under ``key``, or
        measured now), installed on the model (engine/model/plan/resolve.py); ``approximate``
        (``--dtype auto``) lets it pick bf16 and int8 weights too. The paged-decode
        kernel is switched on first: the fused layer is timed against the op-by-op layer on it."""
        from engine.model.plan.resolve import resolve

        self.enable_cpu_decode_kernel()
        self.kernel_plan = resolve(self.model, key, caps.native_bf16, caps.isa, log, approximate)
        return self.kernel_plan

    @property
    def num_blocks(self) -> int:
        return int(self.kv_caches[0].shape[0]) if self.kv_caches else 0

    # ------------------------------------------------------------------ one step
    def prepare(self, batch: Sequence[ScheduledSeq]) -> PreparedBatch:
        """One block-table tensor and slot mapping per KV cache group (a sliding-window
        group's table holds the null block, 0, where its window has passed; the new tokens'
        slots are always in real blocks, so nothing writes block 0), with the query and
        sequence tensors built once and shared by every group's metadata."""
        if not batch:
            raise ValueError("empty batch")
        bs, device = self.block_size, self.device
        query_lens = [len(s.token_ids) for s in batch]
        seq_lens = [s.start_position + n for s, n in zip(batch, query_lens, strict=True)]
        tables_of = checked_block_tables(batch, seq_lens, len(self.block_table_groups), bs)
        input_ids, starts, seq_index, positions = _token_layout(batch, query_lens)
        block_index, offset = positions // bs, positions % bs
        query_start_loc = starts.to(torch.int32).to(device)
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        metas: list[AttentionMetadata] = []
        for g in range(len(self.block_table_groups)):
            width = max(len(tables[g]) for tables in tables_of)
            block_tables = torch.tensor([tables[g] + [0] * (width - len(tables[g])) for tables in tables_of],
                                        dtype=torch.int32)
            slot_mapping = block_tables[seq_index, block_index].to(torch.int64) * bs + offset
            metas.append(AttentionMetadata(
                slot_mapping=slot_mapping.to(device), query_start_loc=query_start_loc, seq_lens=seq_lens_t,
                block_tables=block_tables.to(device), max_query_len=max(query_lens), max_seq_len=max(seq_lens),
                query_lens_cpu=query_lens, seq_lens_cpu=seq_lens,
            ))
        sample_seqs = [s for s in batch if s.needs_sample]
        sample_rows = torch.tensor(
            [int(starts[i + 1]) - 1 for i, s in enumerate(batch) if s.needs_sample], dtype=torch.int64
        )
        return PreparedBatch(
            input_ids=input_ids.to(device), positions=positions.to(device), metas=metas,
            sample_rows=sample_rows.to(device), sample_seqs=sample_seqs,
            sample_positions=[s.start_position + len(s.token_ids) for s in sample_seqs],
        )

    def compute_logits(self, batch: Sequence[ScheduledSeq]) -> tuple[PreparedBatch, torch.Tensor | None]:
        """Run the forward; logits ``[num_sampled, vocab]`` float32 for the sequences that need a
        sample (None on tensor-parallel ranks other than 0, which only lend their slices)."""
        if not self.kv_caches:
            raise RuntimeError("allocate_kv_cache() before execute()")
        t0 = time.perf_counter()
        prepared = self.prepare(batch)
        t1 = time.perf_counter()
        graphs = self.decode_graphs
        if graphs is not None and len(prepared.metas) == 1 and graphs.can_run(prepared.meta):
            hidden = graphs.run(prepared.input_ids, prepared.positions, prepared.meta)
        else:
            hidden = self.model(prepared.input_ids, prepared.positions, self.kv_caches, prepared.model_meta)
        logits = self.model.compute_logits(hidden[prepared.sample_rows])
        self.last_prompt_logprob_rows = 0
        self.last_prompt_logprobs, self.last_prompt_logprob_rows = step_sampling.prompt_logprobs(
            self.model, hidden, batch)
        t2 = time.perf_counter()
        self.last_timings = StepTimings(prepare_s=t1 - t0, forward_s=t2 - t1)
        counter = getattr(self.model, "expert_counter", None)  # a MoE model (engine/model/layers/moe.py)
        self.last_expert_counts = counter.take() if counter is not None else None
        return prepared, logits

    def execute(self, batch: Sequence[ScheduledSeq]) -> dict[str, int]:
        """One step: ``{request_id: sampled token id}`` for each sequence with ``needs_sample``."""
        prepared, logits = self.compute_logits(batch)
        if logits is None:
            return {}
        t0 = time.perf_counter()
        self.last_failed = {}
        sampled, self.last_logprobs = self.sample_logits(prepared, logits)
        self.last_timings.sample_s = time.perf_counter() - t0
        return sampled

    def sample_logits(self, prepared: PreparedBatch,
                      logits: torch.Tensor) -> tuple[dict[str, int], dict[str, TokenLogprobs]]:
        """Sample ``prepared``'s sampled rows from their ``logits``: the tokens, and the
        logprobs of the rows that ask. A row whose parameters raise goes into ``last_failed``
        (the caller clears it per step; a pipeline's rank 0 calls this per micro-batch)."""
        return step_sampling.sample_rows(self.sampler, prepared, logits, self.last_failed)

    def logits_for(self, batch: Sequence[ScheduledSeq]) -> dict[str, torch.Tensor]:
        """Like :meth:`execute` but returns each sampled sequence's logits (tests, scoring)."""
        prepared, logits = self.compute_logits(batch)
        if logits is None:
            return {}
        return {s.request_id: logits[i] for i, s in enumerate(prepared.sample_seqs)}

    # ------------------------------------------------------------------ compile
    def compile(self, warmup_rows: Sequence[int] = (1, 16)) -> float:
        """``torch.compile`` each layer's dense MLP block (norm, gate/up, SiLU*up,
        down, residual), with dynamic token counts so every batch shape the engine
        makes reuses one graph; attention stays eager (its shapes follow the block
        tables). Warms up at ``warmup_rows`` tokens; returns the seconds spent."""
        start = time.perf_counter()
        hidden = self.model_config.hidden_size
        for layer in self.model.layers:
            layer.mlp_block = torch.compile(layer.mlp_block, dynamic=True)  # type: ignore[method-assign]
        with torch.inference_mode():
            for rows in warmup_rows:
                x = torch.zeros(rows, hidden, dtype=self.dtype, device=self.device)
                for layer in self.model.layers:
                    layer.mlp_block(x)
        return time.perf_counter() - start

    # ------------------------------------------------------------------ warm-up
    def warm_up(self, max_num_seqs: int, progress: ProgressCallback | None = None) -> float:
        """Run one step of each shape class the engine makes (one decode, a decode
        batch, a prefill chunk beside decodes, a greedy and a top-k/top-p sample) so
        lazily built state (first kernel calls, oneDNN primitives, allocator pools)
        exists before the first request. It writes a few slots of the first blocks;
        a request only ever reads slots it wrote itself, so they hold no stale data
        anyone can see. Returns the seconds spent."""
        start = time.perf_counter()
        if not self.kv_caches:
            return 0.0
        # block 0 may be the null block (a window group's): never written, so the warm-up keeps off it
        first = 1 if self.null_block_reserved and self.num_blocks > 1 else 0
        blocks = [first + b % (self.num_blocks - first) for b in range(4)]
        greedy = SamplingParams(temperature=0.0)
        sampled = SamplingParams(temperature=1.0, top_k=50, top_p=0.9)
        decodes = max(1, min(max_num_seqs, 8))
        # every group on the same blocks: the warm-up's values are never read
        tables = [blocks] * len(self.block_table_groups)
        shapes = [
            [ScheduledSeq("warm-0", [0], 15, blocks, True, greedy, tables)],
            [ScheduledSeq(f"warm-{i}", [0], 15 + i, blocks, True, sampled, tables) for i in range(decodes)],
            [ScheduledSeq("warm-prefill", [0] * 32, 0, blocks, True, greedy, tables),
             ScheduledSeq("warm-decode", [0], 40, blocks, True, sampled, tables)],
        ]
        for done, batch in enumerate(shapes, 1):
            self.execute(batch)
            if progress:
                progress(done, len(shapes))
        return time.perf_counter() - start

    # ------------------------------------------------------------------ profiling
    def profile_run(self, max_num_batched_tokens: int, max_num_seqs: int) -> StepTimings:
        """One forward at the worst-case shape (``max_num_batched_tokens`` spread over
        ``max_num_seqs`` sequences, as vLLM's dummy run) plus a sampler pass over
        ``max_num_seqs x vocab`` logits with top-k/top-p on. Works with a KV cache
        of a few blocks (the dummy sequences share them); allocates one block if
        none exists yet and drops it after."""
        temporary = not self.kv_caches
        if temporary:
            self.allocate_kv_cache(1)
        try:
            num_seqs = max(1, min(max_num_seqs, max_num_batched_tokens))
            per_seq, extra = divmod(max_num_batched_tokens, num_seqs)
            first = 1 if self.null_block_reserved and self.num_blocks > 1 else 0  # keep off the null block
            params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9)
            batch = []
            for i in range(num_seqs):
                n = per_seq + (extra if i == num_seqs - 1 else 0)
                blocks = [first + b % (self.num_blocks - first) for b in range(-(-n // self.block_size))]
                tables = [blocks] * len(self.block_table_groups)
                batch.append(ScheduledSeq(f"profile-{i}", [0] * n, 0, blocks, True, params, tables))
            self.compute_logits(batch)
            t0 = time.perf_counter()
            dummy_logits = torch.randn(
                max_num_seqs, self.model_config.vocab_size, dtype=torch.float32, device=self.device
            )
            self.sampler.sample(dummy_logits, [params] * max_num_seqs)
            self.last_timings.sample_s = time.perf_counter() - t0
            return self.last_timings
        finally:
            if temporary:
                self.kv_caches = []
