"""What the user told ``logparse explain`` beyond the log: the model, the device, the
utilization, a kvscope recording to set beside it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Options:
    """What the user told us beyond the log."""

    model: str | None = None
    gpu: str | None = None
    gpu_memory_gib: float | None = None
    gpu_memory_utilization: float | None = None
    profile: str | None = None
