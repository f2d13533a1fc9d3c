"""logparse throughput on a large log built from the real corpus, against
``grep -c`` on the same file in the same run, with resident memory sampled along
the way (it must stay flat: the parser streams).

    python -m bench.bench_logparse [--size-mb 200] [--keep FILE]

Prints one JSON line: MB/s of ``logparse summary`` (parse + ledger + checks, no
record list kept), MB/s of the bare record stream, grep's MB/s, the ratio, and
RSS at 10 %, 50 % and 100 % of the file.
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

from logparse.explain import explain
from logparse.parser import iter_records

CORPUS = Path(__file__).resolve().parents[1] / "tests" / "data" / "vllm-logs"
SAMPLE = Path(__file__).resolve().parents[1] / "samples" / "vllm-startup.log"


def build_log(path: Path, size_bytes: int) -> int:
    sources = sorted(CORPUS.glob("*.log")) if CORPUS.is_dir() else [SAMPLE]
    block = b"".join(p.read_bytes().rstrip(b"\n") + b"\n" for p in sources)
    with open(path, "wb") as fh:
        written = 0
        while written < size_bytes:
            fh.write(block)
            written += len(block)
    return written


def time_grep(path: Path) -> tuple[float, int]:
    grep = shutil.which("grep")
    if grep is None:
        return float("nan"), -1
    start = time.perf_counter()
    done = subprocess.run([grep, "-c", "KV cache", str(path)], capture_output=True, text=True, check=False)
    return time.perf_counter() - start, int(done.stdout.strip() or -1)


def time_stream(path: Path, size: int) -> tuple[float, int, dict[str, float]]:
    proc = psutil.Process(os.getpid())
    marks = {0.1: "rss_mb_10pct", 0.5: "rss_mb_50pct"}
    rss: dict[str, float] = {"rss_mb_start": proc.memory_info().rss / 2**20}
    count = 0
    start = time.perf_counter()
    with open(path, "rb") as fh:
        for _ in iter_records(fh):
            count += 1
            if count % 20000 == 0 and marks:
                frac = fh.tell() / size
                for threshold in [t for t in marks if frac >= t]:
                    rss[marks.pop(threshold)] = proc.memory_info().rss / 2**20
    elapsed = time.perf_counter() - start
    rss["rss_mb_end"] = proc.memory_info().rss / 2**20
    return elapsed, count, rss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=float, default=200.0)
    parser.add_argument("--keep", help="write the built log here instead of a temporary file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.keep) if args.keep else Path(tmp) / "big-vllm.log"
        size = build_log(path, int(args.size_mb * 2**20))
        mb = size / 2**20
        grep_s, grep_count = time_grep(path)
        stream_s, records, rss = time_stream(path, size)
        start = time.perf_counter()
        exp = explain(path, keep_records=False)
        summary_s = time.perf_counter() - start
        print(json.dumps({
            "bench": "logparse",
            "size_mb": round(mb, 1),
            "records": records,
            "grep_c_matches": grep_count,
            "grep_mb_s": round(mb / grep_s, 1),
            "stream_mb_s": round(mb / stream_s, 2),
            "summary_mb_s": round(mb / summary_s, 2),
            "grep_over_summary": round((mb / grep_s) / (mb / summary_s), 1),
            "unrecognised": exp.unrecognised,
            **{k: round(v, 1) for k, v in rss.items()},
            "rss_growth_10_to_100pct_mb": round(rss["rss_mb_end"] - rss.get("rss_mb_10pct", rss["rss_mb_start"]), 1),
        }))


if __name__ == "__main__":
    main()
