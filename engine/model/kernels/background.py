"""The CPU kernels, built (or found in the cache) on a background thread that
startup starts in phase A and joins in phase F, so a first start on a new CPU
type compiles while the weights load and the profile run measures, and no
request ever waits on a compiler. ``engine build-kernels`` (run by
``make setup``) builds the same list ahead of time."""

from __future__ import annotations

import importlib
import threading
import time
from collections.abc import Callable
from typing import Any

from engine.model.kernels.build import BuildReport

# Modules exposing ``ensure_built(log) -> BuildReport | None`` (None: switched off).
CPU_KERNEL_MODULES = ("engine.model.attention.cpu_decode", "engine.model.kernels.cpu_gemv", "engine.model.kernels.cpu_norm",
                      "engine.model.kernels.cpu_act", "engine.model.kernels.cpu_layer")


def build_all(log: Callable[[str], None] | None = None) -> list[BuildReport]:
    """Build or load every CPU kernel in turn; a kernel that cannot be built is
    reported as ``unavailable`` (its torch fallback runs), never raised."""
    reports: list[BuildReport] = []
    for name in CPU_KERNEL_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue  # a kernel module this checkout does not have
        ensure = getattr(module, "ensure_built", None)
        if ensure is None:
            continue
        report = ensure(log)
        if report is not None:
            reports.append(report)
    return reports


class KernelBuilds:
    """A running :func:`build_all` on a daemon thread."""

    def __init__(self, log: Any) -> None:
        self._log = log
        self._reports: list[BuildReport] = []
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvscope-kernel-build", daemon=True)

    @classmethod
    def start(cls, log: Any) -> KernelBuilds:
        builds = cls(log)
        builds._thread.start()
        return builds

    def _run(self) -> None:
        try:
            self._reports = build_all(lambda text: self._log.info(text))
        except BaseException as exc:  # reported by join(); the engine falls back to torch paths
            self._error = exc

    def done(self) -> bool:
        return not self._thread.is_alive()

    def join(self) -> float:
        """Wait for the builds; returns the seconds this call waited."""
        start = time.perf_counter()
        self._thread.join()
        if self._error is not None:
            self._log.warning(f"CPU kernel build failed: {type(self._error).__name__}: {self._error}")
        return time.perf_counter() - start

    def settle(self, timeout_s: float = 10.0) -> None:
        """Give a build in flight up to ``timeout_s`` to finish: a startup that fails early
        (a refusal in phase B) must not exit while this thread is inside a kernel's library
        load, which aborts the process ("terminate called without an active exception")
        instead of the refusal's exit status."""
        self._thread.join(timeout_s)

    def reports(self) -> list[BuildReport]:
        return list(self._reports)
