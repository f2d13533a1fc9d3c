"""The sparse mixture-of-experts MLP block: route each token to its top-k experts, then
run every active expert once on the tokens routed to it.

Routing is transformers' (and vLLM's ``fused_topk``): router logits ``x @ W_gate.T``,
softmax in float32, the top ``k`` probabilities, renormalised to sum 1 when the family
says so (Qwen3-MoE's ``norm_topk_prob``, Mixtral always). Experts are grouped, not
looped over tokens: the ``tokens x k`` assignments are sorted by expert (one argsort), the
rows gathered in that order with one ``index_select``, each expert with tokens runs its
SwiGLU on its contiguous slice (one matmul pair per active expert, none for an idle one),
and the weighted rows are summed back into their tokens with one ``index_add_``. The
per-expert token counts the slicing needs come from ``torch.bincount`` on the top-k ids:
they are also what the step event carries (:class:`ExpertCounter`), so observing the
experts costs nothing extra.

Expert weights are stored as vLLM stores them: ``w13 [experts, 2 * intermediate, hidden]``
(gate rows then up rows) and ``w2 [experts, hidden, intermediate]``. :class:`SparseMoeMLP`
holds one layer's router and experts and fills them from a family's HF names
(:class:`ExpertNames`); the two mixins make a family's layer and model sparse
(engine/model/families/qwen3_moe.py, engine/model/families/qwen2_moe.py, engine/model/families/mixtral.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.attention.base import AttentionBackend
from engine.model.families.llama import DecoderLayer, LlamaForCausalLM
from engine.model.kernels.cpu_norm import rms_norm
from engine.model.loading.hf_layout import HfLayout
from engine.modelspec.config import ModelConfig


def route(x: torch.Tensor, router_weight: torch.Tensor, top_k: int,
          renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [tokens, k] in x's dtype, expert ids [tokens, k] int64)`` for ``x [tokens, hidden]``."""
    probs = torch.softmax(F.linear(x, router_weight), dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(x.dtype), ids


def grouped_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                    ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts' weighted SwiGLU outputs summed per token ``[tokens, hidden]``, and the
    tokens routed to each expert ``[experts]`` (int64; sums to ``tokens x k``)."""
    num_experts = w13.shape[0]
    intermediate = w2.shape[2]
    top_k = ids.shape[1]
    flat_ids = ids.reshape(-1)
    counts = torch.bincount(flat_ids, minlength=num_experts)
    order = torch.argsort(flat_ids, stable=True)  # assignments grouped by expert
    token_of = order // top_k  # each sorted assignment's token row
    rows = x.index_select(0, token_of)
    out_rows = torch.empty_like(rows)
    start = 0
    for expert, n in enumerate(counts.tolist()):  # experts, not tokens: idle ones are skipped
        if n == 0:
            continue
        segment = rows[start:start + n]
        gate_up = F.linear(segment, w13[expert])
        hidden = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
        out_rows[start:start + n] = F.linear(hidden, w2[expert])
        start += n
    out_rows.mul_(weights.reshape(-1).index_select(0, order)[:, None])
    out = torch.zeros_like(x)
    out.index_add_(0, token_of, out_rows)
    return out, counts


class ExpertCounter:
    """Tokens routed to each expert, per MoE layer, summed over the forwards since the last
    :meth:`take` (a step's, read by the runner after its forward). ``layers``: the model's
    layer index of each MoE layer, in order."""

    def __init__(self, layers: list[int], num_experts: int) -> None:
        self.layers = layers
        self.num_experts = num_experts
        self._counts: torch.Tensor | None = None

    def add(self, slot: int, counts: torch.Tensor) -> None:
        if self._counts is None:
            self._counts = torch.zeros(len(self.layers), self.num_experts, dtype=torch.int64, device=counts.device)
        self._counts[slot] += counts

    def take(self) -> list[list[int]] | None:
        """The counts since the last take (``[moe layer][expert]``), or None if no forward ran."""
        counts, self._counts = self._counts, None
        return None if counts is None else counts.tolist()


@dataclass(frozen=True, slots=True)
class ExpertNames:
    """A family's HF tensor names for its MoE MLP, under ``model.layers.N.``: the router's,
    the experts' prefix (``<prefix><e>.<name>``) and the gate / up / down projections'; a
    shared expert's prefix and its sigmoid gate's (Qwen2-MoE), when the family has one."""

    router: str
    experts: str
    gate: str
    up: str
    down: str
    shared: str | None = None
    shared_gate: str | None = None

    def layer_names(self, num_experts: int, shared: bool = False) -> list[str]:
        names = [self.router, *(f"{self.experts}{e}.{t}" for e in range(num_experts)
                                for t in (self.gate, self.up, self.down))]
        if shared and self.shared is not None and self.shared_gate is not None:
            names += [*(f"{self.shared}{t}" for t in (self.gate, self.up, self.down)), self.shared_gate]
        return names


# A GGUF's stacked expert tensors ([experts, out, in] per projection; engine/modelspec/families.py
# names them so under model.layers.N.): which part of w13 / w2 each fills.
STACKED_EXPERTS = {"mlp.experts.gate_proj": "gate", "mlp.experts.up_proj": "up", "mlp.experts.down_proj": "down"}

QWEN_MOE_NAMES = ExpertNames("mlp.gate.weight", "mlp.experts.", "gate_proj.weight", "up_proj.weight",
                             "down_proj.weight")
QWEN2_MOE_NAMES = ExpertNames("mlp.gate.weight", "mlp.experts.", "gate_proj.weight", "up_proj.weight",
                              "down_proj.weight", shared="mlp.shared_expert.",
                              shared_gate="mlp.shared_expert_gate.weight")
MIXTRAL_NAMES = ExpertNames("block_sparse_moe.gate.weight", "block_sparse_moe.experts.", "w1.weight", "w3.weight",
                            "w2.weight")


class SparseMoeMLP(nn.Module):
    """A layer's router and experts (vLLM's layout: ``w13`` gate then up rows, ``w2`` down),
    and a shared expert every token runs, scaled by ``sigmoid(x @ shared_gate.T)``, when the
    config has ``shared_expert_intermediate_size`` (Qwen2-MoE)."""

    def __init__(self, config: ModelConfig, names: ExpertNames, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        assert config.num_experts and config.num_experts_per_tok and config.moe_intermediate_size
        h, e, i = config.hidden_size, config.num_experts, config.moe_intermediate_size
        self.names = names
        self.num_experts = e
        self.top_k = config.num_experts_per_tok
        self.intermediate_size = i
        self.renormalize = bool(config.norm_topk_prob)

        def empty(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)

        self.router = empty(e, h)
        self.w13 = empty(e, 2 * i, h)
        self.w2 = empty(e, h, i)
        self.shared_size = config.shared_expert_intermediate_size or 0
        self.shared_w13 = empty(2 * self.shared_size, h) if self.shared_size else None
        self.shared_w2 = empty(h, self.shared_size) if self.shared_size else None
        self.shared_gate = empty(1, h) if self.shared_size else None
        self.counter: ExpertCounter | None = None  # set by the model
        self.slot = 0  # this layer's row in the counter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(x, self.router, self.top_k, self.renormalize)
        out, counts = grouped_experts(x, self.w13, self.w2, weights, ids)
        if self.counter is not None:
            self.counter.add(self.slot, counts)
        if self.shared_w13 is not None and self.shared_w2 is not None and self.shared_gate is not None:
            gate_up = F.linear(x, self.shared_w13)
            shared = F.linear(F.silu(gate_up[:, :self.shared_size]) * gate_up[:, self.shared_size:], self.shared_w2)
            out += torch.sigmoid(F.linear(x, self.shared_gate)) * shared
        return out

    def load_stacked(self, part: str, tensor: torch.Tensor) -> None:
        """Every expert's ``part`` (gate / up / down) from one ``[experts, out, in]`` tensor."""
        i = self.intermediate_size
        target = {"gate": self.w13[:, :i], "up": self.w13[:, i:], "down": self.w2}[part]
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(f"stacked experts' {part}: shape {tuple(tensor.shape)} does not fit {tuple(target.shape)}")
        target.copy_(tensor)

    def target(self, rest: str) -> tuple[torch.Tensor, int, int] | None:
        """``(parameter, row offset, rows)`` an HF name under ``model.layers.N.`` fills."""
        names = self.names
        if rest == names.router:
            return self.router, 0, self.num_experts
        if self.shared_w13 is not None and self.shared_w2 is not None and self.shared_gate is not None:
            shared = {f"{names.shared}{names.gate}": (self.shared_w13, 0, self.shared_size),
                      f"{names.shared}{names.up}": (self.shared_w13, self.shared_size, self.shared_size),
                      f"{names.shared}{names.down}": (self.shared_w2, 0, self.shared_w2.shape[0]),
                      str(names.shared_gate): (self.shared_gate, 0, 1)}
            if rest in shared:
                return shared[rest]
        if not rest.startswith(names.experts):
            return None
        index_str, _, tensor = rest[len(names.experts):].partition(".")
        if not index_str.isdigit() or int(index_str) >= self.num_experts:
            return None
        expert, i = int(index_str), self.intermediate_size
        table = {names.gate: (self.w13[expert], 0, i), names.up: (self.w13[expert], i, i),
                 names.down: (self.w2[expert], 0, self.w2.shape[1])}
        return table.get(tensor)


class SparseLayerMixin(DecoderLayer):
    """A decoder layer whose MLP is sparse where the config says so (``is_moe_layer``): put
    before the family's layer class (a ``DecoderLayer``) and set ``expert_names``; it replaces
    the dense MLP in ``mlp_block``."""

    expert_names: ExpertNames  # the family's HF names for its router and experts
    moe: SparseMoeMLP | None

    def __init__(self, config: ModelConfig, index: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__(config, dtype, device)  # the family's layer class
        self.make_sparse(config, index, self.expert_names, dtype, device)

    def make_sparse(self, config: ModelConfig, index: int, names: ExpertNames, dtype: torch.dtype,
                    device: torch.device | str) -> None:
        self.moe = None
        if config.is_moe_layer(index):
            # Llama's dense MLP is not in a sparse layer: empty, so the inherited name table still reads
            h = config.hidden_size
            self.gate_up_proj = nn.Parameter(torch.empty(0, h, dtype=dtype, device=device), requires_grad=False)
            self.down_proj = nn.Parameter(torch.empty(h, 0, dtype=dtype, device=device), requires_grad=False)
            self.moe = SparseMoeMLP(config, names, dtype, device)

    def mlp_block(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.moe is None:
            return super().mlp_block(hidden)
        return hidden + self.moe(rms_norm(hidden, self.post_attention_layernorm, self.eps))

    def fused_decode_args(self) -> None:
        """The fused C++ decode layer is Llama's dense shape: never here."""
        return None


class SparseLayout(HfLayout):
    """A family's checkpoint layout with sparse layers: the router and each expert's weights by
    the family's HF names (or stacked, as a GGUF holds them), no dense MLP in a sparse layer."""

    def sparse_layer(self, hf_name: str) -> tuple[SparseMoeMLP, str] | None:
        prefix, _, rest = hf_name.partition("model.layers.")
        if prefix or not rest:
            return None
        index_str, _, tail = rest.partition(".")
        layers = self.model.layers
        if not index_str.isdigit() or int(index_str) >= len(layers):
            return None
        moe = layers[int(index_str)].moe
        return (moe, tail) if moe is not None else None

    def target(self, hf_name: str) -> tuple[torch.Tensor, int, int] | None:
        sparse = self.sparse_layer(hf_name)
        if sparse is not None:
            moe, tail = sparse
            found = moe.target(tail)
            if found is not None or tail.startswith(("mlp.", moe.names.experts, moe.names.router)):
                return found  # a dense MLP name in a sparse layer fills nothing
        return super().target(hf_name)

    @torch.no_grad()
    def load(self, hf_name: str, tensor: torch.Tensor) -> None:
        sparse = self.sparse_layer(hf_name)
        if sparse is not None and sparse[1] in STACKED_EXPERTS:
            sparse[0].load_stacked(STACKED_EXPERTS[sparse[1]], tensor)
            return
        super().load(hf_name, tensor)

    def missing(self, seen: set[str]) -> set[str]:
        """A layer's experts loaded from stacked tensors (a GGUF) cover their per-expert names."""
        covered = set(seen)
        for index, layer in enumerate(self.model.layers):
            moe = layer.moe
            if moe is not None and all(f"model.layers.{index}.{n}" in seen for n in STACKED_EXPERTS):
                names = moe.names
                covered.update(f"model.layers.{index}.{names.experts}{e}.{t}" for e in range(moe.num_experts)
                               for t in (names.gate, names.up, names.down))
        return super().missing(covered)

    def names(self) -> list[str]:
        names = [n for n in super().names()
                 if not ((s := self.sparse_layer(n)) is not None and s[1].startswith("mlp."))]
        for index, layer in enumerate(self.model.layers):
            if layer.moe is not None:
                moe = layer.moe
                names.extend(f"model.layers.{index}.{n}"
                             for n in moe.names.layer_names(moe.num_experts, moe.shared_w13 is not None))
        return names


class SparseModelMixin(LlamaForCausalLM):
    """A model with sparse layers (put before the family's model class, a ``LlamaForCausalLM``,
    and set ``layer_class``): their expert weights by the family's HF names, one
    :class:`ExpertCounter` over every MoE layer, and no quantized copies (they cover dense
    projections only)."""

    family_label = "this MoE family"
    layer_class: type[SparseLayerMixin]  # the family's sparse decoder layer
    layout_class: type[HfLayout] = SparseLayout

    def __init__(self, config: ModelConfig, backend: AttentionBackend, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cpu") -> None:
        super().__init__(config, backend, dtype, device)  # the family's model class
        self.attach_expert_counter(int(config.num_experts or 0))
        self.fused_layer_refusal = (f"the fused C++ layer is Llama's dense shape ({self.family_label} runs its "
                                    "layers op by op)")
        self.quantization_refusal = (f"the weight-only quantized copies cover dense projections; kvscope runs "
                                     f"{self.family_label}'s experts in float (use --quantization none)")

    def _make_layer(self, index: int, config: ModelConfig, dtype: torch.dtype,
                    device: torch.device | str) -> nn.Module:
        return self.layer_class(config, index, dtype, device)

    def attach_expert_counter(self, num_experts: int) -> None:
        moe_layers = [i for i, layer in enumerate(self.layers) if layer.moe is not None]
        self.expert_counter = ExpertCounter(moe_layers, num_experts)
        for slot, index in enumerate(moe_layers):
            self.layers[index].moe.counter = self.expert_counter
            self.layers[index].moe.slot = slot

