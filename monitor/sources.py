"""Where the monitor's events come from: the live feeds of :mod:`engine.events.feed`
(the in-process bus, a server's ``GET /events`` stream) or a JSONL recording, opened
here as a :class:`~monitor.state.Timeline` for replay."""

from __future__ import annotations

from pathlib import Path

from engine.errors import UserError
from engine.events import read_events
from monitor.state import Timeline


def load_timeline(path: str | Path, checkpoint_every: int = 500) -> Timeline:
    """Open a JSONL recording for replay; bad files become a one-line UserError."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such recording; pass a .jsonl file written by the engine (engine ... --events FILE)")
    try:
        recording = read_events(path)
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    return Timeline(recording.events, checkpoint_every=checkpoint_every)
