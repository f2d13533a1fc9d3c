"""Running and waiting queues as sortable tables, plus finished/rejected counts and,
for a hybrid KV cache, the selected request's blocks per KV cache group; a row picked
(Enter or a click) opens the request panel below them (monitor/widgets/request_panel.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rich.style import Style
from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import DataTable, Label

from engine.events.folds.view import EngineView, RequestView
from monitor.widgets.legend import group_colour, group_label
from monitor.widgets.request_panel import RequestPanel

# (key, header): keys name the columns for sorting and tests; headers are short so
# every column fits beside the block map at 120 columns. The table's title says the state.
COLUMN_HEADERS = (
    ("id", "id"),
    ("prompt", "prompt"),
    ("computed", "computed"),  # as vLLM's num_computed_tokens: prefix-cache hits included
    ("generated", "gen"),
    ("blocks", "blocks"),
    ("prefix hit", "hit"),  # prefix-cache hit tokens at admission
    ("age s", "age s"),
    ("TTFT s", "TTFT s"),
    ("preempt", "preempt"),
)
COLUMNS = tuple(key for key, _ in COLUMN_HEADERS)
ID_WIDTH = 14  # server ids (cmpl-<32 hex>) show as cmpl-…<8 hex>


def short_id(request_id: str, width: int = ID_WIDTH) -> str:
    """``cmpl-0f3a…`` ids cut in the middle to ``width``: the head says what kind, the tail tells them apart."""
    if len(request_id) <= width:
        return request_id
    head = min(5, width // 2)
    return request_id[:head] + "…" + request_id[-(width - head - 1):]


def request_row(req: RequestView, now: float) -> tuple[object, ...]:
    """One row; ``now`` is the engine clock (the app's :meth:`engine_now`), so ages
    move while a long step runs. TTFT is blank until a token exists."""
    ttft = f"{req.ttft_s:.3f}" if req.ttft_s is not None and req.generated_tokens > 0 else ""
    return (
        short_id(req.request_id), req.prompt_tokens, req.computed_tokens, req.generated_tokens,
        len(req.blocks), req.prefix_hit_tokens, round(max(0.0, now - req.arrived_t), 2), ttft, req.num_preemptions,
    )


class RequestTable(DataTable[object]):
    """One queue; clicking a header sorts by that column (again: reverse)."""

    def __init__(self, **kwargs: Any) -> None:  # Textual's name, id, classes, disabled
        super().__init__(cursor_type="row", zebra_stripes=True, **kwargs)
        self.sort_column: str | None = None
        self.sort_reverse = False

    def on_mount(self) -> None:
        for key, header in COLUMN_HEADERS:
            self.add_column(header, key=key)

    def show(self, requests: list[RequestView], now: float) -> None:
        rows = {req.request_id: request_row(req, now) for req in requests}
        if rows.keys() == {key.value for key in self.rows}:
            self._update_in_place(rows)  # the same requests: no flicker, scroll and cursor stay
            return
        selected = self._selected_key()
        self.clear()
        for rid, row in rows.items():
            self.add_row(*row, key=rid)
        if self.sort_column is not None:
            self.sort(self.sort_column, reverse=self.sort_reverse, key=_sort_key)
        if selected is not None and selected in self.rows:
            self.move_cursor(row=self.get_row_index(selected), animate=False)

    def _update_in_place(self, rows: dict[str, tuple[object, ...]]) -> None:
        changed = False
        for rid, row in rows.items():
            for name, value in zip(COLUMNS, row, strict=True):
                if self.get_cell(rid, name) != value:
                    self.update_cell(rid, name, value, update_width=True)
                    changed = changed or name == self.sort_column
        if changed and self.sort_column is not None:
            self.sort(self.sort_column, reverse=self.sort_reverse, key=_sort_key)

    def _selected_key(self) -> str | None:
        if not self.row_count:
            return None
        try:
            return self.coordinate_to_cell_key(self.cursor_coordinate).row_key.value
        except Exception:  # cursor outside the table
            return None

    @on(DataTable.HeaderSelected)
    def _sort_by_header(self, event: DataTable.HeaderSelected) -> None:
        column = str(event.column_key.value)
        self.sort_reverse = not self.sort_reverse if column == self.sort_column else False
        self.sort_column = column
        self.sort(column, reverse=self.sort_reverse, key=_sort_key)


def _sort_key(value: object) -> tuple[int, object]:
    # Numbers before text so "" (no TTFT yet) sorts last instead of raising.
    return (0, value) if isinstance(value, int | float) else (1, str(value))


def group_counts_text(req: RequestView, groups: list[dict[str, object]]) -> Text:
    """``r5 blocks by group: sliding 128 9 9 9 9 9 · full 32``: the request's live blocks in
    each KV cache group (a window's freed positions are not counted), each count in its
    group's colour, consecutive groups of one spec under one name."""
    text = Text(f"{short_id(req.request_id)} blocks by group:")
    last = None
    for g, blocks in enumerate(req.group_blocks):
        name = group_label(groups[g]) if g < len(groups) else f"group {g}"
        if name != last:
            text.append(f"{' ·' if last is not None else ''} {name}")
            last = name
        text.append(f" {len(blocks)}", style=Style(color=group_colour(g), bold=True))
    return text


class Queues(Vertical):
    """Both queues; posts ``RequestSelected`` when a row is highlighted."""

    @dataclass
    class RequestSelected(Message):
        request_id: str | None

    @dataclass
    class RequestPicked(Message):
        """A row chosen (Enter or a click): its life goes in the request panel."""

        request_id: str | None

    def __init__(self, **kwargs: Any) -> None:  # Textual's name, id, classes, disabled
        super().__init__(**kwargs)
        self._view: EngineView | None = None
        self._selected: str | None = None

    def compose(self) -> ComposeResult:
        yield Label("", id="queue-counts")
        groups = Label("", id="request-groups")
        groups.display = False  # a hybrid KV cache's only: a full-attention run lays out as before
        yield groups
        yield Label("running", classes="queue-title")
        yield RequestTable(id="running-table")
        yield Label("waiting", classes="queue-title")
        yield RequestTable(id="waiting-table")
        yield RequestPanel(id="request-panel")

    def update_view(self, view: EngineView, now: float | None = None) -> None:
        """``now``: the engine clock (default: the latest event's time)."""
        now = view.t if now is None else now
        running, waiting = view.running, view.waiting
        self.query_one("#queue-counts", Label).update(
            f"running {len(running)} · waiting {len(waiting)} · finished {view.finished}"
            f" · rejected {view.rejected} · preemptions {view.preemptions}"
        )
        self.query_one("#running-table", RequestTable).show(running, now)
        self.query_one("#waiting-table", RequestTable).show(waiting, now)
        self._view = view
        self._show_groups()

    def _show_groups(self) -> None:
        """The selected request's blocks per group, shown while it holds any (when the run
        names its groups: one full-attention group's layout is as it always was)."""
        view = self._view
        req = view.requests.get(self._selected) if view is not None and self._selected is not None else None
        label = self.query_one("#request-groups", Label)
        if view is None or req is None or not view.kv_cache_groups or not req.group_blocks:
            label.display = False
            return
        label.update(group_counts_text(req, view.kv_cache_groups))
        label.display = True

    @on(DataTable.RowSelected)
    def _picked(self, event: DataTable.RowSelected) -> None:
        self.post_message(self.RequestPicked(event.row_key.value if event.row_key else None))

    @on(DataTable.RowHighlighted)
    def _highlighted(self, event: DataTable.RowHighlighted) -> None:
        self._selected = event.row_key.value if event.row_key else None
        self._show_groups()
        self.post_message(self.RequestSelected(self._selected))
