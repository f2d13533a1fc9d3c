"""How every kvscope command line runs: ``engine``, ``monitor`` and ``logparse``.

One style for all three: a parser with subcommands, each subcommand's
``set_defaults(func=run)``; argparse's errors on one line; and one exit
convention: a :class:`~engine.errors.UserError` prints ``PROG COMMAND: error: ...``
and exits with its code (2), Ctrl-C exits 130, a closed pipe (``| head``) exits 0.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn, TypeAlias

from engine.errors import UserError


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse's default prints the usage too; keep one line
        self.exit(2, f"{self.prog}: error: {message}\n")


# What every subcommand's ``register`` takes (argparse's action is generic in typeshed only).
Subparsers: TypeAlias = "argparse._SubParsersAction[ArgumentParser]"


def program(prog: str, description: str) -> tuple[ArgumentParser, Subparsers]:
    """A top-level parser and the subparsers action its subcommands register on."""
    parser = ArgumentParser(prog=prog, description=description)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=ArgumentParser)
    return parser, sub


def run_program(parser: argparse.ArgumentParser, argv: Sequence[str] | None,
                explain_unknown: Callable[[Sequence[str]], str | None] | None = None) -> int:
    """Parse ``argv``, run the chosen subcommand's ``func`` and map failures to exit codes.
    ``explain_unknown`` may word the error for arguments the parser does not know."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        message = (explain_unknown(unknown) if explain_unknown else None) or (
            f"unrecognized arguments: {' '.join(unknown)}")
        where = f"{parser.prog} {args.command}" if getattr(args, "command", None) else parser.prog
        parser.exit(2, f"{where}: error: {message}\n")
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        return int(func(args) or 0)
    except UserError as exc:
        print(f"{parser.prog} {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except BrokenPipeError:
        return 0
    except KeyboardInterrupt:
        return 130
