"""The Blocks tab: the block map with its legend beside the running and waiting queues. A
request picked in the queues opens its life in the request panel (picked again: closed), and
the request highlighted there stays lit in the map."""

from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Label

from monitor.widgets.block_map import BlockMap
from monitor.widgets.queues import Queues
from monitor.widgets.request_panel import RequestPanel


class BlocksPane(Vertical):
    def compose(self) -> ComposeResult:
        with Vertical(id="blockmap-column"):
            yield Label("", id="blockmap-legend")
            yield BlockMap(id="blockmap")
        yield Queues(id="queues")

    @on(BlockMap.LegendChanged)
    def _legend_changed(self, message: BlockMap.LegendChanged) -> None:
        for legend in self.query("#blockmap-legend").results(Label):
            legend.update(message.legend)

    @on(Queues.RequestPicked)
    def _pick_request(self, message: Queues.RequestPicked) -> None:
        panel = self.query_one(RequestPanel)
        panel.select(None if message.request_id == panel.request_id else message.request_id)
        for block_map in self.query(BlockMap):
            block_map.selected = message.request_id

    @on(Queues.RequestSelected)
    def _select_request(self, message: Queues.RequestSelected) -> None:
        # A selection can arrive while the screen is being torn down; nothing to highlight then.
        for block_map in self.query(BlockMap):
            block_map.selected = message.request_id
