"""glibc malloc kept from returning a step's activations to the kernel between steps.

A prefill step allocates tensors of several MB (a 2,048-token step's gate/up output
is 12-25 MB) and frees them a few ops later. glibc serves blocks over its mmap
threshold with fresh ``mmap`` pages and returns freed heap tops over its trim
threshold, so every large tensor of every step was faulted in and zeroed again:
copies, SiLU and multiplies ran at page-fault speed. Raising both thresholds lets
freed blocks be reused. A 2,048-token prefill step of SmolLM2 took 2.03-2.29 s
before and 1.61-1.69 s after (AMD Zen 4, AVX512-BF16, 2 threads); ``aten::copy_``
fell from 225 to 99 ms of it, SiLU-and-multiply from 233 to 120 ms.

The cost is resident memory the process keeps after a burst: freed blocks up to
``TRIM_THRESHOLD`` stay mapped for the next step (never more than the largest step's
activations). ``KVSCOPE_MALLOC_TUNE=0`` leaves glibc's defaults.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import platform

MALLOC_TUNE_ENV = "KVSCOPE_MALLOC_TUNE"

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
# glibc refuses an mmap threshold over HEAP_MAX_SIZE / 2: 32 MiB on 64-bit hosts.
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 512 << 20
TOP_PAD = 64 << 20


@functools.cache
def tune_for_steps() -> str:
    """Set glibc's thresholds once per process; what was set, or why not (phase A's event says it)."""
    if os.environ.get(MALLOC_TUNE_ENV, "1") == "0":
        return f"glibc defaults ({MALLOC_TUNE_ENV}=0)"
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "not glibc: the allocator's defaults"
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = all(libc.mallopt(param, value) == 1 for param, value in
                 ((_M_MMAP_THRESHOLD, MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD), (_M_TOP_PAD, TOP_PAD)))
    except (OSError, AttributeError) as exc:
        return f"glibc defaults (mallopt unavailable: {exc})"
    if not ok:
        return "glibc defaults (mallopt refused a value)"
    return (f"glibc mallopt: mmap threshold {MMAP_THRESHOLD >> 20} MiB, trim threshold {TRIM_THRESHOLD >> 20} MiB, "
            f"top pad {TOP_PAD >> 20} MiB (step tensors reuse freed memory; {MALLOC_TUNE_ENV}=0 turns it off)")
