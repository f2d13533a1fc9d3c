"""One rank's slice of a Llama (engine/model/parallel.py says how it splits).

:class:`TensorParallelLlama` is :class:`~engine.model.families.llama.LlamaForCausalLM` built
with one rank's shapes (:func:`~engine.model.parallel.rank_model_config`): the same
layers, the same attention backend and paged KV pool, with three differences:

* the row-parallel O and down projections' partial sums are all-reduced
  (``DecoderLayer.reduce_rows``);
* the embedding looks up only this rank's vocabulary rows and all-reduces;
* the LM head's logits columns are gathered at rank 0 (other ranks get None).

Weights arrive whole (a GGUF, safetensors, the dequantized-weights cache, or dummy
weights drawn exactly as a one-rank model draws them) and each rank keeps its slice,
so TP=N computes what TP=1 computes, up to the order of float sums.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.model.attention.base import AttentionBackend
from engine.model.families.llama import LlamaForCausalLM
from engine.model.layers.projection_linear import fp32_linear
from engine.model.loading.hf_layout import HfLayout, dummy_fill
from engine.model.parallel import TensorParallel, kv_head_start, rank_model_config
from engine.modelspec.config import ModelConfig

_VOCAB_ROWS = ("model.embed_tokens.weight", "lm_head.weight")
# HF tensor suffix -> which dimension this rank slices and by what: column-parallel
# projections split their output rows, row-parallel ones their input columns.
_SPLIT_ROWS = {"self_attn.q_proj": "q", "self_attn.k_proj": "kv", "self_attn.v_proj": "kv",
               "mlp.gate_proj": "mlp", "mlp.up_proj": "mlp"}
_SPLIT_COLUMNS = {"self_attn.o_proj.weight": "q", "mlp.down_proj.weight": "mlp"}


class TensorParallelLayout(HfLayout):
    """Llama's checkpoint layout for one rank: each whole HF tensor sliced to this rank's part
    (:meth:`TensorParallelLlama.shard`) as it loads, and dummy weights drawn whole."""

    @torch.no_grad()
    def load(self, hf_name: str, tensor: torch.Tensor) -> None:
        super().load(hf_name, self.model.shard(hf_name, tensor))

    def whole_parameter_parts(self) -> tuple[LlamaForCausalLM, dict[str, list[tuple[str, int, int]]]]:
        """A one-rank model's shapes (on the meta device: no memory) and, per fused
        parameter name, the HF tensors it is made of: ``(hf name, row offset, rows)``."""
        model = self.model
        whole = LlamaForCausalLM(model.full_config, model.backend, dtype=model.dtype, device="meta")
        names = {id(p): n for n, p in whole.named_parameters()}
        parts: dict[str, list[tuple[str, int, int]]] = defaultdict(list)
        for hf_name in whole.hf_layout.names():
            target = whole.hf_layout.target(hf_name)
            assert target is not None
            param, offset, rows = target
            parts[names[id(param)]].append((hf_name, offset, rows))
        return whole, parts

    def load_whole_parameter(self, parts: list[tuple[str, int, int]], tensor: torch.Tensor) -> None:
        for hf_name, offset, rows in parts:
            self.load(hf_name, tensor[offset : offset + rows])

    @torch.no_grad()
    def init_dummy(self, seed: int = 0) -> int:
        """The dummy weights a one-rank model draws (same generator, same order, whole
        shapes), each rank keeping its slice: TP=N and TP=1 run the same model."""
        generator = torch.Generator(device="cpu").manual_seed(seed)
        whole, parts = self.whole_parameter_parts()
        count = 0
        for name, param in whole.named_parameters():
            tensor = torch.empty(param.shape, dtype=self.model.dtype)
            dummy_fill(name, tensor, generator)
            self.load_whole_parameter(parts[name], tensor)
            count += 1
        return count


class TensorParallelLlama(LlamaForCausalLM):
    layout_class = TensorParallelLayout
    hf_layout: TensorParallelLayout

    def __init__(self, config: ModelConfig, backend: AttentionBackend, tp: TensorParallel,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        super().__init__(rank_model_config(config, tp.world_size), backend, dtype=dtype, device=device)
        self.full_config = config
        self.tp = tp
        for layer in self.layers:
            layer.reduce_rows = tp.all_reduce  # type: ignore[assignment]
        local = self.config
        self._vocab_start = tp.rank * local.vocab_size
        kv0 = kv_head_start(config, tp.world_size, tp.rank)
        # kind -> (first, count) of this rank's rows/columns in the whole tensor
        self._slices = {
            "q": (tp.rank * local.num_attention_heads * local.head_dim, local.num_attention_heads * local.head_dim),
            "kv": (kv0 * local.head_dim, local.num_kv_heads * local.head_dim),
            "mlp": (tp.rank * local.intermediate_size, local.intermediate_size),
        }

    # ------------------------------------------------------------------ forward
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel lookup: this rank's rows, zeros for ids outside them, summed over ranks."""
        rows = self.config.vocab_size
        inside = (input_ids >= self._vocab_start) & (input_ids < self._vocab_start + rows)
        local_ids = torch.where(inside, input_ids - self._vocab_start, 0)
        hidden = F.embedding(local_ids, self.embed_tokens) * inside.unsqueeze(-1).to(self.dtype)
        return self.tp.all_reduce(hidden)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:  # type: ignore[override]
        """Rank 0: ``[rows, vocab]`` float32, every rank's columns gathered; other ranks: None. On CPU
        each rank's columns are float32 sums (``fp32_linear``), as the one-rank model's."""
        local = (fp32_linear(hidden, self.head_weight) if hidden.device.type == "cpu"
                 else F.linear(hidden, self.head_weight).float())
        logits = self.tp.gather_to_driver(local)
        return None if logits is None else logits[:, : self.full_config.vocab_size]

    # ------------------------------------------------------------------ weights
    def shard(self, hf_name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the whole HF tensor ``hf_name`` (norms whole)."""
        if hf_name in _VOCAB_ROWS:
            rows = self.config.vocab_size
            part = tensor[self._vocab_start : self._vocab_start + rows]
            if part.shape[0] < rows:  # the last rank's tail past the vocabulary: zero rows
                part = torch.cat([part, part.new_zeros(rows - part.shape[0], *part.shape[1:])])
            return part
        if not hf_name.startswith("model.layers."):
            return tensor
        rest = hf_name.split(".", 3)[3]
        stem = rest.rpartition(".")[0]  # weight or bias: the same rows
        if stem in _SPLIT_ROWS:
            first, count = self._slices[_SPLIT_ROWS[stem]]
            return tensor[first : first + count]
        if rest in _SPLIT_COLUMNS:
            first, count = self._slices[_SPLIT_COLUMNS[rest]]
            return tensor[:, first : first + count]
        return tensor

    @torch.no_grad()
    def load_cached_slices(self, path: Path) -> bool:
        """Fill this rank's slices from the dequantized-weights cache entry a one-rank
        start wrote (whole fused tensors); False when absent or of other shapes. A
        sharded model never writes the cache: the entry stays the whole model's."""
        from engine.model.loading.startup_cache import load_cached_tensors

        cached = load_cached_tensors(path)
        if cached is None:
            return False
        tensors, _ = cached
        whole, parts = self.hf_layout.whole_parameter_parts()
        shapes = {n: tuple(p.shape) for n, p in whole.named_parameters()}
        if set(tensors) != set(shapes):
            return False
        if any(tuple(tensors[n].shape) != shape or tensors[n].dtype != self.dtype for n, shape in shapes.items()):
            return False
        for name in shapes:
            self.hf_layout.load_whole_parameter(parts[name], tensors[name])
        return True
