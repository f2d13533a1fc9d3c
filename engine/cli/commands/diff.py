"""``engine diff A.jsonl B.jsonl``: what changed between two recordings, and whether B is slower.

Sets two recordings (the real engine's ``--events`` or ``engine simulate``'s; plain or
gzipped) side by side: startup phases, the KV pool, TTFT / inter-token / end-to-end
percentiles, preemptions, prefix-cache hit rate, the block peak, and the step time of
each batch shape (prefill tokens x decode sequences). The verdict compares medians with a
bootstrap interval (engine/events/folds/run_diff.py): a shape regressed when B's median step
is more than --threshold above A's and the interval says it is not noise. Latencies are
shown, not judged: they follow from the step times, the scheduling and the arrivals.

Two runs are compared only when their engine (real or simulated), model, flags and
workload are the same; otherwise the fields that differ are named and --force compares
them anyway. The machine (torch, CPU, threads, the simulator's cost model) may differ.

Exit status: 0 no regression, 1 a regression beyond --threshold, 2 bad input or runs that
are not comparable (without --force).

Two vLLM logs (``.log``, or any file whose first line is not JSON) are compared as two
startups instead: each phase A-G's seconds (vLLM's printed figures, else the log's own
timestamps) and the whole start, side by side (logparse's reading; exit 0).

Examples:
  engine diff before.jsonl after.jsonl
  engine diff vllm-cold.log vllm-warm.log
  engine diff before.jsonl after.jsonl --threshold 5 --json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.cli.program import Subparsers
from engine.errors import UserError

if TYPE_CHECKING:
    from engine.events.folds.run_diff import Comparison, RunDiff, RunProfile

HOW_TO_RECORD = "record one with --events FILE: engine run-workload, serve, generate or simulate"


def register(sub: Subparsers) -> None:
    p = sub.add_parser("diff", help="what changed between two recordings; exit 1 when the second regressed",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a", metavar="A.jsonl", help="the baseline recording (.jsonl or .jsonl.gz)")
    p.add_argument("b", metavar="B.jsonl", help="the recording to judge against it")
    p.add_argument("--threshold", type=threshold_type, default=10.0, metavar="PCT",
                   help="a median this many percent slower than A's is a regression (default 10)")
    p.add_argument("--force", action="store_true",
                   help="compare runs whose model, flags or workload differ, or whose last line is cut")
    p.add_argument("--json", action="store_true", help="print the diff as one JSON object (for CI)")
    p.set_defaults(func=run)


def threshold_type(text: str) -> float:
    """A percentage: ``10`` or ``10%``."""
    try:
        value = float(text.strip().removesuffix("%"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give a percentage, e.g. 10 or 10%") from None
    if not 0 <= value < 1000:
        raise argparse.ArgumentTypeError(f"{text}: give a percentage from 0 up, e.g. 10")
    return value


def load_profile(path_text: str, force: bool) -> RunProfile:
    """Read and fold one recording; a :class:`UserError` saying what to change when it is not one."""
    from engine.events import read_events
    from engine.events.folds.run_diff import profile_run
    from engine.sim.replay import recorded_flags

    path = Path(path_text)
    if not path.is_file():
        raise UserError(f"{path_text}: no such file; give a kvscope recording ({HOW_TO_RECORD})")
    try:  # streamed through engine/events/bounded.py: plain or gzipped, every cap a one-line error
        recording = read_events(path, name=path_text)
    except OSError as exc:
        raise UserError(f"{path_text}: cannot be read ({exc}); give a whole recording, plain or gzipped") from None
    except ValueError as exc:  # read_events names the file and the line
        raise UserError(f"{exc}; {HOW_TO_RECORD}") from None
    if recording.truncated and not force:
        raise UserError(f"{path_text}: its last line is cut (the run was still writing, or stopped): its last steps "
                        "and requests are missing, so the diff would judge part of a run; give the finished "
                        "recording, or pass --force to compare up to its last whole line")
    profile = profile_run(recording.events, recorded_flags(recording), name=path_text, truncated=recording.truncated)
    if not profile.steps:
        raise UserError(f"{path_text}: the recording has no step events, so there is nothing to compare; "
                        "record a run that served requests (engine run-workload or simulate with --events)")
    return profile


def is_log(path_text: str) -> bool:
    """A vLLM log rather than a kvscope recording: named ``.log`` / ``.txt`` (gzipped or not),
    or a first line that is not JSON (every recording's first line is its JSON header)."""
    name = path_text.removesuffix(".gz")
    if name.endswith((".log", ".txt")):
        return True
    if name.endswith((".jsonl", ".json")):
        return False
    from engine.events.bounded import open_binary

    try:
        with open_binary(path_text, tolerant=True) as fh:
            first = fh.readline(4096).lstrip()
    except (OSError, ValueError):
        return False  # load_profile says what is wrong with it
    return bool(first) and not first.startswith(b"{")


def run(args: argparse.Namespace) -> int:
    from engine.events.folds.run_diff import diff_runs

    if is_log(args.a) and is_log(args.b):  # two vLLM startups, phase by phase (logparse)
        from engine.cli.plugins import load_plugin

        compare = load_plugin("kvscope.logdiff", "engine diff a.log b.log compares vLLM logs through logparse")
        return int(compare(args.a, args.b, as_json=args.json))
    a = load_profile(args.a, args.force)
    b = load_profile(args.b, args.force)
    diff = diff_runs(a, b, threshold=args.threshold / 100)
    if not diff.comparable and not args.force:
        if args.json:
            print(json.dumps({"comparable": False, "differences": [d.to_json() for d in diff.differences],
                              "exit_status": 2}, indent=2, default=str))
        raise UserError(f"{args.a} and {args.b} are not comparable runs (A vs B):\n" + "\n".join(
            f"  {d.kind} {d.field}: {_value(d.a)} vs {_value(d.b)}" for d in diff.differences)
            + "\nrecord both with the same engine, model, flags and workload, or pass --force to compare them anyway")
    if args.json:
        print(json.dumps(diff.to_json(), indent=2, default=str))
    else:
        print("\n".join(render(diff, forced=args.force)))
    return diff.exit_status


# -------------------------------------------------------------------- the text form
def render(diff: RunDiff, forced: bool = False) -> list[str]:
    """The text report: the two runs, then startup, the KV pool, latencies, step times by batch shape
    and the verdict, each a block of its own."""
    a, b = diff.a, diff.b
    return [*_header_lines(diff, forced), *_startup_lines(a, b), *_pool_lines(a, b), *_latency_lines(diff),
            *_shape_lines(diff), "", _verdict_line(diff)]


def _header_lines(diff: RunDiff, forced: bool) -> list[str]:
    """What A and B are, whether they compare, and what else differs between them."""
    a, b = diff.a, diff.b
    lines = [f"A: {a.name}  ({a.kind}, {_model_name(a)}, {len(a.workload):,} requests, {a.steps:,} steps, "
             f"{a.busy_seconds:.3f} s in steps)",
             f"B: {b.name}  ({b.kind}, {_model_name(b)}, {len(b.workload):,} requests, {b.steps:,} steps, "
             f"{b.busy_seconds:.3f} s in steps)"]
    if diff.comparable:
        lines.append("comparable: same engine, model, flags and workload")
    else:
        lines.append("NOT COMPARABLE, compared anyway (--force): " + "; ".join(
            f"{d.kind} {d.field}: {_value(d.a)} vs {_value(d.b)}" for d in diff.differences))
    if forced and (a.truncated or b.truncated):
        cut = " and ".join(p.name for p in (a, b) if p.truncated)
        lines.append(f"note: {cut} ends in a cut line: compared up to its last whole line")
    for d in diff.environment:
        lines.append(f"environment {d.field}: {_value(d.a)} -> {_value(d.b)}")
    return lines


def _startup_lines(a: RunProfile, b: RunProfile) -> list[str]:
    from engine.events.folds.run_diff import startup_rows

    if any(t.seconds for p in (a, b) for t in p.phases.values()):
        lines = ["", f"{'startup phase':<22}{'A s':>10}{'B s':>10}{'change':>10}"]
        for letter, name, sa, sb, ca, cb in startup_rows(a, b):
            note = "  (phase D read a stored measurement in " + "/".join(
                x for x, c in (("A", ca), ("B", cb)) if c) + ")" if ca != cb else ""
            lines.append(f"  {letter} {name:<18}{_num(sa, 3):>10}{_num(sb, 3):>10}{_change(sa, sb):>10}{note}")
        return lines
    if a.phases or b.phases:
        return ["", "startup phases: simulated, no time spent in either run"]
    return []


def _pool_lines(a: RunProfile, b: RunProfile) -> list[str]:
    """The KV pool, its peak, the requests finished and preempted, and the prefix hit rate."""
    lines = ["", f"{'':<22}{'A':>16}{'B':>16}{'change':>10}"]
    for title, va, vb in (("KV pool blocks", a.kv_blocks, b.kv_blocks),
                          ("KV pool bytes", a.kv_pool_bytes, b.kv_pool_bytes),
                          ("peak blocks used", a.tally.peak_blocks_used, b.tally.peak_blocks_used),
                          ("requests finished", a.tally.finished, b.tally.finished),
                          ("preemptions", a.tally.preemptions, b.tally.preemptions)):
        lines.append(f"  {title:<20}{_count(va):>16}{_count(vb):>16}{_change(va, vb):>10}")
    ha, hb = a.prefix_hit_rate, b.prefix_hit_rate
    lines.append(f"  {'prefix hit rate':<20}{_pct(ha):>16}{_pct(hb):>16}"
                 f"{'' if ha is None or hb is None else f'{(hb - ha) * 100:+.1f} pt':>10}")
    return lines


def _latency_lines(diff: RunDiff) -> list[str]:
    from engine.events.folds.run_diff import LATENCIES

    lines = ["", f"{'latency (ms)':<22}" + "".join(f"{q + ' ' + x:>11}" for q in ("p50", "p90", "p99")
                                                   for x in ("A", "B")) + f"{'p50 B/A':>9}"]
    for key, title, _ in LATENCIES:
        pa, pb = diff.latency_percentiles[key]["a"] or {}, diff.latency_percentiles[key]["b"] or {}
        cells = "".join(f"{_ms(p.get(q)):>11}" for q in ("p50", "p90", "p99") for p in (pa, pb))
        ratio = f"{pb['p50'] / pa['p50']:.2f}" if pa.get("p50") and pb.get("p50") else ""
        lines.append(f"  {title:<20}{cells}{ratio:>9}")
    return lines


def _shape_lines(diff: RunDiff) -> list[str]:
    """Each batch shape's step counts and medians, with the ratio, its interval and the verdict."""
    lines = ["", f"step time by batch shape (ms)  threshold {diff.threshold * 100:g} %",
             f"  {'prefill tokens':>14}{'decode seqs':>12}{'steps A':>9}{'steps B':>9}{'median A':>11}"
             f"{'median B':>11}{'B/A':>7}  {'95 % interval':<16}verdict"]
    for shape, c in diff.shapes:
        lines.append(f"  {shape.prefill_label:>14}{shape.decode_label:>12}{c.n_a:>9,}{c.n_b:>9,}"
                     f"{_ms(c.median_a):>11}{_ms(c.median_b):>11}{_judged(c)}")
    return lines


def _verdict_line(diff: RunDiff) -> str:
    from engine.events.folds.run_diff import REGRESSION

    if diff.regressions:
        return (f"verdict: {REGRESSION.upper()}: {len(diff.regressions)} batch shape(s) slower by more than "
                f"{diff.threshold * 100:g} % beyond the noise: " + "; ".join(
                    f"{c.name} {c.ratio:.2f}x" for c in diff.regressions))
    better = f" ({len(diff.improvements)} faster)" if diff.improvements else ""
    return f"verdict: no regression beyond {diff.threshold * 100:g} %{better}"


def _judged(c: Comparison) -> str:
    ratio = "" if c.ratio is None else f"{c.ratio:.2f}"
    interval = "" if c.low is None else f"[{c.low:.2f}, {c.high:.2f}]"
    return f"{ratio:>7}  {interval:<16}{c.verdict}"


def _model_name(p: RunProfile) -> str:
    return str(p.model.get("name") or p.flags.get("model") or "model unknown")


def _value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    return "(absent)" if v is None else str(v)


def _num(v: float | None, digits: int) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _count(v: float | None) -> str:
    return "-" if v is None else f"{v:,}"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:,.2f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:.1f} %"


def _change(a: float | None, b: float | None) -> str:
    if a is None or b is None:
        return ""
    if a == b:
        return "="
    if a == 0:
        return "new"
    return f"{(b - a) / a * 100:+.1f} %"
