"""A sink that fails never takes the engine down (issue 30, item 2): the bus stops that
subscriber, says so once (a log line, a ``sink.failed`` event the others fold) and
delivers every later event to the rest; a recording on a disk that fills up is cut back
to its last whole line while the run completes."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from engine.events import Event, EventBus, LogEvent, SinkFailed, StatsEvent, read_events, sink_name
from engine.events.folds.view import EngineView
from engine.modelspec.presets import bundled_gguf_path
from tests.paths import ROOT


class _AlwaysFails:
    sink_name = "always-fails"

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, event: Event) -> None:
        self.calls += 1
        raise OSError(28, "No space left on device")


@pytest.mark.sink_failures_expected
def test_a_raising_subscriber_is_stopped_once_and_the_rest_get_every_event() -> None:
    bus = EventBus()
    before: list[Event] = []
    after: list[Event] = []
    failing = _AlwaysFails()
    view = EngineView()
    for subscriber in (before.append, failing, after.append, view.apply):
        bus.subscribe(subscriber)
    for i in range(5):
        bus.publish(LogEvent(message=f"event {i}"))
    assert failing.calls == 1
    assert bus.failed_sinks == {"always-fails": "OSError: [Errno 28] No space left on device"}
    for seen in (before, after):
        kinds = [e.type for e in seen]
        # the failure is reported right after the event it happened on, in seq order
        assert kinds == ["log", "sink.failed", "log", "log", "log", "log"], kinds
        assert [e.seq for e in seen] == sorted(e.seq for e in seen)
    failed = after[1]
    assert isinstance(failed, SinkFailed) and failed.sink == "always-fails" and failed.at_event == "log"
    assert view.snapshot()["failed_sinks"] == {"always-fails": "OSError: [Errno 28] No space left on device"}
    assert EngineView.from_snapshot(view.snapshot()).failed_sinks == view.failed_sinks


@pytest.mark.sink_failures_expected
def test_a_subscriber_that_fails_on_a_queued_event_is_stopped_too() -> None:
    """The stats reporter publishes while an event is being delivered; a failure on such a
    queued event must be contained the same way."""
    bus = EventBus()
    seen: list[str] = []

    def republish(event: Event) -> None:
        if isinstance(event, LogEvent):
            bus.publish(StatsEvent())

    def fails_on_stats(event: Event) -> None:
        if isinstance(event, StatsEvent):
            raise ValueError("bad stats")

    for subscriber in (republish, fails_on_stats, lambda e: seen.append(e.type)):
        bus.subscribe(subscriber)
    bus.publish(LogEvent())
    bus.publish(LogEvent())
    assert seen == ["log", "stats", "sink.failed", "log", "stats"]
    assert list(bus.failed_sinks) == ["test_a_subscriber_that_fails_on_a_queued_event_is_stopped_too.<locals>"
                                      ".fails_on_stats"]


def test_sink_names() -> None:
    view = EngineView()
    assert sink_name(view.apply) == "EngineView"
    assert sink_name(_AlwaysFails()) == "always-fails"


@pytest.mark.slow  # 3-6 s each on a 2-core machine: in make test-slow, to keep the default suite under 5 min
@pytest.mark.skipif(bundled_gguf_path() is None, reason="the bundled SmolLM2 GGUF is not installed")
def test_a_recording_on_a_full_disk_stops_and_the_run_completes(tmp_path) -> None:
    """A real write failure: the process may write no file past 24 KB (RLIMIT_FSIZE, with
    SIGXFSZ ignored, so write() fails with EFBIG as it would with ENOSPC), and the recording
    of this run needs more."""
    path = tmp_path / "run.jsonl"
    script = textwrap.dedent(f"""
        import resource, signal, sys
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (24_000, 24_000))
        from engine.cli import main
        sys.exit(main(["run-workload", "--num-prompts", "6", "--random-input-len", "64", "--random-output-len",
                       "16", "--request-rate", "inf", "--threads", "1", "--events", {str(path)!r}]))
    """)
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "requests: 6 (length 6)" in run.stdout + run.stderr
    assert f"event sink jsonl {path} failed on a" in run.stderr and "File too large" in run.stderr
    data = path.read_bytes()
    assert 0 < len(data) <= 24_000 and data.endswith(b"\n")  # cut back to its last whole line
    recording = read_events(path)
    assert not recording.truncated and recording.events
    assert recording.events[-1].seq == len(recording.events)  # every line before the failure is there
