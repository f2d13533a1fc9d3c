"""The ``engine`` command: :func:`main` wires the subcommands under
:mod:`engine.cli.commands` (one module each, ``register(subparsers)`` + ``run(args)``);
:mod:`~engine.cli.program` is how every kvscope command line runs and fails (shared
with monitor and logparse); :mod:`~engine.cli.flags` defines vLLM's flag names once;
:mod:`~engine.cli.dashboard` finds the monitor through its entry point."""

from engine.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
