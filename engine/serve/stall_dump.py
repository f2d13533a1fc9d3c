"""A stalled engine core's dump (engine/serve/stall.py): one JSON file beside the recording
with the stall's record (as ``/health`` answers it), the Python stack of every thread of the
core's process, the core's last ``step`` event (the scheduler's last output as published)
and each request's state, tokens and blocks (the server's fold of the core's events).

The stacks come from engine/stacks.py: this process's threads, or a data-parallel core's,
asked for with a signal.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def dump_path(events_path: str | None, rank: int, when: float | None = None) -> Path:
    """``run.jsonl`` → ``run.stall-dp0-20261207-112233.json`` beside it; with no recording, in
    the temporary directory under the server's pid."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(time.time() if when is None else when))
    if events_path:
        p = Path(events_path)
        stem = p.name.split(".")[0] or "run"
        return p.with_name(f"{stem}.stall-dp{rank}-{stamp}.json")
    return Path(tempfile.gettempdir()) / f"kvscope-{os.getpid()}.stall-dp{rank}-{stamp}.json"


def request_rows(state: dict[str, Any], admitted: Sequence[str] = ()) -> list[dict[str, Any]]:
    """The requests a view snapshot holds, running first: id, state, tokens and blocks. A request
    ``admitted`` into the step under way is ``scheduled`` (the view says waiting until that step ends)."""
    scheduled = set(admitted)
    rows = [{"id": rid, "state": "scheduled" if rid in scheduled and r.get("state") == "waiting" else r.get("state"),
             "prompt_tokens": r.get("prompt_tokens", 0),
             "computed_tokens": r.get("computed_tokens", 0), "generated_tokens": r.get("generated_tokens", 0),
             "blocks": len(r.get("blocks") or [])}
            for rid, r in (state.get("requests") or {}).items() if r.get("state") in ("running", "waiting")]
    order = {"running": 0, "scheduled": 1}
    return sorted(rows, key=lambda row: (order.get(row["state"], 2), row["id"]))


def write_dump(path: Path, record: dict[str, Any], stacks: dict[str, str], last_step: dict[str, Any] | None,
               state: dict[str, Any]) -> None:
    """The dump (module docstring), written whole (a temporary file renamed)."""
    body = {"stall": record, "stacks": stacks, "last_step": last_step,
            "requests": state.get("requests") or {}, "kv": state.get("kv"), "written_unix": time.time()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    tmp.write_text(json.dumps(body, indent=1, default=str), encoding="utf-8")
    tmp.replace(path)
