"""``engine startup-report``: ``vllm bench startup``'s report and JSON from kvscope recordings'
phase events (engine/events/exporters/bench_outputs.py), so kvscope's starts sit beside vLLM's."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from engine.cli.program import Subparsers
from engine.errors import UserError

DESCRIPTION = """Read the startup.phase events of one or more recordings (engine serve / run-workload /
generate --events run.jsonl) and print vllm bench startup's report: average and percentile startup
and compilation time for cold starts and warm ones (a warm start reused the stored phase-D
measurement), then each phase A-G. --output-json writes vllm bench startup's JSON."""


def register(sub: Subparsers) -> None:
    p = sub.add_parser("startup-report", help="vllm bench startup's report from recordings' phase events",
                       description=DESCRIPTION)
    p.add_argument("recordings", nargs="+", help="events files (.jsonl), one start each")
    p.add_argument("--output-json", metavar="PATH", help="write vllm bench startup's result JSON here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from engine.events import read_events
    from engine.events.exporters.bench_outputs import startup_lines, startup_result, startup_run

    runs = []
    for path in args.recordings:
        try:
            recording = read_events(path)
        except (OSError, ValueError) as exc:
            raise UserError(f"{path}: {exc}") from exc
        start = startup_run(recording.events, path)
        if start is None:
            raise UserError(f"{path}: no finished startup (phase G) in its events; record a whole start "
                            "(engine serve/run-workload --events FILE)")
        runs.append(start)
    result = startup_result(runs)
    for line in startup_lines(result):
        print(line)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.output_json}")
    return 0
