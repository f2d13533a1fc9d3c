"""Three views of an :class:`~logparse.explain.Explanation`: a rich terminal view
(annotated lines coloured by phase), Markdown, and JSON."""

from __future__ import annotations

import json
import sys
from pathlib import PurePath
from typing import Any, NamedTuple, TextIO

from rich.console import Console
from rich.table import Table
from rich.text import Text

from engine.events.ledger import label as ledger_label
from logparse.check import Check
from logparse.explain import Explanation
from logparse.patterns import FIGURE_NAMES, LEDGER_KEYS
from logparse.startup_phases import render_times

PHASE_STYLES = {
    "A": "cyan", "B": "bright_blue", "C": "green", "D": "magenta", "E": "bright_green",
    "F": "yellow", "G": "blue", "R": "white", "X": "bold red",
}
_BUDGET_KEYS = ("total_gib", "gpu_memory_utilization", "requested_gib", "weights_gib", "peak_activation_gib",
                "non_torch_gib", "non_kv_gib", "cuda_graph_gib", "kv_cache_gib", "kv_cache_tokens", "gpu_blocks",
                "max_concurrency")
# (logparse key, label): the label of the same quantity in engine/events/ledger.py, which every
# kvscope screen uses; "non-KV" is vLLM's own sum and has no kvscope counterpart
def _budget_label(key: str) -> str:
    name = FIGURE_NAMES[key].kvscope
    return ledger_label(name) if name else "non-KV"


BUDGET_ROWS = tuple((key, _budget_label(key)) for key in _BUDGET_KEYS)


def coverage_line(exp: Explanation) -> str:
    """'N records: R recognised, C from vLLM's source, K noise (sources), U unrecognised in T
    templates' for a view's header."""
    cov = exp.coverage
    noise = {k: v for k, v in cov.noise.items() if v}
    sources = f" ({', '.join(f'{k} {v}' for k, v in noise.items())})" if noise else ""
    return (f"{exp.record_count:,} records: {cov.recognised:,} recognised, {cov.catalogued:,} from vLLM's source, "
            f"{sum(noise.values()):,} noise{sources}, {cov.unknown:,} unrecognised"
            f" in {len(cov.unknown_templates):,} templates ({len(cov.known_templates):,} known)")


HEADER_FIELD_CHARS = 120  # a garbled log can print a model name of thousands of characters


def short(value: Any) -> str:
    """A header field as text, '?' when absent, cut with its length when huge."""
    if value is None or value == "":
        return "?"
    text = str(value)
    return text if len(text) <= HEADER_FIELD_CHARS else f"{text[:HEADER_FIELD_CHARS]}… ({len(text):,} characters)"


def unknown_template_rows(exp: Explanation) -> list[str]:
    """The commonest unknown templates, 'count x  template  (first at line N)'."""
    return [f"{t.count:>6,} x  {t.template}  (first at line {t.first_line})" for t in exp.coverage.top_unknown()]


def fmt(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if value != 0 and abs(value) < 0.01:
            return f"{value:.4f}"
        return f"{value:,.3f}".rstrip("0").rstrip(".") if abs(value) < 1000 else f"{value:,.1f}"
    return str(value)


def figure_label(key: str) -> tuple[str, str]:
    """(vLLM's phrase for the figure, its unit); the key itself for a figure not in the table."""
    name = FIGURE_NAMES.get(key)
    return (name.vllm, name.unit) if name else (key, "")


def profile_label(item: str) -> tuple[str, str]:
    return ("phase duration", "s") if item == "duration_s" else figure_label(item)


def mark(check: Check) -> str:
    """✓ held, ✗ failed, ! a warning, – not judged (the log lacks a figure)."""
    if check.kind == "warning" and check.ok is False:
        return "!"
    return {True: "✓", False: "✗", None: "–"}[check.ok]


def budget_rows(exp: Explanation) -> list[tuple[str, Any, Any, str]]:
    """(label, vLLM, kvscope, note) for each budget line where either side has a figure."""
    vllm = {**exp.budget, "kv_cache_tokens": exp.facts.get("kv_cache_tokens"),
            "gpu_blocks": exp.facts.get("gpu_blocks"), "max_concurrency": exp.facts.get("max_concurrency")}
    mine = {row["item"]: row for row in exp.plan.get("rows", [])}
    sources = {"total_gib": exp.budget.get("total_source"),
               "gpu_memory_utilization": exp.budget.get("gpu_memory_utilization_source"),
               "requested_gib": exp.budget.get("requested_source"), "non_kv_gib": exp.budget.get("non_kv_source")}
    out = []
    for key, label in BUDGET_ROWS:
        theirs = vllm.get(key)
        row = mine.get(key, {})
        if theirs is None and not row:
            continue
        src = sources.get(key)
        note = row.get("note", "")
        if src and src != "log" and theirs is not None:
            note = f"vLLM figure: {src}" + (f"; {note}" if note else "")
        out.append((label, theirs, row.get("kvscope"), note))
    if exp.budget.get("unexplained_gib") is not None:
        out.append(("unexplained remainder", exp.budget["unexplained_gib"], None,
                    "requested - non-KV - KV pool (rounding of printed figures, or memory vLLM did not itemise)"))
    if exp.budget.get("outside_budget_gib") is not None:
        out.append(("outside the budget", exp.budget["outside_budget_gib"], None,
                    "total - requested: CUDA context, other processes, and graphs before v0.21"))
    return out


# ------------------------------------------------------------------ terminal
PIPE_WIDTH = 200  # tables on a pipe or in a file: wide enough that no log line wraps


def _console(out: TextIO | None) -> Console:
    """A terminal keeps its own width; a pipe (``| grep``, ``> file``) gets PIPE_WIDTH
    instead of rich's 80 columns, and long text lines never wrap there."""
    if out is None and sys.stdout.isatty():
        return Console(highlight=False, soft_wrap=False)
    return Console(file=out, highlight=False, soft_wrap=True, width=PIPE_WIDTH)


def render_terminal(exp: Explanation, out: TextIO | None = None, summary: bool = False,
                    max_lines: int = 2000) -> None:
    console = _console(out)
    _print_header(console, exp)
    if not summary:
        console.rule("lines")
        _print_lines(console, exp, max_lines)
        console.rule("timeline")
        _print_timeline(console, exp)
    if exp.startup_times.phases:
        console.rule("startup phases (seconds)")
        for row in render_times(exp.startup_times):
            console.print(Text(row))
    if exp.coverage.unknown_templates:
        console.rule("unrecognised lines by template (numbers, strings, paths masked)")
        for row in unknown_template_rows(exp):
            console.print(Text(row, style="dim"))
    console.rule("memory ledger (GiB unless stated)")
    _print_ledger(console, exp)
    if exp.plan.get("profile"):
        console.rule("kvscope run (--profile) beside vLLM")
        _print_profile(console, exp)
    console.rule("checks")
    _print_checks(console, exp)


def _print_header(console: Console, exp: Explanation) -> None:
    """The log, its vLLM and model, its coverage; a failed start and a cut log in a line each."""
    title = Text(f"logparse: {exp.path}", style="bold")
    title.append(f"   vLLM {short(exp.facts.get('vllm_version'))}   model {short(exp.facts.get('model'))}   "
                 f"{coverage_line(exp)}", style="dim")
    console.print(title)
    if exp.startup is not None:
        console.print(Text(exp.startup.sentence(), style="bold red"))
    for cut in exp.cuts:
        console.print(Text(cut.sentence(), style="yellow"))


def _print_lines(console: Console, exp: Explanation, max_lines: int) -> None:
    """Each record, coloured by phase, with what logparse knows of it below."""
    shown = 0
    for record in exp.records:
        if shown >= max_lines:
            console.print(Text(f"… {exp.record_count - shown:,} more records (use --json for all)", style="dim"))
            break
        shown += 1
        phase = record.phase or ("~" if record.noise else "?")
        line = Text(f"{record.line:>6} ", style="dim")
        line.append(f"{phase} ", style=PHASE_STYLES.get(phase, "dim"))
        line.append(record.text[:160] or "(prefix only)", style=PHASE_STYLES.get(phase, "dim") if record.pattern else "dim")
        console.print(line)
        if record.pattern is None:
            if record.template is not None:
                console.print(Text(f"         vLLM {record.template.level} from {', '.join(record.template.files)} "
                                   f"[{record.template.releases}]", style="dim"))
            elif record.noise:
                console.print(Text(f"         not vLLM's: {record.noise}", style="dim"))
            continue
        if record.duplicate_of is not None:
            console.print(Text(f"         same as line {record.duplicate_of} (another rank)", style="dim"))
            continue
        note = Text(f"         {record.pattern.id} [{record.pattern.versions}] ", style="dim")
        if record.fields:
            note.append(", ".join(f"{k}={fmt(v)}" for k, v in record.fields.items()), style="italic")
        console.print(note)
        console.print(Text(f"         {record.pattern.meaning}", style="dim"))


def _print_timeline(console: Console, exp: Explanation) -> None:
    timeline = Table(show_edge=False)
    for col in ("phase", "lines", "from", "to", "span s", "durations printed"):
        timeline.add_column(col)
    for span in exp.timeline:
        timeline.add_row(Text(f"{span.phase} {span.span_name}", style=PHASE_STYLES.get(span.phase, "")),
                         f"{span.first_line}–{span.last_line}", span.first_time or "—", span.last_time or "—",
                         fmt(span.span_s), ", ".join(f"{k}={fmt(v)}" for k, v in span.durations.items()))
    console.print(timeline)


def _print_ledger(console: Console, exp: Explanation) -> None:
    """vLLM's budget beside kvscope's plan, and why the plan is missing when it is."""
    ledger = Table(show_edge=False)
    for col in ("item", "vLLM", "kvscope plan", "note"):
        ledger.add_column(col, overflow="fold")
    for label, theirs, mine, note in budget_rows(exp):
        ledger.add_row(label, fmt(theirs), fmt(mine), Text(note, style="dim"))
    console.print(ledger)
    if exp.plan.get("unavailable"):
        console.print(Text(exp.plan["unavailable"], style="yellow"))


def _print_profile(console: Console, exp: Explanation) -> None:
    prof = Table(show_edge=False)
    for col in ("phase", "vLLM prints", "unit", "vLLM", "kvscope"):
        prof.add_column(col)
    for row in exp.plan["profile"]:
        prof.add_row(row["phase"], *profile_label(row["item"]), fmt(row["vllm"]), fmt(row["kvscope"]))
    console.print(prof)


def _print_checks(console: Console, exp: Explanation) -> None:
    if not exp.checks:
        console.print(Text("no check possible: the log lacks the figures they need", style="dim"))
    for check in exp.checks:
        style = "yellow" if check.kind == "warning" else {True: "green", False: "red", None: "yellow"}[check.ok]
        line = Text(f"{mark(check)} ", style=style)
        line.append(check.title, style="bold")
        line.append(f"  {check.detail}" + (f"  (line {check.line})" if check.line else ""))
        console.print(line)
        for fix in check.fix:
            console.print(Text(f"    fix: {fix.text()}", style="cyan"))


# ------------------------------------------------------------------ markdown
def render_markdown(exp: Explanation, summary: bool = False) -> str:
    out = [f"# logparse: `{exp.path}`", "",
           f"vLLM {short(exp.facts.get('vllm_version'))} · model {short(exp.facts.get('model'))} · "
           f"{coverage_line(exp)}", ""]
    if exp.startup is not None:
        out += [f"**{_md(exp.startup.sentence())}**", ""]
    out += [f"_{_md(cut.sentence())}_\n" for cut in exp.cuts]
    if not summary:
        out += ["## Lines", "", "| line | phase | pattern | fields | meaning |", "|---:|:-:|---|---|---|"]
        for r in exp.records:
            if r.pattern is None and r.template is not None:
                out.append(f"| {r.line} | · | vLLM {r.template.level}: {_md(', '.join(r.template.files))} | "
                           f"`{_md(r.text[:80])}` | releases {r.template.releases} |")
            elif r.pattern is None and r.noise:
                out.append(f"| {r.line} | ~ | not vLLM's: {r.noise} | `{_md(r.text[:80])}` | |")
            elif r.pattern is None:
                out.append(f"| {r.line} | ? | unrecognised | `{_md(r.text[:80])}` | |")
            elif r.duplicate_of is not None:
                out.append(f"| {r.line} | {r.phase} | {r.pattern.id} | | same as line {r.duplicate_of} |")
            else:
                fields = ", ".join(f"{k}={fmt(v)}" for k, v in r.fields.items())
                out.append(f"| {r.line} | {r.phase} | {r.pattern.id} | {_md(fields)} | {_md(r.pattern.meaning)} |")
        out += ["", "## Timeline", "", "| phase | lines | from | to | span s | durations |", "|---|---|---|---|---:|---|"]
        for s in exp.timeline:
            out.append(f"| {s.phase} {s.span_name} | {s.first_line}–{s.last_line} | "
                       f"{s.first_time or '—'} | {s.last_time or '—'} | {fmt(s.span_s)} | "
                       + ", ".join(f"{k}={fmt(v)}" for k, v in s.durations.items()) + " |")
    if exp.startup_times.phases:
        out += ["", "## Startup phases", "", "| phase | seconds | source |", "|---|---:|---|"]
        out += [f"| {p.phase} {p.name} | {fmt(p.seconds)} | {p.source} |" for p in exp.startup_times.phases]
        out.append(f"| whole start | {fmt(exp.startup_times.total_s)} | log times |")
    if exp.coverage.unknown_templates:
        out += ["", "## Unrecognised lines by template", "", "| records | first line | template (masked) |",
                "|---:|---:|---|"]
        out += [f"| {t.count:,} | {t.first_line} | `{_md(t.template)}` |" for t in exp.coverage.top_unknown()]
    out += ["", "## Memory ledger", "", "| item | vLLM | kvscope plan | note |", "|---|---:|---:|---|"]
    for label, theirs, mine, note in budget_rows(exp):
        out.append(f"| {label} | {fmt(theirs)} | {fmt(mine)} | {_md(note)} |")
    if exp.plan.get("unavailable"):
        out += ["", f"_{exp.plan['unavailable']}_"]
    if exp.plan.get("profile"):
        out += ["", "## kvscope run (--profile) beside vLLM", "",
                "| phase | vLLM prints | unit | vLLM | kvscope |", "|:-:|---|---|---:|---:|"]
        for row in exp.plan["profile"]:
            label, unit_ = profile_label(row["item"])
            out.append(f"| {row['phase']} | {_md(label)} | {unit_} | {fmt(row['vllm'])} | {fmt(row['kvscope'])} |")
    out += ["", "## Checks", ""]
    for c in exp.checks:
        out.append(f"- {mark(c)} **{c.title}**: {c.detail}")
        out += [f"  - fix: {_md(fix.text())}" for fix in c.fix]
    if not exp.checks:
        out.append("- no check possible: the log lacks the figures they need")
    return "\n".join(out) + "\n"


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


# ------------------------------------------------------------------ json
def render_json(exp: Explanation, summary: bool = False) -> str:
    return json.dumps(exp.to_json(with_records=not summary), indent=1, default=str, ensure_ascii=False)


# ------------------------------------------------------------------ diff
class DiffRow(NamedTuple):
    item: str  # the ledger key, or PHASE:duration key
    label: str  # what vLLM prints before the figure
    unit: str
    a: Any
    b: Any

    @property
    def difference(self) -> float | int | None:
        numbers = isinstance(self.a, int | float) and isinstance(self.b, int | float)
        return self.b - self.a if numbers and not isinstance(self.a, bool) and not isinstance(self.b, bool) else None


def diff_rows(a: Explanation, b: Explanation) -> list[DiffRow]:
    keys = list(LEDGER_KEYS) + [k for k in ("total_gib", "requested_gib", "non_kv_gib") if k not in LEDGER_KEYS]
    rows = []
    for key in keys:
        va = a.facts.get(key, a.budget.get(key))
        vb = b.facts.get(key, b.budget.get(key))
        if va is None and vb is None:
            continue
        rows.append(DiffRow(key, *figure_label(key), va, vb))
    seen: set[str] = set()
    for first, second, first_is_a in ((a, b, True), (b, a, False)):
        for span in first.timeline:
            for name, value in span.durations.items():
                if name in seen:
                    continue
                seen.add(name)
                other = next((s.durations[name] for s in second.timeline if name in s.durations), None)
                va, vb = (value, other) if first_is_a else (other, value)
                rows.append(DiffRow(f"{span.phase}:{name}", *figure_label(name), va, vb))
    return rows


def short_names(a: str, b: str) -> tuple[str, str]:
    """The file names as column heads; as many folders above them as it takes to tell two
    files of the same name apart."""
    pa, pb = PurePath(a).parts or (a,), PurePath(b).parts or (b,)
    n = 1
    while n < max(len(pa), len(pb)) and pa[-n:] == pb[-n:]:
        n += 1
    return str(PurePath(*pa[-n:])), str(PurePath(*pb[-n:]))


def render_diff(a: Explanation, b: Explanation, out: TextIO | None = None, as_json: bool = False,
                markdown: bool = False) -> str | None:
    rows = diff_rows(a, b)
    name_a, name_b = short_names(a.path, b.path)
    if as_json:
        return json.dumps({"a": a.path, "b": b.path, "a_name": name_a, "b_name": name_b, "rows": [
            {"item": r.item, "label": r.label, "unit": r.unit, "a": r.a, "b": r.b, "difference": r.difference}
            for r in rows]}, indent=1, default=str, ensure_ascii=False)
    paths = "" if (name_a, name_b) == (a.path, b.path) else f"{name_a}: {a.path}   {name_b}: {b.path}"
    if markdown:
        lines = [f"_{_md(paths)}_", ""] if paths else []
        lines += [f"| vLLM prints | unit | `{_md(name_a)}` | `{_md(name_b)}` | Δ |", "|---|---|---:|---:|---:|"]
        for r in rows:
            delta = fmt(r.difference) if r.difference is not None else ""
            lines.append(f"| {_md(r.label)} | {r.unit} | {fmt(r.a)} | {fmt(r.b)} | {delta} |")
        return "\n".join(lines) + "\n"
    console = _console(out)
    table = Table(title="two startups side by side", caption=paths or None)
    for col in ("vLLM prints", "unit", name_a, name_b, "Δ"):
        table.add_column(col, overflow="fold")
    for r in rows:
        table.add_row(r.label, r.unit, fmt(r.a), fmt(r.b), fmt(r.difference) if r.difference is not None else "")
    console.print(table)
    return None
