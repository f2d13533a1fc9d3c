"""The periodic stats line and ``stats`` event, folded from a real event stream
on the event time axis."""

from __future__ import annotations

import io
import json
import re

import pytest

from engine.errors import UserError
from engine.events import Event, EventBus, StatsEvent
from engine.events.exporters.stats import PrefixHitWindow, StatsReporter, format_stats_line
from engine.logs import configure_logging
from tests.scripted_events import NUM_BLOCKS, new_bus, run_script

# vLLM 0.30+'s assembled line (vllm-log-catalog.md row 73), written as a regex here
# so the test does not share the formatter it checks.
VLLM_STATS_LINE = re.compile(
    r"Engine (?P<engine>\d{3}): Avg prompt throughput: (?P<prompt>\d+\.\d) tokens/s, "
    r"Avg generation throughput: (?P<gen>\d+\.\d) tokens/s, Running: (?P<running>\d+) reqs, "
    r"Waiting: (?P<waiting>\d+) reqs, (?:Preemptions: (?P<preemptions>\d+), )?"
    r"(?P<device>\w+) KV cache usage: (?P<kv>\d+\.\d)%, Prefix cache hit rate: (?P<hit>\d+\.\d)%$"
)


class Lines:
    def __init__(self) -> None:
        self.lines: list[tuple[str, bool]] = []

    def __call__(self, line: str, idle: bool) -> None:
        self.lines.append((line, idle))


def test_the_line_has_vllm_wording_and_format() -> None:
    stats = StatsEvent(
        prompt_throughput=120.46,
        generation_throughput=33.0,
        num_running=4,
        num_waiting=1,
        kv_cache_usage=0.125,
        prefix_cache_hit_rate=0.4,
    )
    assert format_stats_line(stats, "CPU") == (
        "Engine 000: Avg prompt throughput: 120.5 tokens/s, Avg generation throughput: 33.0 tokens/s, "
        "Running: 4 reqs, Waiting: 1 reqs, CPU KV cache usage: 12.5%, Prefix cache hit rate: 40.0%"
    )
    stats.num_preemptions = 2
    line = format_stats_line(stats, "GPU", engine_index=3)
    m = VLLM_STATS_LINE.match(line)
    assert m is not None, line
    assert m["engine"] == "003" and m["preemptions"] == "2" and m["device"] == "GPU"


def test_reports_on_event_time_with_throughput_over_the_interval() -> None:
    bus, clock = new_bus()
    lines = Lines()
    reporter = StatsReporter(bus, interval_s=1.0, log=lines)
    bus.subscribe(reporter)
    published: list[Event] = []
    bus.subscribe(published.append)
    totals = run_script(bus, clock)
    stats = [e for e in published if isinstance(e, StatsEvent)]
    # the script spans t = 0 .. 2.0 in 0.5 s steps: reports at t = 1.0 and t = 2.0
    assert len(stats) == len(lines.lines) == 2
    first = stats[0]
    assert first.interval_s == 1.0
    assert first.prompt_throughput == 60.0  # r1 + r2 prompts at their first tokens (t = 0)
    assert first.generation_throughput == 4.0  # two first tokens + two decodes in [0, 1.0]
    assert (first.num_running, first.num_waiting) == (2, 0)  # the step at t = 0.5
    assert first.kv_cache_usage == 5 / NUM_BLOCKS
    assert first.prefix_cache_hit_rate == 16 / 60
    assert first.num_preemptions == 0
    second = stats[1]
    assert second.num_preemptions == 1
    assert second.prefix_cache_hit_rate == (16 + 32) / (60 + 42)
    # closing the last interval accounts for every token exactly once
    last, _line = reporter.report(clock.now)
    reports = [*stats, last]
    assert sum(s.prompt_throughput * s.interval_s for s in reports) == pytest.approx(totals.prompt_tokens)
    assert sum(s.generation_throughput * s.interval_s for s in reports) == pytest.approx(totals.output_tokens)
    # the line is the event's numbers, and names the device from the engine.config event
    m = VLLM_STATS_LINE.match(lines.lines[0][0])
    assert m is not None, lines.lines[0][0]
    assert (m["prompt"], m["gen"], m["running"], m["waiting"]) == ("60.0", "4.0", "2", "0")
    assert m["device"] == "CPU" and m["kv"] == f"{5 / NUM_BLOCKS * 100:.1f}" and m["hit"] == "26.7"
    assert reporter.last_line == format_stats_line(last, "CPU")


def test_stats_events_keep_seq_order_for_every_subscriber() -> None:
    bus, clock = new_bus()
    before: list[Event] = []
    after: list[Event] = []
    bus.subscribe(before.append)
    bus.subscribe(StatsReporter(bus, interval_s=0.5, log=None))
    bus.subscribe(after.append)
    run_script(bus, clock)
    assert any(isinstance(e, StatsEvent) for e in after)
    for seen in (before, after):
        seqs = [e.seq for e in seen]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    assert [e.seq for e in before] == [e.seq for e in after]


def test_idle_intervals_log_at_debug_and_zero_interval_turns_reports_off() -> None:
    lines = Lines()
    clock_now = {"t": 0.0}
    bus = EventBus(clock=lambda: clock_now["t"])
    reporter = StatsReporter(bus, interval_s=0, log=lines)
    bus.subscribe(reporter)
    for t in range(0, 50, 5):
        clock_now["t"] = float(t)
        bus.publish(StatsEvent())  # ignored by the reporter: it never folds its own output
        bus.publish(Event())
    assert lines.lines == []
    reporter.report(10.0)
    reporter.report(20.0)
    assert [idle for _line, idle in lines.lines] == [True, True]
    with pytest.raises(UserError, match="--stats-interval"):
        StatsReporter(bus, interval_s=-1)


def test_default_sink_is_structlog() -> None:
    stream = io.StringIO()
    configure_logging("json", stream=stream)
    try:
        bus, clock = new_bus()
        bus.subscribe(StatsReporter(bus, interval_s=1.0))
        run_script(bus, clock)
    finally:
        configure_logging("json")
    records = [json.loads(line) for line in stream.getvalue().splitlines()]
    messages = [r["event"] for r in records]
    assert messages and all(VLLM_STATS_LINE.match(msg) for msg in messages), messages
    assert {r["level"] for r in records} == {"info"}


def test_prefix_hit_rate_covers_the_most_recent_thousand_requests() -> None:
    window = PrefixHitWindow()
    window.observe(600, 6000, 6000)
    assert window.hit_rate == 1.0
    window.observe(600, 6000, 0)  # 1200 requests: the oldest step leaves the window
    assert window.hit_rate == 0.0
    single = PrefixHitWindow(max_requests=10)
    single.observe(50, 100, 25)  # one step larger than the window stays
    assert single.hit_rate == 0.25


def test_driver_run_token_totals_match_the_reports() -> None:
    driver = pytest.importorskip("engine.sim.driver")
    from engine.core.scheduler import SchedulerConfig

    requests = [
        driver.DriverRequest(f"d{i}", [1000 + i] * (10 + i), output_tokens=30 + i % 5, arrival_step=i)
        for i in range(12)
    ]
    now = {"t": 0.0}
    bus = EventBus(clock=lambda: now["t"])
    reporter = StatsReporter(bus, interval_s=3.0, log=None)
    bus.subscribe(reporter)
    reports: list[StatsEvent] = []
    bus.subscribe(lambda e: reports.append(e) if isinstance(e, StatsEvent) else None)

    def advance(_sched: object, _out: object) -> None:
        now["t"] += 0.5

    config = SchedulerConfig(
        num_blocks=8, block_size=16, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128
    )
    result = driver.run_driver(requests, config, bus=bus, on_step=advance)
    assert result.completed
    final, _line = reporter.report(now["t"])  # published on the bus too
    assert reports[-1] is final
    assert len(reports) >= 3
    assert sum(r.prompt_throughput * r.interval_s for r in reports) == pytest.approx(
        sum(len(r.prompt_token_ids) for r in requests)
    )
    assert sum(r.generation_throughput * r.interval_s for r in reports) == pytest.approx(
        sum(r.output_tokens for r in requests)
    )
    assert result.preemptions > 0, "8 blocks for 4 growing requests were meant to preempt"
    assert sum(r.num_preemptions for r in reports) == result.preemptions
