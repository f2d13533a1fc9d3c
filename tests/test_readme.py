"""The README's figures come from its commands: every ``console`` block line
``$ .venv/bin/engine plan|simulate|replay ...`` is run (in-process, so it takes
seconds) and the lines under it must appear in its output.

An expected line matches an output line that contains its parts (split at ``…``)
in order; ``...`` on its own skips any number of output lines. Commands that
need the model or a server (generate, serve, run-workload) are not run here;
their figures live in the tests of those commands.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

import pytest

from engine.cli import main
from tests.paths import ROOT

RUN_HERE = ("plan", "simulate", "replay")


@dataclass
class Example:
    argv: list[str]
    expected: list[str] = field(default_factory=list)


def readme_examples() -> list[Example]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    examples: list[Example] = []
    for block in re.findall(r"```console\n(.*?)```", text, flags=re.S):
        current: Example | None = None
        lines = block.replace("\\\n", " ").splitlines()
        for line in lines:
            if line.startswith("$ "):
                argv = shlex.split(line[2:], comments=True)
                current = None
                if argv[0] == ".venv/bin/engine" and argv[1] in RUN_HERE:
                    current = Example(argv[1:])
                    examples.append(current)
            elif current is not None:
                current.expected.append(line)
    return examples


def _matches(expected: str, line: str) -> bool:
    position = 0
    for part in (p.strip() for p in expected.split("…")):
        found = line.find(part, position)
        if found < 0:
            return False
        position = found + len(part)
    return True


def assert_output_shows(expected: list[str], output: list[str]) -> None:
    at = 0
    for want in expected:
        if want.strip() == "...":
            continue
        while at < len(output) and not _matches(want, output[at]):
            at += 1
        assert at < len(output), f"README line not in the output (in order): {want!r}"
        at += 1


EXAMPLES = readme_examples()


def test_the_readme_has_runnable_examples() -> None:
    assert {e.argv[0] for e in EXAMPLES} == set(RUN_HERE)
    assert all(e.expected for e in EXAMPLES)


@pytest.mark.parametrize("example", EXAMPLES, ids=[" ".join(e.argv)[:70] for e in EXAMPLES])
def test_readme_figures_come_from_the_command(example: Example, capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    assert main(example.argv) == 0
    assert_output_shows(example.expected, capsys.readouterr().out.splitlines())


def test_the_matcher_fails_on_a_figure_the_output_lacks() -> None:
    output = ["  steps 386   simulated 7.86 s   (4,983 steps/s of wall time)", "  peak pool use 26.1 %"]
    assert_output_shows(["...", "  steps 386   simulated 7.86 s …", "peak pool use 26.1 %"], output)
    with pytest.raises(AssertionError, match=r"26\.0"):
        assert_output_shows(["peak pool use 26.0 %"], output)
    with pytest.raises(AssertionError):  # order matters
        assert_output_shows(["peak pool use 26.1 %", "steps 386"], output)
