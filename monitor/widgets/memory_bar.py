"""The "who owns what" memory bar, scaled to the device's total: outside the
budget, weights, non-torch, activation peak, graphs, the KV pool split into
used / cached-free / free, and the part of the budget nothing holds."""

from __future__ import annotations

from rich.console import Group
from rich.text import Text
from textual.widgets import Static

from engine.events.folds.view import EngineView
from monitor.widgets.legend import wrap_items

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
    "budget unused": "#262626",
}
ALWAYS_SHOWN = frozenset({"outside budget", "KV used", "KV cached-free", "KV free", "budget unused"})


def memory_segments(view: EngineView) -> list[tuple[str, float]]:
    """(label, bytes) of every slice, left to right; empty until the budget is known.

    The slices add up to the device total (more only when the budget's holders
    overrun it): ``budget unused`` is what the budget (total × utilization) leaves
    after weights, non-torch, activation peak, graphs and the KV pool."""
    ledger = view.ledger
    total = float(ledger.get("total_bytes") or 0)
    if not total:
        return []
    util = float(ledger.get("gpu_memory_utilization") or 1.0)
    pool = float(ledger.get("kv_pool_bytes") or 0)
    blocks = view.num_blocks
    per_block = pool / blocks if blocks else 0.0
    free_blocks = max(0, blocks - view.kv_used - view.kv_cached_free) if blocks else 0
    held = [
        ("weights", float(ledger.get("weights_bytes") or 0)),
        ("non-torch", float(ledger.get("non_torch_bytes") or 0)),
        ("activation peak", float(ledger.get("activation_peak_bytes") or 0)),
        ("graphs", float(ledger.get("cuda_graph_bytes") or 0)),
        ("KV used", per_block * view.kv_used),
        ("KV cached-free", per_block * view.kv_cached_free),
        ("KV free", per_block * free_blocks if blocks else pool),
    ]
    budget = total * util
    return [
        ("outside budget", total * (1.0 - util)),
        *held,
        ("budget unused", max(0.0, budget - sum(b for _, b in held))),
    ]


def bar_cells(sizes: list[float], width: int) -> list[int]:
    """Cells per slice for a bar ``width`` wide scaled to ``sum(sizes)``: largest
    remainder, and at least one cell for every slice that holds anything (taken
    from the widest), so a small slice never vanishes."""
    total = sum(sizes)
    if total <= 0 or width <= 0:
        return [0] * len(sizes)
    exact = [width * s / total for s in sizes]
    cells = [max(1 if s > 0 else 0, int(e)) for s, e in zip(sizes, exact, strict=True)]
    by_remainder = sorted(range(len(sizes)), key=lambda i: exact[i] - int(exact[i]), reverse=True)
    for i in by_remainder:
        if sum(cells) >= width:
            break
        if sizes[i] > 0:
            cells[i] += 1
    while sum(cells) > width:
        widest = max(range(len(cells)), key=lambda i: cells[i])
        if cells[widest] <= 1:
            break
        cells[widest] -= 1
    return cells


def legend_lines(items: list[tuple[str, float]], width: int) -> list[Text]:
    """``■ weights 14.96 GiB`` per slice, wrapped between items, never inside one."""
    return wrap_items((Text(f"■ {label} {size / GiB:.2f} GiB", style=SEGMENT_COLOURS[label])
                       for label, size in items), width)


def rank_ledger_lines(view: EngineView) -> list[Text]:
    """Tensor parallelism: each rank's own ledger (the bar above is rank 0's, per device)."""
    lines = []
    for rank in sorted(view.rank_ledgers):
        ledger = view.rank_ledgers[rank]
        lines.append(Text(
            f"rank {rank}: weights {float(ledger.get('weights_bytes') or 0) / GiB:.2f} GiB · activation peak "
            f"{float(ledger.get('activation_peak_bytes') or 0) / GiB:.2f} GiB · KV pool "
            f"{float(ledger.get('kv_pool_bytes') or 0) / GiB:.2f} GiB ({int(ledger.get('num_blocks') or 0):,} blocks)",
            style="dim"))
    return lines


def occupancy_text(view: EngineView) -> str:
    """The KV pool by token slots (engine/events/folds/kv_occupancy.py): what the held blocks hold,
    and per KV cache group when there are several; empty until the block size is known."""
    occupancy = view.occupancy
    if not occupancy.total_slots:
        return ""
    text = f" · tokens {occupancy.token_usage:.1%} of slots ({occupancy.fill:.0%} of allocated)"
    if len(occupancy.groups) > 1:
        text += " · " + ", ".join(f"group {g} {group.fill:.0%}" for g, group in enumerate(occupancy.groups))
    return text


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
        width = max(10, (self.size.width or 100) - 2)
        bar = Text()
        for (label, _), cells in zip(segments, bar_cells([b for _, b in segments], width), strict=True):
            bar.append("█" * cells, style=SEGMENT_COLOURS[label])
        shown = [(label, size) for label, size in segments if size > 0 or label in ALWAYS_SHOWN]
        legend = legend_lines(shown, width)
        ledger = view.ledger
        info = Text(
            f"total {float(ledger['total_bytes']) / GiB:.2f} GiB × util {float(ledger['gpu_memory_utilization'] or 1):.2f}"
            f" · KV {view.kv_used}/{view.num_blocks} blocks used, {view.kv_cached_free} cached-free",
            style="dim",
        )
        info.append(occupancy_text(view))
        if view.encoder_cache_capacity:  # a vision-language model's second budget, beside the KV pool
            info.append(f" · encoder cache {view.encoder_cache_used:,}/{view.encoder_cache_capacity:,} tokens")
        dev = view.device or {}
        if str(dev.get("device", "")).startswith("cpu") and ("process_used" in dev or "reserved" in dev):
            info.append(f" · process RSS {float(dev.get('process_used', dev.get('reserved', 0))) / GiB:.2f} GiB")
        elif "total" in dev and "free" in dev:
            info.append(f" · device ({dev.get('source', 'probe')}): {(dev['total'] - dev['free']) / GiB:.2f} GiB in use")
        elif "rss" in dev:
            info.append(f" · process RSS {dev['rss'] / GiB:.2f} GiB")
        return Group(bar, *legend, info, *rank_ledger_lines(view))
