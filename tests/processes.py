"""Waiting until a set of processes has gone (a killed replica must leave none behind); the
tests that start servers take their free port from bench.bench_server."""

from __future__ import annotations

import time
from collections.abc import Iterable

import psutil


def running(pid: int) -> bool:
    """The process exists and is not a zombie (one that exits between the checks is gone)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_gone(pids: Iterable[int], what: str, timeout_s: float = 5.0) -> None:
    """Fail, naming ``what``, when any of ``pids`` still runs after ``timeout_s`` seconds."""
    pids = list(pids)
    deadline = time.monotonic() + timeout_s
    while any(running(p) for p in pids):
        assert time.monotonic() < deadline, f"{what} (pids {[p for p in pids if running(p)]})"
        time.sleep(0.1)
