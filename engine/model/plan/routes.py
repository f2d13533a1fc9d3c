"""A plan's choices installed on one projection: ``Route`` runs the implementation chosen for
the step's row count (engine/model/layers/kernel_routing.py ``KernelRouting.install_plan`` builds one
per projection, and the projection's ``ProjectionLinear`` runs it)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from engine.model.plan.candidates import Implementation, implementation

if TYPE_CHECKING:
    import torch


class Route:
    """One projection's implementation by step size: the first whose row limit holds."""

    __slots__ = ("impls", "limits")

    def __init__(self, limits: Sequence[int], impls: Sequence[Implementation]) -> None:
        self.limits = tuple(limits)
        self.impls = tuple(impls)

    def _for(self, rows: int) -> Implementation:
        for limit, impl in zip(self.limits, self.impls, strict=True):
            if rows <= limit:
                return impl
        return self.impls[-1]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._for(x.shape[0]).call(x)

    def native(self, x: torch.Tensor) -> torch.Tensor:
        """The output in the dtype the implementation computes in (no cast back)."""
        impl = self._for(x.shape[0])
        return (impl.native or impl.call)(x)

    def computes_in(self, rows: int) -> torch.dtype | None:
        """The dtype a step of ``rows`` rows is cast to (None: the rows' own)."""
        return self._for(rows).computes_in


def build_route(choices: Sequence[tuple[int, str]], weight: torch.Tensor, quantized: Any,
                gemv_kernel: Any, group: str = "") -> tuple[Route, dict[str, torch.Tensor]]:
    """The route for ``choices`` (``(row limit, candidate)`` per class, in order; the last
    class unbounded) and the copies it keeps."""
    limits: list[int] = []
    impls: list[Implementation] = []
    made: dict[str, Implementation] = {}
    last = None
    for limit, candidate in choices:
        if candidate not in made:
            made[candidate] = implementation(candidate, weight, quantized, gemv_kernel, group)
        if candidate == last:
            limits[-1] = limit  # same candidate as the class below: one range
            continue
        limits.append(limit)
        impls.append(made[candidate])
        last = candidate
    limits[-1] = 1 << 62
    extra = {name: t for impl in made.values() for name, t in impl.extra.items()}
    return Route(limits, impls), extra

