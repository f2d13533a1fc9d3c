"""``logparse``: explain a vLLM log line by line, against kvscope's own profile.

    logparse explain LOG [--model M] [--gpu G | --gpu-memory GiB] [--gpu-memory-utilization U]
                         [--profile events.jsonl] [--json | --markdown]
    logparse summary LOG [same options]      ledger and checks only
    logparse diff A.log B.log [--json | --markdown]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from engine.budget.memory import parse_gib
from engine.cli.program import program, run_program
from engine.errors import UserError
from logparse.explain import Explanation, explain
from logparse.options import Options
from logparse.render import render_diff, render_json, render_markdown, render_terminal


def _add_output(p: argparse.ArgumentParser) -> None:
    group = p.add_mutually_exclusive_group()
    group.add_argument("--json", action="store_true", help="one JSON object: records, checks, plan, ledger")
    group.add_argument("--markdown", action="store_true", help="Markdown report")


def _add_context(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model preset, HF folder with config.json, or GGUF (default: the log's model)")
    gpu = p.add_mutually_exclusive_group()
    gpu.add_argument("--gpu", help="GPU preset (h100, a100-40gb, l40s, rtx-4090 ...) when the log lacks the total")
    gpu.add_argument("--gpu-memory", help="device memory in GiB when the log lacks the total")
    p.add_argument("--gpu-memory-utilization", type=float, help="when the log does not print it")
    p.add_argument("--profile", help="a kvscope events.jsonl recording to compare phase by phase (a warning when "
                                     "it ran another model than the log's)")


def build_parser() -> argparse.ArgumentParser:
    parser, sub = program("logparse", "Explain a vLLM startup log against kvscope's own plan.")
    p = sub.add_parser("explain", help="every line: phase, meaning, numbers; ledger, checks, kvscope's plan")
    p.add_argument("log")
    _add_context(p)
    _add_output(p)
    p.set_defaults(func=run)
    p = sub.add_parser("summary", help="ledger and checks only")
    p.add_argument("log")
    _add_context(p)
    _add_output(p)
    p.set_defaults(func=run)
    p = sub.add_parser("diff", help="two startups side by side: each figure under the phrase vLLM prints it with, "
                                    "the file names as column heads")
    p.add_argument("a")
    p.add_argument("b")
    _add_output(p)
    p.set_defaults(func=run)
    return parser


def _options(args: argparse.Namespace) -> Options:
    util = getattr(args, "gpu_memory_utilization", None)
    if util is not None and not 0 < util <= 1:
        raise UserError(f"--gpu-memory-utilization {util}: must be in (0, 1]")
    gpu_memory = getattr(args, "gpu_memory", None)
    return Options(
        model=getattr(args, "model", None),
        gpu=getattr(args, "gpu", None),
        gpu_memory_gib=parse_gib(gpu_memory, "--gpu-memory") if gpu_memory is not None else None,
        gpu_memory_utilization=util,
        profile=getattr(args, "profile", None),
    )


def _load(path: str, options: Options, keep_records: bool = True) -> Explanation:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{path}: no such log file; give the path of a vLLM log")
    if options.gpu:
        from engine.budget.memory import gpu_preset

        gpu_preset(options.gpu)  # fail early with the list of presets
    return explain(p, options, keep_records=keep_records)


def run(args: argparse.Namespace) -> int:
    if args.command == "diff":
        a, b = _load(args.a, Options()), _load(args.b, Options())
        text = render_diff(a, b, as_json=args.json, markdown=args.markdown)
        if text is not None:
            sys.stdout.write(text if text.endswith("\n") else text + "\n")
        return 0
    summary = args.command == "summary"
    exp = _load(args.log, _options(args), keep_records=not summary)
    if args.json:
        sys.stdout.write(render_json(exp, summary=summary) + "\n")
    elif args.markdown:
        sys.stdout.write(render_markdown(exp, summary=summary))
    else:
        render_terminal(exp, summary=summary)
    return failed_status(exp)


def failed_status(exp: Explanation) -> int:
    """1 when a check failed or a failure was recognised (so CI pipelines stop), else 0;
    warnings and checks the log lacked figures for do not count."""
    return 1 if any(c.ok is False and c.kind != "warning" for c in exp.checks) else 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_program(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
