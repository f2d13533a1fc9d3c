"""The replay's step prompt (key ``g``): a step index, Enter jumps there, Esc cancels; hidden
and disabled (it takes no keys) until asked for."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from textual import on
from textual.widgets import Input

from monitor.widgets.block_map import BlockMap


class GotoInput(Input):
    """``jump`` takes the step index typed."""

    def __init__(self, jump: Callable[[int], None], **kwargs: Any) -> None:  # Textual's name, id, classes
        super().__init__(placeholder="go to step index, Enter to jump, Esc to cancel", type="integer", **kwargs)
        self._jump = jump

    def on_mount(self) -> None:
        self.disabled = True  # only takes keys while asked for a step

    def ask(self) -> None:
        self.disabled = False
        self.add_class("visible")
        self.value = ""
        self.focus()

    def cancel(self) -> None:
        """Hidden again, the keys back with the block map."""
        self.remove_class("visible")
        self.disabled = True
        self.screen.query_one(BlockMap).focus()

    @on(Input.Submitted)
    def _submitted(self, event: Input.Submitted) -> None:
        self.cancel()
        if event.value.strip().lstrip("-").isdigit():
            self._jump(int(event.value))
