"""Writes the two data-parallel vLLM logs here. They are synthesised, not captured: each stats
line is the format string of vLLM 0.10's LoggingStatLogger.log (vllm/v1/metrics/loggers.py,
``"Engine %03d: Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s,
Running: %d reqs, Waiting: %d reqs, GPU KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%"``)
under the API server's prefix, every engine's line in one pass every 10 s
(VLLM_LOG_STATS_INTERVAL), after the startup lines that name the layout. Run from the
repository root: ``.venv/bin/python tests/data/vllm-dp-logs/make_logs.py``."""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path

HERE = Path(__file__).parent
PREFIX = "(APIServer pid=2417) INFO {clock} [{source}] "
STATS = ("Engine {engine:03d}: Avg prompt throughput: {prompt:.1f} tokens/s, Avg generation throughput: {gen:.1f} "
         "tokens/s, Running: {running:d} reqs, Waiting: {waiting:d} reqs, GPU KV cache usage: {kv:.1f}%, "
         "Prefix cache hit rate: {hit:.1f}%")
START = datetime(2025, 12, 1, 7, 29, 40)
Round = tuple[tuple[int, int, float], ...]  # each engine's (running, waiting, KV usage %)


def header() -> list[str]:
    lines = [("api_server.py:1896", "vLLM API server version 0.10.2"),
             ("utils.py:328", "non-default args: {'model_tag': 'Qwen/Qwen3-8B', 'model': 'Qwen/Qwen3-8B', "
                              "'max_num_seqs': 16, 'data_parallel_size': 2}"),
             ("api_server.py:1971", "Starting vLLM API server 0 on http://0.0.0.0:8000"),
             ("launcher.py:36", "Available routes are:")]
    return [PREFIX.format(clock=START.strftime("%m-%d %H:%M:%S"), source=src) + text for src, text in lines]


def stats(rounds: list[Round]) -> list[str]:
    """Each round: every engine's (running, waiting, KV usage %), printed 10 s apart."""
    out = []
    for i, engines in enumerate(rounds):
        clock = (START + timedelta(seconds=82 + 10 * i)).strftime("%m-%d %H:%M:%S")
        for engine, (running, waiting, kv) in enumerate(engines):
            out.append(PREFIX.format(clock=clock, source="loggers.py:123") + STATS.format(
                engine=engine, prompt=41.0 * running + 9.5 * waiting, gen=8.2 * running, running=running,
                waiting=waiting, kv=kv, hit=12.0))
    return out


def engine_001_queues() -> list[Round]:
    """Three even rounds, then for 12 rounds (2 min) Engine 001 runs its --max-num-seqs 16 with 8-10
    waiting while Engine 000 runs 4-5 with nothing waiting (over 4x its load: 1.6x the mean; both
    would fit in 2 x 16), then both drain."""
    even: list[Round] = [((8, 0, 20.0), (8, 0, 21.0)), ((9, 0, 24.5), (12, 1, 30.0)), ((7, 0, 19.0), (16, 3, 41.0))]
    piled: list[Round] = [((4 + i % 2, 0, 11.0 + i % 3), (16, 8 + i % 3, 52.0 + i % 5)) for i in range(12)]
    drain: list[Round] = [((3, 0, 8.0), (16, 4, 49.0)), ((2, 0, 5.0), (11, 0, 31.0)), ((0, 0, 0.0), (3, 0, 9.0))]
    return even + piled + drain


def balanced() -> list[Round]:
    """Both engines loaded alike, each at its --max-num-seqs 16 and queueing a little, for 15 rounds."""
    return [((16, 3 + (i % 3), 40.0 + i), (15 + i % 2, 3 + ((i + 1) % 3), 41.0 + i)) for i in range(15)]


if __name__ == "__main__":
    for name, rounds in (("v0.10.2-dp2-engine001-queues.log", engine_001_queues()),
                         ("v0.10.2-dp2-balanced.log", balanced())):
        (HERE / name).write_text("\n".join(header() + stats(rounds)) + "\n")
