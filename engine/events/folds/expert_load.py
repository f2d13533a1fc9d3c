"""Expert load of a mixture-of-experts model, folded from step events.

A MoE model's step event carries ``expert_counts``: per MoE layer (in the model's order),
the tokens the router sent to each expert in that step (each token counts once for each
of its top-k experts, so a layer's row sums to ``tokens x k``). :class:`ExpertLoad` keeps
the last ``window`` steps' rows and says, per layer, each expert's share of the routed
tokens and the layer's imbalance, ``max / mean`` of its experts' counts (1.0: perfectly
even; ``num_experts`` when one expert takes everything). The EngineView (and through it the
monitor's expert panel and the ``/events`` snapshot) and the doctor's hot-expert rule read it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

DEFAULT_WINDOW = 64  # steps


@dataclass(frozen=True, slots=True)
class HotExpert:
    """The most loaded expert of the most imbalanced layer over the window."""

    layer: int  # index among the MoE layers
    expert: int
    tokens: int  # routed to it over the window
    layer_tokens: int  # routed to any expert of that layer over the window
    num_experts: int
    imbalance: float  # the layer's max / mean

    @property
    def share(self) -> float:
        return self.tokens / self.layer_tokens if self.layer_tokens else 0.0

    @property
    def even_share(self) -> float:
        return 1.0 / self.num_experts


class ExpertLoad:
    """Per-layer, per-expert routed-token counts summed over the last ``window`` steps
    (``window`` None: over every step, keeping no per-step rows: the doctor's whole run)."""

    def __init__(self, window: int | None = DEFAULT_WINDOW) -> None:
        self.window = window
        self.steps: deque[list[list[int]]] = deque(maxlen=window or 0)
        self.totals: list[list[int]] = []  # the window's sum, kept as steps enter and leave
        self.steps_seen = 0  # every step with counts, window or not

    @property
    def num_layers(self) -> int:
        return len(self.totals)

    @property
    def steps_in_window(self) -> int:
        return len(self.steps) if self.window is not None else self.steps_seen

    @property
    def num_experts(self) -> int:
        return len(self.totals[0]) if self.totals else 0

    def add(self, counts: Sequence[Sequence[int]]) -> None:
        """One step's ``expert_counts``."""
        rows = [list(map(int, row)) for row in counts]
        if not rows:
            return
        if [len(r) for r in rows] != [len(r) for r in self.totals]:
            self.steps.clear()  # another model (a new engine on the same stream): start over
            self.totals = [[0] * len(r) for r in rows]
            self.steps_seen = 0
        if self.window is not None and len(self.steps) == self.window:
            for total, old in zip(self.totals, self.steps[0], strict=True):
                for e, n in enumerate(old):
                    total[e] -= n
        if self.window is not None:
            self.steps.append(rows)
        for total, row in zip(self.totals, rows, strict=True):
            for e, n in enumerate(row):
                total[e] += n
        self.steps_seen += 1

    def layer_imbalance(self, layer: int) -> float:
        """``max / mean`` of the layer's expert counts over the window (1.0 with nothing routed)."""
        row = self.totals[layer]
        total = sum(row)
        return max(row) * len(row) / total if total else 1.0

    def imbalance(self) -> float:
        """The worst layer's imbalance (1.0 with no MoE layer or nothing routed)."""
        return max((self.layer_imbalance(i) for i in range(self.num_layers)), default=1.0)

    def expert_totals(self) -> list[int]:
        """Each expert's tokens summed over every MoE layer in the window."""
        return [sum(col) for col in zip(*self.totals, strict=True)] if self.totals else []

    def hot_expert(self) -> HotExpert | None:
        """The busiest expert of the most imbalanced layer, or None with nothing routed."""
        if not self.totals or not any(map(sum, self.totals)):
            return None
        layer = max(range(self.num_layers), key=self.layer_imbalance)
        row = self.totals[layer]
        expert = max(range(len(row)), key=row.__getitem__)
        return HotExpert(layer, expert, row[expert], sum(row), len(row), self.layer_imbalance(layer))

    def to_dict(self) -> dict[str, Any]:
        """The window's per-step rows (a snapshot; ``from_dict`` folds them again)."""
        return {"window": self.window, "steps": [list(map(list, s)) for s in self.steps],
                "steps_seen": self.steps_seen}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ExpertLoad:
        window = data.get("window", DEFAULT_WINDOW)
        load = cls(int(window) if window is not None else DEFAULT_WINDOW)
        for step in data.get("steps", []):
            load.add(step)
        load.steps_seen = int(data.get("steps_seen", load.steps_seen))
        return load
