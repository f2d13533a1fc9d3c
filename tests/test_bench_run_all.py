"""``make bench``'s runner: a benchmark past its time limit is stopped with every process it started."""

from __future__ import annotations

import re
import time
from pathlib import Path


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie waiting for its reaper is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_a_benchmark_past_its_limit_is_stopped_with_its_helpers() -> None:
    from bench.run_all import run_one

    status, _seconds, output = run_one("tests.bench_fixtures.hanging_benchmark", [], 5)
    assert status == "timed out after 5 s"
    found = re.search(r"helper pid (\d+)", output)
    assert found is not None, output  # what the benchmark printed before its limit comes back
    helper = int(found.group(1))
    deadline = time.monotonic() + 10  # SIGKILL is delivered at once; this only waits for the kernel
    while _running(helper) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(helper)
