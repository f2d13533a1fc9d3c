"""``engine demo``: what ``make demo`` runs.

Until the live engine lands this prints the memory plans of the bundled model
and of the background's Llama-3.1-8B on H100 example.
"""

from __future__ import annotations

import argparse

from engine.cli import build_parser


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="the README's first command: a guided tour on the bundled model")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    parser = build_parser()
    for argv in (
        ["plan", "--gpu", "l4", "--max-model-len", "8192"],
        ["plan", "--model", "llama-3.1-8b", "--gpu", "h100-80gb", "--gpu-memory-utilization", "0.92",
         "--max-model-len", "32768", "--weights", "14.957", "--activation-peak", "4.0", "--non-torch", "0.3"],
    ):
        print(f"$ engine {' '.join(argv)}")
        sub_args = parser.parse_args(argv)
        sub_args.func(sub_args)
        print()
    return 0
