"""The GPUs of this machine through NVML: utilisation, memory against the engine's
ledger (the rest is outside the ledger), power, temperature, clocks and the
processes holding memory; or why there are no readings."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from rich.text import Text
from textual.widgets import Static

from monitor.gpu import GpuDevice, GpuReader, GpuSnapshot, ledger_gap
from monitor.widgets.spark import spark

GIB = 1024**3
HISTORY = 60  # utilisation readings kept for the sparkline
LEDGER_STYLES = ("blue", "magenta", "green", "yellow", "cyan")


def gib(value: float) -> str:
    return f"{value / GIB:.1f} GiB"


def _maybe(value: float | None, unit: str, fmt: str = ".0f") -> str:
    return "n/a" if value is None else f"{value:{fmt}}{unit}"


LedgerFn = Callable[[], tuple[dict[str, float] | None, str, int]]


def no_ledger(why: str) -> LedgerFn:
    return lambda: (None, why, 0)


class GpuPanel(Static):
    """Reads ``reader`` at its pace (``reader.every_s``; once at mount; never without
    a reader) and draws each device. ``ledger`` returns the engine's memory ledger when
    the source has one (kvscope's EngineView), the reason when it has none (vLLM's
    metrics carry none), and the device index the engine runs on."""

    def __init__(self, reader: GpuReader | None = None, ledger: LedgerFn | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.reader = reader
        self.ledger = ledger or no_ledger("none from this source")
        self.snapshot: GpuSnapshot | None = None
        self.history: dict[int, deque[float]] = {}

    def on_mount(self) -> None:
        if self.reader is None:
            self.update(Text("GPU (NVML)  not read (--no-gpu)", style="dim"))
            return
        self.poll()
        self.set_interval(self.reader.every_s, self.poll)

    def poll(self) -> None:
        assert self.reader is not None
        self.snapshot = self.reader.read()
        for device in self.snapshot.devices:
            self.history.setdefault(device.index, deque(maxlen=HISTORY)).append(device.utilization_pct or 0.0)
        self.redraw()

    def redraw(self) -> None:
        """Draw the last reading again (the ledger may have changed)."""
        if self.snapshot is None:
            return
        ledger, why, on_device = self.ledger()
        self.update_snapshot(self.snapshot, ledger, why, {i: list(h) for i, h in self.history.items()}, on_device)

    def update_snapshot(self, snapshot: GpuSnapshot, ledger: dict[str, float] | None,
                        ledger_source: str = "", history: dict[int, list[float]] | None = None,
                        ledger_device: int = 0) -> None:
        width = max(40, (self.size.width or 120) - 4)
        text = Text("GPU (NVML)  ", style="bold")
        if snapshot.unavailable is not None:
            text.append(f"no readings: {snapshot.unavailable}", style="yellow")
            self.update(text)
            return
        text.append(f"driver {snapshot.driver} · {len(snapshot.devices)} device(s)", style="dim")
        for device in snapshot.devices:
            text.append("\n")
            own = ledger if device.index == ledger_device else None
            why = ledger_source if device.index == ledger_device else "the engine runs on another device"
            text.append_text(self._device(device, own, why, width, (history or {}).get(device.index, [])))
        self.update(text)

    @staticmethod
    def _device(device: GpuDevice, ledger: dict[str, float] | None, ledger_source: str, width: int,
                history: list[float]) -> Text:
        text = Text(f"[{device.index}] {device.name}  ", style="bold")
        text.append(f"util {_maybe(device.utilization_pct, '%')}  ")
        text.append(spark(history, 20), style="cyan")
        text.append(f"  power {_maybe(device.power_w, ' W')}/{_maybe(device.power_limit_w, ' W')}"
                    f"  {_maybe(device.temperature_c, '°C')}"
                    f"  SM {_maybe(device.sm_clock_mhz, ' MHz')}  mem {_maybe(device.memory_clock_mhz, ' MHz')}")
        total = max(1, device.memory_total)
        bar_width = max(20, width - 8)
        parts, outside = ledger_gap(device, ledger)
        text.append(f"\n  memory {gib(device.memory_used)} of {gib(device.memory_total)} used\n  ")
        drawn = 0
        legend = Text("  ")
        for (label, size), style in zip(parts, LEDGER_STYLES, strict=False):
            cells = round(size / total * bar_width)
            text.append("█" * cells, style=style)
            drawn += cells
            legend.append("█ ", style=style).append(f"{label} {gib(size)}  ")
        if outside is not None:
            cells = max(0, round(max(0, outside) / total * bar_width))
            text.append("▓" * cells, style="red")
            drawn += cells
            legend.append("▓ ", style="red").append(f"outside the ledger {gib(outside)} (other processes, "
                                                    "fragmentation, CUDA context)")
        else:
            cells = round(device.memory_used / total * bar_width)
            text.append("▓" * cells, style="white")
            drawn += cells
            legend.append("▓ used  ", style="white")
            legend.append(f"no engine ledger ({ledger_source or 'none from this source'}): "
                          "the used memory cannot be split", style="dim")
        text.append("░" * max(0, bar_width - drawn), style="dim")
        text.append("\n").append_text(legend)
        if device.processes:
            text.append("\n  processes: ")
            text.append("  ".join(f"{p.pid} {p.name or '?'} {gib(p.used_bytes)}" for p in device.processes))
        return text
