"""Every thread's stack, of this process and of another one asked with SIGUSR1
(engine/stacks.py): what a stalled data-parallel core or tensor-parallel rank puts in the
stall dump, and how a stopped one is named."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from engine.stacks import core_stacks, stacks_file, thread_stacks
from tests.paths import ROOT

CHILD = """
import threading, time
from engine.stacks import register_stack_signal
register_stack_signal()
def waiting_in_a_kernel():
    time.sleep(120)
threading.Thread(target=waiting_in_a_kernel, name="engine", daemon=True).start()
print("ready", flush=True)
time.sleep(120)
"""


def test_this_process_names_every_thread_with_its_stack() -> None:
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="kvscope-engine-under-test", daemon=True)
    thread.start()
    try:
        stacks = thread_stacks()
        mine = next(text for name, text in stacks.items() if name.startswith("kvscope-engine-under-test"))
        assert "wait" in mine
    finally:
        stop.set()


def test_another_process_writes_its_stacks_on_request_and_a_stopped_one_is_named() -> None:
    child = subprocess.Popen([sys.executable, "-c", CHILD], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        stacks = core_stacks(child.pid)
        text = stacks[f"pid {child.pid}"]
        assert "waiting_in_a_kernel" in text and "<module>" in text  # both threads
        os.kill(child.pid, signal.SIGSTOP)
        try:
            stopped = core_stacks(child.pid, wait_s=0.3)[f"pid {child.pid}"]
        finally:
            os.kill(child.pid, signal.SIGCONT)
        assert "no stacks within 0.3 s: the process is stopped" in stopped
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and stacks_file(child.pid).read_text().count("waiting_in_a_kernel") < 2:
            time.sleep(0.05)  # continued, it answers the request it held
        assert stacks_file(child.pid).read_text().count("waiting_in_a_kernel") == 2
    finally:
        child.kill()
        child.wait()
        stacks_file(child.pid).unlink(missing_ok=True)
