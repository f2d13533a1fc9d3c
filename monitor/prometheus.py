"""vLLM's Prometheus exposition text -> one :class:`EngineMetrics` per engine (DP rank).

What the monitor reads from a vLLM server (or a kvscope one: it serves the same
families) is one scrape of ``GET /metrics``. Names follow vLLM's wire names
(``PrometheusStatLogger`` in vLLM's vllm/v1/metrics/loggers.py; the list in
https://docs.vllm.ai/en/latest/design/metrics.html): counters carry ``_total``, histograms
``_bucket``/``_sum``/``_count``, and the older names (``gpu_cache_usage_perc``,
``gpu_prefix_cache_*``) are read where the newer ones are absent. Every family
carries an ``engine`` label (the DP rank) since vLLM 0.8.3; each rank is its own
:class:`EngineMetrics`, so imbalance between ranks stays visible.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

VLLM_PREFIX = "vllm:"
DEFAULT_ENGINE = "0"  # servers before 0.8.3 (and kvscope) carry no engine label
HISTOGRAMS = {
    "ttft": "vllm:time_to_first_token_seconds",
    "itl": "vllm:inter_token_latency_seconds",
    "e2e": "vllm:e2e_request_latency_seconds",
    "queue": "vllm:request_queue_time_seconds",
}
# Wire name -> EngineMetrics field; the first name present wins (new names first).
GAUGES = {
    "running": ("vllm:num_requests_running",),
    "waiting": ("vllm:num_requests_waiting",),
    "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
}
COUNTERS = {
    "preemptions": ("vllm:num_preemptions_total",),
    "prompt_tokens": ("vllm:prompt_tokens_total",),
    "generation_tokens": ("vllm:generation_tokens_total",),
    "prefix_queries": ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
    "prefix_hits": ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
    "finished": ("vllm:request_success_total",),
}


@dataclass(slots=True)
class Histogram:
    """A cumulative Prometheus histogram: ``buckets`` as (upper bound, count) sorted by bound."""

    buckets: list[tuple[float, float]] = field(default_factory=list)
    total: float = 0.0
    count: float = 0.0

    def minus(self, earlier: Histogram | None) -> Histogram:
        """The observations made since ``earlier`` (a rate window); a counter reset
        (a restarted server) keeps the whole of this one."""
        if earlier is None or earlier.count > self.count or len(earlier.buckets) != len(self.buckets):
            return self
        return Histogram(
            buckets=[(le, c - c0) for (le, c), (_, c0) in zip(self.buckets, earlier.buckets, strict=True)],
            total=self.total - earlier.total, count=self.count - earlier.count,
        )

    def quantile(self, q: float) -> float | None:
        """PromQL's ``histogram_quantile``: linear inside the bucket holding rank
        ``q * count``; the highest finite bound when the rank lands in ``+Inf``.
        None without observations."""
        if not self.buckets or self.count <= 0:
            return None
        rank = q * self.count
        lower_bound, lower_count = 0.0, 0.0
        for le, cumulative in self.buckets:
            if cumulative >= rank:
                if math.isinf(le):
                    return lower_bound
                in_bucket = cumulative - lower_count
                if in_bucket <= 0:
                    return le
                return lower_bound + (le - lower_bound) * (rank - lower_count) / in_bucket
            lower_bound, lower_count = le, cumulative
        return lower_bound


@dataclass(slots=True)
class EngineMetrics:
    """One engine's (DP rank's) reading of one scrape. Counters are cumulative."""

    engine: str = DEFAULT_ENGINE
    model_name: str = ""
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0  # 0..1, cached-but-free blocks count as free (vLLM's definition)
    preemptions: float = 0.0
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0
    finished: float = 0.0
    histograms: dict[str, Histogram] = field(default_factory=dict)
    cache_config: dict[str, str] = field(default_factory=dict)  # vllm:cache_config_info's labels

    @property
    def num_gpu_blocks(self) -> int:
        value = self.cache_config.get("num_gpu_blocks", "")
        return int(value) if value.isdigit() else 0

    @property
    def block_size(self) -> int:
        value = self.cache_config.get("block_size", "")
        return int(value) if value.isdigit() else 0


# Every sample name parse_metrics reads; the rest of an exposition is skipped unparsed.
READ_NAMES = frozenset(
    [name for names in (*GAUGES.values(), *COUNTERS.values()) for name in names]
    + [f"{base}_{part}" for base in HISTOGRAMS.values() for part in ("bucket", "sum", "count")]
    + ["vllm:cache_config_info"]
)


def has_vllm_families(text: str) -> bool:
    """Whether ``text`` is a Prometheus exposition with vLLM's families in it."""
    return "vllm:num_requests_running" in text or "vllm:num_requests_waiting" in text


def strip_exposition(text: str) -> str:
    """The samples a recording keeps: ``vllm:`` lines only, without ``# HELP``/``# TYPE``
    comments or ``_created`` timestamps (a third of the text, and never read). Types
    come back from the names, which is all :func:`parse_metrics` needs."""
    keep = []
    for line in text.splitlines():
        if line.startswith(VLLM_PREFIX) and "_created" not in line.split("{", 1)[0].split(" ", 1)[0]:
            keep.append(line)
    return "\n".join(keep) + "\n"


_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def iter_samples(text: str, names: frozenset[str] | None = None) -> Iterator[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every ``vllm:`` sample line, in order. A plain line
    reader (the exposition's sample grammar: ``name{k="v",...} value [timestamp]``):
    prometheus_client's parser builds a family object per metric and costs about ten
    times as much, which is most of a fleet's polling CPU. ``names`` (optional) keeps
    only those samples, unparsed lines of other families skipped. Raises ``ValueError``
    with the line for a sample that does not parse."""
    for line in text.splitlines():
        if not line.startswith(VLLM_PREFIX):
            continue
        brace = line.find("{")
        if names is not None and (line[:brace] if brace >= 0 else line.split(" ", 1)[0]) not in names:
            continue  # a family nobody reads: skip its labels
        if brace >= 0:
            close = line.rfind("}")
            if close < brace:
                raise ValueError(f"not a Prometheus sample line: {line[:120]!r}")
            name = line[:brace]
            labels = {k: v.replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")
                      for k, v in _LABEL.findall(line, brace, close)}
            rest = line[close + 1:].split()
        else:
            name, *rest = line.split()
            labels = {}
        if not rest:
            raise ValueError(f"not a Prometheus sample line: {line[:120]!r}")
        try:
            value = float(rest[0])
        except ValueError:
            raise ValueError(f"not a Prometheus sample value: {line[:120]!r}") from None
        yield name, labels, value


def parse_metrics(text: str) -> dict[str, EngineMetrics]:
    """One scrape -> {engine label: EngineMetrics}, engines in label order.

    Raises ``ValueError`` (with the bad line) on text that is not a Prometheus exposition."""
    engines: dict[str, EngineMetrics] = {}
    gauge_names = {name: key for key, names in GAUGES.items() for name in names}
    counter_names = {name: key for key, names in COUNTERS.items() for name in names}
    histogram_names = {name: key for key, name in HISTOGRAMS.items()}
    seen: dict[tuple[str, str], str] = {}  # (engine, field) -> the wire name that set it
    for name, labels, value in iter_samples(text, READ_NAMES):
        engine_label = labels.get("engine", DEFAULT_ENGINE)
        metrics = engines.get(engine_label)
        if metrics is None:
            metrics = engines[engine_label] = EngineMetrics(engine=engine_label)
        if labels.get("model_name") and not metrics.model_name:
            metrics.model_name = labels["model_name"]
        if name == "vllm:cache_config_info":
            metrics.cache_config = {k: v for k, v in labels.items() if k not in ("engine", "model_name")}
            continue
        key = gauge_names.get(name) or counter_names.get(name)
        if key is not None:
            _set_first(metrics, key, name, value, seen, GAUGES.get(key) or COUNTERS[key])
            continue
        base, _, part = name.rpartition("_")
        hist_key = histogram_names.get(base)
        if hist_key is not None:
            hist = metrics.histograms.setdefault(hist_key, Histogram())
            if part == "bucket":
                hist.buckets.append((float(labels.get("le", "+Inf")), value))
            elif part == "sum":
                hist.total += value
            elif part == "count":
                hist.count += value
    for metrics in engines.values():
        for hist in metrics.histograms.values():
            hist.buckets.sort()
    return dict(sorted(engines.items()))


def _set_first(metrics: EngineMetrics, key: str, name: str, value: float,
               seen: dict[tuple[str, str], str], names: tuple[str, ...]) -> None:
    """Set ``key`` from ``name`` unless a preferred (earlier-listed) name already set
    it; labelled series of one name (request_success by finished_reason) add up."""
    slot = (metrics.engine, key)
    previous = seen.get(slot)
    if previous is None or names.index(name) < names.index(previous):
        setattr(metrics, key, value)
        seen[slot] = name
    elif previous == name:
        setattr(metrics, key, getattr(metrics, key) + value)
