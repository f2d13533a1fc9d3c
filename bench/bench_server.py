"""Load on a running ``engine serve``: concurrent streaming clients on loopback,
some leaving mid-stream and some sending malformed requests.

``run_load`` is what the server tests use; ``python -m bench.bench_server``
starts the bundled model on a free port, runs the load and prints throughput,
TTFT and ITL percentiles (client-side, from the SSE chunks).

    python -m bench.bench_server --clients 200 --max-tokens 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from engine.cli.commands.demo import free_port

ROOT = Path(__file__).resolve().parent.parent

# Each one must be refused with a 4xx and a message: bad JSON, wrong type,
# negative max_tokens, prompt + max_tokens beyond --max-model-len, n > 1.
MALFORMED_BODIES: tuple[bytes, ...] = (
    b'{"prompt": "unterminated',
    json.dumps({"prompt": "hello", "max_tokens": "lots"}).encode(),
    json.dumps({"prompt": "hello", "max_tokens": -3}).encode(),
    json.dumps({"prompt": "hello", "max_tokens": 1_000_000}).encode(),
    json.dumps({"prompt": "hello", "n": 2}).encode(),
    b'{"prompt": "lone surrogate \\ud800"}',  # valid JSON, not valid Unicode
    b'{"prompt": "hello", "temperature": NaN}',
)


@dataclass
class LoadResult:
    clients: int
    wall_s: float = 0.0
    statuses: dict[int, int] = field(default_factory=dict)
    accepted: int = 0  # streams that answered 200
    completed: int = 0  # streams read to [DONE]
    disconnected: int = 0  # streams the client closed after its first token
    abandoned: int = 0  # non-streaming requests the client gave up on while they were queued
    retried_429: int = 0  # refusals by --max-waiting-requests, retried after Retry-After
    malformed_refused: int = 0
    output_tokens: int = 0  # content chunks received (one token each)
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def count(self, status: int) -> None:
        self.statuses[status] = self.statuses.get(status, 0) + 1

    @property
    def server_errors(self) -> int:
        return sum(n for status, n in self.statuses.items() if status >= 500)

    def percentiles(self) -> dict[str, float]:
        def pct(values: list[float], q: float) -> float:
            return float(np.percentile(values, q)) * 1e3 if values else float("nan")

        return {
            "ttft_p50_ms": pct(self.ttft_s, 50), "ttft_p90_ms": pct(self.ttft_s, 90),
            "ttft_p99_ms": pct(self.ttft_s, 99), "itl_p50_ms": pct(self.itl_s, 50),
            "itl_p90_ms": pct(self.itl_s, 90), "itl_p99_ms": pct(self.itl_s, 99),
        }  # fmt: skip

    def lines(self) -> list[str]:
        p = self.percentiles()
        tput = self.output_tokens / self.wall_s if self.wall_s else 0.0
        return [
            f"{self.clients} clients in {self.wall_s:.2f} s: statuses {dict(sorted(self.statuses.items()))}, "
            f"{self.completed} completed, {self.disconnected} disconnected, {self.abandoned} abandoned while queued, "
            f"{self.malformed_refused} malformed refused, "
            f"{self.retried_429} retries after 429",
            f"throughput {tput:.1f} output tok/s ({self.output_tokens} tokens), "
            f"{self.completed / self.wall_s if self.wall_s else 0:.1f} completed req/s",
            f"TTFT p50 {p['ttft_p50_ms']:.0f} ms, p90 {p['ttft_p90_ms']:.0f} ms, p99 {p['ttft_p99_ms']:.0f} ms; "
            f"ITL p50 {p['itl_p50_ms']:.1f} ms, p90 {p['itl_p90_ms']:.1f} ms, p99 {p['itl_p99_ms']:.1f} ms",
        ]


async def _stream_one(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, leave_early: bool,
                      result: LoadResult) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True, "ignore_eos": True}
    start = time.perf_counter()  # TTFT as the user sees it: from the first attempt
    for _ in range(MAX_429_RETRIES):
        if await _stream_attempt(client, url, body, start, leave_early, result):
            return


MAX_429_RETRIES = 100


async def _stream_attempt(client: httpx.AsyncClient, url: str, body: dict[str, Any], start: float,
                          leave_early: bool, result: LoadResult) -> bool:
    """One try; False when refused with 429 (after sleeping its Retry-After)."""
    async with client.stream("POST", url, json=body) as response:
        result.count(response.status_code)
        if response.status_code == 429:
            await response.aread()
            result.retried_429 += 1
            await asyncio.sleep(float(response.headers.get("retry-after", "1")) * random.uniform(0.5, 1.5))
            return False
        if response.status_code != 200:
            await response.aread()
            return True
        result.accepted += 1
        last: float | None = None
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                result.completed += 1
                return True
            chunk = json.loads(line[6:])
            if "error" in chunk:
                result.errors.append(str(chunk["error"]))
                return True
            if not chunk.get("choices"):
                continue
            now = time.perf_counter()
            result.output_tokens += 1
            if last is None:
                result.ttft_s.append(now - start)
            else:
                result.itl_s.append(now - last)
            last = now
            if leave_early:
                result.disconnected += 1
                return True  # closing the response drops the connection mid-stream
    return True


async def _malformed_one(client: httpx.AsyncClient, url: str, body: bytes, result: LoadResult) -> None:
    response = await client.post(url, content=body, headers={"Content-Type": "application/json"})
    result.count(response.status_code)
    if 400 <= response.status_code < 500 and "message" in response.json().get("error", {}):
        result.malformed_refused += 1
    else:
        result.errors.append(f"malformed body {body[:40]!r} got {response.status_code}")


async def _abandon_one(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, result: LoadResult,
                       patience_s: float) -> None:
    """A non-streaming request given up after ``patience_s`` (still queued behind the others)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    try:
        response = await client.post(url, json=body, timeout=patience_s)
    except httpx.TimeoutException:
        result.abandoned += 1
        return
    result.count(response.status_code)
    if response.status_code == 200:
        result.accepted += 1
        result.completed += 1


async def run_load(base_url: str, clients: int = 200, disconnect_fraction: float = 0.2,
                   malformed_fraction: float = 0.1, max_tokens: int = 8, api_key: str | None = None,
                   seed: int = 0, timeout_s: float = 300.0, abandon_fraction: float = 0.0,
                   abandon_after_s: float = 1.0) -> LoadResult:
    """All ``clients`` start at once, each on its own connection: streams read to the end,
    streams left after their first token, malformed bodies, and (``abandon_fraction``)
    non-streaming requests abandoned after ``abandon_after_s`` while they wait."""
    rng = random.Random(seed)
    result = LoadResult(clients=clients)
    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=0)
    roles = ["malformed"] * round(clients * malformed_fraction) + ["leave"] * round(clients * disconnect_fraction)
    roles += ["abandon"] * round(clients * abandon_fraction)
    roles += ["full"] * (clients - len(roles))
    rng.shuffle(roles)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout_s) as client:
        tasks = []
        for i, role in enumerate(roles):
            words = " ".join(rng.choice(("cache", "block", "token", "paged", "prefix", "queue")) for _ in range(8))
            prompt = f"Client {i} asks about {words}:"
            if role == "malformed":
                tasks.append(_malformed_one(client, url, MALFORMED_BODIES[i % len(MALFORMED_BODIES)], result))
            elif role == "abandon":
                tasks.append(_abandon_one(client, url, prompt, max_tokens, result, abandon_after_s))
            else:
                tasks.append(_stream_one(client, url, prompt, max_tokens, role == "leave", result))
        start = time.perf_counter()
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        result.wall_s = time.perf_counter() - start
    result.errors.extend(repr(o) for o in outcomes if isinstance(o, BaseException))
    return result


# ------------------------------------------------------------- server process
def start_server(port: int, *extra: str, env: dict[str, str] | None = None,
                 log_path: Path | None = None) -> subprocess.Popen[bytes]:
    """``engine serve`` on 127.0.0.1:``port`` with the bundled model; returns
    once /health answers 200 (raises with the log tail if it dies first)."""
    cmd = [sys.executable, "-m", "engine.cli", "serve", "--port", str(port), "--log-format", "json", *extra]
    log = open(log_path or os.devnull, "wb")  # noqa: SIM115
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", {proc: log_path}, timeout_s=180)
    except RuntimeError:
        proc.kill()
        raise
    return proc


def wait_healthy(url: str, processes: dict[subprocess.Popen[bytes], Path | None], timeout_s: float) -> None:
    """Return once ``url``/health answers 200; a RuntimeError with the log tail of whichever
    of ``processes`` (process -> its log file, or None) exits first, or on the timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for proc, log_path in processes.items():
            if proc.poll() is not None:
                tail = log_path.read_text(errors="replace")[-3000:] if log_path and log_path.is_file() else ""
                raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}: {tail}")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"{url} did not answer /health within {timeout_s:g} s")


def stop_server(proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return int(proc.returncode)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--disconnect-fraction", type=float, default=0.2)
    parser.add_argument("--malformed-fraction", type=float, default=0.1)
    parser.add_argument("--url", default=None, help="an already running server (default: start one)")
    args, serve_flags = parser.parse_known_args(argv)
    proc = None
    url = args.url
    if url is None:
        port = free_port()
        proc = start_server(port, *(serve_flags or ["--max-model-len", "1024", "--kv-cache-memory-bytes", "64Mi",
                                                    "--max-num-batched-tokens", "512", "--max-num-seqs", "32"]))
        url = f"http://127.0.0.1:{port}"
    try:
        result = asyncio.run(run_load(url, args.clients, args.disconnect_fraction, args.malformed_fraction,
                                      args.max_tokens))
        for line in result.lines():
            print(line)
        state: dict[str, Any] = httpx.get(f"{url}/debug/state", timeout=10).json()
        print(f"after the load: {len(state['requests'])} requests in the engine, kv used {state['kv']['used']}")
    finally:
        if proc is not None:
            stop_server(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
