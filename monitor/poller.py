"""Polling replicas' ``/metrics``: one asyncio task per replica, each with its own timeout.

A :class:`MetricsPoller` scrapes one server every ``interval_s`` and hands on a
:class:`~engine.events.MetricsScrape` per answer and a :class:`~engine.events.LogEvent`
(``data``: source, state, reason) whenever its connection changes, so the fold
(:class:`monitor.replica.ReplicaState`), a recording and the header all see outages.
A replica that stops answering costs its own task at most ``timeout_s`` per poll; the
others keep their pace (nothing blocks the event loop). It retries at the poll
interval, backing off to ``max_retry_s`` while it stays down.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import httpx

from engine.errors import UserError
from engine.events import Event, LogEvent, MetricsScrape
from monitor.prometheus import has_vllm_families, strip_exposition
from monitor.replica import DISCONNECTED, LIVE, REFUSED

KVSCOPE, VLLM = "kvscope", "vllm"


def base_url(url: str) -> str:
    """``http://host:port`` (a trailing ``/metrics`` or ``/events`` dropped)."""
    if not url.startswith(("http://", "https://")):
        raise UserError(f"{url!r} is not a server URL; pass http://HOST:PORT")
    url = url.rstrip("/")
    for suffix in ("/metrics", "/events"):
        url = url.removesuffix(suffix)
    return url


def _reason(exc: httpx.HTTPError, timeout_s: float) -> str:
    if isinstance(exc, httpx.TimeoutException):
        return f"no answer in {timeout_s:g} s"
    if isinstance(exc, httpx.ConnectError):
        return "connection refused (is the server running?)" if "refused" in str(exc).lower() \
            else f"cannot connect: {exc}"
    return f"{exc.__class__.__name__}: {exc}"


async def detect_kind(client: httpx.AsyncClient, url: str) -> str:
    """``kvscope`` when the server answers ``GET /events`` (kvscope's event stream),
    ``vllm`` when it only serves vLLM's families at ``/metrics``; raises
    :class:`UserError` when it serves neither (or does not answer)."""
    try:
        async with client.stream("GET", url + "/events", headers={"Accept": "text/event-stream"}) as r:
            if r.status_code == 200 and r.headers.get("content-type", "").startswith("text/event-stream"):
                return KVSCOPE
        r = await client.get(url + "/metrics")
    except httpx.HTTPError as exc:
        raise UserError(f"{url}: {_reason(exc, client.timeout.connect or 0.0)}") from exc
    if r.status_code == 200 and has_vllm_families(r.text):
        return VLLM
    raise UserError(f"{url}: neither a kvscope /events stream nor vLLM's families at /metrics (HTTP {r.status_code})")


class MetricsPoller:
    """Scrapes ``url``/metrics every ``interval_s`` until :meth:`stop`."""

    def __init__(self, url: str, deliver: Callable[[Event], None], *, interval_s: float = 1.0,
                 timeout_s: float = 2.0, max_retry_s: float = 10.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.url = base_url(url)
        self.deliver = deliver
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.max_retry_s = max(interval_s, max_retry_s)
        self.clock = clock
        self.state = ""
        self.failures = 0
        self._stopped = asyncio.Event()

    def stop(self) -> None:
        self._stopped.set()

    def _note(self, state: str, reason: str = "") -> None:
        if state == self.state and state != DISCONNECTED:
            return
        if state == DISCONNECTED and self.state == DISCONNECTED:
            return  # still down: one note per outage
        level = {LIVE: "info", DISCONNECTED: "warning", REFUSED: "error"}.get(state, "info")
        text = f"{self.url}: {state}" + (f", {reason}" if reason else "")
        self.state = state
        self.deliver(LogEvent(level=level, message=text, data={"source": self.url, "state": state, "reason": reason},
                              t=self.clock()))

    async def poll_once(self, client: httpx.AsyncClient) -> bool:
        """One scrape; True when it produced a reading."""
        try:
            r = await client.get(self.url + "/metrics", timeout=self.timeout_s)
        except httpx.HTTPError as exc:
            self._note(DISCONNECTED, _reason(exc, self.timeout_s))
            return False
        if r.status_code in (401, 403, 404):
            self._note(REFUSED, f"HTTP {r.status_code} at /metrics")
            return False
        if r.status_code != 200:
            self._note(DISCONNECTED, f"HTTP {r.status_code}")
            return False
        if not has_vllm_families(r.text):
            self._note(REFUSED, "no vllm: families at /metrics")
            return False
        self._note(LIVE)
        self.deliver(MetricsScrape(source=self.url, text=strip_exposition(r.text), t=self.clock()))
        return True

    async def run(self, client: httpx.AsyncClient | None = None) -> None:
        """Poll until stopped; a refusal (wrong endpoint) is retried slowly, an
        outage at growing intervals, a live server every ``interval_s``."""
        own = client is None
        client = client or httpx.AsyncClient(timeout=self.timeout_s)
        try:
            while not self._stopped.is_set():
                started = time.monotonic()
                ok = await self.poll_once(client)
                self.failures = 0 if ok else self.failures + 1
                delay = self.interval_s if ok else min(self.max_retry_s, self.interval_s * 2 ** (self.failures - 1))
                with contextlib.suppress(TimeoutError):  # the interval passed without a stop
                    await asyncio.wait_for(self._stopped.wait(), max(0.0, delay - (time.monotonic() - started)))
        finally:
            if own:
                await client.aclose()


def detect_kinds(urls: list[str], timeout_s: float = 2.0) -> dict[str, str]:
    """Each server's kind (``kvscope``, ``vllm``), asked concurrently; ``?`` for one
    that does not answer or serves neither (the fleet polls it anyway)."""

    async def ask_all() -> dict[str, str]:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            async def one(url: str) -> str:
                try:
                    return await detect_kind(client, url)
                except UserError:
                    return "?"
            kinds = await asyncio.gather(*(one(u) for u in urls))
        return dict(zip(urls, kinds, strict=True))

    return asyncio.run(ask_all())
