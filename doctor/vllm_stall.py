"""A real vLLM's stall, judged from its ``/metrics``: ``engine_stalled`` where an engine
reports requests running while its token counters (``vllm:prompt_tokens_total`` +
``vllm:generation_tokens_total``) stay frozen (engine/events/folds/frozen_counters.py, the fold
``monitor vllm`` shows too). ``engine doctor http://...`` samples for ``--duration``
seconds; a run frozen for :data:`~engine.events.folds.frozen_counters.FROZEN_S` is critical, one
frozen for the whole of a shorter sample a warning (a prefill that long also freezes them:
sample longer to tell).
"""

from __future__ import annotations

from doctor.rules.finding import CRITICAL, WARNING, Finding
from doctor.vllm_dp import VllmFleet, engine_name
from engine.events.folds.frozen_counters import FROZEN_S, FrozenCounters

# Frozen for less than this says nothing: one decode step under load, or any prefill, takes that long.
MIN_FROZEN_S = 5.0


def stall_findings(fleet: VllmFleet, duration_s: float) -> list[Finding]:
    """One finding per engine whose counters stayed frozen with requests running for
    ``min(FROZEN_S, duration_s)`` (the whole sample when it is shorter than FROZEN_S), and never
    less than :data:`MIN_FROZEN_S`."""
    frozen = FrozenCounters(frozen_s=max(min(FROZEN_S, duration_s * 0.9), MIN_FROZEN_S))
    for round_ in fleet.rounds:
        for engine, (_, running, _) in round_.readings.items():
            if engine in round_.tokens:
                frozen.observe(round_.t, str(engine), running, round_.tokens[engine])
    findings = []
    for run in frozen.runs:
        name = engine_name(int(run.engine))
        long_enough = run.seconds >= FROZEN_S
        ended = ("its counters moved again at the end of it" if run.recovered
                 else "still frozen at the last scrape")
        evidence = [f"{name} reported {run.running} requests running while vllm:prompt_tokens_total and "
                    f"vllm:generation_tokens_total stayed at {run.tokens:,.0f} for {run.seconds:,.0f} s; {ended}",
                    "/health and /metrics answered throughout: a stall they do not report (vllm#41725, PR#36451)"]
        cause = ("the engine core is alive but takes no step (a hung kernel, a collective waiting on a rank, a "
                 "deadlocked scheduler)" if long_enough else
                 f"either a stall or one prefill longer than the {run.seconds:,.0f} s sampled (vLLM counts a prompt's "
                 f"tokens when its prefill completes): sample for {FROZEN_S:g} s or more (--duration) to tell")
        findings.append(Finding(
            "engine_stalled", CRITICAL if long_enough else WARNING,
            f"engine stalled: {name} has requests running and counted no token for {run.seconds:,.0f} s",
            evidence, cause, [], numbers={"engine": int(run.engine), "frozen_s": run.seconds, "running": run.running,
                                          "tokens": run.tokens, "recovered": run.recovered},
            place=f"{engine_name(int(run.engine))}, {run.seconds:,.0f} s of scrapes"))
    return findings
