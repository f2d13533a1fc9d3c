"""The CPU default ``--max-num-batched-tokens`` from a plan's measured prefill speed."""

from __future__ import annotations

from engine.model.plan.kernel_plan import KernelPlan

# The CPU default token budget where the plan's measured speed fits more than vLLM-CPU's 2,048
# tokens (engine/startup/resolve.py CPU_PROMPT_STEP_TOKENS, the floor) in about this many seconds of
# projections (attention, norms and sampling add ~15-25 %), so the budget scales with a fast CPU.
# Tighter step targets (0.1 s; one second on the steps with decodes alone) were measured and
# dropped: CPU_PROMPT_STEP_TOKENS' comment has the figures.
STEP_TARGET_S = 1.0
BUDGET_MIN, BUDGET_MAX, BUDGET_QUANTUM = 128, 8192, 64


def derived_batch_budget(plan: KernelPlan, num_layers: int) -> tuple[int, str] | None:
    """The CPU default ``--max-num-batched-tokens`` from the plan's prefill speed: one step's
    projections near ``STEP_TARGET_S``; None when the plan has no biggest-class timings."""
    per_token = plan.prefill_us_per_token(num_layers)
    if per_token is None or per_token <= 0:
        return None
    raw = STEP_TARGET_S * 1e6 / per_token
    tokens = int(min(BUDGET_MAX, max(BUDGET_MIN, raw // BUDGET_QUANTUM * BUDGET_QUANTUM)))
    return tokens, (f"derived from the kernel plan's prefill speed ({1e6 / per_token:,.0f} tok/s of projections, "
                    f"{per_token:,.1f} µs a token over {num_layers} layers): {tokens:,} tokens keep one step's "
                    f"projections near {STEP_TARGET_S * 1000:.0f} ms (attention and sampling add ~15-25 %)")

