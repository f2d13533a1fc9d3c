"""What this CPU can do, read once: torch's dispatch capability plus the
/proc/cpuinfo flags that decide dtypes and kernels (avx2, avx512f, avx512_bf16,
avx512_vnni, amx).

Machines of one kind differ (Zen 3 has AVX2 only, Zen 4 adds AVX-512 BF16), and
the fastest correct configuration differs with them: bf16 GEMM without native
bf16 instructions is emulated (~1 GFLOP/s against fp32's ~55 on a 2-core Zen 3),
so ``--dtype auto`` picks bf16 only where it is native. Every choice made from
these facts carries its reason, for phase A's event and ``engine plan``.
"""

from __future__ import annotations

import functools
import os
import platform
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The flags kvscope decides anything on, in the order they are reported.
DECISIVE_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
                  "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")


@dataclass(frozen=True, slots=True)
class CpuCapabilities:
    """The CPU facts that matter to kvscope; build with :func:`detect`."""

    model_name: str
    torch_capability: str  # torch.backends.cpu.get_cpu_capability(): "AVX2", "AVX512", "DEFAULT", ...
    flags: frozenset[str] = field(default_factory=frozenset)
    machine: str = "x86_64"

    def has(self, flag: str) -> bool:
        return flag in self.flags

    @property
    def native_bf16(self) -> bool:
        """bf16 dot products in hardware (AVX512-BF16 or AMX-BF16): bf16 GEMM runs at speed."""
        return self.has("avx512_bf16") or self.has("amx_bf16")

    @property
    def isa(self) -> str:
        """The widest vector ISA, as one word: amx, avx512_bf16, avx512, avx2 or baseline."""
        if self.has("amx_bf16"):
            return "amx"
        if self.has("avx512_bf16"):
            return "avx512_bf16"
        if self.has("avx512f"):
            return "avx512"
        if self.has("avx2") and self.has("fma"):
            return "avx2"
        return "baseline"

    @property
    def kernel_key(self) -> str:
        """What a compiled ``-march=native`` kernel depends on: the ISA word plus
        the decisive flags present, so a build never runs on a CPU without them."""
        present = "-".join(f for f in DECISIVE_FLAGS if self.has(f))
        return f"{self.isa}:{present}"

    def summary(self) -> dict[str, Any]:
        return {"model_name": self.model_name, "torch_capability": self.torch_capability, "isa": self.isa,
                "native_bf16": self.native_bf16, "machine": self.machine,
                "flags": [f for f in DECISIVE_FLAGS if self.has(f)]}

    def line(self) -> str:
        flags = " ".join(f for f in DECISIVE_FLAGS if self.has(f)) or "none"
        return f"{self.model_name} ({self.machine}); torch capability {self.torch_capability}; ISA {self.isa}; flags: {flags}"


def parse_cpuinfo(text: str) -> tuple[str, frozenset[str]]:
    """Model name and flag set of the first processor in a /proc/cpuinfo text."""
    model, flags = "unknown CPU", frozenset[str]()
    for raw in text.splitlines():
        key, _, value = raw.partition(":")
        key = key.strip()
        if key == "model name" and model == "unknown CPU":
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = frozenset(value.split())
        if flags and model != "unknown CPU":
            break
    return model, flags


def _torch_capability(flags: frozenset[str] = frozenset()) -> str:
    """torch's own answer when torch is loaded already; otherwise the same answer read
    from the flags (ATen's dispatch rule), so a calculator like ``engine plan`` does
    not pay two seconds of ``import torch`` for one word."""
    if "torch" not in sys.modules and flags:
        return inferred_torch_capability(flags)
    try:
        import torch

        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # torch missing or too old to say: the flags still decide
        return "unknown"


def inferred_torch_capability(flags: frozenset[str]) -> str:
    """The kernel set ATen dispatches to on an x86 CPU with ``flags`` (its cpuinfo
    checks): AVX512 needs F, BW, VL and DQ; AVX2 needs AVX2 and FMA. An
    ``ATEN_CPU_CAPABILITY`` override is honoured, as torch honours it."""
    override = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().upper()
    if override:
        return override
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return "AVX512"
    if {"avx2", "fma"} <= flags:
        return "AVX2"
    return "DEFAULT"


def detect(cpuinfo_text: str | None = None, torch_capability: str | None = None) -> CpuCapabilities:
    """Read this machine (or the given texts, for tests and other machines' reports)."""
    if cpuinfo_text is None:
        return _detect_here()
    model, flags = parse_cpuinfo(cpuinfo_text)
    return CpuCapabilities(model, torch_capability or _torch_capability(), flags, platform.machine())


@functools.cache
def _detect_here() -> CpuCapabilities:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    model, flags = parse_cpuinfo(text)
    if model == "unknown CPU":
        model = platform.processor() or model
    return CpuCapabilities(model, _torch_capability(flags), flags, platform.machine())


@dataclass(frozen=True, slots=True)
class DtypeChoice:
    dtype: str
    reason: str


def choose_cpu_dtype(caps: CpuCapabilities) -> DtypeChoice:
    """``--dtype auto`` on CPU: bf16 where the CPU multiplies it natively (half the
    bytes per decode step, full-speed GEMM), float32 everywhere else (emulated bf16
    GEMM is 50x slower than fp32 and ruins prefill)."""
    if caps.native_bf16:
        which = "AMX-BF16" if caps.has("amx_bf16") else "AVX512-BF16"
        return DtypeChoice("bfloat16", f"this CPU has {which}: bf16 GEMM is native")
    return DtypeChoice("float32", f"ISA {caps.isa} has no native bf16 (no avx512_bf16/amx_bf16): "
                                  "bf16 would be emulated, fp32 is faster")
