"""What ``engine doctor`` reads: a kvscope recording (``.jsonl``, or gzipped), a live
kvscope server (its ``/events`` stream, through the monitor's own SSE client), a live
vLLM server (its ``/metrics``, sampled) or a vLLM log (through logparse). The kind is
told by the argument, not by a flag: an ``http(s)://`` URL is live (a server without
``/events`` that serves vLLM's queue gauges is a vLLM one, :func:`live_kind`), a file
starting with the kvscope events header (plain or gzip) is a recording, any other file
is a log.
"""

from __future__ import annotations

import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from doctor.facts import RunFacts
from doctor.vllm_dp import EngineRound, VllmFleet
from engine.errors import UserError
from engine.events import SCHEMA_NAME, Recording, read_events
from engine.events.bounded import GZIP_MAGIC
from engine.events.feed import LIVE, REFUSED, HttpFeed, events_url

RECORDING = "recording"
LIVE_URL = "live"
VLLM_METRICS = "vllm-metrics"
VLLM_LOG = "vllm-log"
METRICS_INTERVAL_S = 1.0  # between scrapes of a vLLM server's /metrics
MIN_SCRAPES = 10  # a short --duration scrapes faster, so a run of SUSTAINED_ROUNDS can show
# vLLM's per-engine gauges and counter read from /metrics (every series labelled engine = DP rank
# since 0.8.3); gpu_cache_usage_perc is the name before 0.9, read where the new one is absent.
QUEUE_FAMILIES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                  "vllm:gpu_cache_usage_perc", "vllm:generation_tokens")
TOKEN_FAMILIES = ("vllm:prompt_tokens", "vllm:generation_tokens")  # counters a stalled engine leaves frozen


class InputError(UserError):
    """The input cannot be read; ``engine doctor`` exits 3 so scripts tell it from a critical finding (2)."""

    exit_code = 3


def kind_of(source: str) -> str:
    if source.startswith(("http://", "https://")):
        return LIVE_URL
    path = Path(source)
    if not path.is_file():
        raise InputError(f"{source}: no such file; pass a recording (.jsonl), a vLLM log or http://HOST:PORT")
    with path.open("rb") as fh:
        head = fh.read(64)
    if head.startswith(GZIP_MAGIC) or SCHEMA_NAME.encode() in head:
        return RECORDING
    if path.suffix in (".jsonl", ".json"):
        raise InputError(f"{source}: not a kvscope event file (its first line must be the {SCHEMA_NAME} header); "
                         "record one with --events FILE")
    return VLLM_LOG


def _read_recording(path: Path) -> Recording:
    """Read through the bounded reader (engine/events/bounded.py): plain or gzipped, streamed."""
    try:
        return read_events(path)
    except OSError as exc:
        raise InputError(f"{path}: {exc}") from None
    except ValueError as exc:  # read_events names the file, the line and the field (or the cap broken)
        raise InputError(str(exc)) from None


def dp_sibling_paths(path: Path, config: dict[str, Any]) -> list[Path]:
    """A data-parallel core's own recording (``run.dp1.jsonl``: its flags name its rank) and
    the other cores' beside it (engine/dp_core.py's ``rank_events_path`` names), rank order."""
    rank, size = config.get("data_parallel_rank"), int(config.get("data_parallel_size") or 1)
    mark = f".dp{rank}."
    if rank is None or size < 2 or mark not in path.name:
        return [path]
    named = [path.with_name(path.name.replace(mark, f".dp{r}.", 1)) for r in range(size)]
    return [p for p in named if p.is_file()]


def facts_from_recording(path: str | Path) -> RunFacts:
    """The recording's fold. A data-parallel core's recording is folded with the other cores'
    beside it, so dp_imbalance sees every rank: their events merged by time (each core's bus
    clock starts when the core does, so the ranks line up within their start skew)."""
    path = Path(path)
    recording = _read_recording(path)
    paths = dp_sibling_paths(path, recording.config)
    events = recording.events
    if len(paths) > 1:
        recordings = [recording if p == path else _read_recording(p) for p in paths]
        events = sorted((e for r in recordings for e in r.events), key=lambda e: e.t)  # stable: each file's order
    facts = RunFacts()
    for event in events:
        facts(event)
    return facts


def facts_from_server(url: str, duration_s: float, api_key: str | None = None,
                      connect_timeout_s: float = 5.0) -> RunFacts:
    """Follow a server's ``/events`` for ``duration_s`` seconds (its snapshot first: flags,
    startup phases and the recent events it kept) and fold what arrived."""
    feed = HttpFeed(url, api_key=api_key, retry_s=connect_timeout_s, connect_timeout_s=connect_timeout_s)
    facts = RunFacts()
    feed.start()
    try:
        if not feed.connected.wait(connect_timeout_s):
            state = feed.connection
            raise InputError(f"{feed.url}: {state.reason or state.state}")
        deadline = time.monotonic() + duration_s
        while True:
            for event in feed.drain():
                facts(event)
            if feed.connection.state == REFUSED:
                raise InputError(f"{feed.url}: refused, {feed.connection.reason}")
            if time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        if feed.connection.state != LIVE and not facts.events:
            raise InputError(f"{feed.url}: {feed.connection.reason or 'no events arrived'}")
    finally:
        feed.stop()
    return facts


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def live_kind(url: str, api_key: str | None = None, timeout_s: float = 5.0) -> str:
    """LIVE_URL for a kvscope server (anything but a 404 on ``/events``: its refusal or an
    unreachable host is reported by :func:`facts_from_server`), VLLM_METRICS for a server
    without ``/events`` whose ``/metrics`` has vLLM's queue gauges."""
    events = events_url(url)
    base = events.removesuffix("/events")
    try:
        with httpx.Client(timeout=timeout_s) as client:
            with client.stream("GET", events, headers={"Accept": "text/event-stream", **_headers(api_key)}) as r:
                if r.status_code != 404:
                    return LIVE_URL
            metrics = client.get(base + "/metrics", headers=_headers(api_key))
    except httpx.HTTPError:
        return LIVE_URL
    if metrics.status_code == 200 and "vllm:num_requests_" in metrics.text:
        return VLLM_METRICS
    raise InputError(f"{base}: no /events (not a kvscope server) and no vLLM queue gauges on /metrics "
                     f"(HTTP {metrics.status_code}); pass a kvscope or a vLLM server's http://HOST:PORT")


def engine_readings(text: str) -> tuple[dict[int, tuple[int, int, float]], dict[int, float]]:
    """One /metrics scrape: ``{engine: (waiting, running, KV usage share)}`` and each engine's
    generated tokens so far, read with prometheus_client's parser (only vLLM's queue
    families are handed to it)."""
    values = _engine_values(text, QUEUE_FAMILIES)
    readings = {e: (round(v.get("vllm:num_requests_waiting", 0.0)), round(v.get("vllm:num_requests_running", 0.0)),
                    v.get("vllm:kv_cache_usage_perc", v.get("vllm:gpu_cache_usage_perc", 0.0)))
                for e, v in values.items() if "vllm:num_requests_running" in v or "vllm:num_requests_waiting" in v}
    generated = {e: v["vllm:generation_tokens"] for e, v in values.items() if "vllm:generation_tokens" in v}
    return readings, generated


def engine_token_totals(text: str) -> dict[int, float]:
    """One /metrics scrape: each engine's prompt + generation tokens counted so far."""
    return {e: sum(v.get(name, 0.0) for name in TOKEN_FAMILIES)
            for e, v in _engine_values(text, TOKEN_FAMILIES).items() if any(name in v for name in TOKEN_FAMILIES)}


def _engine_values(text: str, families: tuple[str, ...]) -> dict[int, dict[str, float]]:
    """``{engine: {family: value}}`` of ``families`` in one scrape (prometheus_client's parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    kept = "\n".join(line for line in text.splitlines()
                     if line.removeprefix("# HELP ").removeprefix("# TYPE ").startswith(families))
    values: dict[int, dict[str, float]] = {}
    try:
        for family in text_string_to_metric_families(kept + "\n"):
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                engine = sample.labels.get("engine", "0")
                if engine.isdigit():
                    values.setdefault(int(engine), {})[family.name] = sample.value
    except ValueError as exc:
        raise InputError(f"/metrics: not a Prometheus exposition ({exc})") from None
    return values


def sample_vllm_metrics(url: str, duration_s: float, api_key: str | None = None,
                        interval_s: float | None = None, timeout_s: float = 5.0) -> VllmFleet:
    """Scrape a vLLM server's ``/metrics`` every ``interval_s`` (1 s, or duration / 10 when
    shorter) for ``duration_s`` seconds: each scrape one round of every engine's queue."""
    base = events_url(url).removesuffix("/events")
    interval = interval_s or max(0.05, min(METRICS_INTERVAL_S, duration_s / MIN_SCRAPES))
    rounds: list[EngineRound] = []
    previous: tuple[float, dict[int, float]] | None = None
    start = time.monotonic()
    with httpx.Client(timeout=timeout_s) as client:
        while True:
            try:
                r = client.get(base + "/metrics", headers=_headers(api_key))
            except httpx.HTTPError as exc:
                raise InputError(f"{base}/metrics: {exc.__class__.__name__}: {exc}") from None
            t = time.monotonic() - start
            if r.status_code != 200:
                raise InputError(f"{base}/metrics: HTTP {r.status_code}")
            readings, generated = engine_readings(r.text)
            tps = ({e: (n - previous[1][e]) / (t - previous[0]) for e, n in generated.items()
                    if e in previous[1] and n >= previous[1][e]} if previous and t > previous[0] else {})
            previous = (t, generated)
            rounds.append(EngineRound(t, readings, len(rounds) + 1, datetime.now().strftime("%H:%M:%S"), tps,
                                      engine_token_totals(r.text)))
            if t >= duration_s:
                break
            time.sleep(max(0.0, start + len(rounds) * interval - time.monotonic()))
    return VllmFleet("metrics", rounds)
