"""logparse throughput on a large log built from the real corpus, against
``grep -c`` on the same file in the same run, with resident memory sampled along
the way (it must stay flat: the parser streams).

    python -m bench.bench_logparse [--size-mb 1024] [--keep FILE]

The log is what a long-running server writes: every corpus startup once, then
:data:`RUNTIME_LINES_PER_START` periodic stats and access lines taken from the
corpus's real ones (the vLLM 0.32 capture), again and again, to the size asked.
Prints one JSON line: MB/s of ``logparse summary`` (the fast path: parse + ledger +
checks, stats/access runs counted, no record list kept), of the full record stream
(what ``explain`` reads), grep's MB/s, the ratio, the CPU's ISA, and RSS at 10 %,
50 % and 100 % of the file while summarising.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import psutil

from engine.model.cpu_caps import detect
from logparse.explain import explain
from logparse.fastscan import iter_summary
from logparse.parser import iter_records

CORPUS = Path(__file__).resolve().parents[1] / "tests" / "data" / "vllm-logs"
SAMPLE = Path(__file__).resolve().parents[1] / "samples" / "vllm-startup.log"


RUNTIME_LINES_PER_START = 320_000  # ~32 MB of stats and access lines after each pass over the 51 startups
STATS_EVERY = 8  # one stats line per this many runtime lines (the rest are access lines)


def build_log(path: Path, size_bytes: int) -> int:
    sources = sorted(CORPUS.glob("*.log")) if CORPUS.is_dir() else [SAMPLE]
    startups = b"".join(p.read_bytes().rstrip(b"\n") + b"\n" for p in sources)
    lines = startups.splitlines(keepends=True)
    stats = [line for line in lines if b"Avg prompt throughput: " in line and b"(APIServer" in line] or [
        line for line in lines if b"Avg prompt throughput: " in line]
    access = [line for line in lines if b'HTTP/1.1" 200' in line]
    runtime = b"".join(stats[i % len(stats)] if i % STATS_EVERY == 0 else access[i % len(access)]
                       for i in range(RUNTIME_LINES_PER_START))
    with open(path, "wb") as fh:
        written = 0
        while written < size_bytes:
            fh.write(startups)
            fh.write(runtime)
            written += len(startups) + len(runtime)
    return written


def time_grep(path: Path) -> tuple[float, int]:
    grep = shutil.which("grep")
    if grep is None:
        return float("nan"), -1
    start = time.perf_counter()
    done = subprocess.run([grep, "-c", "KV cache", str(path)], capture_output=True, text=True, check=False)
    return time.perf_counter() - start, int(done.stdout.strip() or -1)


def time_stream(path: Path, limit_bytes: int) -> tuple[float, int, int]:
    """Seconds, records and bytes of the full record stream over the file's first ``limit_bytes``
    (it reads every line in Python; the whole file would take minutes)."""
    count = 0
    start = time.perf_counter()
    with open(path, "rb") as fh:
        for _ in iter_records(fh):
            count += 1
            if count % 4096 == 0 and fh.tell() >= limit_bytes:
                break
        read = fh.tell()
    return time.perf_counter() - start, count, read


def summary_rss(path: Path, size: int) -> dict[str, float]:
    """RSS while the fast summary streams the file, at 10 %, 50 % and the end."""
    proc = psutil.Process(os.getpid())
    marks = {0.1: "rss_mb_10pct", 0.5: "rss_mb_50pct"}
    rss: dict[str, float] = {"rss_mb_start": proc.memory_info().rss / 2**20}
    with open(path, "rb") as fh:
        for _ in iter_summary(fh):
            frac = fh.tell() / size
            for threshold in [t for t in marks if frac >= t]:
                rss[marks.pop(threshold)] = proc.memory_info().rss / 2**20
    rss["rss_mb_end"] = proc.memory_info().rss / 2**20
    return rss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=float, default=1024.0)
    parser.add_argument("--stream-mb", type=float, default=16.0, help="how much of the file the full record stream reads")
    parser.add_argument("--keep", help="write the built log here instead of a temporary file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.keep) if args.keep else Path(tmp) / "big-vllm.log"
        size = build_log(path, int(args.size_mb * 2**20))
        mb = size / 2**20
        grep_s, grep_count = time_grep(path)
        start = time.perf_counter()
        exp = explain(path, keep_records=False)
        summary_s = time.perf_counter() - start
        grep_again_s, _ = time_grep(path)  # grep before and after: the load of a shared machine moves
        grep_s = min(grep_s, grep_again_s)
        stream_s, stream_records, stream_bytes = time_stream(path, int(args.stream_mb * 2**20))
        rss = summary_rss(path, size)
        caps = detect(torch_capability="-")  # the ISA from /proc/cpuinfo; torch is not needed here
        print(json.dumps({
            "bench": "logparse",
            "cpu": caps.model_name,
            "isa": caps.isa,
            "size_mb": round(mb, 1),
            "records": exp.record_count,
            "coverage": {k: v for k, v in exp.coverage.to_json().items() if k != "unknown_lines"},
            "grep_c_matches": grep_count,
            "grep_mb_s": round(mb / grep_s, 1),
            "summary_mb_s": round(mb / summary_s, 2),
            "grep_over_summary": round((mb / grep_s) / (mb / summary_s), 1),
            "stream_mb_s": round(stream_bytes / 2**20 / stream_s, 2),
            "stream_records": stream_records,
            **{k: round(v, 1) for k, v in rss.items()},
            "rss_growth_10_to_100pct_mb": round(rss["rss_mb_end"] - rss.get("rss_mb_10pct", rss["rss_mb_start"]), 1),
        }))


if __name__ == "__main__":
    main()
