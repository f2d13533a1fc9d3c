"""The GPU screen of kvscope's own dashboard (key ``G``): this machine's GPUs through
NVML against the engine's ledger from the view (weights, activation peak, KV pool,
graphs; the rest of the used memory is outside the ledger). Esc goes back."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.screen import Screen
from textual.widgets import Footer, Static

from engine.events.folds.view import EngineView
from monitor.gpu import GpuReader, device_index
from monitor.widgets.gpu_panel import GpuPanel, LedgerFn


def view_ledger(view: Callable[[], EngineView]) -> LedgerFn:
    """The ledger the engine's events reported, and the device it runs on."""

    def read() -> tuple[dict[str, float] | None, str, int]:
        current = view()
        ledger = {k: float(v) for k, v in current.ledger.items()} if any(current.ledger.values()) else None
        device = device_index(str((current.device or {}).get("device") or current.config.get("device") or ""))
        return ledger, "" if ledger else "no startup phases seen yet", device

    return read


class GpuScreen(Screen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "app.pop_screen", "back"),
                                              Binding("q", "app.quit", "quit")]

    def __init__(self, reader: GpuReader, view: Callable[[], EngineView], replay: bool) -> None:
        super().__init__()
        self.reader, self.view, self.replay = reader, view, replay

    def compose(self) -> ComposeResult:
        note = ("replay: this machine's GPUs now, the recording's ledger" if self.replay
                else "this machine's GPUs against the engine's ledger")
        yield Static(Text(f"kvscope monitor · GPU · {note}", style="bold"), classes="title")
        yield GpuPanel(self.reader, view_ledger(self.view), id="gpu-screen-panel")
        yield Footer(show_command_palette=False)
