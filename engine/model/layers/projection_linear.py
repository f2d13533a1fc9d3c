"""One projection's ``x @ W.T (+ bias)``, and the one place a step's way to multiply is chosen.

A projection (a decoder layer's ``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``, or the
model's LM head as ``"head"``) is a :class:`ProjectionLinear`. It owns its three ways to run, in
order: the kernel plan's route for the step's row count once a plan is installed
(engine/model/plan/routes.py); else its blocks' bound kernel (a
:class:`~engine.model.layers.quantized_linear.QuantizedLinear`, none on a float model) for steps
of at most ``max_rows`` rows; else the float weight through torch (the LM head's in float32 sums,
:func:`fp32_linear`).

The float weight stays a parameter of the module that holds the projection (the checkpoint
layout, the state dict and the weights cache name it there); the projection reads it by name,
drops it to a placeholder of its shape where no step multiplies by it (:func:`holds_nothing`),
and makes it again from its blocks (their values exactly).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from engine.model.layers.quantized_linear import QuantizedLinear
    from engine.model.plan.routes import Route

# fp32_linear multiplies a bf16/fp16 weight this many bytes of fp32 rows at a time: each
# slice is widened once into a buffer that stays in cache for its GEMM (widening the
# whole LM head per call cost ~50 ms at one row; Zen 4, indicative, loaded machine).
FP32_SLICE_BYTES = 2 << 20


def fp32_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x.float() @ weight.T`` summed and returned in float32 whatever ``weight``'s dtype: the
    LM head's logits in every dtype mode, so greedy decoding never picks among bf16-rounded
    ties (a bf16 GEMM rounds its output: "The" 25.375 vs "L" 25.375 where fp32 has 25.325
    vs 25.243). bf16 weights are widened exactly, a slice at a time; no fp32 copy is kept."""
    x = x.float()
    if weight.dtype == torch.float32:
        return F.linear(x, weight)
    rows = max(64, FP32_SLICE_BYTES // (4 * weight.shape[1]))
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32, device=x.device)
    for start in range(0, weight.shape[0], rows):
        out[:, start : start + rows] = F.linear(x, weight[start : start + rows].float())
    return out


def holds_nothing(t: torch.Tensor) -> bool:
    """A placeholder for a float weight not held: its shape over one element."""
    return not t.is_mkldnn and t.dim() == 2 and t.numel() > 1 and t.stride() == (0, 0)


def placeholder(like: torch.Tensor) -> nn.Parameter:
    """A parameter of ``like``'s shape and dtype that holds one element."""
    zero = torch.zeros(1, 1, dtype=like.dtype, device=like.device).expand(like.shape)
    return nn.Parameter(zero, requires_grad=False)


class ProjectionLinear:
    """One projection of ``owner`` (a decoder layer, or the model for the LM head): its blocks
    (``blocks``, None: float only), the kernel plan's route (``route``, None: no plan) and the
    float parameter ``owner.<attr>`` behind them. ``fp32_sums``: the torch path sums and returns
    float32 on CPU (the LM head's logits)."""

    __slots__ = ("attr", "blocks", "fp32_sums", "name", "owner", "route")

    def __init__(self, owner: nn.Module, name: str, attr: str | None = None, fp32_sums: bool = False) -> None:
        self.owner = owner
        self.name = name  # the kernel plan's target and the blocks' buffer names (``<name>_int4``)
        self.attr = attr or name
        self.fp32_sums = fp32_sums
        self.blocks: QuantizedLinear | None = None
        self.route: Route | None = None

    @property
    def weight(self) -> torch.Tensor:
        """The float weight ``[out, in]`` (a placeholder where it is not held)."""
        return cast(torch.Tensor, getattr(self.owner, self.attr))

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W.T (+ bias)``: the plan's route for this step's rows when there is one; else the
        blocks' kernel when bound and the step has at most ``max_rows`` rows; else the float
        weight through torch. The route and the kernel return float32 rows."""
        route, q = self.route, self.blocks
        if route is not None:
            out = route(x)
        elif q is not None and q.gemv is not None and x.shape[0] <= q.max_rows:
            out = q.gemv(x)
        elif self.fp32_sums and x.device.type == "cpu":
            out = fp32_linear(x, self.weight)
        else:
            return F.linear(x, self.weight, bias)
        return out if bias is None else out + bias

    def native(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` in the dtype its implementation computes in (the plan's bf16 GEMM: bf16, no
        cast back); without a route, as :meth:`__call__`."""
        return self.route.native(x) if self.route is not None else self(x)

    def computes_in(self, rows: int) -> torch.dtype | None:
        """The dtype a step of ``rows`` rows is cast to before the multiply (None: the rows' own)."""
        return self.route.computes_in(rows) if self.route is not None else None

    # ------------------------------------------------------------------ the float weight
    def holds_float(self) -> bool:
        return not holds_nothing(self.weight)

    def float_bytes(self) -> int:
        """Bytes the float weight takes when held (a placeholder's shape counts the same)."""
        weight = self.weight
        return weight.numel() * weight.element_size()

    def drop_float(self) -> int:
        """Replace the float weight by a placeholder of its shape; returns the bytes it held."""
        dropped = self.float_bytes()
        setattr(self.owner, self.attr, placeholder(self.weight))
        return dropped

    def restore_float(self) -> torch.Tensor:
        """The float weight made again from the blocks (their values exactly), in its own dtype."""
        assert self.blocks is not None, f"{self.name}: no blocks to make the float weight from"
        weight = nn.Parameter(self.blocks.dequantize().to(self.weight.dtype), requires_grad=False)
        setattr(self.owner, self.attr, weight)
        return weight
