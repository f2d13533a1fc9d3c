"""Open the live dashboard for ``--monitor`` without importing the monitor.

The dashboard is a plug-in: a package registers a callable under the
``kvscope.dashboard`` entry point group (``monitor.launch:run_dashboard`` in
pyproject.toml), and the engine calls it as ``fn(bus, snapshot_fn, title)`` in
the main thread. The engine only publishes events; what draws them is not its
concern (tests/test_import_rules.py keeps it that way).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.cli.plugins import load_plugin
from engine.events import EventBus

ENTRY_POINT_GROUP = "kvscope.dashboard"


def load_dashboard() -> Callable[[EventBus, Callable[[], dict[str, Any]] | None, str], None]:
    """The registered dashboard launcher; a UserError when none is installed."""
    return load_plugin(ENTRY_POINT_GROUP, "--monitor needs the kvscope monitor package")


def run_dashboard(bus: EventBus, snapshot_fn: Callable[[], dict[str, Any]] | None, title: str) -> None:
    """Show the dashboard for ``bus`` in this thread until the user quits it."""
    load_dashboard()(bus, snapshot_fn, title)
