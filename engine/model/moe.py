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
(gate rows then up rows) and ``w2 [experts, hidden, intermediate]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
