"""What the GPUs of this machine say through NVML, behind one small interface.

:class:`GpuReader` is the interface the GPU panel reads: ``read()`` returns a
:class:`GpuSnapshot`, either devices or the reason there are none (the library is
not found, no device, NVML refused). :class:`NvmlReader` is the real one (pynvml from
nvidia-ml-py); :class:`RecordedGpuReader` plays back readings saved as JSON (the
tests, and a machine without GPUs). ``engine_ledger`` (the engine's own memory
ledger: weights, activation peak, KV pool, CUDA graphs) is set beside a device's
used memory by :func:`ledger_gap`: the rest is "outside the ledger" (other
processes, the allocator's fragmentation, the CUDA context).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from engine.errors import UserError

# The ledger quantities that live in device memory, under EngineView's ledger keys.
LEDGER_PARTS = (("weights_bytes", "weights"), ("activation_peak_bytes", "activation peak"),
                ("kv_pool_bytes", "KV pool"), ("cuda_graph_bytes", "graphs"), ("non_torch_bytes", "non-torch"))


@dataclass(slots=True)
class GpuProcess:
    pid: int
    name: str
    used_bytes: int


@dataclass(slots=True)
class GpuDevice:
    """One device's reading. None where NVML does not report the quantity."""

    index: int
    name: str
    memory_used: int
    memory_total: int
    utilization_pct: float | None = None
    memory_utilization_pct: float | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    temperature_c: float | None = None
    sm_clock_mhz: float | None = None
    memory_clock_mhz: float | None = None
    processes: list[GpuProcess] = field(default_factory=list)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GpuDevice:
        fields = {k: v for k, v in data.items() if k in cls.__dataclass_fields__ and k != "processes"}
        return cls(**fields, processes=[GpuProcess(**p) for p in data.get("processes", [])])


@dataclass(slots=True)
class GpuSnapshot:
    """Devices, or why there are none (``unavailable``)."""

    devices: list[GpuDevice] = field(default_factory=list)
    unavailable: str | None = None
    driver: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GpuSnapshot:
        return cls(devices=[GpuDevice.from_dict(d) for d in data.get("devices", [])],
                   unavailable=data.get("unavailable"), driver=str(data.get("driver", "")))


class GpuReader(Protocol):
    every_s: float  # how often a panel should read it

    def read(self) -> GpuSnapshot: ...


def ledger_gap(device: GpuDevice, ledger: dict[str, float] | None) -> tuple[list[tuple[str, int]], int | None]:
    """The ledger's parts that hold bytes and what the device uses beyond them
    ("outside the ledger"; None without a ledger). A ledger larger than the used
    memory (the engine is on another device, or not started) is no split either."""
    if not ledger:
        return [], None
    parts = [(label, int(ledger.get(key) or 0)) for key, label in LEDGER_PARTS if ledger.get(key)]
    outside = device.memory_used - sum(b for _, b in parts)
    if not parts or outside < 0:
        return [], None
    return parts, outside


def device_index(name: str | None) -> int:
    """``cuda:1`` -> 1; the first device for ``cuda`` or anything else."""
    tail = (name or "").rpartition(":")[2]
    return int(tail) if tail.isdigit() else 0


class NvmlReader:
    """The machine's GPUs through pynvml. NVML is initialised once, on the first read;
    every failure becomes the snapshot's ``unavailable`` reason, never an exception."""

    every_s = 1.0

    def __init__(self) -> None:
        self._nvml: Any = None
        self._failure: str | None = None

    def _init(self) -> str | None:
        if self._nvml is not None or self._failure is not None:
            return self._failure
        try:
            import pynvml
        except ImportError:
            self._failure = "pynvml not installed (pip install nvidia-ml-py)"
            return self._failure
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError_LibraryNotFound:
            self._failure = "NVML library not found (libnvidia-ml.so: no NVIDIA driver on this machine)"
        except pynvml.NVMLError_DriverNotLoaded:
            self._failure = "NVIDIA driver not loaded (no device)"
        except pynvml.NVMLError as exc:
            self._failure = f"NVML refused: {exc}"
        else:
            self._nvml = pynvml
        return self._failure

    def read(self) -> GpuSnapshot:
        failure = self._init()
        if failure is not None:
            return GpuSnapshot(unavailable=failure)
        nv = self._nvml
        try:
            count = nv.nvmlDeviceGetCount()
            driver = _text(nv.nvmlSystemGetDriverVersion())
        except nv.NVMLError as exc:
            return GpuSnapshot(unavailable=f"NVML refused: {exc}")
        if count == 0:
            return GpuSnapshot(unavailable="no NVIDIA device (NVML found none)", driver=driver)
        return GpuSnapshot(devices=[self._device(i) for i in range(count)], driver=driver)

    def _device(self, index: int) -> GpuDevice:
        nv = self._nvml
        handle = nv.nvmlDeviceGetHandleByIndex(index)
        memory = nv.nvmlDeviceGetMemoryInfo(handle)
        device = GpuDevice(index=index, name=_text(nv.nvmlDeviceGetName(handle)),
                           memory_used=int(memory.used), memory_total=int(memory.total))
        rates = _maybe(lambda: nv.nvmlDeviceGetUtilizationRates(handle))
        if rates is not None:
            device.utilization_pct, device.memory_utilization_pct = float(rates.gpu), float(rates.memory)
        device.power_w = _maybe(lambda: nv.nvmlDeviceGetPowerUsage(handle) / 1000.0)
        device.power_limit_w = _maybe(lambda: nv.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000.0)
        device.temperature_c = _maybe(lambda: float(nv.nvmlDeviceGetTemperature(handle, nv.NVML_TEMPERATURE_GPU)))
        device.sm_clock_mhz = _maybe(lambda: float(nv.nvmlDeviceGetClockInfo(handle, nv.NVML_CLOCK_SM)))
        device.memory_clock_mhz = _maybe(lambda: float(nv.nvmlDeviceGetClockInfo(handle, nv.NVML_CLOCK_MEM)))
        processes = _maybe(lambda: list(nv.nvmlDeviceGetComputeRunningProcesses(handle)), [])
        for p in processes or []:
            name = _maybe(lambda p=p: _text(nv.nvmlSystemGetProcessName(p.pid)), "") or ""
            used = p.usedGpuMemory if isinstance(p.usedGpuMemory, int) else 0
            device.processes.append(GpuProcess(pid=int(p.pid), name=name.rsplit("/", 1)[-1], used_bytes=used))
        return device


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _maybe(read: Any, default: Any = None) -> Any:
    """A quantity some devices do not report (NVML_ERROR_NOT_SUPPORTED): the default."""
    try:
        return read()
    except Exception:  # pynvml raises one class per NVML error code
        return default


class RecordedGpuReader:
    """Readings saved as JSON (``{"snapshots": [GpuSnapshot.to_dict(), ...]}``), one per
    :meth:`read`, the last repeated; ``every_s`` the pace they were taken at."""

    def __init__(self, snapshots: list[GpuSnapshot], every_s: float = 1.0) -> None:
        if not snapshots:
            raise ValueError("a recorded GPU reader needs at least one snapshot")
        self.snapshots = snapshots
        self.every_s = every_s
        self.position = 0

    @classmethod
    def load(cls, path: str | Path, every_s: float = 1.0) -> RecordedGpuReader:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise UserError(f"{path}: cannot read GPU readings ({exc}); pass a JSON file of NVML snapshots") from exc
        snapshots = [GpuSnapshot.from_dict(s) for s in data.get("snapshots", [])]
        if not snapshots:
            raise UserError(f"{path}: no snapshots; pass a JSON file {{\"snapshots\": [...]}} of NVML readings")
        return cls(snapshots, every_s)

    def read(self) -> GpuSnapshot:
        snapshot = self.snapshots[min(self.position, len(self.snapshots) - 1)]
        self.position += 1
        return snapshot
