"""A vLLM log as findings: logparse reads it (its patterns, its failures with the
fix in numbers) and this module words the result as the doctor's findings, so
``engine doctor vllm.log`` and ``engine doctor run.jsonl`` answer alike.

vLLM's log has no steps or request ids (a V1 log has the stats line at most),
so these findings carry line numbers and the figures vLLM printed instead.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from doctor.rules import CRITICAL, WARNING, Finding
from logparse.explain import Check, Explanation, explain
from logparse.patterns import FIGURE_NAMES

# logparse's check ids under the doctor's rule names (the same failure, read from a log).
RULE_OF_CHECK = {"max_seq_len_exceeds_kv": "startup_refused", "no_cache_blocks": "startup_refused",
                 "free_below_request": "startup_oom", "oom": "startup_oom", "oom_sampler": "startup_oom",
                 "oom_graph_capture": "startup_oom",
                 "preemption": "pool_binds"}
CAUSES = {"startup_refused": "the pool cannot hold one --max-model-len request: lower the context, raise the memory "
                             "cap, use an fp8 KV cache or add tensor parallelism",
          "startup_oom": "another process holds device memory, or the cap is too close to 1.0: give the engine "
                         "the device to itself and back the cap off by a few points",
          "pool_binds": "more work admitted than the KV pool holds: the same prefill is paid twice"}
# The printed figures quoted as evidence, in the order vLLM prints them.
EVIDENCE_FIGURES = ("total_gib", "gpu_memory_utilization", "weights_gib", "peak_activation_gib", "kv_cache_gib",
                    "kv_cache_tokens", "gpu_blocks", "max_model_len", "max_concurrency")


def _printed_figures(explanation: Explanation) -> str | None:
    parts = []
    for key in EVIDENCE_FIGURES:
        value = explanation.printed.get(key)
        if value is None and key in explanation.facts:
            value = str(explanation.facts[key])
        if value is not None:
            name = FIGURE_NAMES[key]
            parts.append(f"{name.vllm} {value}{' ' + name.unit if name.unit and name.unit != 'x' else name.unit}")
    return "vLLM printed: " + "; ".join(parts) if parts else None


def finding_of(check: Check, explanation: Explanation) -> Finding:
    rule = RULE_OF_CHECK.get(check.id, f"vllm_{check.id}")
    evidence = [f"line {check.line}: {check.detail}" if check.line else check.detail]
    figures = _printed_figures(explanation)
    if figures:
        evidence.append(figures)
    numbers: dict[str, Any] = {"line": check.line, "check": check.id}
    numbers.update({k: explanation.facts[k] for k in EVIDENCE_FIGURES if k in explanation.facts})
    return Finding(rule, CRITICAL if check.kind == "failure" else WARNING, check.title, evidence,
                   CAUSES.get(rule, check.title), [dataclasses.replace(fix) for fix in check.fix], numbers=numbers)


def diagnose_log(path: str | Path) -> list[Finding]:
    """The log's failures and warnings as findings (a log of a healthy start gives none)."""
    explanation = explain(path, keep_records=False)
    return [finding_of(c, explanation) for c in explanation.checks
            if c.ok is False and c.kind in ("failure", "warning")]
