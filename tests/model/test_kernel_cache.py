"""The compiled-kernel cache: a builder killed mid-build never blocks the next start,
a live builder is waited for with progress lines, entries do not depend on paths."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.model.kernels import build
from engine.model.kernels.build import KernelSpec, build_lock, choose_cxx_standard, cxx_standard, load_kernel

HOLD_LOCK = """
import sys, time
from pathlib import Path
from engine.model.kernels.build import build_lock
with build_lock(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def _holder(folder: Path, seconds: float) -> subprocess.Popen[str]:
    child = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(folder), str(seconds)],
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline().strip() == "held"
    return child


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_killed_builder_frees_the_lock_at_once(tmp_path: Path, sig: signal.Signals) -> None:
    child = _holder(tmp_path, 600)
    child.send_signal(sig)
    child.wait(timeout=10)
    start = time.monotonic()
    with build_lock(tmp_path, timeout_s=5) as waited:
        assert waited < 2
    assert time.monotonic() - start < 2
    assert (tmp_path / "build.lock").is_file()  # the lock file may stay: it is the flock, not its existence


def test_a_live_builder_is_waited_for_with_progress(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build, "PROGRESS_EVERY_S", 0.2)
    child = _holder(tmp_path, 1.5)
    lines: list[str] = []
    with build_lock(tmp_path, log=lines.append, timeout_s=30) as waited:
        assert waited >= 0.5
    child.wait(timeout=10)
    assert lines and all(f"waiting for process {child.pid}" in line for line in lines), lines


def test_waiting_has_a_limit(tmp_path: Path) -> None:
    child = _holder(tmp_path, 600)
    try:
        with pytest.raises(TimeoutError, match=f"held by process {child.pid}"), build_lock(tmp_path, timeout_s=0.3):
            pass
    finally:
        child.kill()
        child.wait(timeout=10)


def test_the_key_depends_on_source_and_flags_not_on_paths() -> None:
    spec = KernelSpec("k", "int f() { return 1; }", ("f",))
    assert spec.key() == KernelSpec("k", "int f() { return 1; }", ("f",)).key()
    assert spec.key() != KernelSpec("k", "int f() { return 2; }", ("f",)).key()
    assert spec.key() != KernelSpec("k", "int f() { return 1; }", ("f",), cflags=("-O2",)).key()
    assert spec.module_name() == f"k_{spec.key()}"


TINY = KernelSpec("kvscope_test_tiny", "#include <torch/extension.h>\nint64_t answer() { return 42; }\n",
                  ("answer",), cflags=("-O1",), ldflags=())

BUILD_TINY = """
import sys
from pathlib import Path
from engine.model.kernels.build import KernelSpec, load_kernel
spec = KernelSpec("kvscope_test_tiny", "#include <torch/extension.h>\\nint64_t answer() { return 42; }\\n",
                  ("answer",), cflags=("-O1",), ldflags=())
load_kernel(spec, root=Path(sys.argv[1]))
"""


@pytest.mark.slow
def test_a_start_after_a_builder_killed_mid_compile_builds_and_caches(tmp_path: Path) -> None:
    """A real compile, SIGKILLed while the compiler runs; the next load builds in a
    fresh scratch folder, removes the dead one, and later loads hit the cache."""
    child = subprocess.Popen([sys.executable, "-c", BUILD_TINY, str(tmp_path)])
    folder = tmp_path / TINY.module_name()
    deadline = time.monotonic() + 60
    while not list(folder.glob("scratch-*")) and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(2)  # the compiler is running now
    assert child.poll() is None, "the builder finished before it could be killed"
    child.kill()
    child.wait(timeout=10)
    (folder / f"scratch-{child.pid}" / "lock").touch()  # torch's own baton, left behind: must not matter
    module, report = load_kernel(TINY, root=tmp_path)
    assert report.status == "built" and module is not None and module.answer() == 42  # type: ignore[attr-defined]
    assert not (folder / f"scratch-{child.pid}").exists()
    _, again = load_kernel(TINY, root=tmp_path)
    assert again.status == "cached" and again.seconds < 1


CMAKE_20 = """set_target_properties(torch PROPERTIES
    INTERFACE_INCLUDE_DIRECTORIES "${TORCH_INCLUDE_DIRS}"
    CXX_STANDARD 20
)"""


def test_the_cxx_standard_is_the_one_torch_was_built_for() -> None:
    """torch's own CMake config names its standard; without it, C++20 from torch 2.14 on
    (its ATen headers need it), C++17 before."""
    assert choose_cxx_standard("2.13.0+cpu", CMAKE_20) == "-std=c++20"
    assert choose_cxx_standard("2.14.0", CMAKE_20.replace("20", "23")) == "-std=c++23"
    assert choose_cxx_standard("2.14.0", None) == "-std=c++20"
    assert choose_cxx_standard("2.15.1+cu130", "") == "-std=c++20"
    assert choose_cxx_standard("2.13.1", None) == "-std=c++17"
    assert choose_cxx_standard("2.4.0", "no standard named here") == "-std=c++17"
    import torch

    config = Path(torch.__file__).parent / "share" / "cmake" / "Torch" / "TorchConfig.cmake"
    if config.is_file() and "CXX_STANDARD" in config.read_text():  # the torch in use says it itself
        assert cxx_standard() == choose_cxx_standard("0.0", config.read_text())
    else:
        assert cxx_standard() == choose_cxx_standard(torch.__version__, None)
