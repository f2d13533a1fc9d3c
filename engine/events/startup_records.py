"""The records of a start: the configuration (every flag and the model summary) and
startup phases A–G, their progress and the ETA."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from engine.events.record import Event


@dataclass(slots=True)
class EngineConfigEvent(Event):
    """Every flag and the model summary, emitted once before phase A."""

    type: ClassVar[str] = "engine.config"
    config: dict[str, Any] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)
    planned: bool = False


# ---------------------------------------------------------------------- startup
PHASES: dict[str, str] = {
    "A": "init",
    "B": "budget",
    "C": "load_weights",
    "D": "profile_run",
    "E": "kv_cache",
    "F": "graphs_compile",
    "G": "ready",
}


@dataclass(slots=True)
class StartupPhase(Event):
    """One startup phase boundary.

    status: ``begin`` | ``end`` | ``skipped`` | ``failed``. ``memory_before`` /
    ``memory_after`` hold device readings in bytes (total, free, allocated,
    reserved, peak, source). ``data`` holds the phase's own numbers (weights
    bytes, measured activation peak, KV pool bytes/blocks/tokens, concurrency...) in
    their JSON form; engine/events/phase_data.py declares them, one record per phase
    (``phase_record(event)``, ``read_phase(event, KvCacheData)``; producers publish
    ``record.to_dict()``). ``planned`` marks numbers from ``engine plan``;
    ``simulated`` from ``engine simulate``. ``rank``: the tensor-parallel rank whose
    phase it is (every rank runs A–G; rank 0 publishes the others' phases too), on every
    rank's events, rank 0's included; None (not written) when the replica has one rank,
    so a one-rank recording is what it always was. ``pp_rank`` / ``tp_rank``: under
    pipeline parallelism, the stage whose phase it is and the rank within the stage
    (every stage runs A–G for its own layers and KV pool, engine/pipeline.py); None (not
    written) otherwise. ``fixes``: a refused budget's fixes as data (engine/budget/fixes.py
    ``Fix.to_json``: flag, current, proposed, why), any one of which makes it fit; the
    ``reason`` sentence is rendered from them. Written only on a failure that has them, so
    other recordings are as they were; older recordings have the sentence alone.
    """

    type: ClassVar[str] = "startup.phase"
    written_when_set: ClassVar[frozenset[str]] = frozenset({"rank", "pp_rank", "tp_rank", "fixes"})
    phase: str = "A"
    name: str = "init"
    status: str = "begin"
    duration_s: float | None = None
    memory_before: dict[str, Any] | None = None
    memory_after: dict[str, Any] | None = None
    data: dict[str, Any] = field(default_factory=dict)
    reason: str | None = None
    fixes: list[dict[str, Any]] = field(default_factory=list)
    planned: bool = False
    simulated: bool = False
    rank: int | None = None
    pp_rank: int | None = None
    tp_rank: int | None = None

    def to_dict(self) -> dict[str, Any]:
        out = Event.to_dict(self)  # drops rank 0 with None (written_when_set): rank 0 goes back in
        for name in ("rank", "pp_rank", "tp_rank"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out


@dataclass(slots=True)
class StartupProgress(Event):
    """How far a long phase has got: ``done`` of ``total`` ``unit`` (total None when
    unknown) of ``what`` (``weights``, ``profile run``, ``kernels``, ``warm-up``), so
    the console, the dashboard and a recording show a phase that is moving."""

    type: ClassVar[str] = "startup.progress"
    phase: str = "C"
    what: str = ""
    done: float = 0.0
    total: float | None = None
    unit: str = ""

@dataclass(slots=True)
class StartupEta(Event):
    """The startup's prediction of itself (engine/startup_eta.py), published once before
    phase A: ``phases`` maps each phase letter to its predicted seconds, ``sources`` to where
    that came from (``history``: this machine's earlier starts of the same model and flags;
    ``read rate``: the model's bytes over phase C's measured read rate; ``machine``: other
    starts here; ``default``), ``starts`` counts the earlier starts read, ``key`` names the
    model and flags. The dashboard shows elapsed against predicted; ``/health`` the ETA."""

    type: ClassVar[str] = "startup.eta"
    phases: dict[str, float] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    starts: int = 0
    key: str = ""
