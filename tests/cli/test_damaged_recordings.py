"""A recording damaged in its types, not its bytes, through every reader: engine replay
(--verify and --at), engine doctor and monitor replay each print one line naming the
file, the line and the field, and exit non-zero, with no traceback."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine.cli.main import main as engine_main
from monitor.cli import main as monitor_main
from tests.paths import SAMPLES

# A monitor replay that read a damaged file as good would start the dashboard: fail, don't hang.
pytestmark = pytest.mark.timeout(60)

REAL_RUN = SAMPLES / "smollm2_run.jsonl"  # a real run of the bundled model
LINES = REAL_RUN.read_text().splitlines()
ROWS = [json.loads(line) for line in LINES]
FIRST_STEP = next(i for i, row in enumerate(ROWS) if row.get("type") == "step")
PHASE_E_END = next(i for i, row in enumerate(ROWS)
                   if row.get("type") == "startup.phase" and row["phase"] == "E" and row["status"] == "end")
STEP_INDEX = ROWS[FIRST_STEP]["index"]


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda row: row.__setitem__(key, value)


def _first_allocation_null(row: dict[str, Any]) -> None:
    row["allocated"][next(iter(row["allocated"]))] = None


def _phase_value_a_string(row: dict[str, Any]) -> None:
    row["data"]["num_blocks"] = "many"


# kind -> (line index, edit, the field the message names)
DAMAGE: dict[str, tuple[int, Callable[[dict[str, Any]], None], str]] = {
    "a string where a number goes": (FIRST_STEP, _set("t", "NaN"), "t"),
    "null where an object goes": (FIRST_STEP, _set("allocated", None), "allocated"),
    "null where a list goes": (FIRST_STEP, _first_allocation_null, "allocated[...]"),
    "a config that is not an object": (0, _set("config", None), "config"),
    "a header field of the wrong type": (0, _set("version", "1"), "version"),
    "a phase's number as a string": (PHASE_E_END, _phase_value_a_string, "data.num_blocks"),
}

READERS: dict[str, Callable[[Path], int]] = {
    "engine replay --verify": lambda path: engine_main(["replay", str(path), "--verify"]),
    "engine replay --at": lambda path: engine_main(["replay", str(path), "--at", str(STEP_INDEX)]),
    "engine doctor": lambda path: engine_main(["doctor", str(path)]),
    "monitor replay": lambda path: monitor_main(["replay", str(path)]),
}


def test_the_undamaged_run_reads_in_every_reader(capsys: pytest.CaptureFixture[str]) -> None:
    """The readers accept the real run itself (the damage below is what they refuse)."""
    assert engine_main(["replay", str(REAL_RUN), "--verify"]) == 0
    assert engine_main(["replay", str(REAL_RUN), "--at", str(STEP_INDEX)]) == 0
    assert engine_main(["doctor", str(REAL_RUN)]) in (0, 1, 2)  # the exit status is the worst finding's severity
    assert "error" not in capsys.readouterr().err


@pytest.mark.parametrize("reader", list(READERS))
@pytest.mark.parametrize("kind", list(DAMAGE))
def test_type_damage_is_one_line_naming_file_line_and_field(kind: str, reader: str, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    index, edit, field = DAMAGE[kind]
    row = json.loads(LINES[index])
    edit(row)
    lines = list(LINES)
    lines[index] = json.dumps(row)
    damaged = tmp_path / "damaged.jsonl"
    damaged.write_text("\n".join(lines) + "\n")

    code = READERS[reader](damaged)

    out, err = capsys.readouterr()
    assert code != 0
    assert "Traceback" not in out + err
    message = err.strip()
    assert "\n" not in message, message
    assert f"error: {damaged}: line {index + 1}: " in message, message
    assert f"field `{field}`: expected " in message, message
