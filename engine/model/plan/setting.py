"""``KVSCOPE_KERNEL_PLAN``, the switch: unset (the stored plan, or one measured now), ``off`` (the
fallback constants), ``measure`` (measure again), or a pinned plan (a path or the JSON itself,
read by engine/model/plan/store.py ``pinned``); and what ``--dtype auto`` means with the plan on."""

from __future__ import annotations

import os

PLAN_ENV = "KVSCOPE_KERNEL_PLAN"


def plan_setting() -> str:
    """``KVSCOPE_KERNEL_PLAN``: ``""`` (stored or measured), ``off``, ``measure``, or a pinned plan."""
    return os.environ.get(PLAN_ENV, "").strip()


def plan_enabled() -> bool:
    return plan_setting().lower() not in ("off", "0", "false", "no")


# ``--dtype auto`` on CPU with the plan on (engine/startup/resolve.py resolve_dtype, ``engine plan``).
AUTO_DTYPE = "float32"
AUTO_DTYPE_REASON = ("the kernel plan runs float32 activations and picks each projection's implementation by "
                     "measurement (bf16 GEMM over bf16 weights and bf16 prefill attention where bf16 is native and "
                     "measured fastest; the fused fp32 decode layer where it wins; float32 logits always); "
                     f"{PLAN_ENV}=off runs the ISA rule")

