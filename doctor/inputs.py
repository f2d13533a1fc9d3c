"""What ``engine doctor`` reads: a kvscope recording (``.jsonl``, or gzipped), a live
kvscope server (its ``/events`` stream, through the monitor's own SSE client) or a
vLLM log (through logparse). The kind is told by the argument, not by a flag: an
``http(s)://`` URL is live, a file starting with the kvscope events header (plain or
gzip) is a recording, any other file is a log.
"""

from __future__ import annotations

import gzip
import time
from pathlib import Path
from typing import Any

from doctor.facts import RunFacts
from engine.errors import UserError
from engine.events import SCHEMA_NAME, Recording, read_events
from engine.events.feed import LIVE, REFUSED, HttpFeed

RECORDING = "recording"
LIVE_URL = "live"
VLLM_LOG = "vllm-log"
GZIP_MAGIC = b"\x1f\x8b"


class InputError(UserError):
    """The input cannot be read; ``engine doctor`` exits 3 so scripts tell it from a critical finding (2)."""

    exit_code = 3


def kind_of(source: str) -> str:
    if source.startswith(("http://", "https://")):
        return LIVE_URL
    path = Path(source)
    if not path.is_file():
        raise InputError(f"{source}: no such file; pass a recording (.jsonl), a vLLM log or http://HOST:PORT")
    with path.open("rb") as fh:
        head = fh.read(64)
    if head.startswith(GZIP_MAGIC) or SCHEMA_NAME.encode() in head:
        return RECORDING
    if path.suffix in (".jsonl", ".json"):
        raise InputError(f"{source}: not a kvscope event file (its first line must be the {SCHEMA_NAME} header); "
                         "record one with --events FILE")
    return VLLM_LOG


def _read_recording(path: Path) -> Recording:
    try:
        raw = path.read_bytes()
        return read_events(gzip.decompress(raw) if raw.startswith(GZIP_MAGIC) else raw, name=str(path))
    except (OSError, EOFError) as exc:
        raise InputError(f"{path}: {exc}") from None
    except ValueError as exc:  # read_events names the file, the line and the field
        raise InputError(str(exc)) from None


def dp_sibling_paths(path: Path, config: dict[str, Any]) -> list[Path]:
    """A data-parallel core's own recording (``run.dp1.jsonl``: its flags name its rank) and
    the other cores' beside it (engine/dp_core.py's ``rank_events_path`` names), rank order."""
    rank, size = config.get("data_parallel_rank"), int(config.get("data_parallel_size") or 1)
    mark = f".dp{rank}."
    if rank is None or size < 2 or mark not in path.name:
        return [path]
    named = [path.with_name(path.name.replace(mark, f".dp{r}.", 1)) for r in range(size)]
    return [p for p in named if p.is_file()]


def facts_from_recording(path: str | Path) -> RunFacts:
    """The recording's fold. A data-parallel core's recording is folded with the other cores'
    beside it, so dp_imbalance sees every rank: their events merged by time (each core's bus
    clock starts when the core does, so the ranks line up within their start skew)."""
    path = Path(path)
    recording = _read_recording(path)
    paths = dp_sibling_paths(path, recording.config)
    events = recording.events
    if len(paths) > 1:
        recordings = [recording if p == path else _read_recording(p) for p in paths]
        events = sorted((e for r in recordings for e in r.events), key=lambda e: e.t)  # stable: each file's order
    facts = RunFacts()
    for event in events:
        facts(event)
    return facts


def facts_from_server(url: str, duration_s: float, api_key: str | None = None,
                      connect_timeout_s: float = 5.0) -> RunFacts:
    """Follow a server's ``/events`` for ``duration_s`` seconds (its snapshot first: flags,
    startup phases and the recent events it kept) and fold what arrived."""
    feed = HttpFeed(url, api_key=api_key, retry_s=connect_timeout_s, connect_timeout_s=connect_timeout_s)
    facts = RunFacts()
    feed.start()
    try:
        if not feed.connected.wait(connect_timeout_s):
            state = feed.connection
            raise InputError(f"{feed.url}: {state.reason or state.state}")
        deadline = time.monotonic() + duration_s
        while True:
            for event in feed.drain():
                facts(event)
            if feed.connection.state == REFUSED:
                raise InputError(f"{feed.url}: refused, {feed.connection.reason}")
            if time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        if feed.connection.state != LIVE and not facts.events:
            raise InputError(f"{feed.url}: {feed.connection.reason or 'no events arrived'}")
    finally:
        feed.stop()
    return facts
