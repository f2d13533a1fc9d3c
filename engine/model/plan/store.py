"""Plans kept between starts: stored beside phase D's profile under a key of everything they depend
on, listed by model for ``engine plan``, and pinned by ``KVSCOPE_KERNEL_PLAN``."""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engine.model.plan.kernel_plan import PLAN_FORMAT_VERSION, KernelPlan
from engine.model.plan.setting import PLAN_ENV, plan_setting

PLANS_FOLDER = "kernel_plans"  # under the profiles folder (engine/model/memory/profile_cache.py)


def plan_key(parts: Mapping[str, Any]) -> str:
    """The stored plan's key: ``parts`` (weights, formats, dtype, ISA, torch, threads) plus
    the sources of this package's modules and of the kernels."""
    from engine.model.attention import cpu_decode
    from engine.model.kernels import cpu_gemv, cpu_layer

    digest = hashlib.sha256()
    for module in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(module.read_bytes())
    kernels = [cpu_gemv.SPEC.module_name(), cpu_layer.SPEC.module_name(), cpu_decode.SPEC.module_name()]
    text = json.dumps({"format": PLAN_FORMAT_VERSION, "plan_source": digest.hexdigest()[:16],
                       "kernels": kernels, **parts},
                      sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def _entry(key: str) -> Path | None:
    from engine.model.memory.profile_cache import profile_root

    root = profile_root()
    return None if root is None else root / PLANS_FOLDER / f"{key}.json"


def load_stored(key: str) -> KernelPlan | None:
    path = _entry(key)
    if path is None or not path.is_file():
        return None
    try:
        plan = KernelPlan.from_json(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None
    plan.source, plan.key = "stored", key
    return plan


def store(plan: KernelPlan) -> None:
    """Write the plan beside the profiles (best effort: a read-only cache still starts)."""
    from engine.model.loading.startup_cache import atomic_write

    path = _entry(plan.key)
    if path is None:
        return
    text = json.dumps({**plan.to_json(), "source": "measured"})
    with contextlib.suppress(OSError):
        atomic_write(path, lambda tmp: Path(tmp).write_text(text))


def stored_for_model(name: str) -> list[KernelPlan]:
    """The stored plans measured for model ``name`` (any flags), newest first: ``engine plan``."""
    path = _entry("x")
    if path is None or not path.parent.is_dir():
        return []
    plans = []
    for entry in path.parent.glob("*.json"):
        try:
            plan = KernelPlan.from_json(json.loads(entry.read_text()))
        except (OSError, ValueError):
            continue
        if plan.model == name:
            plans.append(plan)
    return sorted(plans, key=lambda p: p.measured_at, reverse=True)


def pinned() -> KernelPlan | None:
    """The plan ``KVSCOPE_KERNEL_PLAN`` names (a path or the JSON itself), or None."""
    from engine.errors import UserError

    value = plan_setting()
    if value.lower() in ("", "measure", "off", "0", "false", "no", "auto"):
        return None
    try:
        text = value if value.startswith("{") else Path(value).expanduser().read_text()
        plan = KernelPlan.from_json(json.loads(text))
    except (OSError, ValueError) as exc:
        raise UserError(f"{PLAN_ENV}={value[:80]!r}: {exc}; give a plan JSON (from a phase F event's "
                        "kernel_plan or a stored plan file), its path, 'measure' or 'off'") from None
    plan.source = "pinned"
    return plan


