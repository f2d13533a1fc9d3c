"""The startup as the dashboard shows it, folded from ``startup.phase``, ``startup.eta`` and
``startup.progress``: each phase's latest status per rank (rank 0's are the replica's), the
memory ledger the phases reported, the last memory reading and the time left. One part of
:class:`engine.events.folds.view.EngineView`, which snapshots it with the rest."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.events.ledger import LEDGER
from engine.events.record import Event
from engine.events.startup_records import PHASES, StartupEta, StartupPhase, StartupProgress

# The ledger the dashboard draws: the quantities of engine/events/ledger.py's one table
# that the memory bar and the KV pool need, under that table's names.
LEDGER_KEYS = tuple(item.name for item in LEDGER if item.name in {
    "total_bytes", "gpu_memory_utilization", "weights_bytes", "non_torch_bytes", "activation_peak_bytes",
    "cuda_graph_bytes", "kv_pool_bytes", "num_blocks", "block_size"})

@dataclass(slots=True)
class PhaseView:
    """The latest known status of one startup phase."""

    phase: str
    name: str
    status: str = "pending"
    duration_s: float | None = None
    memory_delta: int | None = None  # used bytes after - before (_memory_delta), when both known
    reason: str | None = None
    data: dict[str, Any] = field(default_factory=dict)
    memory_measure: str | None = None  # what memory_delta measured: allocated, rss (CPU), used
    started_t: float | None = None  # the bus time of its begin
    # The latest startup.progress of this phase: {"what", "done", "total", "unit", "t"}
    # (total None when unknown); cleared when the phase begins again.
    progress: dict[str, Any] | None = None
    # The startup's prediction of this phase (startup.eta), seconds; None: no prediction
    predicted_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "phase": self.phase,
            "name": self.name,
            "status": self.status,
            "duration_s": self.duration_s,
            "memory_delta": self.memory_delta,
            "reason": self.reason,
            "data": dict(self.data),
            "memory_measure": self.memory_measure,
            "started_t": self.started_t,
            "progress": dict(self.progress) if self.progress is not None else None,
        } | ({"predicted_s": self.predicted_s} if self.predicted_s is not None else {})


def phase_views(phases: dict[str, Any]) -> dict[str, PhaseView]:
    """A snapshot's phases (one rank's) as views."""
    return {
        k: PhaseView(
            phase=p.get("phase", k),
            name=p.get("name", ""),
            status=p.get("status", "pending"),
            duration_s=p.get("duration_s"),
            memory_delta=p.get("memory_delta"),
            reason=p.get("reason"),
            data=dict(p.get("data", {})),
            memory_measure=p.get("memory_measure"),
            started_t=p.get("started_t"),
            progress=dict(p["progress"]) if p.get("progress") is not None else None,
            predicted_s=p.get("predicted_s"),
        )
        for k, p in phases.items()
    }


def startup_eta(phases: dict[str, PhaseView], now: float) -> dict[str, Any] | None:
    """While a start is predicted and not finished: the running (or next) phase, its elapsed and
    predicted seconds, and the seconds left (what is left of this phase's prediction, never
    below 0, plus the phases to come). None before a prediction or once phase G ended."""
    if not any(p.predicted_s is not None for p in phases.values()):
        return None
    ready = phases.get("G")
    if ready is not None and ready.status in ("end", "skipped"):
        return None
    current = next((p for p in phases.values() if p.status in ("running", "failed")), None)
    if current is None:
        current = next((phases[k] for k in PHASES if k in phases and phases[k].status == "pending"), None)
    if current is None:
        return None
    elapsed = max(0.0, now - current.started_t) if current.started_t is not None else 0.0
    later = [k for k in PHASES if k > current.phase]
    left = max(0.0, (current.predicted_s or 0.0) - elapsed) + sum(
        phases[k].predicted_s or 0.0 for k in later if k in phases and phases[k].status == "pending")
    return {"phase": current.phase, "name": current.name, "status": current.status, "elapsed_s": elapsed,
            "predicted_s": current.predicted_s, "eta_s": left}


def snapshot_startup_eta(state: dict[str, Any], now: float) -> dict[str, Any] | None:
    """:func:`startup_eta` of a snapshot's phases (``/health`` reads the server's snapshot)."""
    return startup_eta(phase_views(state.get("phases") or {}), now)


# What a phase's memory delta measures, by where the reading came from: on CUDA the
# bytes torch's live tensors hold; on CPU torch reports no allocations (always 0), so
# the process's resident memory (``process_used``, also in ``reserved``) is what moves.
DEVICE_MEASURES = ("allocated", "used", "rss")
CPU_MEASURES = ("process_used", "rss", "reserved", "allocated")


def _memory_delta(before: dict[str, Any] | None, after: dict[str, Any] | None) -> tuple[int, str] | None:
    """Growth of the used memory across a phase and what it measured: allocated
    bytes on a device that has them, process RSS on CPU, otherwise total − free."""
    if not before or not after:
        return None
    on_cpu = str(after.get("device") or before.get("device") or "").startswith("cpu")
    for key in CPU_MEASURES if on_cpu else DEVICE_MEASURES:
        if before.get(key) is not None and after.get(key) is not None:
            measure = "rss" if on_cpu and key in ("process_used", "reserved") else key
            return int(after[key]) - int(before[key]), measure
    if all(k in d for d in (before, after) for k in ("total", "free")):
        used = (int(after["total"]) - int(after["free"])) - (int(before["total"]) - int(before["free"]))
        return used, "used"
    return None


class StartupState:
    """Every rank's startup phases and ledger, and rank 0's last memory reading (``device``,
    empty before any). Its containers are filled in place, never replaced, so a reader may hold them."""

    def __init__(self, phases: dict[str, PhaseView] | None = None, ledger: dict[str, float] | None = None,
                 rank_phases: dict[int, dict[str, PhaseView]] | None = None,
                 rank_ledgers: dict[int, dict[str, float]] | None = None,
                 device: dict[str, Any] | None = None) -> None:
        self.phases: dict[str, PhaseView] = {} if phases is None else phases
        self.ledger: dict[str, float] = dict.fromkeys(LEDGER_KEYS, 0) if ledger is None else ledger
        # Tensor parallelism: the other ranks' phases and ledgers (rank 0's are ``phases``
        # and ``ledger``, the replica's); empty with one rank.
        self.rank_phases: dict[int, dict[str, PhaseView]] = {} if rank_phases is None else rank_phases
        self.rank_ledgers: dict[int, dict[str, float]] = {} if rank_ledgers is None else rank_ledgers
        self.device: dict[str, Any] = dict(device or {})

    def apply(self, event: Event) -> None:
        if isinstance(event, StartupPhase):
            self._on_phase(event)
        elif isinstance(event, StartupEta):
            self._on_eta(event)
        elif isinstance(event, StartupProgress):
            self._on_progress(event)

    def read_config(self, config: dict[str, Any]) -> None:
        """A planned ``engine.config`` may already carry the budget."""
        for key in LEDGER_KEYS:
            if key in config and isinstance(config[key], int | float):
                self.ledger[key] = config[key]

    def phase(self, phase: str, name: str | None = None, rank: int = 0) -> PhaseView:
        """Phase ``phase`` of rank ``rank`` (0: the replica's), begun pending when unseen."""
        phases = self.rank_phases.setdefault(rank, {}) if rank else self.phases
        view = phases.get(phase)
        if view is None:
            view = phases[phase] = PhaseView(phase=phase, name=name or PHASES.get(phase, phase))
        return view

    def _on_phase(self, ev: StartupPhase) -> None:
        rank = ev.rank or 0  # None: a one-rank replica
        view = self.phase(ev.phase, ev.name, rank)
        ledger = self.rank_ledgers.setdefault(rank, dict.fromkeys(LEDGER_KEYS, 0)) if rank else self.ledger
        view.name = ev.name
        view.status = "running" if ev.status == "begin" else ev.status
        if ev.status == "begin":
            view.started_t = ev.t
            view.progress = None
        if ev.duration_s is not None:
            view.duration_s = ev.duration_s
        delta = _memory_delta(ev.memory_before, ev.memory_after)
        if delta is not None:
            view.memory_delta, view.memory_measure = delta
        view.reason = ev.reason
        view.data.update(ev.data)
        for key in LEDGER_KEYS:
            value = ev.data.get(key)
            if isinstance(value, int | float):
                ledger[key] = value
        if ev.memory_after and not ev.rank:
            self.device.clear()
            self.device.update(ev.memory_after)

    def _on_eta(self, ev: StartupEta) -> None:
        for letter, seconds in ev.phases.items():
            if letter in PHASES:
                self.phase(letter).predicted_s = seconds

    def _on_progress(self, ev: StartupProgress) -> None:
        view = self.phase(ev.phase)
        if view.status == "pending":  # progress before its begin (a late subscriber): it is running
            view.status = "running"
        view.progress = {"what": ev.what, "done": ev.done, "total": ev.total, "unit": ev.unit, "t": ev.t}

    def to_dict(self) -> dict[str, Any]:
        """The snapshot's ``phases``, ``ledger``, ``device`` and (tensor parallelism) ``ranks``."""
        return {"phases": {k: p.to_dict() for k, p in self.phases.items()}, "ledger": dict(self.ledger),
                "device": dict(self.device) if self.device else None} | (
            {"ranks": {str(rank): {"phases": {k: p.to_dict() for k, p in phases.items()},
                                   "ledger": dict(self.rank_ledgers.get(rank, {}))}
                       for rank, phases in sorted(self.rank_phases.items())}} if self.rank_phases else {})

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> StartupState:
        ranks = state.get("ranks", {})
        return cls(phase_views(state.get("phases", {})), dict.fromkeys(LEDGER_KEYS, 0.0) | dict(state.get("ledger", {})),
                   {int(r): phase_views(s.get("phases", {})) for r, s in ranks.items()},
                   {int(r): dict.fromkeys(LEDGER_KEYS, 0.0) | dict(s.get("ledger", {})) for r, s in ranks.items()},
                   state.get("device"))
