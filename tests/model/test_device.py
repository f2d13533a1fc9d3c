"""Memory readings and the measured activation peak on CPU."""

from __future__ import annotations

import torch

from engine.budget.memory import GiB
from engine.model.memory.device import (
    TensorBytesTracker,
    device_word,
    measure_peak,
    read_memory,
    resolve_device,
)

MiB = 1024**2


def test_tracker_measures_the_high_water_mark_of_live_tensors() -> None:
    tracker = TensorBytesTracker()
    with tracker:
        a = torch.ones(4096, 1024)  # 16 MiB
        b = a @ torch.ones(1024, 2048)  # + 8 MiB operand, + 32 MiB result
        del a
        c = b.relu()  # + 32 MiB while b is alive
        del b, c
    assert tracker.peak == 64 * MiB
    assert tracker.current == 0


def test_peak_grows_with_the_step_size() -> None:
    weight = torch.randn(256, 256)

    def step(tokens: int) -> torch.Tensor:
        x = torch.randn(tokens, 256)
        return (x @ weight).relu().sum()

    device = torch.device("cpu")
    _, small = measure_peak(device, lambda: step(512))
    _, large = measure_peak(device, lambda: step(4096))
    assert small.activation_peak_bytes > 0
    assert large.activation_peak_bytes > 4 * small.activation_peak_bytes


def test_cpu_reading_names_its_source() -> None:
    cpu = resolve_device("cpu")
    reading = read_memory(cpu)
    assert reading.total > reading.free > 0 and "psutil" in reading.source
    budget = read_memory(cpu, device_memory_gib=4.0)
    assert budget.total == 4 * GiB and budget.source == "--device-memory"
    assert device_word(cpu) == "CPU"
