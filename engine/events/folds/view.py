"""EngineView: a fold of engine events into the engine's whole state.

This is the event layer's reducer (docs/architecture.md: events are the single
source of truth). The monitor's widgets only render an :class:`EngineView`; they
never look at events. The same reducer serves every source (in-process bus,
HTTP ``/events``, JSONL replay) and the server's ``/events`` stream: the server
folds the events it has published through :meth:`EngineView.apply` and sends
:meth:`EngineView.snapshot` as the first ``snapshot`` event to a new subscriber,
which rebuilds the view with :meth:`EngineView.from_snapshot` (or simply
``apply(SnapshotEvent(state=...))``).

Snapshot dict format (``SNAPSHOT_VERSION`` 1), all plain JSON::

    {
      "version": 1,
      "last_seq": int, "t": float, "step": int | None,   # last folded event/step
      "config": {...}, "model": {...},                    # from engine.config
      "phases": {"A": {"phase", "name", "status", "duration_s", "memory_delta",
                       "reason", "data", "memory_measure", "started_t",
                       "progress": {"what", "done", "total", "unit", "t"} | null}, ...},
      "ledger": {"total_bytes", "gpu_memory_utilization", "weights_bytes",
                 "non_torch_bytes", "activation_peak_bytes", "cuda_graph_bytes",
                 "kv_pool_bytes", "num_blocks", "block_size"},   # ints, missing = 0
      "device": {...} | null,                              # last memory reading
      "kv": {"used", "cached_free", "total"},              # the last step's (total: phase E's before one)
      "requests": {rid: {"state", "prompt_tokens", "max_tokens", "computed_tokens",
                         "generated_tokens", "blocks": [int], "prefix_hit_tokens",
                         "arrived_t", "ttft_s", "num_preemptions",
                         "group_blocks": [[int], ...]}},   # several KV cache groups only: ``blocks``
                                                           # by group (config order)
      "cached": [int],                                     # blocks holding cached KV
      "window_freed": [[block, group], ...],               # hybrid only: free blocks a sliding
                                                           # window released (not a finish)
      "finished": int, "rejected": int, "preemptions": int,
      "failed_sinks": {sink: error},                       # sinks the bus stopped (sink.failed)
      "engine_error": str | null,                          # why the engine loop stopped (engine.stopped)
      "stalled": {rank: {"phase", "stalled_s", "limit_s", "last_step", "t", "dump"}},  # cores stalled now
                                                           # (engine.stalled until engine.recovered; absent: none)
      "series": {"step": [...], "prefill": [...], "decode": [...], "running": [...],
                 "waiting": [...], "kv_pct": [...], "step_ms": [...],
                 "preempted": [...]},                      # last ``series_window`` steps
      "recent": [event.to_dict(), ...],                    # last ``recent_window`` events
      "ranks": {"1": {"phases": {...}, "ledger": {...}}, ...}  # tensor parallelism: the other
                                                           # ranks' (absent with one rank)
      "encoder_cache": {"used", "capacity"},               # tokens, from the last encoder.step
                                                           # (vision-language runs only)
      "experts": {"window", "steps": [[[int]]], "steps_seen"},  # MoE only: the last steps'
                                                           # expert_counts (expert_load.py)
      "parallel": {"window_s", "now", "ranks", "stages", "first_tokens"},  # several DP ranks or PP
                                                           # stages only (parallel_window.py)
      "dp_rank": int,                                      # the DP rank the rest shows (absent
    }                                                      # before any step or request event)

A data-parallel server's snapshot adds ``data_parallel`` (every rank's counts,
``rank_shown``: the rank of the rest); see :func:`snapshot_dp_rank`.

The view folds with collaborators of its own: its requests are the shared request records
(:class:`~engine.events.folds.request_record.RequestFold`, read through :class:`RequestView`),
its startup phases :class:`~engine.events.folds.startup_state.StartupState`, the faults the
engine reported :class:`EngineFaults`, and its blocks the block table.

Block owners are not stored: they are the union of every request's ``blocks``,
so the snapshot cannot disagree with itself; nor is a held block's KV cache group
(``block_groups``): it is the index of the request's ``group_blocks`` list holding it.
Every request's blocks are held per group; ``group_blocks`` is written only when there
are several (one group's are ``blocks``), and ``window_freed`` only when a window freed
something, so a full-attention snapshot is what it always was, and one without them
loads as one group. The block table itself is folded
by :class:`engine.events.folds.block_table.BlockTableState`, the same fold replay and
the tests use.

Seeking a recording (snapshot checkpoints every N steps) is the monitor's
:class:`monitor.state.Timeline`, built on this view.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any

from engine.events import (
    EngineConfigEvent,
    EngineStopped,
    Event,
    LogEvent,
    RequestArrived,
    RequestFinished,
    RequestFirstToken,
    RequestPreempted,
    RequestRejected,
    RequestScheduled,
    SinkFailed,
    SnapshotEvent,
    StartupEta,
    StartupPhase,
    StartupProgress,
    StatsEvent,
    StepEvent,
    event_from_dict,
)
from engine.events.engine_records import EngineRecovered, EngineStalled
from engine.events.folds.block_table import BlockTableState
from engine.events.folds.expert_load import ExpertLoad
from engine.events.folds.kv_occupancy import KvOccupancy, view_occupancy
from engine.events.folds.parallel_window import ParallelWindow
from engine.events.folds.request_record import RequestFold, RequestRecord
from engine.events.folds.startup_state import StartupState
from engine.events.step_records import EncoderStepEvent

SNAPSHOT_VERSION = 1
SERIES_NAMES = ("step", "prefill", "decode", "running", "waiting", "kv_pct", "step_ms", "preempted")
RUNNING = "running"
WAITING = "waiting"


class RequestView:
    """One request still in the engine (running or waiting), as the dashboard reads it: its
    record (the shared fold's, engine/events/folds/request_record.py) and its blocks (the
    view's block table)."""

    __slots__ = ("record", "table")

    def __init__(self, record: RequestRecord, table: BlockTableState) -> None:
        self.record = record
        self.table = table

    @property
    def request_id(self) -> str:
        return self.record.request_id

    @property
    def state(self) -> str:
        return self.record.state

    @property
    def prompt_tokens(self) -> int:
        return self.record.prompt_tokens

    @property
    def max_tokens(self) -> int:
        return self.record.max_tokens

    @property
    def computed_tokens(self) -> int:
        """As vLLM's num_computed_tokens: prefix-cache hits count as computed."""
        return self.record.computed_tokens

    @property
    def generated_tokens(self) -> int:
        return self.record.output_tokens

    @property
    def blocks(self) -> list[int]:
        return self.table.tables.get(self.record.request_id, [])

    @property
    def group_blocks(self) -> list[list[int]]:
        """``blocks`` split by KV cache group (config order): one list with one group; [] when it holds none."""
        return self.table.group_tables.get(self.record.request_id, [])

    @property
    def prefix_hit_tokens(self) -> int:
        return self.record.scheduled_hit_tokens

    @property
    def arrived_t(self) -> float:
        return self.record.arrived_t or 0.0

    @property
    def ttft_s(self) -> float | None:
        return self.record.ttft_s

    @property
    def num_preemptions(self) -> int:
        return self.record.num_preemptions

    def to_dict(self) -> dict[str, Any]:
        group_blocks = self.group_blocks
        return {
            "state": self.state,
            "prompt_tokens": self.prompt_tokens,
            "max_tokens": self.max_tokens,
            "computed_tokens": self.computed_tokens,
            "generated_tokens": self.generated_tokens,
            "blocks": list(self.blocks),
            "prefix_hit_tokens": self.prefix_hit_tokens,
            "arrived_t": self.arrived_t,
            "ttft_s": self.ttft_s,
            "num_preemptions": self.num_preemptions,
        } | ({"group_blocks": [list(g) for g in group_blocks]} if len(group_blocks) > 1 else {})


def record_from_dict(request_id: str, data: dict[str, Any]) -> RequestRecord:
    """A snapshot's request as a record (its blocks go to the view's block table)."""
    return RequestRecord(
        request_id,
        state=data.get("state", WAITING),
        prompt_tokens=int(data.get("prompt_tokens", 0)),
        max_tokens=int(data.get("max_tokens", 0)),
        computed_tokens=int(data.get("computed_tokens", 0)),
        output_tokens=int(data.get("generated_tokens", 0)),
        scheduled_hit_tokens=int(data.get("prefix_hit_tokens", 0)),
        arrived_t=float(data.get("arrived_t", 0.0)),
        ttft_s=data.get("ttft_s"),
        num_preemptions=int(data.get("num_preemptions", 0)),
    )


class EngineFaults:
    """What the engine reported going wrong: the sinks the bus stopped (``sink.failed``: sink
    name -> the error that stopped it) and the cores stalled now (``engine.stalled`` by rank,
    until its ``engine.recovered``). Its containers are filled in place, never replaced."""

    def __init__(self, failed_sinks: dict[str, str] | None = None,
                 stalled: dict[int, dict[str, Any]] | None = None) -> None:
        self.failed_sinks: dict[str, str] = {} if failed_sinks is None else failed_sinks
        self.stalled: dict[int, dict[str, Any]] = {} if stalled is None else stalled

    def apply(self, ev: Event) -> None:
        if isinstance(ev, SinkFailed):
            self.failed_sinks[ev.sink] = ev.error
        elif isinstance(ev, EngineStalled):
            self.stalled[ev.rank] = {"phase": ev.phase, "stalled_s": ev.stalled_s, "limit_s": ev.limit_s,
                                     "last_step": ev.last_step, "t": ev.t, "dump": ev.dump}
        elif isinstance(ev, EngineRecovered):
            self.stalled.pop(ev.rank, None)

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> EngineFaults:
        """A snapshot's ``failed_sinks`` and ``stalled``."""
        return cls({str(k): str(v) for k, v in dict(state.get("failed_sinks") or {}).items()},
                   {int(r): dict(s) for r, s in (state.get("stalled") or {}).items()})


def _set_kv_layout(fold: RequestFold, ledger: dict[str, float], config: dict[str, Any]) -> None:
    """The block size and KV cache groups the request fold derives a resumed request's prefix hit from."""
    fold.set_kv_layout(int(ledger.get("block_size") or config.get("block_size") or 0), config)


def _snapshot_tables(requests: dict[str, Any]) -> tuple[dict[str, list[int]], dict[str, list[list[int]]]]:
    """A snapshot's requests' blocks: every request's, and by group (none written: one group's)."""
    tables: dict[str, list[int]] = {}
    group_tables: dict[str, list[list[int]]] = {}
    for rid, data in requests.items():
        blocks = [int(b) for b in data.get("blocks", [])]
        groups = [[int(b) for b in g] for g in data.get("group_blocks") or []] or ([blocks] if blocks else [])
        if blocks:
            tables[rid] = blocks
        if groups:
            group_tables[rid] = groups
    return tables, group_tables


def event_dp_rank(event: Event) -> int | None:
    """The data-parallel rank whose engine core published ``event``; None for an event no
    rank's scheduler stamps (config, startup phases, logs)."""
    return getattr(event, "dp_rank", None)


def snapshot_dp_rank(state: dict[str, Any]) -> int | None:
    """The DP rank a snapshot's pool and requests are: its ``dp_rank``, else the rank a data-parallel
    server's ``/debug/state?dp_rank=R`` says it shows; None before any rank's event."""
    rank = state.get("dp_rank")
    if rank is None and state.get("data_parallel"):
        rank = state["data_parallel"].get("rank_shown", 0)
    return None if rank is None else int(rank)


class EngineView:
    """Everything the dashboard shows, folded from events by :meth:`apply`. ``dp_rank``
    (optional) fixes the DP rank the pool, requests and series follow before any event."""

    def __init__(self, series_window: int = 4096, recent_window: int = 200, dp_rank: int | None = None) -> None:
        self.series_window = series_window
        self.recent_window = recent_window
        self.last_seq = 0
        self.t = 0.0
        self.step: int | None = None
        self.config: dict[str, Any] = {}
        self.model: dict[str, Any] = {}
        self._share(StartupState(), EngineFaults(), BlockTableState())  # the table: the shared fold of step block deltas
        self.kv_used = 0
        self.kv_cached_free = 0
        self.kv_total = 0
        # vision-language runs (encoder.step events): the encoder cache beside the KV pool, in tokens
        self.encoder_cache_used = 0
        self.encoder_cache_capacity = 0
        self.request_fold = RequestFold(finished_kept=0)  # the requests in the engine: the shared record fold
        self._owners: dict[int, set[str]] | None = None
        self._groups: dict[int, int] | None = None
        self.finished = 0
        self.rejected = 0
        self.preemptions = 0
        self.engine_error: str | None = None  # engine.stopped: why the engine loop stopped
        self.series: dict[str, deque[float]] = {n: deque(maxlen=series_window) for n in SERIES_NAMES}
        self.recent: deque[Event] = deque(maxlen=recent_window)
        self.stats: StatsEvent | None = None
        self.experts = ExpertLoad()  # a MoE model's routed tokens per expert, over the last steps
        # Every DP rank's queue, KV and throughput and every PP stage's bubble, over the last
        # seconds (parallel_window.py). The rest of the view is one DP rank's, ``dp_rank``: the
        # snapshot's, else the first step or request event's. Another rank's events reach only
        # ``parallel`` and ``recent``: each rank has its own KV pool, block ids and requests.
        self.parallel = ParallelWindow()
        self.dp_rank: int | None = dp_rank

    # ------------------------------------------------------------ derived views
    @property
    def block_owners(self) -> dict[int, set[str]]:
        """Block id -> ids of the requests holding it; rebuilt lazily, once per
        render rather than once per folded step."""
        if self._owners is None:
            owners: dict[int, set[str]] = {}
            for rid, blocks in self.table.tables.items():
                for b in blocks:
                    owners.setdefault(b, set()).add(rid)
            self._owners = owners
        return self._owners

    @property
    def block_groups(self) -> dict[int, int]:
        """Held block id -> its KV cache group; rebuilt lazily like :attr:`block_owners`."""
        if self._groups is None:
            self._groups = self.table.block_groups()
        return self._groups

    @property
    def kv_cache_groups(self) -> list[dict[str, Any]]:
        """``engine.config``'s ``kv_cache_groups`` (``{"kind", "sliding_window", "layers"}``
        each, config order); [] when it names none (one full-attention group)."""
        groups = self.config.get("kv_cache_groups")
        return [dict(g) for g in groups if isinstance(g, dict)] if isinstance(groups, list) else []

    @property
    def occupancy(self) -> KvOccupancy:
        """The pool by token slots: filled against allocated per KV cache group, PR#57336's
        token usage, and the partly filled blocks (engine/events/folds/kv_occupancy.py)."""
        return view_occupancy(self)

    @property
    def num_blocks(self) -> int:
        return int(self.kv_total or self.ledger.get("num_blocks", 0) or 0)

    @property
    def requests(self) -> dict[str, RequestView]:
        """The requests in the engine, arrival order."""
        table = self.table
        return {rid: RequestView(record, table) for rid, record in self.request_fold.lives.items()}

    @property
    def running(self) -> list[RequestView]:
        return [r for r in self.requests.values() if r.state == RUNNING]

    @property
    def waiting(self) -> list[RequestView]:
        return [r for r in self.requests.values() if r.state == WAITING]

    # ------------------------------------------------------------------- folding
    def fold(self, events: Iterable[Event]) -> EngineView:
        for event in events:
            self.apply(event)
        return self

    def apply(self, event: Event) -> None:
        """Fold one event into the view. Unknown event kinds only land in ``recent``."""
        self.t = max(self.t, event.t)
        self.parallel.apply(event)
        rank = event_dp_rank(event)
        if rank is not None and self.dp_rank is None:
            self.dp_rank = rank
        other_rank = rank is not None and rank != self.dp_rank
        if not other_rank:  # another DP rank's bus counts its own seq
            self.last_seq = max(self.last_seq, event.seq)
        handler = None if other_rank else _HANDLERS.get(type(event))
        if handler is not None:
            handler(self, event)
        if not isinstance(event, SnapshotEvent | StepEvent | EncoderStepEvent):
            self.recent.append(event)

    def _on_report(self, ev: Event) -> None:
        """The engine's latest reports, kept as they are: the stats, the encoder cache's use,
        why the engine loop stopped."""
        if isinstance(ev, StatsEvent):
            self.stats = ev
        elif isinstance(ev, EncoderStepEvent):
            self.encoder_cache_used = ev.cache_used_tokens
            self.encoder_cache_capacity = ev.cache_capacity_tokens
        elif isinstance(ev, EngineStopped):
            self.engine_error = ev.error

    def _on_config(self, ev: EngineConfigEvent) -> None:
        self.config = dict(ev.config)
        self.model = dict(ev.model)
        self.startup.read_config(ev.config)

    def _share(self, startup: StartupState, faults: EngineFaults, table: BlockTableState) -> None:
        """The parts the view folds with, their containers read here under the view's names."""
        self.startup, self.faults, self.table = startup, faults, table
        self.phases, self.ledger, self.device = startup.phases, startup.ledger, startup.device
        # Tensor parallelism: the other ranks' phases and ledgers (rank 0's are ``phases``
        # and ``ledger``, the replica's); empty with one rank.
        self.rank_phases, self.rank_ledgers = startup.rank_phases, startup.rank_ledgers
        self.failed_sinks, self.stalled = faults.failed_sinks, faults.stalled
        # Block id -> the group whose sliding window released it, for blocks whose last release
        # was a window's (not a finish or preemption); a held block may be listed (another
        # request's window left it), so read ``block_owners`` first.
        self.cached, self.window_freed = table.cached, table.window_freed

    def _request(self, request_id: str) -> RequestView:
        """The request's view, its record begun (arrived now) when the fold has none."""
        record = self.request_fold.lives.get(request_id)
        if record is None:
            record = self.request_fold.record(request_id)
            record.arrived_t = self.t
        return RequestView(record, self.table)

    def _on_request(self, ev: Event) -> None:
        lives = self.request_fold.lives
        if isinstance(ev, RequestFinished) and ev.request_id in lives:
            self.finished += 1  # a lone finish (abort while waiting); the step usually retires it
        elif isinstance(ev, RequestRejected):
            self.rejected += 1
        self.request_fold(ev)

    def _on_step(self, ev: StepEvent) -> None:
        self.step = ev.index
        # strict=False: a live monitor that missed an event should keep drawing.
        self.table.apply(ev, strict=False)
        self._owners = None
        self._groups = None
        lives = self.request_fold.lives
        self.finished += sum(1 for rid in ev.finished if rid in lives)
        _set_kv_layout(self.request_fold, self.ledger, self.config)
        self.request_fold(ev)
        self.preemptions += len(ev.preempted)
        self.kv_used = ev.kv_blocks_used
        self.kv_cached_free = ev.kv_blocks_cached_free
        self.kv_total = ev.kv_blocks_total or self.kv_total
        s = self.series
        s["step"].append(ev.index)
        s["prefill"].append(ev.num_prefill_tokens)
        s["decode"].append(ev.num_decode_tokens)
        s["running"].append(ev.num_running)
        s["waiting"].append(ev.num_waiting)
        s["kv_pct"].append(100.0 * ev.kv_blocks_used / ev.kv_blocks_total if ev.kv_blocks_total else 0.0)
        s["step_ms"].append(ev.duration_s * 1000.0)
        s["preempted"].append(len(ev.preempted))
        if ev.expert_counts:
            self.experts.add(ev.expert_counts)

    # ------------------------------------------------------------------ snapshot
    def snapshot(self, series_window: int | None = None, recent_window: int | None = None) -> dict[str, Any]:
        """The whole view as plain JSON (format in the module docstring)."""
        n_series = self.series_window if series_window is None else series_window
        n_recent = self.recent_window if recent_window is None else recent_window
        startup = self.startup.to_dict()
        ranks = startup.pop("ranks", None)
        return {
            "version": SNAPSHOT_VERSION,
            "last_seq": self.last_seq,
            "t": self.t,
            "step": self.step,
            "config": dict(self.config),
            "model": dict(self.model),
            **startup,
            "kv": {"used": self.kv_used, "cached_free": self.kv_cached_free, "total": self.num_blocks},
            "requests": {rid: r.to_dict() for rid, r in self.requests.items()},
            "cached": sorted(self.cached),
            **({"window_freed": [[b, g] for b, g in sorted(self.window_freed.items())]} if self.window_freed else {}),
            "finished": self.finished,
            "rejected": self.rejected,
            "preemptions": self.preemptions,
            "failed_sinks": dict(self.failed_sinks),
            "engine_error": self.engine_error,
            "series": {k: list(v)[-n_series:] if n_series else [] for k, v in self.series.items()},
            "recent": [e.to_dict() for e in list(self.recent)[-n_recent:]] if n_recent else [],
        } | ({"ranks": ranks} if ranks is not None else {}) \
          | ({"encoder_cache": {"used": self.encoder_cache_used, "capacity": self.encoder_cache_capacity}}
             if self.encoder_cache_capacity else {}) \
          | ({"experts": self.experts.to_dict()} if self.experts.num_layers else {}) \
          | ({"parallel": self.parallel.to_dict()} if self.parallel.parallel else {}) \
          | ({"dp_rank": self.dp_rank} if self.dp_rank is not None else {}) \
          | ({"stalled": {str(r): dict(s) for r, s in self.stalled.items()}} if self.stalled else {})

    @classmethod
    def from_snapshot(
        cls, state: dict[str, Any], series_window: int = 4096, recent_window: int = 200
    ) -> EngineView:
        view = cls(series_window=series_window, recent_window=recent_window)
        view._load(state)
        return view

    def _load(self, state: dict[str, Any]) -> None:
        if int(state.get("version", SNAPSHOT_VERSION)) > SNAPSHOT_VERSION:
            raise ValueError(f"snapshot version {state.get('version')} is newer than this monitor reads")
        self.last_seq = int(state.get("last_seq", 0))
        self.t = float(state.get("t", 0.0))
        self.step = state.get("step")
        self.config = dict(state.get("config", {}))
        self.model = dict(state.get("model", {}))
        kv = state.get("kv", {})
        self.kv_used = int(kv.get("used", 0))
        self.kv_cached_free = int(kv.get("cached_free", 0))
        self.kv_total = int(kv.get("total", 0))
        encoder = state.get("encoder_cache", {})
        self.encoder_cache_used = int(encoder.get("used", 0))
        self.encoder_cache_capacity = int(encoder.get("capacity", 0))
        requests = state.get("requests", {})
        self.request_fold = RequestFold(finished_kept=0)
        for rid, data in requests.items():
            self.request_fold.add(record_from_dict(rid, data))
        tables, group_tables = _snapshot_tables(requests)
        table = BlockTableState(
            tables=tables,
            cached=set(state.get("cached", [])),
            num_blocks=self.kv_total,
            last_step=self.step if self.step is not None else -1,
            group_tables=group_tables,
            window_freed={int(b): int(g) for b, g in state.get("window_freed") or []},
        )
        self._share(StartupState.from_dict(state), EngineFaults.from_dict(state), table)
        self._owners = None
        self._groups = None
        self.finished = int(state.get("finished", 0))
        self.rejected = int(state.get("rejected", 0))
        self.preemptions = int(state.get("preemptions", 0))
        self.engine_error = state.get("engine_error")
        series = state.get("series", {})
        self.series = {n: deque(series.get(n, []), maxlen=self.series_window) for n in SERIES_NAMES}
        self.recent = deque(
            (event_from_dict(d) for d in state.get("recent", [])), maxlen=self.recent_window
        )
        self.experts = ExpertLoad.from_dict(state["experts"]) if state.get("experts") else ExpertLoad()
        balance = state.get("data_parallel")  # a data-parallel server's snapshot: every rank's counts now
        # That server's snapshot is one rank's view, whose fold saw only that rank's steps: a view
        # that already folds the server's stream of every rank (a switch to another rank, a
        # reconnect) keeps its own fold and seeds it.
        if not (balance and self.parallel.num_ranks):
            self.parallel = ParallelWindow.from_dict(state["parallel"]) if state.get("parallel") else ParallelWindow()
        self.dp_rank = snapshot_dp_rank(state)
        if balance:
            self.parallel.seed_ranks(balance, self.t)


_HANDLERS: dict[type, Any] = {
    EngineConfigEvent: EngineView._on_config,
    StartupPhase: lambda view, ev: view.startup.apply(ev),
    StartupProgress: lambda view, ev: view.startup.apply(ev),
    StartupEta: lambda view, ev: view.startup.apply(ev),
    RequestArrived: EngineView._on_request,
    RequestScheduled: EngineView._on_request,
    RequestFirstToken: EngineView._on_request,
    RequestPreempted: EngineView._on_request,
    RequestFinished: EngineView._on_request,
    RequestRejected: EngineView._on_request,
    StepEvent: EngineView._on_step,
    EncoderStepEvent: EngineView._on_report,
    StatsEvent: EngineView._on_report,
    EngineStopped: EngineView._on_report,
    SnapshotEvent: lambda view, ev: view._load(ev.state),
    SinkFailed: lambda view, ev: view.faults.apply(ev),
    EngineStalled: lambda view, ev: view.faults.apply(ev),
    EngineRecovered: lambda view, ev: view.faults.apply(ev),
    LogEvent: None,
}
_HANDLERS = {k: v for k, v in _HANDLERS.items() if v is not None}
