"""The "who owns what" memory bar: outside the budget, weights, non-torch,
activation peak, graphs, and the KV pool split into used / cached-free / free."""

from __future__ import annotations

from rich.console import Group
from rich.text import Text
from textual.widgets import Static

from engine.events.view import EngineView

GiB = 1024**3
SEGMENT_COLOURS = {
    "outside budget": "#555555",
    "weights": "#4e79a7",
    "non-torch": "#bab0ac",
    "activation peak": "#f28e2b",
    "graphs": "#b07aa1",
    "KV used": "#59a14f",
    "KV cached-free": "#5fafd7",
    "KV free": "#2e4a2e",
}


def memory_segments(view: EngineView) -> list[tuple[str, float]]:
    """(label, bytes) of every slice, left to right; empty until the budget is known."""
    ledger = view.ledger
    total = float(ledger.get("total_bytes") or 0)
    if not total:
        return []
    util = float(ledger.get("gpu_memory_utilization") or 1.0)
    pool = float(ledger.get("kv_pool_bytes") or 0)
    blocks = view.num_blocks
    used_frac = view.kv_used / blocks if blocks else 0.0
    cached_frac = view.kv_cached_free / blocks if blocks else 0.0
    return [
        ("outside budget", total * (1.0 - util)),
        ("weights", float(ledger.get("weights_bytes") or 0)),
        ("non-torch", float(ledger.get("non_torch_bytes") or 0)),
        ("activation peak", float(ledger.get("activation_peak_bytes") or 0)),
        ("graphs", float(ledger.get("cuda_graph_bytes") or 0)),
        ("KV used", pool * used_frac),
        ("KV cached-free", pool * cached_frac),
        ("KV free", pool * max(0.0, 1.0 - used_frac - cached_frac)),
    ]


class MemoryBar(Static):
    """A stacked bar sized to the widget, with a GiB legend and the device reading."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__("memory: waiting for the budget (phase B)", **kwargs)  # type: ignore[arg-type]
        self._view: EngineView | None = None

    def update_view(self, view: EngineView) -> None:
        self._view = view
        self.update(self._render_bar())

    def on_resize(self) -> None:
        if self._view is not None:
            self.update(self._render_bar())

    def _render_bar(self) -> Group | Text:
        view = self._view
        if view is None:
            return Text("")
        segments = memory_segments(view)
        if not segments:
            return Text("memory: waiting for the budget (phase B)", style="dim")
        total = sum(b for _, b in segments)
        width = max(10, (self.size.width or 100) - 2)
        bar = Text()
        used_cells = 0
        for i, (label, size) in enumerate(segments):
            cells = round(width * size / total) if i < len(segments) - 1 else width - used_cells
            cells = max(0, min(cells, width - used_cells))
            used_cells += cells
            bar.append("█" * cells, style=SEGMENT_COLOURS[label])
        legend = Text()
        for label, size in segments:
            legend.append("■ ", style=SEGMENT_COLOURS[label])
            legend.append(f"{label} {size / GiB:.2f} GiB  ")
        ledger = view.ledger
        info = Text(
            f"total {float(ledger['total_bytes']) / GiB:.1f} GiB × util {float(ledger['gpu_memory_utilization'] or 1):.2f}"
            f" · KV {view.kv_used}/{view.num_blocks} blocks used, {view.kv_cached_free} cached-free",
            style="dim",
        )
        if view.device:
            dev = view.device
            if "total" in dev and "free" in dev:
                info.append(
                    f" · device ({dev.get('source', 'probe')}): {(dev['total'] - dev['free']) / GiB:.2f} GiB in use"
                )
            elif "rss" in dev:
                info.append(f" · process RSS {dev['rss'] / GiB:.2f} GiB")
        return Group(bar, legend, info)
