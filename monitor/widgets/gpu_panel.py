"""The GPUs of this machine through NVML: utilisation, memory against the engine's
ledger (the rest is outside the ledger), power, temperature, clocks and the
processes holding memory; or why there are no readings."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from monitor.gpu import GpuDevice, GpuSnapshot, ledger_gap
from monitor.widgets.spark import spark

GIB = 1024**3
LEDGER_STYLES = ("blue", "magenta", "green", "yellow", "cyan")


def gib(value: float) -> str:
    return f"{value / GIB:.1f} GiB"


def _maybe(value: float | None, unit: str, fmt: str = ".0f") -> str:
    return "n/a" if value is None else f"{value:{fmt}}{unit}"


class GpuPanel(Static):
    """``update_snapshot(snapshot, ledger, history)``: ``ledger`` is the engine's
    memory ledger when the source has one (kvscope), None otherwise (vLLM's
    metrics carry none); ``history`` maps device index to recent utilisation."""

    def update_snapshot(self, snapshot: GpuSnapshot, ledger: dict[str, float] | None,
                        ledger_source: str = "", history: dict[int, list[float]] | None = None) -> None:
        width = max(40, (self.size.width or 120) - 4)
        text = Text("GPU (NVML)  ", style="bold")
        if snapshot.unavailable is not None:
            text.append(f"no readings: {snapshot.unavailable}", style="yellow")
            self.update(text)
            return
        text.append(f"driver {snapshot.driver} · {len(snapshot.devices)} device(s)", style="dim")
        for device in snapshot.devices:
            text.append("\n")
            text.append_text(self._device(device, ledger, ledger_source, width, (history or {}).get(device.index, [])))
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
            legend.append("no engine ledger from this source" + (f" ({ledger_source})" if ledger_source else "")
                          + ": the used memory cannot be split", style="dim")
        text.append("░" * max(0, bar_width - drawn), style="dim")
        text.append("\n").append_text(legend)
        if device.processes:
            text.append("\n  processes: ")
            text.append("  ".join(f"{p.pid} {p.name or '?'} {gib(p.used_bytes)}" for p in device.processes))
        return text
