"""Where in startup a failure happened, read from the traceback printed with it.

A vLLM failure usually arrives as a traceback: ``Traceback (most recent call last):``,
frames (``File "…/gpu_model_runner.py", line 5684, in capture_model``) with their code
lines, and the exception last (``torch.AcceleratorError: CUDA error: out of memory``).
The exception's words say *what* failed; the frames say *where*: the same "out of
memory" means a graph pool that did not fit when a frame is CUDA-graph capture, an
activation peak when it is the profiling run. :class:`TracebackTracker` keeps each
process's frames since its last ``Traceback`` line and, when a failure line arrives,
records the place its frames show.
"""

from __future__ import annotations

import re

from logparse.parser import Record

# (place, words a frame of that place contains), most specific first: a capture runs
# _dummy_run too, so capture is decided before profiling.
PLACES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("graph_capture", ("capture_model", "_capture_cudagraphs", "torch/cuda/graphs.py", "capture_begin",
                       "capture_end", "cuda_graph.py", "_warmup_and_capture", "capture_graph")),
    ("sampler_warmup", ("_dummy_sampler_run",)),
    ("kv_allocation", ("initialize_kv_cache", "_allocate_kv_cache", "initialize_from_config", "_reshape_kv_cache",
                       "_allocate_kv_cache_tensors", "initialize_kv_cache_tensors", "_init_cache_engine")),
    ("profiling", ("profile_run", "determine_available_memory", "determine_num_available_blocks")),
    ("loading", ("load_model", "load_weights")),
    ("device_init", ("init_device", "init_worker_distributed_environment", "ncclCommInitRank",
                     "initialize_model_parallel", "init_distributed_environment", "init_worker")),
    # past startup, tried last: the engine's busy loop, a request's step, the output handler, shutdown
    ("serving", ("run_busy_loop", "_process_engine_step", "execute_model_with_error_logging", "output_handler",
                 "_run_engine", "step_with_batch_queue")),
    ("shutdown", ("shutdown", "destroy_model_parallel", "destroy_process_group")),
)
# the startup phase (engine/events/phase_names.py letters) each place belongs to; R: after startup
PLACE_PHASES = {"graph_capture": "F", "sampler_warmup": "F", "kv_allocation": "E", "profiling": "D", "loading": "C",
                "device_init": "A", "serving": "R", "shutdown": "R"}
RUNTIME_PLACES = frozenset({"serving", "shutdown"})  # a traceback there is no failed start
# A place's words match whole identifiers: V1's _initialize_kv_caches wraps profiling, allocation and
# capture alike, so it must not read as initialize_kv_cache (allocation).
_PLACE_RES = tuple((place, re.compile("|".join(rf"(?<!\w){re.escape(w)}(?!\w)" for w in words)))
                   for place, words in PLACES)
MAX_FRAMES = 400  # per process; a longer traceback keeps its last frames, where the failure is
MAX_PROCESSES = 64


def place_in(frames: list[str]) -> str | None:
    """The first place of :data:`PLACES` any frame names (frames of the innermost call last)."""
    text = "\n".join(frames)
    for place, regex in _PLACE_RES:
        if regex.search(text):
            return place
    return None


class TracebackTracker:
    """Feed it every record in order; ask :meth:`place_of` for a failure record."""

    def __init__(self) -> None:
        self.frames: dict[str | None, list[str]] = {}
        self.places: dict[int, str] = {}  # failure record's line -> place

    def add(self, record: Record) -> None:
        process = record.process
        if record.noise == "traceback":
            if "Traceback (most recent call last)" in record.text or process not in self.frames:
                if len(self.frames) >= MAX_PROCESSES:
                    self.frames.clear()
                self.frames[process] = []
            frames = self.frames[process]
            frames.append(record.text)
            del frames[:-MAX_FRAMES]
            return
        pattern = record.pattern
        if pattern is not None and pattern.failure:
            # a record joined from an unprefixed traceback carries its frames in its own text
            place = place_in([*self.frames.get(process, []), record.text])
            if place is not None:
                self.places[record.line] = place
        elif pattern is not None:
            self.frames.pop(process, None)  # the process went on: its traceback is over

    def interrupt(self) -> None:
        """Lines the tracker did not see (a counted run) end every open traceback."""
        self.frames.clear()

    def place_of(self, record: Record) -> str | None:
        return self.places.get(record.line)
