"""``monitor follow URL`` follows a server (``monitor URL`` for short; several URLs: the
fleet view); ``monitor vllm URL`` watches a vLLM server through its /metrics and KV
events; ``monitor record URL... --out FILE`` records them; ``monitor replay FILE.jsonl``
replays a recording (kvscope's, or one ``monitor record`` made)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from engine.cli.program import program, run_program
from engine.errors import UserError

if TYPE_CHECKING:  # the monitor's modules load only once arguments parse
    from monitor.external import KvEndpoint
    from monitor.gpu import GpuReader

SUBCOMMANDS = ("follow", "replay", "vllm", "record")


def build_parser() -> argparse.ArgumentParser:
    parser, sub = program("monitor", "The kvscope dashboard: follow a server live, or replay a recording.")
    p = sub.add_parser("follow", help="follow a running server's /events stream (several URLs: the fleet view)")
    p.add_argument("url", nargs="+", help="server address, e.g. http://127.0.0.1:8000 (kvscope or vLLM)")
    p.add_argument("--api-key", default=os.environ.get("KVSCOPE_API_KEY"),
                   help="bearer token if the server was started with --api-key")
    _add_polling(p)
    p.set_defaults(func=follow)
    p = sub.add_parser("vllm", help="watch a vLLM server: its /metrics and, with --kv-events, its KV cache events")
    p.add_argument("url", help="the vLLM server, e.g. http://127.0.0.1:8000")
    p.add_argument("--kv-events", metavar="ENDPOINT",
                   help="its KV-event publisher's endpoint as vLLM's --kv-events-config names it: tcp://*:5557 "
                        "(vLLM binds: the monitor connects to the server's host) or tcp://THIS_HOST:5557 (vLLM "
                        "connects: the monitor binds it); default: what GET /kv_event_sources lists")
    p.add_argument("--kv-replay", metavar="ENDPOINT",
                   help="its replay endpoint (replay_endpoint), to fill gaps, e.g. tcp://127.0.0.1:5558")
    _add_polling(p)
    p.set_defaults(func=watch_vllm)
    p = sub.add_parser("record", help="record servers' /metrics (and KV events) as a JSONL recording")
    p.add_argument("url", nargs="+", help="servers to scrape, e.g. http://127.0.0.1:8000")
    p.add_argument("--out", required=True, help="the recording to write, e.g. fleet.jsonl")
    p.add_argument("--kv-events", metavar="ENDPOINT", help="the first server's KV-event publisher (tcp://HOST:5557)")
    p.add_argument("--kv-replay", metavar="ENDPOINT", help="its replay endpoint (tcp://HOST:5558)")
    p.add_argument("--duration", type=float, help="seconds to record (default: until Ctrl-C)")
    _add_polling(p)
    p.set_defaults(func=record)
    p = sub.add_parser("replay", help="replay a JSONL recording (engine ... --events FILE)")
    p.add_argument("file", help="a JSONL event recording (engine ... --events FILE)")
    p.add_argument("--play", action="store_true", help="start playing instead of paused")
    p.add_argument("--checkpoint-every", type=int, default=500, help="steps between seek checkpoints")
    p.set_defaults(func=replay)
    return parser


def _add_polling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--interval", type=float, default=1.0, help="seconds between /metrics polls (default 1)")
    p.add_argument("--timeout", type=float, default=2.0, help="seconds a poll may take before the replica is down")
    p.add_argument("--gpu-readings", metavar="FILE",
                   help="NVML readings recorded as JSON instead of this machine's NVML (monitor/gpu.py's format)")
    p.add_argument("--no-gpu", action="store_true", help="do not read NVML")


def _check_polling(args: argparse.Namespace) -> None:
    if args.interval <= 0 or args.timeout <= 0:
        raise UserError(f"--interval {args.interval:g} / --timeout {args.timeout:g}: both must be positive seconds")


def _gpu_reader(args: argparse.Namespace) -> GpuReader | None:
    from monitor.gpu import NvmlReader, RecordedGpuReader

    if getattr(args, "no_gpu", False):
        return None
    return RecordedGpuReader.load(args.gpu_readings) if getattr(args, "gpu_readings", None) else NvmlReader()


def _kv(args: argparse.Namespace, source: str, discover: bool = False) -> list[KvEndpoint]:
    """The KV-event endpoint to subscribe to: ``--kv-events`` as vLLM's ``--kv-events-config``
    names it (vLLM's bind/connect rule applied in mirror), or with ``discover`` and no flag,
    what the server's ``GET /kv_event_sources`` (vLLM 0.32 and later) lists."""
    from urllib.parse import urlsplit

    from monitor.external import KvEndpoint
    from monitor.kv_events import replay_side, subscriber_side

    host = urlsplit(source).hostname or "127.0.0.1"
    if not args.kv_events:
        if args.kv_replay:
            raise UserError("--kv-replay needs --kv-events (the publisher's endpoint)")
        return _discovered_kv(source, host, args.timeout) if discover else []
    endpoint, bind = subscriber_side(args.kv_events, host)
    return [KvEndpoint(source, endpoint, replay_side(args.kv_replay, host) if args.kv_replay else None, bind=bind)]


def _discovered_kv(source: str, host: str, timeout_s: float) -> list[KvEndpoint]:
    """The first (DP rank 0's) source ``GET /kv_event_sources`` lists; none when the server
    has no such route (vLLM before it, or kvscope without --kv-events-config)."""
    import httpx

    from monitor.external import KvEndpoint
    from monitor.kv_events import discovered_side, replay_side, sources_listed

    try:
        response = httpx.get(source.rstrip("/") + "/kv_event_sources", timeout=timeout_s)
    except httpx.HTTPError as exc:
        print(f"monitor: {source}/kv_event_sources: {exc}; KV events need --kv-events ENDPOINT", file=sys.stderr)
        return []
    if response.status_code != 200:
        print(f"monitor: {source}/kv_event_sources answered {response.status_code}; KV events need "
              "--kv-events ENDPOINT", file=sys.stderr)
        return []
    sources = sources_listed(response.json())
    if not sources:
        return []
    first = sources[0]
    if len(sources) > 1:
        print(f"monitor: {len(sources)} KV-event sources (one per DP rank); following rank "
              f"{first.get('data_parallel_rank') or 0}'s", file=sys.stderr)
    endpoint, bind = discovered_side(first["endpoint"], host)
    replay = first.get("replay_endpoint")
    return [KvEndpoint(source, endpoint, replay_side(replay, host) if replay else None, bind=bind,
                       topic=str(first.get("topic") or ""))]


def follow(args: argparse.Namespace) -> int:
    from monitor.poller import KVSCOPE, VLLM, base_url, detect_kinds

    _check_polling(args)
    urls = [base_url(u) for u in args.url]
    kinds = detect_kinds(urls, timeout_s=args.timeout)
    if len(urls) == 1 and kinds[urls[0]] != VLLM:
        # kvscope (or nothing answering yet: kvscope's feed reconnects with its reason on screen)
        return _follow_kvscope(urls[0], args.api_key, _gpu_reader(args))
    if len(urls) == 1:
        return _run_fleet(args, urls, kinds, detail=urls[0])
    return _run_fleet(args, urls, {u: k for u, k in kinds.items() if k in (KVSCOPE, VLLM)})


def _follow_kvscope(url: str, api_key: str | None, gpu: GpuReader | None = None) -> int:
    from engine.events.feed import HttpFeed
    from monitor.app import MonitorApp  # Textual loads only once arguments parse

    MonitorApp(feed=HttpFeed(url, api_key=api_key), gpu=gpu).run()
    return 0


def _run_fleet(args: argparse.Namespace, urls: list[str], kinds: dict[str, str], detail: str | None = None,
               kv: list[KvEndpoint] | None = None) -> int:
    """The fleet view; Enter on a kvscope replica opens its full dashboard, and quitting
    that comes back to the fleet (its states kept, its pollers restarted)."""
    from monitor.external import ExternalFeed
    from monitor.fleet_app import FleetApp

    states = None
    gpu = _gpu_reader(args)
    while True:
        feed = ExternalFeed(urls, kv=kv or [], interval_s=args.interval, timeout_s=args.timeout)
        app = FleetApp(feed=feed, gpu=gpu, detail=detail, states=states, kinds=kinds)
        chosen = app.run()
        if not chosen:
            return 0
        states, detail = app.states, None
        _follow_kvscope(chosen, getattr(args, "api_key", None), gpu)


def watch_vllm(args: argparse.Namespace) -> int:
    from monitor.poller import VLLM, base_url

    _check_polling(args)
    url = base_url(args.url)
    return _run_fleet(args, [url], {url: VLLM}, detail=url, kv=_kv(args, url, discover=True))


def record(args: argparse.Namespace) -> int:
    import asyncio

    from monitor.record import record as record_sources

    _check_polling(args)
    if args.duration is not None and args.duration <= 0:
        raise UserError(f"--duration {args.duration:g}: must be positive seconds")
    out = Path(args.out)
    if not out.parent.is_dir():
        raise UserError(f"--out {out}: no such folder {out.parent}")
    kv = _kv(args, args.url[0])

    def progress(count: int) -> None:
        print(f"\r{out}: {count} events", end="", file=sys.stderr, flush=True)

    try:
        count = asyncio.run(record_sources(args.url, out, kv=kv, interval_s=args.interval, timeout_s=args.timeout,
                                           duration_s=args.duration, progress=progress))
    except KeyboardInterrupt:
        print(f"\n{out}: stopped", file=sys.stderr)
        return 0
    print(f"\n{out}: {count} events from {len(args.url)} source(s)", file=sys.stderr)
    return 0


def replay(args: argparse.Namespace) -> int:
    from monitor.app import MonitorApp
    from monitor.external import load_external_timeline
    from monitor.sources import load_timeline

    if args.checkpoint_every < 1:
        raise UserError(f"--checkpoint-every {args.checkpoint_every}: must be at least 1")
    external = load_external_timeline(args.file)
    if external is not None:  # a recording `monitor record` made: the fleet view, seekable
        from monitor.fleet_app import FleetApp

        detail = external.sources[0] if len(external.sources) == 1 else None
        FleetApp(timeline=external, detail=detail, source_name=str(args.file)).run()
        return 0
    timeline = load_timeline(args.file, checkpoint_every=args.checkpoint_every)
    MonitorApp(timeline=timeline, source_name=str(args.file), autoplay=args.play).run()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] not in SUBCOMMANDS and not args[0].startswith("-"):
        args.insert(0, "follow")  # `monitor URL`, the short form
    return run_program(build_parser(), args)


if __name__ == "__main__":
    sys.exit(main())
