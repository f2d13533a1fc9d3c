"""``engine doctor`` end to end: a recording (with the simulator's what-if for a
fix), a live server's /events stream over real HTTP on 127.0.0.1, a failing vLLM
log from the corpus, the exit status by severity and the JSON shape."""

from __future__ import annotations

import gzip
import http.server
import json
import re
import threading
from collections.abc import Iterator

import pytest

from doctor.cli import examine
from doctor.inputs import facts_from_recording
from doctor.remedies import WhatIf
from doctor.rules.registry import diagnose
from engine.cli.main import main
from engine.events import SnapshotEvent, dumps, read_events
from engine.events.folds.view import EngineView
from tests.doctor.recordings import path_of
from tests.paths import DATA

TPU_LOG = DATA / "vllm-logs" / "v0.9.2dev-llama-tpu-v5e-8-kvmem-fail.log"


def run_doctor(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    status = main(["doctor", *argv])
    return status, capsys.readouterr().out


def test_fp8_fix_ends_the_storm_in_the_simulator() -> None:
    facts = facts_from_recording(path_of("pool_binds"))
    (finding,) = [f for f in diagnose(facts) if f.rule == "pool_binds"]  # request_thrashing names its worst request
    fp8 = next(f for f in finding.fixes if f.flag == "--kv-cache-dtype")
    fp8.effect = WhatIf(facts).effect(finding.rule, fp8)
    assert fp8.effect is not None and fp8.effect.startswith("simulated on l4, the same 32 requests: preemptions 16 → 0")
    assert fp8.numbers["simulated"]["output_tokens_per_s"]["after"] > fp8.numbers["simulated"]["output_tokens_per_s"]["before"]


@pytest.mark.slow
def test_pool_binds_report_with_simulated_effects(capsys: pytest.CaptureFixture[str]) -> None:
    status, out = run_doctor(capsys, str(path_of("pool_binds")), "--json")
    report = json.loads(out)
    assert status == 2 and report["status"] == "critical" and report["kind"] == "recording"
    # prefix_miss_causes: preempted requests come back to find their own blocks evicted (the pool, again)
    assert [f["rule"] for f in report["findings"]] == ["pool_binds", "prefix_miss_causes", "request_thrashing"]
    finding = report["findings"][0]
    assert finding["where"] == "steps 132–361"
    effects = {fix["flag"]: fix["numbers"]["simulated"] for fix in finding["fixes"]}
    # every fix ends the storm in the simulation of the same 32 requests on the same L4 pool
    for flag in ("--max-num-seqs", "--kv-cache-dtype", "--gpu-memory-utilization"):
        assert effects[flag]["preemptions"]["before"] >= 10 and effects[flag]["preemptions"]["after"] == 0, flag


def test_long_prompt_fix_cuts_the_worst_itl(capsys: pytest.CaptureFixture[str]) -> None:
    status, out = run_doctor(capsys, str(path_of("long_prompts")))
    assert status == 1
    assert "WARNING latency spikes when long prompts arrive (steps 74–116)" in out
    line = next(x for x in out.splitlines() if x.startswith("  fix: --max-num-batched-tokens 8192 -> 512"))
    worst = re.search(r"worst ITL (\d+) ms → (\d+) ms", line)
    assert worst is not None and int(worst[1]) == 222 and int(worst[2]) < 222 / 5
    assert re.search(r"TTFT p99 \d+ ms → \d+ ms", line)


def test_healthy_recording_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    status, out = run_doctor(capsys, str(path_of("healthy")))
    assert status == 0 and out.startswith(f"kvscope doctor: {path_of('healthy')} (recording): healthy, 0 findings")


def test_failing_vllm_log(capsys: pytest.CaptureFixture[str]) -> None:
    status, out = run_doctor(capsys, str(TPU_LOG), "--json")
    report = json.loads(out)
    assert status == 2 and report["kind"] == "vllm-log"
    (finding,) = report["findings"]
    assert finding["rule"] == "startup_refused" and finding["severity"] == "critical"
    assert finding["evidence"][0] == ("line 5: one 131,072-token request does not fit the KV pool "
                                      "(16.00 GiB needed, 0.71 GiB available)")
    # logparse's fix, structured where it is computed: the doctor reads its fields, no sentence parsed back
    assert any(f["flag"] == "--max-model-len" and f["current"] == 131_072 and f["why"] == "fits the current pool"
               for f in finding["fixes"])


def test_unreadable_inputs_exit_three(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    assert main(["doctor", str(tmp_path / "missing.jsonl")]) == 3
    assert "no such file" in capsys.readouterr().err
    other = tmp_path / "other.jsonl"
    other.write_text('{"not": "kvscope"}\n')
    assert main(["doctor", str(other)]) == 3
    assert "not a kvscope event file" in capsys.readouterr().err
    broken = tmp_path / "cut.jsonl.gz"
    broken.write_bytes(gzip.compress(b"not a recording\n")[:10])
    assert main(["doctor", str(broken)]) == 3


@pytest.fixture
def events_server() -> Iterator[str]:
    """A real HTTP server streaming a recording as kvscope's /events does: the
    view's snapshot (with its recent events) first, then every later event."""
    events = read_events(gzip.decompress(path_of("long_prompts").read_bytes())).events
    cut = next(i for i, e in enumerate(events) if getattr(e, "index", None) == 60)
    view = EngineView().fold(events[:cut])
    lines = [dumps(SnapshotEvent(state=view.snapshot(), seq=view.last_seq).to_dict())]
    lines += [dumps(e.to_dict()) for e in events[cut:]]

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write("".join(f"data: {line}\n\n" for line in lines).encode())
            self.wfile.flush()
            self.close_connection = True

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_live_server_events(events_server: str) -> None:
    kind, findings, notes = examine(events_server, duration_s=0.5, simulate=False)
    assert kind == "live" and [f.rule for f in findings] == ["long_prompt_spikes"]
    assert findings[0].evidence[0].startswith("request doc1 (16,000-token prompt) arrived at step 74")
    assert notes[-1].startswith("live: ")
