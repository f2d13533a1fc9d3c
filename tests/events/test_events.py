"""The event bus, the JSONL recording format, and the reader's tolerance of a cut tail."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from engine.events import (
    EVENT_TYPES,
    EventBus,
    JsonlSink,
    RequestArrived,
    StartupPhase,
    StepEvent,
    event_from_dict,
    read_events,
)


def _record(path: Path, n_steps: int = 5) -> list[dict]:
    clock = iter(range(1000))
    bus = EventBus(clock=lambda: float(next(clock)))
    sink = JsonlSink(path, config={"model": "m"})
    bus.subscribe(sink)
    bus.publish(StartupPhase(phase="A", name="init", status="begin"))
    bus.publish(RequestArrived(request_id="r1", prompt_tokens=12, max_tokens=4))
    for i in range(n_steps):
        bus.publish(StepEvent(index=i, scheduled={"r1": [1, "decode"]}, allocated={"r1": [i]}, num_running=1))
    sink.close()
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_bus_stamps_seq_and_time_and_fans_out() -> None:
    bus = EventBus(clock=lambda: 1.5)
    seen_a: list = []
    seen_b: list = []
    bus.subscribe(seen_a.append)
    fn = bus.subscribe(seen_b.append)
    bus.publish(RequestArrived(request_id="x"))
    bus.unsubscribe(fn)
    bus.publish(RequestArrived(request_id="y"))
    assert [e.seq for e in seen_a] == [1, 2]
    assert [e.request_id for e in seen_b] == ["x"]
    assert seen_a[0].t == 1.5


def test_round_trip_every_event_type() -> None:
    for cls in EVENT_TYPES.values():
        event = cls()
        again = event_from_dict(json.loads(json.dumps(event.to_dict())))
        assert type(again) is cls and again.to_dict() == event.to_dict()


def test_jsonl_header_and_lines(tmp_path: Path) -> None:
    rows = _record(tmp_path / "run.jsonl")
    assert rows[0]["schema"] == "kvscope.events" and rows[0]["version"] == 1 and rows[0]["config"] == {"model": "m"}
    assert [r["type"] for r in rows[1:3]] == ["startup.phase", "request.arrived"]
    recording = read_events(tmp_path / "run.jsonl")
    assert not recording.truncated and len(recording.events) == 7
    assert isinstance(recording.events[-1], StepEvent) and recording.events[-1].allocated == {"r1": [4]}


def test_reader_survives_a_cut_at_every_byte_of_the_last_line(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    _record(path)
    data = path.read_bytes()
    last_start = data.rstrip(b"\n").rfind(b"\n") + 1
    for cut in range(last_start, len(data) + 1):
        recording = read_events(data[:cut])
        whole_last_line = cut >= len(data) - 1  # the final newline itself is optional
        expected = 7 if whole_last_line else 6
        assert len(recording.events) == expected, cut
        assert recording.truncated == (last_start < cut and not whole_last_line)
        assert all(isinstance(e, type(e)) for e in recording.events)


def test_reader_rejects_other_files(tmp_path: Path) -> None:
    other = tmp_path / "x.jsonl"
    other.write_text('{"hello": 1}\n')
    with pytest.raises(ValueError, match="not a kvscope event file"):
        read_events(other)


def test_reader_rejects_a_corrupt_middle_line(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    _record(path)
    lines = path.read_text().splitlines()
    lines[3] = lines[3][:10]
    with pytest.raises(ValueError, match="line 4"):
        read_events(io.StringIO("\n".join(lines) + "\n").getvalue().encode())


def test_sink_flushes_every_event(tmp_path: Path) -> None:
    path = tmp_path / "live.jsonl"
    bus = EventBus()
    sink = JsonlSink(path)
    bus.subscribe(sink)
    bus.publish(StepEvent(index=0))
    # Not closed: a concurrent reader already sees the whole line.
    assert len(read_events(path).events) == 1
    sink.close()


def test_an_event_is_serialised_once_for_every_sink_that_writes_it() -> None:
    """The recording and /events share one line per event; the same object published again
    (a replay re-stamps it) is serialised again, with its new stamps."""
    from engine.events.recording import dumps, event_line

    bus = EventBus()
    recording = io.StringIO()
    sink = JsonlSink(recording)
    lines: list[str] = []
    bus.subscribe(sink)
    bus.subscribe(lambda event: lines.append(event_line(event)))
    event = RequestArrived(request_id="r1", prompt_tokens=3, max_tokens=4)
    bus.publish(event)
    assert lines[0] is event_line(event) and lines[0] == dumps(event.to_dict())
    bus.publish(event)  # seq 2 now: a new line, not the cached one
    assert json.loads(lines[1])["seq"] == 2 and recording.getvalue().splitlines()[1:] == lines
