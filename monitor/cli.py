"""``monitor follow URL`` follows a server (``monitor URL`` for short);
``monitor replay FILE.jsonl`` replays a recording."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from engine.cli.program import program, run_program
from engine.errors import UserError

SUBCOMMANDS = ("follow", "replay")


def build_parser() -> argparse.ArgumentParser:
    parser, sub = program("monitor", "The kvscope dashboard: follow a server live, or replay a recording.")
    p = sub.add_parser("follow", help="follow a running server's /events stream")
    p.add_argument("url", help="server address, e.g. http://127.0.0.1:8000")
    p.add_argument("--api-key", default=os.environ.get("KVSCOPE_API_KEY"),
                   help="bearer token if the server was started with --api-key")
    p.set_defaults(func=follow)
    p = sub.add_parser("replay", help="replay a JSONL recording (engine ... --events FILE)")
    p.add_argument("file", help="a JSONL event recording (engine ... --events FILE)")
    p.add_argument("--play", action="store_true", help="start playing instead of paused")
    p.add_argument("--checkpoint-every", type=int, default=500, help="steps between seek checkpoints")
    p.set_defaults(func=replay)
    return parser


def follow(args: argparse.Namespace) -> int:
    from monitor.app import MonitorApp  # Textual loads only once arguments parse
    from monitor.sources import HttpFeed

    MonitorApp(feed=HttpFeed(args.url, api_key=args.api_key)).run()
    return 0


def replay(args: argparse.Namespace) -> int:
    from monitor.app import MonitorApp
    from monitor.sources import load_timeline

    if args.checkpoint_every < 1:
        raise UserError(f"--checkpoint-every {args.checkpoint_every}: must be at least 1")
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
