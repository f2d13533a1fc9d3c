"""The README's figures come from its commands: every ``console`` block line
``$ .venv/bin/engine plan|simulate|replay ...`` is run (in-process, so it takes
seconds) and the lines under it must appear in its output.

An expected line matches an output line that contains its parts (split at ``…``)
in order; ``...`` on its own skips any number of output lines.

The README's answers come from the model on this machine's own kernel plan (the stored or
measured one, as a user's start gets; slow: each loads the model): ``engine generate``
prints the line under it, ``engine serve`` followed by a ``curl`` answers the line under the
curl (its ``jq`` path read from the JSON), and the offline-API ``python`` block prints the
answer in its ``print(...)  # ...`` comment. run-workload's figures live in its own tests.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from bench.bench_server import free_port
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


# ------------------------------------------------------------- the model's answers (slow)
@dataclass
class Answer:
    """A README command whose printed answer is checked: ``engine generate`` (``curl`` None), or
    the ``engine serve`` before a ``curl`` line; ``expected`` is the line the README shows under it."""

    argv: list[str]
    expected: str
    curl: list[str] | None = None


def readme_answers() -> list[Answer]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    answers: list[Answer] = []
    for block in re.findall(r"```console\n(.*?)```", text, flags=re.S):
        lines = block.replace("\\\n", " ").splitlines()
        serve: list[str] | None = None
        for i, line in enumerate(lines):
            if not line.startswith("$ "):
                continue
            argv = shlex.split(line[2:].split("|")[0] if line.startswith("$ curl") else line[2:], comments=True)
            following = lines[i + 1] if i + 1 < len(lines) and not lines[i + 1].startswith("$ ") else None
            if argv[:2] == [".venv/bin/engine", "serve"]:
                serve = argv[1:]
            elif argv[:2] == [".venv/bin/engine", "generate"] and following is not None:
                answers.append(Answer(argv[1:], following))
            elif argv[0] == "curl" and serve is not None and following is not None:
                jq = re.search(r"jq -r '([^']+)'", line)
                assert jq is not None, f"the README's curl pipes into jq -r '<path>': {line!r}"
                answers.append(Answer(serve, following, [*argv, jq.group(1)]))
    return answers


def readme_python_answer() -> tuple[str, str]:
    """The offline-API block and the answer its ``print(...)  # answer`` line names."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    code = next(b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if "llm.chat(" in b)
    printed = re.search(r"^print\(.*\)  # (.+)$", code, flags=re.M)
    assert printed is not None, "the offline-API example names its answer: print(...)  # answer"
    return code, printed.group(1)


ANSWERS = readme_answers()


def test_the_readme_answers_are_found() -> None:
    assert [a.argv[0] for a in ANSWERS] == ["generate", "serve"]
    assert all(a.expected and not a.expected.startswith("$") for a in ANSWERS)
    assert readme_python_answer()[1] == ANSWERS[0].expected


@pytest.mark.slow  # loads the model (and measures its kernel plan on a machine's first start)
def test_the_readme_generate_example_prints_its_answer(capsys: pytest.CaptureFixture[str]) -> None:
    example = next(a for a in ANSWERS if a.curl is None)
    assert main(example.argv) == 0
    assert capsys.readouterr().out.splitlines() == [example.expected]


def _jq(document: object, path: str) -> object:
    """``jq -r PATH`` for the README's paths (``.key`` and ``[index]`` steps)."""
    for key, index in re.findall(r"\.(\w+)|\[(\d+)\]", path):
        document = document[key] if key else document[int(index)]  # type: ignore[index]
    return document




@pytest.mark.slow  # starts engine serve (the bundled model) and sends the README's curl request
def test_the_readme_curl_example_gets_its_answer(tmp_path: Path) -> None:
    import httpx

    from bench.bench_server import start_server

    example = next(a for a in ANSWERS if a.curl is not None)
    assert example.curl is not None
    port = free_port()
    serve = [arg for arg in example.argv[1:] if arg != "serve"]
    server = start_server(port, *serve, log_path=tmp_path / "serve.log")
    try:
        curl = example.curl
        url = next(arg for arg in curl if "/v1/" in arg).replace("127.0.0.1:8000", f"127.0.0.1:{port}")
        headers = dict(curl[i + 1].split(": ", 1) for i, arg in enumerate(curl) if arg == "-H")
        body = json.loads(curl[curl.index("-d") + 1])
        response = httpx.post(f"http://{url}", headers=headers, json=body, timeout=120)
        assert response.status_code == 200, response.text
        assert _jq(response.json(), curl[-1]) == example.expected
    finally:
        server.terminate()
        server.wait(timeout=60)


@pytest.mark.slow  # loads the model through the offline API
def test_the_readme_offline_api_example_prints_its_answer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    code, answer = readme_python_answer()
    monkeypatch.chdir(tmp_path)  # its events="run.jsonl" lands here
    out, namespace = io.StringIO(), {}  # type: ignore[var-annotated]
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, "README.md", "exec"), namespace)  # the README's own example
    finally:
        if "llm" in namespace:
            namespace["llm"].close()  # the example leaves it open, as a script would until exit
    assert out.getvalue().splitlines() == [answer]
    assert (tmp_path / "run.jsonl").stat().st_size > 0
