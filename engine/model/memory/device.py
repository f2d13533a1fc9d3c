"""Device memory probes and peak measurement.

CUDA: ``torch.cuda.mem_get_info`` for total/free, torch's allocator statistics
for allocated/reserved/peak, and pynvml for driver version and this process's
usage. CPU: the budget's total is ``--device-memory`` GiB or the available
system memory (psutil), and every reading says which.

The phase-D activation peak is measured, never estimated: on CUDA from
``torch.cuda.max_memory_allocated``; on CPU by :class:`TensorBytesTracker`, a
``TorchDispatchMode`` that counts the bytes of every tensor storage created
during the run and subtracts them when the storage is freed.
"""

from __future__ import annotations

import importlib.metadata
import os
import weakref
from dataclasses import asdict, dataclass
from typing import Any

import psutil
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

from engine.modelspec.config import GiB


@dataclass(slots=True)
class MemoryReading:
    """One snapshot of device memory, in bytes."""

    device: str  # "cpu" | "cuda:0"
    total: int
    free: int
    allocated: int  # bytes held by live tensors (torch), where known
    reserved: int  # bytes held by torch's caching allocator (CUDA) / process RSS (CPU)
    peak: int  # torch allocator peak since the last reset (CUDA); 0 on CPU
    source: str  # how ``total`` was obtained
    process_used: int | None = None  # pynvml per-process (CUDA) or RSS (CPU)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        from engine.errors import UserError

        raise UserError("--device cuda: no CUDA device is visible to torch; use --device cpu or auto")
    return torch.device(name)


def device_word(device: torch.device) -> str:
    """The word vLLM puts before "KV cache size" (GPU, CPU, XPU...)."""
    return "GPU" if device.type == "cuda" else device.type.upper()


def _nvml_process_used(index: int) -> tuple[int | None, str | None]:
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        driver = pynvml.nvmlSystemGetDriverVersion()
        pid = os.getpid()
        used = None
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == pid:
                used = int(proc.usedGpuMemory or 0)
        return used, driver if isinstance(driver, str) else driver.decode()
    except Exception:  # NVML absent (CPU machines, containers without the driver library)
        return None, None


def read_memory(device: torch.device, device_memory_gib: float | None = None) -> MemoryReading:
    if device.type == "cuda":
        index = device.index or 0
        free, total = torch.cuda.mem_get_info(index)
        used, _ = _nvml_process_used(index)
        return MemoryReading(
            device=f"cuda:{index}",
            total=int(total),
            free=int(free),
            allocated=int(torch.cuda.memory_allocated(index)),
            reserved=int(torch.cuda.memory_reserved(index)),
            peak=int(torch.cuda.max_memory_allocated(index)),
            source="torch.cuda.mem_get_info",
            process_used=used,
        )
    vm = psutil.virtual_memory()
    rss = psutil.Process().memory_info().rss
    if device_memory_gib is not None:
        total = int(device_memory_gib * GiB)
        # The process's own memory at startup (imports, interpreter) is outside the
        # budget, like a CUDA context: what limits the budget is the machine's free memory.
        free = min(total, int(vm.available))
        source = "--device-memory"
    else:
        total = int(vm.available + rss)
        free = int(vm.available)
        source = "psutil available system memory + process RSS"
    return MemoryReading(device="cpu", total=total, free=free, allocated=0, reserved=int(rss), peak=0,
                         source=source, process_used=int(rss))


def versions(device: torch.device) -> dict[str, Any]:
    out: dict[str, Any] = {"torch": torch.__version__, "device": str(device), "threads": torch.get_num_threads()}
    try:  # the version from metadata: importing triton on a CPU machine costs time and exit-time noise
        out["triton"] = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        out["triton"] = None
    if device.type == "cuda":
        out["cuda"] = torch.version.cuda
        out["gpu_name"] = torch.cuda.get_device_name(device)
        out["driver"] = _nvml_process_used(device.index or 0)[1]
    else:
        out["cpu_count"] = os.cpu_count()
    return out


class TensorBytesTracker(TorchDispatchMode):
    """Counts live tensor-storage bytes created inside the mode; ``peak`` is the
    high-water mark above what was live when tracking began (which is zero:
    only storages created inside are counted). Storage Python objects are
    preserved by torch for as long as the storage lives, so a finaliser on them
    fires exactly when the memory is released."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # False keeps torch from wrapping __torch_dispatch__ in torch._dynamo.disable,
        # whose first call imports torch._dynamo (~1.5 s of startup on a 2-core CPU).
        # Nothing is compiled inside the profile run, so there is nothing to skip.
        return False

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        nbytes = storage.nbytes()
        if nbytes == 0 or key in self._live:
            return
        self._live[key] = nbytes
        self.current += nbytes
        if self.current > self.peak:
            self.peak = self.current
        weakref.finalize(storage, self._release, key, nbytes)

    def _release(self, key: int, nbytes: int) -> None:
        if self._live.pop(key, None) is not None:
            self.current -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # An output on an input's storage (a view, an in-place op) allocated nothing: a slice of a
        # weight mapped before tracking began is not the mapping's bytes created here.
        # An opaque input (a oneDNN-packed weight, engine/model/plan/candidates.py pack_for_mkldnn) has no storage to read.
        inputs: set[int] = set()
        tree_map_only(torch.Tensor, lambda t: None if t.is_mkldnn else inputs.add(t.untyped_storage().data_ptr()),
                      (args, kwargs))
        tree_map_only(torch.Tensor, lambda t: None if t.is_mkldnn or t.untyped_storage().data_ptr() in inputs
                      else self._track(t), out)
        return out


@dataclass(slots=True)
class PeakMeasurement:
    activation_peak_bytes: int
    non_torch_bytes: int
    method: str


def measure_peak(device: torch.device, fn: Any) -> tuple[Any, PeakMeasurement]:
    """Run ``fn()`` and measure its activation peak (bytes above the baseline)
    and non-torch growth (process memory that torch's accounting does not explain)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base_alloc = torch.cuda.memory_allocated(device)
        free_before, _ = torch.cuda.mem_get_info(device)
        reserved_before = torch.cuda.memory_reserved(device)
        result = fn()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base_alloc
        free_after, _ = torch.cuda.mem_get_info(device)
        reserved_growth = torch.cuda.memory_reserved(device) - reserved_before
        non_torch = max(0, (free_before - free_after) - reserved_growth)
        return result, PeakMeasurement(int(peak), int(non_torch), "torch.cuda.max_memory_allocated")
    process = psutil.Process()
    rss_before = process.memory_info().rss
    tracker = TensorBytesTracker()
    with tracker:
        result = fn()
    rss_growth = process.memory_info().rss - rss_before
    # RSS that stays after the run and is not held by live tensors: allocator
    # caches, oneDNN primitive caches, thread pools.
    non_torch = max(0, rss_growth - tracker.current)
    return result, PeakMeasurement(int(tracker.peak), int(non_torch), "TorchDispatchMode tensor-bytes tracking")
