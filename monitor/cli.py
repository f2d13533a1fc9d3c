"""``monitor URL [--api-key K]`` follows a server; ``monitor replay FILE.jsonl`` replays."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from engine.errors import UserError


def _parser(prog: str, replay: bool) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    if replay:
        parser.add_argument("file", help="a JSONL event recording (engine --events-file)")
        parser.add_argument("--play", action="store_true", help="start playing instead of paused")
        parser.add_argument("--checkpoint-every", type=int, default=500, help="steps between seek checkpoints")
    else:
        parser.add_argument("url", help="server address, e.g. http://127.0.0.1:8000")
        parser.add_argument("--api-key", default=os.environ.get("KVSCOPE_API_KEY"),
                            help="bearer token if the server was started with --api-key")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    from monitor.app import MonitorApp  # Textual import only once arguments parse
    from monitor.sources import HttpFeed, load_timeline

    try:
        if args_list[:1] == ["replay"]:
            args = _parser("monitor replay", replay=True).parse_args(args_list[1:])
            if args.checkpoint_every < 1:
                raise UserError("--checkpoint-every must be at least 1")
            timeline = load_timeline(args.file, checkpoint_every=args.checkpoint_every)
            MonitorApp(timeline=timeline, source_name=str(args.file), autoplay=args.play).run()
        else:
            args = _parser("monitor", replay=False).parse_args(args_list)
            MonitorApp(feed=HttpFeed(args.url, api_key=args.api_key)).run()
    except UserError as exc:
        print(f"monitor: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
