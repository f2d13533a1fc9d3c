"""Legends as one or more lines, wrapped between items and never inside one
(the block map's and the memory bar's), and a hybrid KV cache's groups as the
block map's legend and the request table name and colour them."""

from __future__ import annotations

from collections.abc import Iterable

from rich.style import Style
from rich.text import Text


def wrap_items(items: Iterable[Text], width: int) -> list[Text]:
    """``items`` two spaces apart, a new line wherever the next would pass ``width``."""
    lines: list[Text] = []
    line = Text()
    for item in items:
        if line.cell_len and line.cell_len + 2 + item.cell_len > width:
            lines.append(line)
            line = Text()
        if line.cell_len:
            line.append("  ")
        line.append_text(item)
    if line.cell_len:
        lines.append(line)
    return lines


# A hybrid pool's group colours: the palette in group order, yellow last (it is the
# selected request's).
GROUP_PALETTE = (
    "#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f",
    "#b07aa1", "#ff9da7", "#9c755f", "#86bcb6", "#edc948",
)


def group_colour(group: int) -> str:
    """A KV cache group's colour (hybrid pools)."""
    return GROUP_PALETTE[group % len(GROUP_PALETTE)]


def group_label(spec: dict[str, object]) -> str:
    """``full`` or ``sliding W``, as the legend names a group's spec."""
    window = spec.get("sliding_window")
    return f"sliding {window}" if spec.get("kind") == "sliding_window" and window else "full"


def group_legend_items(groups: list[dict[str, object]], num_groups: int, glyph: str = "■") -> list[Text]:
    """One item per run of consecutive groups of one spec: each group's ``glyph`` in its
    colour, the spec's name and the layers: ``■■■■■ sliding 512 (5 groups × 3 layers)``,
    ``■ full (3 layers)``. Groups the config does not name are ``group g``."""
    specs = [(group_label(g), len(layers) if isinstance(layers := g.get("layers"), list | tuple) else 0)
             for g in groups]
    specs += [(f"group {g}", 0) for g in range(len(specs), num_groups)]
    items: list[Text] = []
    start = 0
    while start < len(specs):
        name = specs[start][0]
        stop = start
        while stop < len(specs) and specs[stop][0] == name and not name.startswith("group "):
            stop += 1
        stop = max(stop, start + 1)
        item = Text()
        for g in range(start, stop):
            item.append(glyph, style=Style(color=group_colour(g)))
        layers = [n for _, n in specs[start:stop]]
        if not any(layers):
            item.append(f" {name}")
        elif len(layers) == 1:
            item.append(f" {name} ({layers[0]} layer{'s' if layers[0] != 1 else ''})")
        elif len(set(layers)) == 1:
            item.append(f" {name} ({len(layers)} groups × {layers[0]} layers)")
        else:
            item.append(f" {name} ({len(layers)} groups: {'+'.join(map(str, layers))} layers)")
        items.append(item)
        start = stop
    return items
