"""Commands the engine offers but other packages implement, found through entry points.

``--monitor`` (group ``kvscope.dashboard``) and ``engine doctor`` (``kvscope.doctor``)
are registered in pyproject.toml by the packages that draw or judge events, so
engine/ never imports them (tests/test_import_rules.py keeps it that way).
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Any

from engine.errors import UserError


def load_plugin(group: str, purpose: str) -> Any:
    """The first callable registered under ``group`` (by name); a UserError naming
    ``purpose`` when none is installed."""
    found = sorted(entry_points(group=group), key=lambda ep: ep.name)
    if not found:
        raise UserError(f"{purpose} (no {group!r} entry point is installed; run `pip install -e .` in the "
                        "kvscope checkout)")
    return found[0].load()
