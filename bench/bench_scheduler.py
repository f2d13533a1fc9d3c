"""Scheduler steps/s for ``make bench``: both traces, all three event modes, as JSON lines."""

from __future__ import annotations

import argparse

from engine.cli.commands.bench_scheduler import run


def main() -> int:
    return run(argparse.Namespace(trace="all", events="all", repeats=5, json=True))


if __name__ == "__main__":
    raise SystemExit(main())
