"""The ``engine`` command: ``main`` wires the subcommands under ``commands`` (one module each,
``register(subparsers)`` + ``run(args)``).

- ``main``: the parser and every subcommand wired
- ``__main__``: ``python -m engine.cli``
- ``program``: how every kvscope command line runs and fails (shared with monitor and logparse)
- ``flags``: flags copied from ``EngineConfig``, the workload flags
- ``vllm_flags``: vLLM flags kvscope lacks, explained
- ``exporters``: the trace and exporter flags
- ``plugins``, ``dashboard``: the entry points (the dashboard, the doctor)
- ``commands``: one module per subcommand
"""

from engine.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
