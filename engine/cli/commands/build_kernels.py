"""``engine build-kernels``: compile (or find in the cache) every CPU kernel for
this CPU type and torch version, so no engine start waits on a compiler.
``make setup`` runs it; startup also builds in the background if it was skipped."""

from __future__ import annotations

import argparse
import time

from engine.cli.program import Subparsers
from engine.model.cpu_caps import detect
from engine.model.kernels.background import build_all
from engine.model.kernels.build import kernel_cache_root


def register(sub: Subparsers) -> None:
    p = sub.add_parser("build-kernels", help="compile the CPU kernels into the shared kernel cache")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    print(f"CPU: {detect().line()}")
    print(f"kernel cache: {kernel_cache_root()}")
    start = time.perf_counter()
    reports = build_all(lambda text: print(f"  {text}", flush=True))
    for r in reports:
        where = r.path or r.reason or ""
        print(f"{r.name}: {r.status} in {r.seconds:.1f} s ({where})")
    print(f"done in {time.perf_counter() - start:.1f} s")
    # A kernel that cannot be built is not an error: the engine runs its torch path.
    return 0
