"""``POST /start_profile`` / ``/stop_profile``: the torch profiler around the engine's
steps, as vLLM's routes run it in its workers. Both calls run on the engine thread
(:meth:`~engine.serve.async_engine.AsyncEngine.call`), so the profile holds whole steps
and the thread that runs them. The trace is Chrome trace JSON (ui.perfetto.dev opens
it) written into ``trace_dir``: where kvscope's own Perfetto trace goes (``--trace-out``'s
folder), else vLLM's ``VLLM_TORCH_PROFILER_DIR``, else beside ``--events``, else the
working directory; the answer to ``/stop_profile`` names the file. Under
``--data-parallel-size D`` every rank's engine core runs its own profiler (the steps run
there, not in the API server's process) and writes its own file into the same folder,
``...-dp<rank>-<pid>.json``; the answer lists them all."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from engine.errors import UserError
from engine.logs import get_logger

PROFILER_DIR_ENV = "VLLM_TORCH_PROFILER_DIR"


def profile_dir(trace_out: str | None, events: str | None) -> str:
    """Where the profiler's traces go (see the module docstring)."""
    if trace_out:
        return str(Path(trace_out).resolve().parent)
    if os.environ.get(PROFILER_DIR_ENV):
        return os.environ[PROFILER_DIR_ENV]
    if events:
        return str(Path(events).resolve().parent)
    return os.getcwd()


class TorchProfiler:
    """One torch.profiler session at a time; start and stop on the engine thread."""

    def __init__(self, trace_dir: str, label: str = "") -> None:
        """``label``: in the file's name (a data-parallel core's ``dp<rank>``)."""
        self.trace_dir = trace_dir
        self.label = label
        self._profile: Any = None
        self._started = 0.0

    def start(self, engine: object = None) -> str:
        import torch.profiler

        if self._profile is not None:
            raise UserError("the profiler is already running; POST /stop_profile first")
        Path(self.trace_dir).mkdir(parents=True, exist_ok=True)
        profile = torch.profiler.profile(activities=_activities(), record_shapes=False, with_stack=False)
        profile.start()
        self._profile, self._started = profile, time.time()
        get_logger("kvscope.serve").info(f"torch profiler started; the trace goes to {self.trace_dir}")
        return self.trace_dir

    def stop(self, engine: object = None) -> str:
        if self._profile is None:
            raise UserError("the profiler is not running; POST /start_profile first")
        profile, self._profile = self._profile, None
        profile.stop()
        label = f"{self.label}-" if self.label else ""
        path = Path(self.trace_dir) / f"kvscope-torch-profile-{int(self._started)}-{label}{os.getpid()}.json"
        profile.export_chrome_trace(str(path))
        get_logger("kvscope.serve").info(f"torch profiler stopped; trace written to {path}")
        return str(path)


def _activities() -> list[Any]:
    import torch
    from torch.profiler import ProfilerActivity

    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
