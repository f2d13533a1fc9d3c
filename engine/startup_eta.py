"""A startup that predicts itself: each phase's expected seconds, from this machine's own
earlier starts.

Every finished start is recorded in a small history file (``startup-history.json`` in the
startup cache folder, or ``$KVSCOPE_STARTUP_HISTORY``; ``off`` disables it), per key: the
model (its path and size) and the resolved flags that change what startup does. The next
start of the same key predicts each phase as the median of its last three starts (the
latest while there are fewer: a first, cold start is not what a warm second one takes). A
model or flags never started here: phase C from the model file's size over the read rate
phase C reached in this machine's earlier starts, the other phases from this machine's
other starts, else from defaults. The prediction is published once, before phase A, as a
``startup.eta`` event (what the dashboard and ``/health`` read), and :class:`EtaTicker`
logs a running phase every few seconds: ``phase C load weights: 12 s of ~30 s``.

The history is bounded (:data:`MAX_STARTS`, :data:`MAX_KEYS`, :data:`MAX_FILE_BYTES`),
written to a temporary name and renamed, and a file that cannot be read or parsed is a miss,
never a failed start. Everything here but :class:`EtaSession` is a pure function or takes
its clock, so tests drive it with their own.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.events import PHASES, Event, EventBus, StartupEta, StartupPhase

HISTORY_ENV = "KVSCOPE_STARTUP_HISTORY"
HISTORY_NAME = "startup-history.json"
FORMAT = 1
MAX_STARTS = 8  # per key: the last eight starts
MAX_KEYS = 32  # models x flags; the least recently started key goes first
MAX_RATES = 8  # phase C read rates kept for this machine
MAX_FILE_BYTES = 1 << 20  # a larger file is not ours (or is damaged): a miss
RECENT = 3  # a phase's prediction is the median of this many latest starts
# Phase C read rate assumed before this machine has measured one (a local SSD through the
# page cache reads faster; a cold network disk slower): 1 GiB/s.
DEFAULT_READ_BYTES_PER_S = float(1 << 30)
# A phase never seen on this machine: seconds, from kvscope's starts on 2-core CPUs.
DEFAULT_SECONDS = {"A": 0.5, "B": 0.05, "C": 5.0, "D": 3.0, "E": 0.1, "F": 5.0, "G": 0.01}
# Flags that do not change what startup does: left out of the key, so a new --seed or
# --events file still finds its earlier starts.
NOT_KEYED = frozenset({
    "model", "served_model_name", "seed", "stats_interval", "log_prompts", "events_path", "kv_events_config",
    "data_parallel_rank", "node_rank", "master_addr", "master_port", "rendezvous_timeout_s",
})


# ------------------------------------------------------------------ the history
@dataclass(frozen=True, slots=True)
class StartRecord:
    """One finished start: when (wall seconds), each phase's seconds, the model file's bytes."""

    at: float
    phases: Mapping[str, float]
    model_bytes: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"at": self.at, "phases": dict(self.phases), "model_bytes": self.model_bytes}


@dataclass(frozen=True, slots=True)
class History:
    """Past starts per key (oldest first) and phase C's read rates (bytes/s) on this machine."""

    starts: Mapping[str, Sequence[StartRecord]] = field(default_factory=dict)
    read_rates: Sequence[float] = ()

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "read_rates": list(self.read_rates),
                "keys": {k: [r.to_json() for r in v] for k, v in self.starts.items()}}


def history_from_json(data: Any) -> History:
    """A parsed history file; anything not in its shape is a miss (an empty history)."""
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("keys"), dict):
        return History()
    starts: dict[str, list[StartRecord]] = {}
    for key, rows in data["keys"].items():
        records = [r for r in (_start_record(row) for row in rows if isinstance(row, dict)) if r is not None] \
            if isinstance(rows, list) else []
        if records:
            starts[str(key)] = records[-MAX_STARTS:]
    rates = [float(r) for r in data.get("read_rates") or [] if _positive(r)] \
        if isinstance(data.get("read_rates"), list) else []
    return History(starts, tuple(rates[-MAX_RATES:]))


def _positive(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 < value < float("inf")


def _start_record(row: dict[str, Any]) -> StartRecord | None:
    phases = row.get("phases")
    if not isinstance(phases, dict) or not _positive(row.get("at")):
        return None
    seconds = {k: float(v) for k, v in phases.items() if k in PHASES and isinstance(v, int | float)
               and not isinstance(v, bool) and 0 <= v < float("inf")}
    size = row.get("model_bytes")
    model_bytes = int(size) if isinstance(size, int | float) and _positive(size) else None
    return StartRecord(float(row["at"]), seconds, model_bytes) if seconds else None


def history_path() -> Path | None:
    """Where the history lives: ``$KVSCOPE_STARTUP_HISTORY``, else the startup cache folder's
    ``startup-history.json``; None when either is switched off."""
    value = os.environ.get(HISTORY_ENV)
    if value is not None:
        return None if value.strip().lower() in ("", "off", "0", "none") else Path(value)
    from engine.model.loading.startup_cache import cache_dir  # torch is loaded by then: startup has begun

    root = cache_dir()
    return None if root is None else root / HISTORY_NAME


def load_history(path: Path | None) -> History:
    """The history at ``path``; a missing, unreadable, oversized or malformed file is empty."""
    if path is None:
        return History()
    try:
        with path.open("rb") as handle:
            raw = handle.read(MAX_FILE_BYTES + 1)
        if len(raw) > MAX_FILE_BYTES:
            return History()
        return history_from_json(json.loads(raw))
    except (OSError, ValueError, RecursionError):
        return History()


def save_history(path: Path, history: History) -> None:
    """Write to a temporary name in the same folder and rename it over the old file, so a
    reader sees the old history or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".startup-history-", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(history.to_json(), handle, separators=(",", ":"))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def record_start(history: History, key: str, seconds: Mapping[str, float], now: float,
                 model_bytes: int | None = None) -> History:
    """``history`` with one more start of ``key`` (``seconds`` per phase, at wall time ``now``),
    bounded: the last :data:`MAX_STARTS` per key, the :data:`MAX_KEYS` most recently started keys,
    and phase C's read rate when the model's bytes are known."""
    record = StartRecord(now, {k: float(v) for k, v in seconds.items() if k in PHASES}, model_bytes)
    starts = {k: list(v) for k, v in history.starts.items() if k != key}
    starts[key] = [*history.starts.get(key, ()), record][-MAX_STARTS:]
    while len(starts) > MAX_KEYS:
        del starts[min(starts, key=lambda k: starts[k][-1].at)]
    rates = list(history.read_rates)
    load_s = record.phases.get("C")
    if model_bytes and load_s and load_s > 0:
        rates = [*rates, model_bytes / load_s][-MAX_RATES:]
    return History(starts, tuple(rates))


# ------------------------------------------------------------------ the prediction
@dataclass(frozen=True, slots=True)
class Prediction:
    """Each phase's predicted seconds and where it came from: ``history`` (this key's
    earlier starts), ``read rate`` (the model's bytes over phase C's measured rate),
    ``machine`` (this machine's starts of other models or flags) or ``default``."""

    key: str
    phases: Mapping[str, float]
    sources: Mapping[str, str]
    starts: int  # earlier starts of this key the prediction read

    @property
    def total_s(self) -> float:
        return sum(self.phases.values())

    def event(self) -> StartupEta:
        return StartupEta(phases=dict(self.phases), sources=dict(self.sources), starts=self.starts, key=self.key)


def recent_estimate(values: Sequence[float]) -> float:
    """The median of the last :data:`RECENT` values, the latest while there are fewer."""
    if len(values) < RECENT:
        return values[-1]
    return float(statistics.median(values[-RECENT:]))


def predict(history: History, key: str, model_bytes: int | None = None) -> Prediction:
    """Each phase A–G's seconds for the next start of ``key``."""
    own = history.starts.get(key, ())
    phases: dict[str, float] = {}
    sources: dict[str, str] = {}
    for letter in PHASES:
        mine = [r.phases[letter] for r in own if letter in r.phases]
        if mine:
            phases[letter], sources[letter] = recent_estimate(mine), "history"
            continue
        if letter == "C" and model_bytes:
            rate = recent_estimate(history.read_rates) if history.read_rates else DEFAULT_READ_BYTES_PER_S
            phases[letter], sources[letter] = model_bytes / rate, "read rate" if history.read_rates else "default"
            continue
        others = [r.phases[letter] for k, rs in history.starts.items() if k != key for r in rs[-1:]
                  if letter in r.phases]
        if others:
            phases[letter], sources[letter] = float(statistics.median(others)), "machine"
        else:
            phases[letter], sources[letter] = DEFAULT_SECONDS[letter], "default"
    return Prediction(key, phases, sources, len(own))


def start_key(flags: Mapping[str, Any], model_path: str | None, model_name: str) -> str:
    """The history key: the model (its file or folder and its size, or its name for a preset)
    and every flag that changes what startup does."""
    identity = model_name
    if model_path:
        identity = f"{os.path.realpath(model_path)}:{model_bytes_of(model_path)}"
    keyed = {k: v for k, v in sorted(flags.items()) if k not in NOT_KEYED}
    text = json.dumps({"model": identity, "flags": keyed}, sort_keys=True, default=str)
    return f"{model_name[:40]}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def model_bytes_of(path: str | None) -> int | None:
    """The model's size on disk: the file's, or the sum of a folder's files (one level)."""
    if not path:
        return None
    try:
        p = Path(path)
        if p.is_dir():
            return sum(f.stat().st_size for f in p.iterdir() if f.is_file()) or None
        return p.stat().st_size or None
    except OSError:
        return None


# ------------------------------------------------------------------ the log line
def phase_words(letter: str) -> str:
    """``C`` -> ``phase C load weights``."""
    return f"phase {letter} {PHASES.get(letter, letter).replace('_', ' ')}"


def _seconds_text(seconds: float) -> str:
    return f"{seconds:.1f}" if seconds < 10 else f"{seconds:,.0f}"


def eta_line(letter: str, elapsed_s: float, predicted_s: float | None) -> str:
    """``phase C load weights: 12 s of ~30 s``; past the prediction it says so."""
    head = f"{phase_words(letter)}: {_seconds_text(elapsed_s)} s"
    if predicted_s is None:
        return head
    if elapsed_s > predicted_s:
        return f"{head}, past the ~{_seconds_text(predicted_s)} s predicted"
    return f"{head} of ~{_seconds_text(predicted_s)} s"


class EtaTicker:
    """A bus subscriber that knows the running phase and its prediction; :meth:`tick` (called
    every ``interval_s`` by :meth:`start`'s thread, or by a test) logs the line for a phase
    that has run at least ``interval_s``. Only the lead rank's own phases count."""

    def __init__(self, log: Callable[[str], Any], interval_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.log = log
        self.interval_s = interval_s
        self.clock = clock
        self.predicted: dict[str, float] = {}
        self.running: tuple[str, float] | None = None  # (phase letter, clock at its begin)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __call__(self, event: Event) -> None:
        if isinstance(event, StartupEta):
            self.predicted = dict(event.phases)
        elif isinstance(event, StartupPhase) and not event.rank:
            self.running = (event.phase, self.clock()) if event.status == "begin" else None

    def line(self, now: float) -> str | None:
        running = self.running
        if running is None or now - running[1] < self.interval_s:
            return None
        letter, began = running
        return eta_line(letter, now - began, self.predicted.get(letter))

    def tick(self) -> str | None:
        text = self.line(self.clock())
        if text is not None:
            self.log(text)
        return text

    def start(self) -> EtaTicker:
        def run() -> None:
            while not self._stop.wait(self.interval_s):
                self.tick()

        self._thread = threading.Thread(target=run, name="kvscope-startup-eta", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()


# ------------------------------------------------------------------ one start
class EtaSession:
    """One start's prediction and record: :meth:`open` publishes ``startup.eta`` and starts the
    ticker; :meth:`record` adds the finished start to the history; :meth:`close` stops the
    ticker. A history that cannot be written is logged, never raised."""

    def __init__(self, bus: EventBus, log: Any, key: str, model_bytes: int | None, path: Path | None,
                 interval_s: float = 5.0) -> None:
        self.bus, self.log, self.key, self.model_bytes, self.path = bus, log, key, model_bytes, path
        self.history = load_history(path)
        self.prediction = predict(self.history, key, model_bytes)
        self.ticker = EtaTicker(log.info, interval_s)

    def open(self) -> EtaSession:
        self.bus.subscribe(self.ticker)
        self.bus.publish(self.prediction.event())
        p = self.prediction
        origin = f"{p.starts} earlier start{'s' if p.starts != 1 else ''} here" if p.starts else \
            f"no earlier start of this model and flags here ({', '.join(sorted(set(p.sources.values())))})"
        self.log.info(f"startup predicted ~{p.total_s:.1f} s from {origin}: "
                      + " ".join(f"{k} {v:.2f}" for k, v in p.phases.items()))
        self.ticker.start()
        return self

    def record(self, seconds: Mapping[str, float], now: float | None = None) -> None:
        if self.path is None:
            return
        history = record_start(load_history(self.path), self.key, seconds, time.time() if now is None else now,
                               self.model_bytes)  # read again: another start may have written since
        try:
            save_history(self.path, history)
        except OSError as exc:
            self.log.warning(f"startup history not written ({self.path}: {exc.strerror or exc}); "
                             "the next start predicts without this one")

    def close(self) -> None:
        self.ticker.stop()
        self.bus.unsubscribe(self.ticker)
