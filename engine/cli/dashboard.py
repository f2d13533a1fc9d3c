"""Open the live dashboard for ``--monitor`` without importing the monitor.

The dashboard is a plug-in: a package registers a callable under the
``kvscope.dashboard`` entry point group (``monitor.launch:run_dashboard`` in
pyproject.toml), and the engine calls it as ``fn(bus, snapshot_fn, title)`` in
the main thread. The engine only publishes events; what draws them is not its
concern (tests/test_import_rules.py keeps it that way).
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

from engine.errors import UserError
from engine.events import EventBus

ENTRY_POINT_GROUP = "kvscope.dashboard"


def load_dashboard() -> Callable[[EventBus, Callable[[], dict[str, Any]] | None, str], None]:
    """The registered dashboard launcher; a UserError when none is installed."""
    found = sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name)
    if not found:
        raise UserError(f"--monitor needs the kvscope monitor package (no {ENTRY_POINT_GROUP!r} entry point "
                        "is installed; run `pip install -e .` in the kvscope checkout)")
    return found[0].load()


def run_dashboard(bus: EventBus, snapshot_fn: Callable[[], dict[str, Any]] | None, title: str) -> None:
    """Show the dashboard for ``bus`` in this thread until the user quits it."""
    load_dashboard()(bus, snapshot_fn, title)
