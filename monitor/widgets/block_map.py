"""The KV block map: one cell per block (or per group of blocks), Line-API rendered.

Only the visible rows are rendered, so a 27,635-block pool costs what the
screen shows. ``update_view`` precomputes one style per cell in a single pass
over the pool; ``render_line`` merely slices it.

A hybrid KV cache (``engine.config``'s ``kv_cache_groups``: sliding-window and
full-attention groups drawing from one pool) is coloured by KV cache group instead of
by request, the legend naming each group ("sliding W" / "full" with its layers), and a
free block that a sliding window released while its request ran is drawn ◁ in its
group's colour, apart from a block a finish freed (○ cached-free, · free). A
full-attention pool draws exactly as before.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, ClassVar

from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual.binding import Binding, BindingType
from textual.geometry import Size
from textual.message import Message
from textual.reactive import reactive
from textual.scroll_view import ScrollView
from textual.strip import Strip

from engine.events.folds.view import EngineView
from monitor.widgets.legend import group_colour, group_legend_items, wrap_items

PALETTE = (
    "#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f",
    "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#86bcb6",
)
FREE_STYLE = Style(color="#3a3a3a")
CACHED_STYLE = Style(color="#5fafd7")
SHADES = "░▒▓█"
FREE_CHAR = "·"
CACHED_CHAR = "○"
USED_CHAR = "■"
PARTIAL_CHAR = "▪"  # a request's last block, partly filled: slots allocated that hold no token yet
SELECTED_STYLE = Style(color="#000000", bgcolor="#ffff5f", bold=True)
GROUP_USED_STYLE = Style(color="#59a14f")
WINDOW_CHAR = "◁"  # left its sliding window while the request ran (not freed by a finish)
ZOOM = Binding.Group("zoom")


def request_colour(request_id: str) -> str:
    """A stable colour per request id (crc32, so it is the same in every run)."""
    return PALETTE[zlib.crc32(request_id.encode()) % len(PALETTE)]


class BlockMap(ScrollView, can_focus=True):
    """Cells coloured by owner (a hybrid pool: by KV cache group; ◁ left a window); a
    request's partly filled last block ▪; cached-free ○, free ·; zoomed out, cells shaded by
    occupancy."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("plus,equals_sign", "zoom_in", "zoom", key_display="+", group=ZOOM),
        Binding("minus", "zoom_out", "zoom", key_display="-", group=ZOOM),
    ]

    @dataclass
    class LegendChanged(Message):
        """The scale, pool size or width changed; the text says what a cell stands for
        and shows every mark and colour the map draws."""

        legend: Text

    blocks_per_cell: reactive[int] = reactive(0)  # 0 = fit the pool to the visible area
    selected: reactive[str | None] = reactive(None)

    def __init__(self, **kwargs: Any) -> None:  # Textual's name, id, classes, disabled
        super().__init__(**kwargs)
        self._view: EngineView | None = None
        self._cells: list[tuple[str, Style]] = []
        self._num_blocks = 0
        self._legend = ""
        self._groups: list[dict[str, object]] = []  # the config's kv_cache_groups
        self._num_groups = 0  # > 0: a hybrid pool, drawn by group

    # --------------------------------------------------------------- public API
    def update_view(self, view: EngineView) -> None:
        self._view = view
        self._rebuild()

    @property
    def effective_blocks_per_cell(self) -> int:
        if self.blocks_per_cell > 0:
            return self.blocks_per_cell
        width = max(1, self._columns())
        rows = max(1, self.size.height or 1)
        per_cell = 1
        while -(-self._num_blocks // per_cell) > width * rows:
            per_cell *= 2
        return per_cell

    def legend(self) -> str:
        return self.legend_text().plain

    def legend_items(self) -> list[Text]:
        """One item per mark the map draws, in its own style."""
        per = self.effective_blocks_per_cell
        items = [Text(f"1 cell = {per} block{'s' if per > 1 else ''} · {self._num_blocks:,} blocks")]
        if self._num_groups:
            if per > 1:  # a cell takes the colour of the group holding most of its blocks
                shades = Text()
                for i, shade in enumerate(SHADES):
                    shades.append(shade, style=Style(color=group_colour(i)))
                items.append(shades.append(" share used (colour = group)"))
            items += group_legend_items(self._groups, self._num_groups)
        elif per == 1:
            used = Text()
            for colour in PALETTE[:3]:
                used.append(USED_CHAR, style=Style(color=colour))
            used.append(" used (colour = request)")
            items.append(used)
        if per == 1:
            items.append(Text.assemble((PARTIAL_CHAR, Style(color=PALETTE[0])), " partly filled"))
        else:
            items.append(Text.assemble((SHADES, GROUP_USED_STYLE), " share of the cell's blocks used"))
        items.append(Text.assemble((USED_CHAR if per == 1 else SHADES[-1], SELECTED_STYLE), " selected request"))
        if self._num_groups:
            window = Text()
            for g, spec in enumerate(self._groups or [{"kind": "sliding_window", "sliding_window": 1}]):
                if spec.get("kind") == "sliding_window":
                    window.append(WINDOW_CHAR, style=Style(color=group_colour(g)))
            window.append(" freed by the window")
            items.append(window)
        items += [
            Text.assemble((CACHED_CHAR, CACHED_STYLE), " cached-free"),
            Text.assemble((FREE_CHAR, FREE_STYLE), " free"),
        ]
        return items

    def legend_text(self, width: int | None = None) -> Text:
        """The legend wrapped to ``width`` (the map's) between items, never inside one."""
        return Text("\n").join(wrap_items(self.legend_items(), width or self._columns()))

    def owners_by_block(self) -> dict[int, frozenset[str]]:
        """What the map shows: block -> owning request ids (tests compare this)."""
        if self._view is None:
            return {}
        return {b: frozenset(o) for b, o in self._view.block_owners.items() if o}

    def groups_by_block(self) -> dict[int, int]:
        """What a map drawn by group colours a held block by: block -> KV cache group."""
        return dict(self._view.block_groups) if self._view is not None else {}

    def window_freed_blocks(self) -> dict[int, int]:
        """The blocks the map draws ◁: free (no owner), last released by a sliding window;
        block -> the group whose window released it."""
        if self._view is None:
            return {}
        owners = self._view.block_owners
        return {b: g for b, g in self._view.window_freed.items() if not owners.get(b)}

    def cell(self, index: int) -> tuple[str, Style]:
        """The character and style of cell ``index`` as drawn."""
        return self._cells[index]

    def action_zoom_in(self) -> None:
        self.blocks_per_cell = max(1, self.effective_blocks_per_cell // 2)

    def action_zoom_out(self) -> None:
        self.blocks_per_cell = min(4096, self.effective_blocks_per_cell * 2)

    # ----------------------------------------------------------------- internals
    def watch_blocks_per_cell(self) -> None:
        self._rebuild()

    def watch_selected(self) -> None:
        self._rebuild()

    def on_resize(self) -> None:
        self._rebuild()

    def _columns(self) -> int:
        return max(1, self.scrollable_content_region.width or self.size.width or 1)

    def _rebuild(self) -> None:
        view = self._view
        if view is None:
            return
        self._num_blocks = view.num_blocks
        per = self.effective_blocks_per_cell
        self._groups = view.kv_cache_groups
        groups, window = view.block_groups, view.window_freed
        # drawn by group when the run names its groups (several, or a window): one
        # full-attention group's map colours by request
        self._num_groups = max(len(self._groups), max(groups.values(), default=-1) + 1,
                               max(window.values(), default=-1) + 1) if self._groups or window else 0
        group_styles = [Style(color=group_colour(g)) for g in range(self._num_groups)]
        cells = self._block_cells(view, group_styles) if per == 1 else self._zoomed_cells(view, per, group_styles)
        self._cells = cells
        legend = self.legend_text()
        if legend.markup != self._legend:
            self._legend = legend.markup
            self.post_message(self.LegendChanged(legend))
        columns = self._columns()
        self.virtual_size = Size(columns, -(-len(cells) // columns))
        self.refresh()

    def _block_cells(self, view: EngineView, group_styles: list[Style]) -> list[tuple[str, Style]]:
        """One cell per block: its owner's colour (its group's, in a hybrid pool), the selected
        request's blocks lit, a window's freed blocks, cached-free and free."""
        owners, cached, selected = view.block_owners, view.cached, self.selected
        groups, window, partial = view.block_groups, view.window_freed, view.occupancy.partial
        styles: dict[str, Style] = {}  # one Style per request: render_line joins runs by identity
        cells: list[tuple[str, Style]] = []
        for b in range(self._num_blocks):
            holders = owners.get(b)
            if holders:
                char = PARTIAL_CHAR if b in partial else USED_CHAR
                if selected is not None and selected in holders:
                    cells.append((char, SELECTED_STYLE))
                    continue
                if self._num_groups:
                    cells.append((char, group_styles[groups.get(b, 0)]))
                    continue
                rid = min(holders)
                style = styles.get(rid)
                if style is None:
                    style = styles[rid] = Style(color=request_colour(rid))
                cells.append((char, style))
            elif b in window:
                cells.append((WINDOW_CHAR, group_styles[window[b]]))
            elif b in cached:
                cells.append((CACHED_CHAR, CACHED_STYLE))
            else:
                cells.append((FREE_CHAR, FREE_STYLE))
        return cells

    def _zoomed_cells(self, view: EngineView, per: int, group_styles: list[Style]) -> list[tuple[str, Style]]:
        """``per`` blocks a cell, shaded by how many are in use (coloured by the group holding
        most of them, in a hybrid pool); a cell holding a selected request's block lit."""
        owners, cached, selected = view.block_owners, view.cached, self.selected
        groups, window = view.block_groups, view.window_freed
        selected_blocks = set(view.requests[selected].blocks) if selected in view.requests else set()
        used_style = GROUP_USED_STYLE
        cells: list[tuple[str, Style]] = []
        for start in range(0, self._num_blocks, per):
            stop = min(start + per, self._num_blocks)
            used = sum(1 for b in range(start, stop) if b in owners)
            if selected_blocks and any(b in selected_blocks for b in range(start, stop)):
                cells.append((SHADES[-1], SELECTED_STYLE))
            elif used:
                shade = SHADES[min(len(SHADES) - 1, (used * len(SHADES) - 1) // (stop - start))]
                if self._num_groups:  # the group holding most of the cell's blocks
                    held = [groups.get(b, 0) for b in range(start, stop) if b in owners]
                    used_style = group_styles[max(set(held), key=held.count)]
                cells.append((shade, used_style))
            elif window_in := [window[b] for b in range(start, stop) if b in window]:
                cells.append((WINDOW_CHAR, group_styles[max(set(window_in), key=window_in.count)]))
            elif any(b in cached for b in range(start, stop)):
                cells.append((CACHED_CHAR, CACHED_STYLE))
            else:
                cells.append((FREE_CHAR, FREE_STYLE))
        return cells

    def render_line(self, y: int) -> Strip:
        columns = self._columns()
        row = self.scroll_offset.y + y
        chunk = self._cells[row * columns : (row + 1) * columns]
        if not chunk:
            return Strip.blank(self.size.width)
        segments: list[Segment] = []
        text, style = chunk[0]
        run = [text]
        for char, cell_style in chunk[1:]:
            if cell_style is style:
                run.append(char)
            else:
                segments.append(Segment("".join(run), style))
                run, style = [char], cell_style
        segments.append(Segment("".join(run), style))
        return Strip(segments, len(chunk)).extend_cell_length(self.size.width)
