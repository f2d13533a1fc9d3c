"""The Perfetto / Chrome trace of a recording: valid Trace Event Format, and the
recording's steps and requests, one for one.

The checks below are the format's rules as its spec states them (required fields
per phase type, B/E pairing, counters' numeric values), written from the spec, not
from engine/events/exporters/perfetto.py; they run on the real engine's recording and on a
simulated one with preemptions.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from engine.cli import main
from engine.events import PHASES, read_events
from engine.events.exporters.perfetto import PerfettoTrace, trace_of
from tests.paths import SAMPLES

RECORDINGS = ("smollm2_run.jsonl", "monitor_sim.jsonl")
ROUNDING_US = 0.002  # ts and dur are each rounded to 0.001 µs
METADATA_NAMES = {"process_name", "thread_name", "process_sort_index", "thread_sort_index"}


def check_trace_event_format(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """Assert the JSON object form of the Trace Event Format; return its records."""
    assert isinstance(trace.get("traceEvents"), list)
    records = trace["traceEvents"]
    last_ts: dict[tuple[int, int], float] = {}
    open_slices: dict[tuple[int, int], list[str]] = defaultdict(list)
    complete: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    named_threads: set[tuple[int, int]] = set()
    named_processes: set[int] = set()
    flows: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for record in records:
        ph = record["ph"]
        assert isinstance(record["pid"], int) and isinstance(record["name"], str), record
        if ph == "M":
            assert record["name"] in METADATA_NAMES and isinstance(record["args"], dict), record
            if record["name"] == "thread_name":
                named_threads.add((record["pid"], record["tid"]))
            if record["name"] == "process_name":
                named_processes.add(record["pid"])
            continue
        assert isinstance(record["ts"], int | float) and record["ts"] >= 0, record
        track = (record["pid"], record.get("tid", 0))
        assert record["ts"] >= last_ts.get(track, 0.0), f"ts goes back on track {track}: {record}"
        last_ts[track] = record["ts"]
        if ph == "X":
            assert isinstance(record["tid"], int) and isinstance(record["dur"], int | float) and record["dur"] >= 0
            complete[track].append((record["ts"], record["ts"] + record["dur"]))
        elif ph == "B":
            open_slices[track].append(record["name"])
        elif ph == "E":
            assert open_slices[track], f"E without B on {track}"
            open_slices[track].pop()
        elif ph in ("i", "I"):
            assert record.get("s", "t") in ("g", "p", "t"), record
        elif ph == "C":
            assert record["args"] and all(isinstance(v, int | float) for v in record["args"].values()), record
        elif ph in ("s", "f"):  # a flow arrow's ends: one of each per id, inside a slice of their tracks
            assert isinstance(record["id"], int) and record["cat"], record
            assert ph == "s" or record["bp"] == "e", record
            flows[record["id"]].append(record)
        else:
            raise AssertionError(f"phase type {ph!r} is not one this trace should use")
    assert not any(open_slices.values()), "B without E"
    for track, spans in complete.items():  # slices on one track nest or follow, never cross
        stack: list[float] = []
        for start, end in sorted(spans, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1] <= start + ROUNDING_US:
                stack.pop()
            assert not stack or end <= stack[-1] + ROUNDING_US, f"slices cross on track {track}"
            stack.append(end)
        assert track in named_threads, f"track {track} has no thread_name"
    assert {pid for pid, _ in named_threads} <= named_processes
    for ends in flows.values():
        assert sorted(r["ph"] for r in ends) == ["f", "s"], ends
        for end in ends:
            assert any(a - ROUNDING_US <= end["ts"] <= b + ROUNDING_US
                       for a, b in complete[(end["pid"], end["tid"])]), f"a flow end outside any slice: {end}"
    return records


@pytest.mark.parametrize("name", RECORDINGS)
def test_a_recording_becomes_a_valid_trace_with_its_steps_and_requests(name: str) -> None:
    recording = read_events(SAMPLES / name)
    records = check_trace_event_format(json.loads(json.dumps(trace_of(recording.events))))
    threads = {(r["pid"], r["tid"]): r["args"]["name"] for r in records if r["name"] == "thread_name"}
    by_thread: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        if r["ph"] not in ("M", "s", "f"):  # flow arrows: their own test
            by_thread[threads.get((r["pid"], r["tid"]), "")].append(r)
    steps = [e for e in recording.events if e.type == "step"]
    assert len(by_thread["steps"]) == len(steps)
    assert [s["args"]["index"] for s in by_thread["steps"]] == [s.index for s in steps]
    assert [s["name"][0] for s in by_thread["startup phases"]] == list(PHASES)
    arrived = {e.request_id for e in recording.events if e.type == "request.arrived"}
    request_threads = {thread for (pid, _), thread in threads.items() if pid == 2}
    assert request_threads == arrived
    finished = {e.request_id for e in recording.events if e.type == "request.finished"}
    preempted = [e.request_id for e in recording.events if e.type == "request.preempted"]
    for request_id in arrived:
        names = [r["name"] for r in by_thread[request_id]]
        assert names[0] == "queued" and "prefill" in names
        assert names.count("finished") == (request_id in finished)
        assert names.count("preempted") == preempted.count(request_id)
    # every token a step scheduled is on some request's track
    scheduled = sum(n for s in steps for n, _ in s.scheduled.values())
    assert sum(r["args"]["tokens"] for rid in arrived for r in by_thread[rid] if r["ph"] == "X"
               and r["name"] in ("prefill", "decode")) == scheduled
    counters = {r["name"] for r in records if r["ph"] == "C"}
    assert counters == {"KV cache usage %", "running", "waiting", "prefill tokens", "decode tokens", "preemptions"}
    last_preemptions = [r for r in records if r["ph"] == "C" and r["name"] == "preemptions"][-1]
    assert last_preemptions["args"]["value"] == len(preempted)


def test_replay_writes_the_trace_file_and_a_bad_path_is_refused_first(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "trace.json"
    assert main(["replay", str(SAMPLES / "monitor_sim.jsonl"), "--trace", str(out)]) == 0
    assert f"wrote the Perfetto trace {out}" in capsys.readouterr().out
    live = PerfettoTrace()  # the sink a live run subscribes folds the same events the same way
    for event in read_events(SAMPLES / "monitor_sim.jsonl").events:
        live(event)
    assert json.loads(out.read_text()) == json.loads(json.dumps(live.trace()))
    assert main(["replay", str(SAMPLES / "monitor_sim.jsonl"), "--trace-out", str(tmp_path / "no" / "t.json")]) == 2
    assert "--trace-out" in capsys.readouterr().err


def test_flow_arrows_join_each_request_to_the_steps_that_served_it() -> None:
    """One arrow per (request, step) it was scheduled in: from its track to the steps track,
    at a time inside that step's slice (issue 33)."""
    recording = read_events(SAMPLES / "monitor_sim.jsonl")
    records = check_trace_event_format(trace_of(recording.events))
    threads = {(r["pid"], r["tid"]): r["args"]["name"] for r in records if r["name"] == "thread_name"}
    steps = sorted((r["ts"], r["ts"] + r["dur"], r["args"]["index"]) for r in records
                    if r["ph"] == "X" and threads.get((r["pid"], r["tid"])) == "steps")
    starts = {r["id"]: threads[(r["pid"], r["tid"])] for r in records if r["ph"] == "s"}
    served: dict[str, list[int]] = defaultdict(list)
    for r in records:
        if r["ph"] == "f":
            index = next(i for a, b, i in steps if a <= r["ts"] <= b)
            served[starts[r["id"]]].append(index)
    expected: dict[str, list[int]] = defaultdict(list)
    for event in recording.events:
        if event.type == "step":
            for rid in event.scheduled:  # type: ignore[attr-defined]
                expected[rid].append(event.index)  # type: ignore[attr-defined]
    assert served == expected
