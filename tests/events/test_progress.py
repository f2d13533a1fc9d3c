"""The console face of startup.progress: a bar on a terminal, periodic lines on a pipe."""

from __future__ import annotations

import io

from engine.events import StartupPhase, StartupProgress
from engine.events.exporters.progress import ProgressPrinter, progress_text


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_pipe_gets_the_first_line_then_one_per_interval_and_the_last() -> None:
    lines: list[str] = []
    now = [0.0]
    printer = ProgressPrinter(io.StringIO(), lines.append, interval_s=5.0, clock=lambda: now[0])
    for done in range(1, 273):
        now[0] = done * 0.1  # 27 s of loading
        printer(StartupProgress(phase="C", what="weights", done=done, total=272, unit="tensors"))
    assert lines[0] == "phase C weights: 1/272 tensors (0%)" and lines[-1] == "phase C weights: 272/272 tensors (100%)"
    assert len(lines) == 1 + 5 + 1  # the first, one per 5 s of the 27, the last
    printer(StartupProgress(phase="D", what="profile run", done=0, total=1, unit="steps"))
    assert len(lines) == 7  # a begin/end marker says nothing on a pipe


def test_a_terminal_gets_one_bar_redrawn_in_place() -> None:
    screen = Terminal()
    printer = ProgressPrinter(screen, lambda _: None)
    for done in (1, 2, 3):
        printer(StartupProgress(phase="F", what="warm-up", done=done, total=3, unit="step shapes"))
    out = screen.getvalue()
    assert out.count("\r") == 3 and out.endswith("phase F warm-up: 3/3 step shapes (100%)\x1b[K\n")
    assert "████████████████████████" in out.splitlines()[-1]
    printer(StartupProgress(phase="F", what="kernel builds", done=0, total=None, unit="builds"))
    printer(StartupPhase(phase="F", name="graphs_compile", status="end"))  # the phase ends the open line
    assert screen.getvalue().endswith("phase F kernel builds: 0 builds\x1b[K\n")


def test_text_without_a_total() -> None:
    assert progress_text(StartupProgress(phase="C", what="weights", done=1234, unit="tensors")) == (
        "phase C weights: 1,234 tensors")
