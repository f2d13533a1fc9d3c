"""The startup rules: refused because the context does not fit the KV pool, and out of
memory at a startup phase (weights, profile run, graph capture, warm-up).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any

from doctor.facts import RunFacts
from doctor.rules.finding import CRITICAL, Finding
from engine.budget.fixes import Fix
from engine.budget.memory import GiB


def startup_refused(facts: RunFacts) -> Iterable[Finding]:
    """Startup refuses because the context does not fit (phase B/E's budget check). The
    fixes are the ones the check recorded on the failed phase (flag, current, proposed,
    why); a recording made before it recorded them has only the sentence."""
    failed = facts.failed_phase
    if failed is None or not failed.reason or "out of memory" in failed.reason.lower():
        return
    reason = failed.reason
    if not failed.fixes and failed.phase not in ("B", "E") and "kv cache" not in reason.lower():
        return
    fixes = [Fix.from_json(row) for row in failed.fixes] or fixes_from_old_sentence(reason)
    kv = facts.kv_cache
    numbers: dict[str, Any] = {"phase": failed.phase}
    if kv is not None and kv.kv_cache_tokens is not None:
        numbers["kv_cache_tokens"] = kv.kv_cache_tokens
    yield Finding("startup_refused", CRITICAL, "startup refused: the context does not fit the KV pool",
                  [f"phase {failed.phase} ({failed.name}) failed: {reason}"],
                  "the pool cannot hold one --max-model-len request: lower the context, raise the memory cap, "
                  "use an fp8 KV cache or add tensor parallelism", fixes, numbers=numbers)


# The fallback for recordings made before the budget check recorded its fixes (startup.phase
# ``fixes``, engine/budget/fixes.py): their refusal is a sentence, "...; try raise ... or lower
# ... to 16 or less" (or "...; raise ..."), split before each verb. Nothing else parses a fix.
_OPTION_SPLIT = re.compile(r" or (?=(?:raise|lower|increasing|decreasing|use|a smaller|add)\b)")


def fixes_from_old_sentence(reason: str) -> list[Fix]:
    """An old recording's refusal sentence as fixes: each option's first ``--flag`` and the
    option's words as its why, values unknown (the sentence does not separate them)."""
    _, _, advice = reason.partition("; try ")
    if not advice:
        _, _, advice = reason.rpartition("; ")
    fixes = []
    for option in filter(None, (part.strip() for part in _OPTION_SPLIT.split(advice))):
        flag = next((w for w in option.split() if w.startswith("--")), option)
        fixes.append(Fix(flag, None, None, option))
    return fixes


_OOM_WHERE = {"C": "while loading the weights", "D": "in the profile run (the worst-case step)",
              "E": "allocating the KV pool", "F": "at CUDA-graph capture", "G": "at the first large batch (warm-up)"}


def startup_oom(facts: RunFacts) -> Iterable[Finding]:
    """Out of memory at graph capture or the first large batch."""
    failed = facts.failed_phase
    if failed is None or not failed.reason or "out of memory" not in failed.reason.lower():
        return
    evidence = [f"phase {failed.phase} ({failed.name}) failed: {failed.reason}"]
    reading = failed.memory_before or {}
    numbers: dict[str, Any] = {"phase": failed.phase}
    total, free, reserved = reading.get("total"), reading.get("free"), reading.get("reserved")
    others = None
    if total and free is not None and reserved is not None:
        others = max(0, total - free - reserved)
        numbers["held_by_others_bytes"] = others
        evidence.append(f"before phase {failed.phase}: {free / GiB:.2f} of {total / GiB:.2f} GiB free, "
                        f"{reserved / GiB:.2f} GiB this engine's, {others / GiB:.2f} GiB held by other processes")
    util = float(facts.flag("gpu_memory_utilization", 0.9))
    fixes = []
    if failed.phase == "F":
        sizes = facts.flag("cuda_graph_sizes") or []
        fixes.append(Fix("--enforce-eager", None, None, "skips CUDA-graph capture and its memory (slower decode)"))
        if len(sizes) > 1:
            fixes.append(Fix("--cuda-graph-sizes", max(sizes), max(sizes) // 2,
                             f"capture {len(sizes) - 1} sizes instead of {len(sizes)}: the largest graph's buffers go"))
    if failed.phase == "D":
        tokens = int(facts.flag("max_num_batched_tokens", 8192))
        fixes.append(Fix("--max-num-batched-tokens", tokens, tokens // 2,
                         "halves the profile run's activations"))
    backed_off = max(0.05, util - 0.05 - (others / total if others and total else 0.0))
    fixes.append(Fix("--gpu-memory-utilization", util, f"{math.floor(backed_off * 100) / 100:.2f}",
                     "leaves room outside the budget" + (" and for the other processes' memory" if others else "")))
    yield Finding("startup_oom", CRITICAL, f"out of memory {_OOM_WHERE.get(failed.phase, 'at startup')}", evidence,
                  "another process holds device memory, or the cap is too close to 1.0: give the engine the device "
                  "to itself and back the cap off by a few points", fixes, numbers=numbers)
