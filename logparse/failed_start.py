"""Did the start fail, in which phase, and why.

A vLLM start fails in many ways and says so in many words: ``EngineCore failed to start``,
``EngineCore hit an exception``, a worker that ``died unexpectedly``, an exception in a
worker ``while processing method init_device``, ``torch.OutOfMemoryError``, ``NCCL error``,
``ray.exceptions.RayTaskError(...)``, a Ray node marked dead, ``CUDA error: an illegal memory access``, or only a
traceback the paste cuts before its last line. :class:`StartupWatch` sees every record as it
streams past (any record: a hand-written pattern, a line from vLLM's source, noise or an
unknown line) and keeps the *signals* of a failure, each with its line, its class and the
startup phase the log had reached; :meth:`StartupWatch.outcome` picks the most specific one
(an out-of-memory says more than "EngineCore failed to start", which only points up to it)
and places it: by the traceback's frames where they name a place (graph capture, profiling,
KV allocation, loading, device init), else by the last startup phase the log printed.

A failure after the server was ready (its routes, ``Application startup complete``, a stats
or access line, or a traceback whose frames are the engine's busy loop, a request's step, the
output handler or shutdown, where a paste keeps none of those lines) is no failed start: it is
reported as an engine that died at runtime.
A log whose KV pool is printed smaller than one max-model-len request (``# GPU blocks: 229``
x 16 = 3,664 tokens < 4,096) is a failed start even where the paste lost vLLM's error line:
:func:`kv_below_max_len_check`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from engine.budget.fixes import Fix
from logparse.check import Check
from logparse.parser import Record
from logparse.patterns import PHASE_NAMES
from logparse.tracebacks import MAX_FRAMES, PLACE_PHASES, RUNTIME_PLACES, place_in

STARTUP_PHASES = "ABCDEFG"
# The classes of failure, most specific first: the outcome names the first class any signal has.
CAUSE_ORDER = ("kv_below_max_len", "no_kv_memory", "free_memory", "oom", "nccl", "cuda_error", "ray",
               "profiling", "exception", "worker_died", "engine_core", "cut_traceback")
CAUSE_WORDS = {
    "kv_below_max_len": "the KV cache holds less than one max-model-len request",
    "no_kv_memory": "no memory left for the KV cache",
    "free_memory": "less device memory free than requested",
    "oom": "out of memory",
    "nccl": "NCCL (GPU collective) error",
    "cuda_error": "CUDA error",
    "ray": "Ray error",
    "profiling": "memory profiling error",
    "exception": "an exception",
    "worker_died": "a worker process died",
    "engine_core": "the engine core process died",
    "cut_traceback": "a traceback the log cuts before its exception line",
}
# logparse's failure checks (logparse/failures.py) under the class of failure they are.
CHECK_CAUSES = {"kv_below_max_model_len": "kv_below_max_len", "max_seq_len_exceeds_kv": "kv_below_max_len",
                "no_cache_blocks": "no_kv_memory", "free_below_request": "free_memory", "oom": "oom",
                "oom_graph_capture": "oom", "oom_sampler": "oom", "profiling_error": "profiling"}

# The startup phase each check's failure belongs to, whatever line the log printed last.
CHECK_PHASES = {"kv_below_max_model_len": "E", "max_seq_len_exceeds_kv": "E", "no_cache_blocks": "E",
                "free_below_request": "B", "profiling_error": "D", "oom_graph_capture": "F", "oom_sampler": "F"}

_MARKERS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("engine_core", re.compile(r"^Process (?:EngineCore\w*|SpawnProcess-\d+):$|EngineCore failed to start|Engine core initialization failed|EngineCore hit an "
                               r"exception|EngineCore encountered a fatal error|Engine process failed to start|"
                               r"Engine core proc \S+ died unexpectedly")),
    ("ray", re.compile(r"has been marked dead because the detector has missed too many heartbeats|^Raylet is "
                       r"terminated")),  # a Ray node lost: the vLLM ranks on it with it
    ("worker_died", re.compile(r"Worker proc \S+ died unexpectedly|\bproc \S+ died unexpectedly|Worker \S+ pid \d+ "
                               r"died, exit code|WorkerProc (?:hit an exception|failed to start|initialization "
                               r"failed)|Exception in worker \S+ while processing method (?P<method>\w+)|Error "
                               r"executing method '?(?P<method2>\w+)")),
)
_EXCEPTION = re.compile(r"^(?:[A-Za-z_]\w*\.)*(?:[A-Z]\w*(?:Error|Exception|Exit)|Exception)(?:\((?P<inner>\w+)\))?: \S")
# Exception lines that only point at the real one ("See root cause above").
_WRAPPER = re.compile(r"See root cause above|See stack trace|EngineDeadError|initialization failed due to an "
                      r"exception in a background process")
_CLASSES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("oom", re.compile(r"OutOfMemoryError|[Oo]ut of memory|RESOURCE_EXHAUSTED")),
    ("nccl", re.compile(r"NCCL error|nccl\w*Error|ProcessGroupNCCL|ncclCommInitRank failed")),
    ("cuda_error", re.compile(r"(?:CUDA|HIP|CUDA driver) error|AcceleratorError|cudaError\w+")),
    ("ray", re.compile(r"\bray\.exceptions\.|RayTaskError|ActorDiedError|RayActorError|RaySystemError")),
)
# A worker method named by the failure line, as the place in startup it is.
METHOD_PLACES = {"init_device": "device_init", "load_model": "loading", "determine_num_available_blocks": "profiling",
                 "determine_available_memory": "profiling", "profile_run": "profiling",
                 "initialize_cache": "kv_allocation", "initialize_from_config": "kv_allocation",
                 "compile_or_warm_up_model": "graph_capture"}
# Lines that only a server past its startup prints.
READY_PATTERNS = frozenset({"uvicorn_running", "uvicorn_startup", "uvicorn_started", "server_starting", "route",
                            "available_routes", "supported_tasks", "stats", "uvicorn_access", "init_engine_took"})
MAX_SIGNALS = 64


@dataclass(slots=True)
class Signal:
    cause: str
    line: int
    text: str
    phase: str  # the last startup phase the log had printed when it came
    method: str | None = None
    implied: bool = False  # the phase is the failure's own (a check's), not the log's last line


@dataclass(slots=True)
class StartupFailure:
    """What failed, where, and the line that says so (``runtime``: after the server was ready)."""

    cause: str
    summary: str
    line: int
    phase: str
    phase_source: str
    place: str | None = None
    runtime: bool = False
    via_ray: bool = False
    signals: list[Signal] = field(default_factory=list)

    @property
    def phase_name(self) -> str:
        return PHASE_NAMES.get(self.phase, "no startup line before it")

    def cause_text(self) -> str:
        """The doctor's cause: the class of failure and where."""
        where = "after the server was ready" if self.runtime else f"during {self.phase_name}"
        return f"{CAUSE_WORDS[self.cause]}{' (through Ray)' if self.via_ray else ''} {where}"

    def headline(self) -> str:
        """'startup failed in phase F (compile / CUDA graphs): <class of failure>'."""
        what = CAUSE_WORDS[self.cause] + (" (through Ray)" if self.via_ray else "")
        head = "the engine died at runtime" if self.runtime else f"startup failed in phase {self.phase} ({self.phase_name})"
        return f"{head}: {what}"

    def sentence(self) -> str:
        """The headline with the line that says it, as explain prints it."""
        return f"{self.headline()}: {self.summary} (line {self.line}; phase from {self.phase_source})"

    def to_json(self) -> dict[str, Any]:
        return {"failed": not self.runtime, "runtime": self.runtime, "cause": self.cause, "summary": self.summary,
                "line": self.line, "phase": self.phase, "phase_name": self.phase_name,
                "phase_source": self.phase_source, "place": self.place, "via_ray": self.via_ray,
                "headline": self.headline(), "sentence": self.sentence(),
                "signals": [{"cause": s.cause, "line": s.line, "text": s.text[:300]} for s in self.signals[:8]]}


def classify(text: str) -> str | None:
    """The class of failure a line's words name (out of memory, NCCL, CUDA error, Ray), if any."""
    for cause, regex in _CLASSES:
        if regex.search(text):
            return cause
    return None


class StartupWatch:
    """Fed every record in order (and each counted run), with the fold's last startup phase."""

    def __init__(self) -> None:
        self.signals: list[Signal] = []
        self.ready_line: int | None = None
        self.last_progress_line = 0  # the last record of a startup phase (A-G) that is not a failure
        self.frames: list[str] = []  # traceback lines seen since the first signal (and just before it)
        self.recent_frames: list[str] = []
        self.in_traceback = False
        self.via_ray = False

    def add(self, record: Record, phase: str) -> None:
        self._track_traceback(record)
        pattern = record.pattern
        if pattern is not None and self.ready_line is None and (pattern.id in READY_PATTERNS or pattern.phase == "R"):
            self.ready_line = record.line
        if pattern is not None and pattern.phase in STARTUP_PHASES and not pattern.failure:
            self.last_progress_line = record.line
        self._signal(record, phase)

    def add_run(self, first_line: int) -> None:
        """A run of stats/access lines: the server was serving."""
        self.in_traceback = False
        if self.ready_line is None:
            self.ready_line = first_line

    def _track_traceback(self, record: Record) -> None:
        if record.noise == "traceback" or (self.in_traceback and record.pattern is None and record.template is None):
            self.in_traceback = not _EXCEPTION.match(record.text)
            bucket = self.frames if self.signals else self.recent_frames
            if len(bucket) < MAX_FRAMES:
                bucket.append(record.text)
            elif bucket is self.recent_frames:
                del bucket[: MAX_FRAMES // 2]
        elif record.pattern is not None or _EXCEPTION.match(record.text):
            self.in_traceback = False

    def _signal(self, record: Record, phase: str) -> None:
        text = record.text
        if record.duplicate_of is not None or len(self.signals) >= MAX_SIGNALS or not text:
            return
        cause, method = None, None
        for name, regex in _MARKERS:
            m = regex.search(text)
            if m:
                cause, method = name, m.groupdict().get("method") or m.groupdict().get("method2")
                break
        exception = _EXCEPTION.match(text)
        if cause is None and not exception:
            return
        specific = classify(text)
        self.via_ray = self.via_ray or bool(specific == "ray" or re.search(r"\bray\.exceptions|RayTaskError", text))
        if specific is None and exception and not _WRAPPER.search(text):
            specific = "exception"
        if not self.signals:
            self.frames = self.recent_frames[-MAX_FRAMES // 2:]
        self.signals.append(Signal(specific or cause or "exception", record.line, text, phase, method))

    def outcome(self, failure_checks: list[tuple[str, int | None, str, str]], last_phase: str,
                last_line: int) -> StartupFailure | None:
        """The failure, if any: ``failure_checks`` are (check id, line, sentence, phase) of logparse's own."""
        # an exception the start went on past was caught: only one after the last progress line counts
        signals = [s for s in self.signals if s.cause != "exception" or s.line > self.last_progress_line]
        signals += [Signal(CHECK_CAUSES[cid], line or last_line, sentence, CHECK_PHASES.get(cid, phase), None,
                           cid in CHECK_PHASES) for cid, line, sentence, phase in failure_checks if cid in CHECK_CAUSES]
        if self.in_traceback and (self.ready_line is None or not signals):
            signals.append(Signal("cut_traceback", last_line, "the log ends inside a traceback", last_phase))
        if not signals:
            return None
        best = min(signals, key=lambda s: (CAUSE_ORDER.index(s.cause), s.line))
        first = min(signals, key=lambda s: s.line)
        # a cut traceback's frames never became a signal's: they are the recent ones
        place = place_in(self.frames or self.recent_frames) or next((METHOD_PLACES[s.method] for s in signals
                                                if s.method in METHOD_PLACES), None)
        ready = self.ready_line is not None and self.ready_line < first.line
        runtime = ready or place in RUNTIME_PLACES  # frames in the busy loop or shutdown: the server had started
        if ready:
            phase, source = "R", "a line only a ready server prints (line " + f"{self.ready_line})"
        elif runtime:
            phase, source = "R", f"the traceback's frames ({place})"
        elif best.implied:
            phase, source = best.phase, "the failure's own line"
        elif place is not None:
            phase, source = PLACE_PHASES[place], f"the traceback's frames ({place.replace('_', ' ')})"
        elif self.last_progress_line == 0:
            phase, source = "?", "nothing: the log shows no startup line before the failure"
        else:
            phase, source = first.phase, "the last startup line the log printed"
        return StartupFailure(best.cause, best.text[:300], best.line, phase, source, place, runtime, self.via_ray,
                              sorted(signals, key=lambda s: s.line))


# ------------------------------------------------------------------ KV below one request
def kv_shortfall(facts: dict[str, Any], block_size: int) -> tuple[int, str] | None:
    """(tokens the pool holds, how they were read) when that is below max-model-len on a model that
    attends fully (a printed concurrency of 1x or more, or padding layers, mean vLLM's hybrid
    per-group count, where tokens / max-model-len says nothing)."""
    max_len, conc = facts.get("max_model_len"), facts.get("max_concurrency")
    if not isinstance(max_len, int) or max_len <= 0 or facts.get("padding_layers") is not None:
        return None
    if isinstance(conc, int | float) and conc >= 1:
        return None
    tokens = facts.get("kv_cache_tokens")
    how = f"{tokens:,} tokens (GPU KV cache size)" if isinstance(tokens, int) else ""
    blocks = facts.get("gpu_blocks")
    if not isinstance(tokens, int) and isinstance(blocks, int) and blocks > 0:
        tokens = blocks * block_size
        how = f"{blocks:,} blocks x {block_size} = {tokens:,} tokens"
    if not isinstance(tokens, int) or tokens >= max_len:
        return None
    return tokens, how


def kv_shortfall_fixes(facts: dict[str, Any], tokens: int, max_len: int, total: float | None,
                       util: float | None) -> list[Fix]:
    """The fixes in the log's numbers: the context that fits, the memory that would hold one request."""
    fixes = [Fix("--max-model-len", max_len, tokens, f"the pool holds {tokens:,} tokens: one request of that length fits")]
    grow = max_len / tokens
    kv = facts.get("kv_cache_gib")
    if isinstance(kv, int | float) and kv > 0 and total and util is not None:
        extra = kv * (grow - 1)
        target = util + extra / total
        fixes.append(Fix("--gpu-memory-utilization", util, f"{target:.3f}", f"adds the {extra:.2f} GiB the pool lacks "
                         f"({kv} GiB x {grow:.3f})" + (" (beyond 1.0: not possible on this device)" if target > 1 else ""),
                         numbers={"missing_gib": extra}))
    else:
        fixes.append(Fix("--gpu-memory-utilization", util, None, f"raise it so the KV pool grows by {grow:.3f}x "
                         f"({max_len:,} / {tokens:,} tokens)"))
    if not str(facts.get("kv_cache_dtype", "auto")).lower().startswith("fp8"):
        fixes.append(Fix("--kv-cache-dtype", facts.get("kv_cache_dtype", "auto"), "fp8",
                         f"halves bytes per token: the same pool holds {2 * tokens:,} tokens"
                         + (" (enough)" if 2 * tokens >= max_len else " (still short)")))
    return fixes


# ------------------------------------------------------------------ what to do, by class
def cause_fixes(failure: StartupFailure) -> list[Fix]:
    """Advice for a failure no memory check of logparse's covers (those carry their own fixes)."""
    place, cause = failure.place, failure.cause
    if cause == "nccl":
        return [Fix("NCCL_DEBUG=INFO", None, None, "rerun with it: NCCL then prints which transport (P2P, SHM, "
                    "IB, socket) failed"),
                Fix("NCCL_P2P_DISABLE=1", None, None, "when the GPUs cannot reach each other peer to peer (consumer "
                    "cards, some VMs and containers)"),
                Fix("--shm-size", None, "16g", "in docker, or --ipc=host: NCCL's shared-memory transport needs more "
                    "than docker's 64 MB")]
    if cause == "oom":
        return _oom_fixes(place)
    if cause == "cuda_error":
        return [Fix("CUDA_LAUNCH_BLOCKING=1", None, None, "rerun with it so the traceback names the kernel that failed"),
                Fix("--enforce-eager", None, None, "captures no CUDA graphs: tells a capture bug from a kernel bug"
                    + (" (the failure was in graph capture)" if place == "graph_capture" else ""))]
    if cause == "ray":
        return [Fix("--distributed-executor-backend", "ray", "mp", "on one node the multiprocessing executor has no "
                    "Ray actors or placement groups to fail"),
                Fix("", None, None, "a Ray error wraps the worker's own: its first line names that exception")]
    if cause == "worker_died":
        return [Fix("", None, None, "the worker's own traceback (under its process prefix) names the cause; an exit "
                    "code of -9 is the kernel's out-of-memory killer, host RAM rather than device memory")]
    if cause == "cut_traceback":
        return [Fix("", None, None, "the log ends inside the traceback: its last line (the exception) names the cause;"
                    " paste the lines after it")]
    return [Fix("", None, None, "the root cause is the exception printed before this line; this log does not show "
                "it" if cause == "engine_core" else f"the exception line names the cause: {failure.summary[:160]}")]


def _oom_fixes(place: str | None) -> list[Fix]:
    if place == "graph_capture":
        return [Fix("--enforce-eager", None, None, "captures no CUDA graphs, so their pool needs no memory"),
                Fix("--gpu-memory-utilization", None, None, "lower it by a few hundredths: the graph pool lives "
                    "outside the KV pool")]
    if place == "kv_allocation":
        return [Fix("--gpu-memory-utilization", None, None, "lower it by a few hundredths: the pool was sized from a "
                    "profile another allocation (another process, fragmentation) no longer matches"),
                Fix("--kv-cache-memory", None, None, "or give the pool's size in bytes so no profile decides it")]
    if place == "loading":
        return [Fix("--tensor-parallel-size", None, None, "raise it, or serve a quantised checkpoint: the weights "
                    "alone do not fit one device")]
    return [Fix("--max-num-batched-tokens", None, None, "lower it or --max-num-seqs: the profiling step allocates "
                "activations for that many tokens"),
            Fix("--gpu-memory-utilization", None, None, "or lower it when another process holds device memory")]


# ------------------------------------------------------------------ as explain's checks
def kv_below_check(facts: dict[str, Any], lines: dict[str, int], budget: dict[str, Any],
                   checks: list[Check]) -> Check | None:
    """A failure check when the printed pool is below one max-model-len request and vLLM's own
    error line (max_seq_len_exceeds_kv) is not in the log to say so."""
    if any(c.id == "max_seq_len_exceeds_kv" for c in checks):
        return None
    block = int(facts.get("block_size", 16))
    found = kv_shortfall(facts, block)
    if found is None:
        return None
    tokens, how = found
    max_len = int(facts["max_model_len"])
    return Check("kv_below_max_model_len", "KV cache below max-model-len", False,
                 f"{how} < max-model-len {max_len:,}: one request does not fit, so vLLM refuses to start",
                 kind="failure", formula="kv_cache_tokens < max_model_len", expected=max_len, actual=tokens,
                 line=lines.get("kv_cache_tokens", lines.get("gpu_blocks")),
                 fix=kv_shortfall_fixes(facts, tokens, max_len, budget.get("total_gib"),
                                        budget.get("gpu_memory_utilization")))


def startup_outcome(watch: StartupWatch, failures: list[tuple[Record, str]], last_phase: str, last_line: int,
                    checks: list[Check]) -> StartupFailure | None:
    """The start's failure from the watch's signals and logparse's failure checks; a check of its own
    (startup_failed, or engine_died after the server was ready) where no memory check covers it."""
    phases = {record.line: phase for record, phase in failures}
    found = [(c.id, c.line, f"{c.title}: {c.detail}", phases.get(c.line or -1, last_phase))
             for c in checks if c.kind == "failure" and c.ok is False]
    failure = watch.outcome(found, last_phase, last_line)
    if failure is None or any(cid in CHECK_CAUSES for cid, *_ in found):
        return failure
    check_id = "engine_died" if failure.runtime else "startup_failed"
    title = "the engine died after startup" if failure.runtime else (
        f"startup failed in phase {failure.phase} ({failure.phase_name})")
    checks.append(Check(check_id, title, False, failure.sentence(), kind="failure", line=failure.line,
                        fix=cause_fixes(failure)))
    return failure
