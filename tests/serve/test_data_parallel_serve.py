"""What the API server shows of every replica under ``--data-parallel-size 2`` (issues 35
and 37): ``GET /events`` streams both ranks' step and request events, ``/debug/state``
answers for either rank (``?dp_rank=``), ``/debug/requests`` and ``include_metrics`` see
requests on both ranks, and ``/start_profile`` / ``/stop_profile`` profile both engine
cores, each writing its own trace into the events' folder. A real ``engine serve -dp 2``
of a tiny dummy-weight Llama (tests/test_data_parallel.py's), driven by httpx."""

from __future__ import annotations

import concurrent.futures
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.test_data_parallel import tiny_dp_server

# slow: two engine-core processes start (40-90 s on the loaded shared 2-core Zen 4)
pytestmark = pytest.mark.slow

CONCURRENT = 6  # requests in flight at once: the balancer spreads them over both ranks


@pytest.fixture(scope="module")
def dp_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    with tiny_dp_server(tmp_path_factory.mktemp("tiny-llama-dp"), "--enable-per-request-metrics") as server:
        yield server


def _complete(url: str, index: int, **fields: Any) -> dict[str, Any]:
    body = {"prompt": [5 + index, 17, 29, 31, 40 + index], "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            **fields}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def _load(url: str, **fields: Any) -> list[dict[str, Any]]:
    with concurrent.futures.ThreadPoolExecutor(CONCURRENT) as pool:
        return list(pool.map(lambda i: _complete(url, i, **fields), range(CONCURRENT)))


def test_events_stream_every_ranks_steps_and_requests(dp_server: dict[str, Any]) -> None:
    url = dp_server["url"]
    seen: list[dict[str, Any]] = []
    both_ranks = threading.Event()

    def read() -> None:
        with httpx.stream("GET", f"{url}/events", timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    seen.append(json.loads(line[len("data: "):]))
                    steps = {e.get("dp_rank", 0) for e in seen if e["type"] == "step"}
                    finished = {e.get("dp_rank", 0) for e in seen if e["type"] == "request.finished"}
                    if steps == finished == {0, 1}:
                        both_ranks.set()
                        return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    while not seen:  # the snapshot came: the stream is connected
        reader.join(0.05)
    assert seen[0]["type"] == "snapshot" and seen[0]["state"]["data_parallel"]["size"] == 2
    _load(url)
    assert both_ranks.wait(60), sorted({(e["type"], e.get("dp_rank", 0)) for e in seen})
    # rank 1 sends only what says its rank: no second copy of a startup or stats event
    assert {e["type"] for e in seen if e.get("dp_rank", 0) == 1} <= {"step", "request.arrived", "request.scheduled",
                                                                     "request.first_token", "request.preempted",
                                                                     "request.finished", "request.rejected"}


def test_debug_state_and_requests_answer_for_either_rank(dp_server: dict[str, Any]) -> None:
    url = dp_server["url"]
    answers = _load(url, include_metrics=True)
    assert all(a["metrics"] is not None and a["metrics"]["time_to_first_token_ms"] > 0 for a in answers)
    routed = {a["id"] for a in answers}
    rows = httpx.get(f"{url}/debug/requests", params={"state": "finished"}).json()["requests"]
    assert {r["dp_rank"] for r in rows if r["id"] in routed} == {0, 1}
    one = next(r for r in rows if r["id"] in routed and r["dp_rank"] == 1)
    assert httpx.get(f"{url}/debug/requests/{one['id']}").json()["dp_rank"] == 1
    for rank in (0, 1):
        state = httpx.get(f"{url}/debug/state", params={"dp_rank": rank}).json()
        assert state["data_parallel"]["rank_shown"] == rank and state["last_seq"] > 0
        assert state["step"] > 0 and state["kv"]["total"] > 0  # that rank's own steps and pool
    refused = httpx.get(f"{url}/debug/state", params={"dp_rank": 2})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "dp_rank"
    assert "0..1" in refused.json()["error"]["message"]


def test_logprobs_and_prompt_logprobs_come_back_from_either_rank(dp_server: dict[str, Any]) -> None:
    answers = _load(dp_server["url"], logprobs=1, prompt_logprobs=1)
    rows = httpx.get(f"{dp_server['url']}/debug/requests", params={"state": "finished"}).json()["requests"]
    assert {r["dp_rank"] for r in rows if r["id"] in {a["id"] for a in answers}} == {0, 1}
    for answer in answers:
        choice = answer["choices"][0]
        assert len(choice["logprobs"]["token_logprobs"]) == 8
        assert choice["prompt_logprobs"][0] is None and len(choice["prompt_logprobs"]) == 5


def test_profiling_covers_every_rank_and_writes_each_trace_beside_the_events(dp_server: dict[str, Any]) -> None:
    url = dp_server["url"]
    started = httpx.post(f"{url}/start_profile", timeout=60)
    assert started.status_code == 200 and started.json()["trace_dir"] == str(dp_server["events"].parent)
    assert httpx.post(f"{url}/start_profile", timeout=60).status_code == 400  # one at a time, on every rank
    _load(url)
    stopped = httpx.post(f"{url}/stop_profile", timeout=120)
    assert stopped.status_code == 200, stopped.text
    traces = [Path(p) for p in stopped.json()["traces"]]
    assert stopped.json()["trace"] == str(traces[0]) and len(traces) == 2
    for rank, trace in enumerate(traces):
        assert trace.parent == dp_server["events"].parent and f"-dp{rank}-" in trace.name
        events = json.loads(trace.read_text())["traceEvents"]
        assert any("aten::" in str(e.get("name", "")) for e in events)  # that core's steps ran torch ops
    assert httpx.post(f"{url}/stop_profile", timeout=60).status_code == 400  # nothing left running


def test_a_profiles_step_limit_reaches_every_rank(dp_server: dict[str, Any]) -> None:
    url = dp_server["url"]
    started = httpx.post(f"{url}/start_profile", json={"max_steps": 2}, timeout=60)
    assert started.status_code == 200 and started.json()["limits"]["max_steps"] == 2
    _load(url)  # each rank stops its own profile after two of its steps
    stopped = httpx.post(f"{url}/stop_profile", timeout=120)
    assert stopped.status_code == 200, stopped.text
    traces = stopped.json()["traces"]
    assert len(set(traces)) == 2 and all(Path(t).is_file() for t in traces)
