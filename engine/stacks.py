"""Every thread's Python stack: of this process (``sys._current_frames``), or of a
data-parallel engine core, another process, asked with SIGUSR1. A core registers
``faulthandler`` on that signal (:func:`register_stack_signal`) to write every thread's stack
into its stacks file (:func:`stacks_file`) at C level, so a core whose thread holds the GIL
in a hung kernel still answers; one that cannot (SIGSTOP: the signal waits for SIGCONT) is
named as such, with its process state from ``/proc``. The stall detector's dump
(engine/serve/stall_dump.py) holds what they return.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import TextIO

STACKS_WAIT_S = 2.0  # how long a core gets to write its stacks
STACKS_SIGNAL = signal.SIGUSR1
_KEPT_OPEN: list[TextIO] = []
_PROC_STATES = {"R": "running", "S": "sleeping", "D": "in uninterruptible I/O", "T": "stopped (SIGSTOP or a tracer)",
                "t": "stopped by a tracer", "Z": "a zombie"}


def thread_stacks() -> dict[str, str]:
    """Every thread of this process: ``"name (ident)"`` -> its stack, innermost last."""
    names = {t.ident: t.name for t in threading.enumerate()}
    return {f"{names.get(ident, '?')} ({ident})": "".join(traceback.format_stack(frame))
            for ident, frame in sys._current_frames().items()}


def stacks_file(pid: int) -> Path:
    """Where the core of process ``pid`` writes its stacks on :data:`STACKS_SIGNAL`."""
    return Path(tempfile.gettempdir()) / f"kvscope-stacks-{pid}.txt"


def register_stack_signal() -> Path:
    """In an engine-core or worker process: write every thread's stack to :func:`stacks_file` on
    SIGUSR1. Without a writable file it registers nothing (the dump then says no stacks came)."""
    import faulthandler

    path = stacks_file(os.getpid())
    try:
        handle = path.open("w")
    except OSError:
        return path
    _KEPT_OPEN.append(handle)  # faulthandler writes to its descriptor: it must stay open for the process's life
    faulthandler.register(STACKS_SIGNAL, file=handle, all_threads=True)
    return path


def process_state(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "unknown"
    code = stat.rsplit(")", 1)[-1].split()[0]
    return _PROC_STATES.get(code, code)


def core_stacks(pid: int, wait_s: float = STACKS_WAIT_S) -> dict[str, str]:
    """Process ``pid``'s stacks, asked for with SIGUSR1 (module docstring); what it wrote
    since the last ask, or why nothing came."""
    path = stacks_file(pid)
    try:
        start = path.stat().st_size
        os.kill(pid, STACKS_SIGNAL)
    except OSError as exc:
        return {f"pid {pid}": f"no stacks: {exc}"}
    deadline = time.monotonic() + wait_s
    text = previous = ""
    while time.monotonic() < deadline:
        time.sleep(0.05)
        with path.open() as fh:
            fh.seek(start)
            text = fh.read()
        if text and text == previous:  # written and no longer growing
            break
        previous = text
    if not text:
        return {f"pid {pid}": f"no stacks within {wait_s:g} s: the process is {process_state(pid)} (it writes them "
                              "when it runs again)"}
    return {f"pid {pid}": text}
