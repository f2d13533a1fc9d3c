"""The ``engine`` command. Each subcommand lives in its own module under
``engine/cli/commands/`` and exposes ``register(subparsers)``; the module's
``run(args)`` does the work. This file only wires them together; how a command
line runs and fails is :mod:`engine.cli.program`'s, shared with monitor and logparse."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence

from engine.gc_policy import defer_collections

defer_collections()  # before a command loads torch: see engine/gc_policy.py

import engine.cli.commands  # noqa: E402
from engine.cli.program import program, run_program  # noqa: E402
from engine.cli.vllm_flags import explain_unknown  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser, sub = program("engine", "kvscope: an observability-first LLM inference engine")
    for info in sorted(pkgutil.iter_modules(engine.cli.commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"engine.cli.commands.{info.name}")
        register = getattr(module, "register", None)
        if register is not None:
            register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return run_program(build_parser(), argv, explain_unknown=explain_unknown)


if __name__ == "__main__":
    sys.exit(main())
