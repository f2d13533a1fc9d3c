"""The compiled-kernel cache: one build per (kernel source, compiler flags, CPU
ISA, torch version), shared by every checkout and virtual environment, and a
build lock that a dead builder cannot hold.

torch's ``load_inline`` keys its build folder by name and embeds the venv's
include paths in ``build.ninja``, so each venv rebuilt the kernel in turn; and
its ``lock`` file (``O_CREAT|O_EXCL``) outlives a killed builder, after which
every later start waited on it forever. Here instead:

* the entry's name is a hash of what the binary depends on, never of a path;
  a finished entry is a single ``<module>.so`` imported directly, no ninja run;
* builders serialise on ``fcntl.flock``, which the kernel drops when the holder
  dies, so a SIGKILLed or SIGTERMed builder frees the next start at once;
* each build runs in its own scratch folder (an orphaned compiler keeps writing
  into a folder nobody reads) and the result is renamed into place atomically;
* a waiting or building process logs the elapsed time every few seconds.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.machinery
import importlib.util
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from engine.model.cpu_caps import detect

KERNEL_CACHE_ENV = "KVSCOPE_KERNEL_CACHE"
# How often a waiting or building process says it is still at it.
PROGRESS_EVERY_S = 10.0


# Before torch's CMake config names its standard: the ATen headers need C++20 from this torch on.
CXX20_TORCH = (2, 14)


def choose_cxx_standard(torch_version: str, torch_config_cmake: str | None) -> str:
    """The ``-std=`` flag the kernels compile with: the standard torch's own headers were built
    for (``CXX_STANDARD N`` in its ``TorchConfig.cmake``), else by its version: C++20 from
    torch 2.14 on (its ATen headers use C++20 features), C++17 before."""
    match = re.search(r"CXX_STANDARD\s+(\d+)", torch_config_cmake or "")
    if match:
        return f"-std=c++{match.group(1)}"
    parts = re.match(r"(\d+)\.(\d+)", torch_version)
    version = (int(parts.group(1)), int(parts.group(2))) if parts else (0, 0)
    return "-std=c++20" if version >= CXX20_TORCH else "-std=c++17"


def cxx_standard() -> str:
    """:func:`choose_cxx_standard` for the torch in use. Passed after torch's own flags (the last
    ``-std`` wins), so a torch whose ``load_inline`` still adds an older standard than its
    headers need builds all the same. Not part of the cache key: torch's version decides it."""
    import torch

    config = Path(torch.__file__).parent / "share" / "cmake" / "Torch" / "TorchConfig.cmake"
    return choose_cxx_standard(torch.__version__, config.read_text(errors="replace") if config.is_file() else None)


def kernel_cache_root() -> Path:
    """``$KVSCOPE_KERNEL_CACHE``, else ``$KVSCOPE_CACHE_DIR/kernels``, else ``~/.cache/kvscope/kernels``.
    Kernels are cached even when the weights cache is off (``KVSCOPE_CACHE_DIR=off``)."""
    explicit = os.environ.get(KERNEL_CACHE_ENV)
    if explicit:
        return Path(explicit)
    base = os.environ.get("KVSCOPE_CACHE_DIR", "")
    if base and base.strip().lower() not in ("off", "0", "none"):
        return Path(base) / "kernels"
    return Path.home() / ".cache" / "kvscope" / "kernels"


@dataclass(frozen=True, slots=True)
class KernelSpec:
    """One C++ extension: its source and how it is compiled."""

    name: str
    source: str
    functions: tuple[str, ...]
    cflags: tuple[str, ...] = ("-O3", "-march=native", "-fopenmp", "-ffast-math")
    ldflags: tuple[str, ...] = ("-fopenmp",)

    def key(self) -> str:
        """Hash of everything the binary depends on (not where torch or the checkout live)."""
        import torch

        text = "\0".join([self.source, *self.functions, *self.cflags, *self.ldflags, torch.__version__,
                          detect().kernel_key, sys.implementation.cache_tag])
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def module_name(self) -> str:
        return f"{self.name}_{self.key()}"


@dataclass(slots=True)
class BuildReport:
    """How a kernel was obtained, for phase F's event."""

    name: str
    status: str  # "cached" | "built" | "unavailable"
    seconds: float
    path: str | None = None
    waited_s: float = 0.0  # time spent waiting for another builder
    reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "seconds": round(self.seconds, 3), "path": self.path,
                "waited_s": round(self.waited_s, 3), "reason": self.reason}


def _import_extension(module_name: str, path: Path) -> ModuleType:
    if module_name in sys.modules:
        return sys.modules[module_name]
    loader = importlib.machinery.ExtensionFileLoader(module_name, str(path))
    spec = importlib.util.spec_from_file_location(module_name, str(path), loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    sys.modules[module_name] = module
    return module


@contextlib.contextmanager
def _ticker(say: Callable[[float], None], every_s: float) -> Iterator[None]:
    """Call ``say(elapsed)`` every ``every_s`` seconds while the block runs."""
    done = threading.Event()
    start = time.monotonic()

    def loop() -> None:
        while not done.wait(every_s):
            say(time.monotonic() - start)

    thread = threading.Thread(target=loop, name="kvscope-build-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=1)


@contextlib.contextmanager
def build_lock(folder: Path, log: Callable[[str], None] | None = None,
               timeout_s: float | None = None) -> Iterator[float]:
    """Hold the folder's build lock (an ``flock``: released by the kernel when the
    holder exits, however it exits). Yields the seconds spent waiting for it.
    Raises TimeoutError after ``timeout_s`` of waiting on a live holder."""
    folder.mkdir(parents=True, exist_ok=True)
    lock_path = folder / "build.lock"
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    start = time.monotonic()
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"

            def say(elapsed: float) -> None:
                if log is not None:
                    log(f"waiting for process {holder} to finish building {folder.name} ({elapsed:.0f} s)")

            with _ticker(say, PROGRESS_EVERY_S):
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if timeout_s is not None and time.monotonic() - start > timeout_s:
                            raise TimeoutError(f"{lock_path}: held by process {holder} for over "
                                               f"{timeout_s:.0f} s") from None
                        time.sleep(0.05)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield time.monotonic() - start
    finally:
        os.close(fd)  # closing drops the flock


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_dead_scratch(folder: Path) -> None:
    """Scratch folders of builders that are gone (killed mid-build)."""
    for scratch in folder.glob("scratch-*"):
        try:
            pid = int(scratch.name.split("-", 1)[1])
        except ValueError:
            continue
        if pid == os.getpid() or not _pid_alive(pid):
            shutil.rmtree(scratch, ignore_errors=True)


def load_kernel(spec: KernelSpec, log: Callable[[str], None] | None = None,
                root: Path | None = None) -> tuple[ModuleType | None, BuildReport]:
    """The compiled module for ``spec``, from the cache or built now (under the lock).
    Never raises for a missing compiler or a failed build: the module is None and
    the report says why, so the caller falls back to its torch path."""
    start = time.monotonic()
    module_name = spec.module_name()
    folder = (root or kernel_cache_root()) / module_name
    target = folder / f"{module_name}.so"
    if target.is_file():
        try:
            module = _import_extension(module_name, target)
            return module, BuildReport(spec.name, "cached", time.monotonic() - start, str(target))
        except ImportError:
            pass  # a broken entry: rebuild it below
    try:
        with build_lock(folder, log) as waited:
            if target.is_file():  # another process built it while we waited
                try:
                    module = _import_extension(module_name, target)
                    return module, BuildReport(spec.name, "cached", time.monotonic() - start, str(target), waited)
                except ImportError:
                    target.unlink(missing_ok=True)
            _remove_dead_scratch(folder)
            scratch = folder / f"scratch-{os.getpid()}"
            shutil.rmtree(scratch, ignore_errors=True)
            scratch.mkdir(parents=True)
            if log is not None:
                log(f"building CPU kernel {spec.name} for {detect().isa} "
                    "(once per CPU type and torch version; cached after)")
            build_start = time.monotonic()

            def say(elapsed: float) -> None:
                if log is not None:
                    log(f"still building CPU kernel {spec.name} ({elapsed:.0f} s)")

            from torch.utils.cpp_extension import load_inline

            with _ticker(say, PROGRESS_EVERY_S):
                module = load_inline(name=module_name, cpp_sources=spec.source, functions=list(spec.functions),
                                     extra_cflags=[*spec.cflags, cxx_standard()],
                                     extra_ldflags=list(spec.ldflags), build_directory=str(scratch), verbose=False)
            built = scratch / f"{module_name}.so"
            os.replace(built, target)  # atomic: a reader sees no file or the whole file
            shutil.rmtree(scratch, ignore_errors=True)
            seconds = time.monotonic() - start
            if log is not None:
                log(f"built CPU kernel {spec.name} in {time.monotonic() - build_start:.1f} s")
            return module, BuildReport(spec.name, "built", seconds, str(target), waited)
    except Exception as exc:  # no compiler, no ninja, no headers, a timeout: the torch path still works
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        reason = f"{type(exc).__name__}: {first}"
        return None, BuildReport(spec.name, "unavailable", time.monotonic() - start, reason=reason)


class CachedKernel:
    """One kernel's module for this process: built or loaded once on first use (thread
    safe), switched off by its environment variable, with the reason when unavailable."""

    def __init__(self, spec: KernelSpec, env_var: str) -> None:
        self.spec = spec
        self.env_var = env_var
        self._lock = threading.Lock()
        self._module: ModuleType | None = None
        self._tried = False
        self.report: BuildReport | None = None

    @property
    def disabled(self) -> bool:
        return os.environ.get(self.env_var, "1") == "0"

    def get(self, log: Callable[[str], None] | None = None) -> ModuleType | None:
        """The module, or None (switched off, or it could not be built here)."""
        if self.disabled:
            return None
        if self._tried:
            return self._module
        with self._lock:
            if not self._tried:
                self._module, self.report = load_kernel(self.spec, log)
                self._tried = True
        return self._module

    def ensure_built(self, log: Callable[[str], None] | None = None) -> BuildReport | None:
        """Build or load now; the report, or None when switched off."""
        if self.disabled:
            return None
        self.get(log)
        return self.report

    @property
    def unavailable_reason(self) -> str | None:
        if self.disabled:
            return f"{self.env_var}=0"
        return self.report.reason if self.report is not None and self._module is None else None
