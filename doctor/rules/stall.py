"""An engine core that had work and finished no step within the stall limit
(``engine.stalled``): one finding per stall.
"""

from __future__ import annotations

from collections.abc import Iterable

from doctor.facts import RunFacts, StallFacts
from doctor.rules.finding import CRITICAL, Finding

# What a stalled core was doing, by its heartbeat's phase (engine/heartbeat.py), and where to look.
_STALL_CAUSES = {
    "forward": "the model's forward did not return: a kernel, a collective between ranks or the device hung "
               "(the dump's stack of the engine thread names the call)",
    "schedule": "the scheduler did not return (pure Python: the dump's stack names the loop)",
    "update": "updating the requests with the step's tokens or publishing its events did not return (a blocked "
              "event sink, such as a recording on a full or hung disk, is one way)",
    "detokenize": "detokenising or matching stop strings did not return",
    "idle": "the engine loop stopped turning between steps with requests waiting (a command it ran, such as a "
            "profiler start or stop, did not return)",
}


def _stall_finding(stall: StallFacts) -> Finding:
    lasted = (f"it stepped again after {stall.recovered_after_s:,.1f} s (engine.recovered)"
              if stall.recovered_after_s is not None else "it had not stepped again when the events end")
    after = f"after step {stall.last_step}" if stall.last_step is not None else "before its first step"
    evidence = [f"engine core {stall.rank} finished no step for {stall.stalled_s:,.1f} s (limit {stall.limit_s:,.1f} s)"
                f" with work pending, in its {stall.phase or '?'} phase, {after}", lasted]
    if stall.requests:
        shown = ", ".join(stall.requests[:5]) + (f" and {len(stall.requests) - 5} more" if len(stall.requests) > 5 else "")
        evidence.append(f"{len(stall.requests)} requests held: {shown}")
    if stall.dump:
        evidence.append(f"stacks of every thread, the last step and each request's blocks: {stall.dump}")
    return Finding("engine_stalled", CRITICAL, f"engine stalled: core {stall.rank} made no progress for "
                   f"{stall.stalled_s:,.0f} s in {stall.phase or '?'}", evidence,
                   _STALL_CAUSES.get(stall.phase, "the engine core made no progress"), [], stall.last_step,
                   stall.last_step, {"rank": stall.rank, "phase": stall.phase, "stalled_s": stall.stalled_s,
                                     "limit_s": stall.limit_s, "recovered_after_s": stall.recovered_after_s,
                                     "requests": len(stall.requests), "dump": stall.dump},
                   place=f"rank {stall.rank}, {after}")


def engine_stalled(facts: RunFacts) -> Iterable[Finding]:
    """An engine core had work and finished no step within the stall limit (``engine.stalled``,
    engine/serve/stall.py): alive, so no failure ended it, but making no progress (vllm#41725,
    PR#36451). One finding per stall: the rank, what the step was doing, how long, the
    requests it held and the dump that has its stacks."""
    for stall in facts.stalls:
        yield _stall_finding(stall)
