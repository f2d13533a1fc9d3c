"""engine doctor: diagnose a run, with the fix in numbers.

Reads a kvscope recording (.jsonl or .jsonl.gz), a live kvscope server
(http://HOST:PORT: its /events stream for --duration seconds), a live vLLM server
(no /events: its /metrics sampled for --duration seconds, the data-parallel engines'
queues judged for balance) or a vLLM log, and
reports each finding with its evidence (steps, requests, numbers), the likely
cause and the fix: the flag, its new value from the budget formula and, for a
recording or a live run, the simulator's what-if on the same requests.

Exit status: 0 healthy, 1 warnings, 2 critical, 3 the input could not be read
(a wrong flag is 2 too, with argparse's message on stderr).

Examples:
  engine doctor run.jsonl
  engine doctor http://127.0.0.1:8000 --duration 30
  engine doctor vllm-serve.log --json
"""

from __future__ import annotations

import argparse

from engine.cli.plugins import load_plugin
from engine.cli.program import Subparsers
from engine.errors import UserError

ENTRY_POINT_GROUP = "kvscope.doctor"


def register(sub: Subparsers) -> None:
    p = sub.add_parser("doctor", help="diagnose a recording, a live server or a vLLM log, with the fix in numbers",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", metavar="URL|RECORDING|LOG",
                   help="http://HOST:PORT of a kvscope or vLLM server, a recording (.jsonl[.gz]) or a vLLM log")
    p.add_argument("--json", action="store_true", help="print the findings as one JSON object")
    p.add_argument("--duration", type=float, default=10.0, metavar="S",
                   help="live: seconds of the /events stream (a vLLM server: of /metrics scrapes) to judge "
                        "(default 10)")
    p.add_argument("--api-key", default=None, help="live: the server's --api-key")
    p.add_argument("--no-simulate", action="store_true",
                   help="skip the simulator's what-if for each fix (the budget formula's numbers stay)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.duration <= 0:
        raise UserError(f"--duration {args.duration:g}: give a positive number of seconds")
    return int(load_plugin(ENTRY_POINT_GROUP, "engine doctor needs the kvscope doctor package")(args))
