"""The ``engine`` command. Each subcommand lives in its own module under
``engine/cli/commands/`` and exposes ``register(subparsers)``; the module's
``run(args)`` does the work. This file only wires them together and turns
:class:`~engine.errors.UserError` into a one-line message and exit code 2."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence

import engine.cli.commands
from engine.errors import UserError


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's default prints usage too; keep one line
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _ArgumentParser(prog="engine", description="kvscope: an observability-first LLM inference engine")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_ArgumentParser)
    for info in sorted(pkgutil.iter_modules(engine.cli.commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"engine.cli.commands.{info.name}")
        register = getattr(module, "register", None)
        if register is not None:
            register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        print(f"engine {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
