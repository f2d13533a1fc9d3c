"""Prometheus series updated every step without a prometheus_client call on the step path.

Each wrapper keeps its series' value the way prometheus_client would (the same float
operations in the same order, so the value is the same to the last bit) in plain attributes
of its own, and :class:`SeriesWriter` writes those values into the series when the registry is
collected (``/metrics``, ``get_sample_value``, a merged data-parallel exposition): a scrape
reads what it read before. A step then costs a few attribute updates instead of some fifteen
prometheus_client calls, each a lock and several frames, which ran with cold caches after
the forward pass.

The writer is registered in the registry before the families it writes: a registry collects
its collectors in the order they were registered, so every family's samples are read after
the write. Every update of a wrapped series must go through its wrapper (the wrapper owns
the value); the other families of the same registry stay plain prometheus_client series.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric


class DeferredCounter:
    """A counter series' ``inc``: the total kept here, written at collection."""

    __slots__ = ("_series", "total")

    def __init__(self, series: Any) -> None:
        self._series = series  # the labelled prometheus_client Counter child
        self.total = 0.0

    def inc(self, amount: float = 1) -> None:
        if amount < 0:  # prometheus_client's refusal
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        self.total += amount

    def write(self) -> None:
        self._series._value.set(self.total)


class DeferredGauge:
    """A gauge series' ``set``: the last value kept here, written at collection."""

    __slots__ = ("_series", "value")

    def __init__(self, series: Any) -> None:
        self._series = series  # the labelled prometheus_client Gauge child
        self.value = 0.0

    def set(self, value: float) -> None:
        self.value = float(value)

    def write(self) -> None:
        self._series._value.set(self.value)


class DeferredHistogram:
    """A histogram series' ``observe``: the sum and each bucket's count kept here (a value in
    the first bucket whose bound is at least it, as prometheus_client's ``observe``; NaN in
    the sum only), written at collection."""

    __slots__ = ("_bounds", "_series", "counts", "sum")

    def __init__(self, series: Any) -> None:
        self._series = series  # the labelled prometheus_client Histogram child
        self._bounds: list[float] = list(series._upper_bounds)  # ascending, the last +Inf
        self.counts = [0] * len(self._bounds)
        self.sum = 0.0

    def observe(self, amount: float) -> None:
        self.sum += amount
        if amount == amount:  # not NaN: NaN is in no bucket
            self.counts[bisect.bisect_left(self._bounds, amount)] += 1

    def observe_many(self, amounts: Sequence[float]) -> None:
        """Every one of ``amounts`` observed, their sum added at once (as the metrics'
        ``observe_many`` adds it to a plain series)."""
        if not amounts:
            return
        counts, bounds = self.counts, self._bounds
        for amount in amounts:
            if amount == amount:
                counts[bisect.bisect_left(bounds, amount)] += 1
        self.sum += sum(amounts)

    def write(self) -> None:
        series = self._series
        series._sum.set(self.sum)
        for bucket, count in zip(series._buckets, self.counts, strict=True):
            bucket.set(float(count))


Deferred = DeferredCounter | DeferredGauge | DeferredHistogram


class SeriesWriter:
    """A collector with no families of its own: collected, it writes every deferred series'
    value into its prometheus_client series (one write at a time, so a later scrape never
    reads an older value than an earlier one did)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._series: list[Deferred] = []
        self._lock = threading.Lock()
        registry.register(self)

    def add(self, series: Deferred) -> Any:
        self._series.append(series)
        return series

    def describe(self) -> Iterable[Metric]:
        return ()  # names nothing: registering it collects nothing

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            for series in self._series:
                series.write()
        return ()
