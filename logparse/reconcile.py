"""The log's own figures first, when kvscope's plan is set beside vLLM's.

vLLM prints what it measured: the weights it loaded (a quantised checkpoint's real size, not
parameters x 2 bytes), the activation peak of its profiling step and the memory outside
torch. Where the log prints them, kvscope's plan takes them instead of its shape estimates,
so the comparison is of the KV arithmetic alone and a quantised model no longer plans a
negative KV pool from bf16 weights. The block size is read from the log's own figures too:
the tokens it prints over the blocks it prints. A CUDA-graph pool the log shows vLLM took out
of the KV pool (v0.21+ estimates it first) is taken out of kvscope's pool too. And the model
name loses vLLM's elision (``Qwen3-8B...`` in a banner cut to width) before the preset lookup.
"""

from __future__ import annotations

import re
from typing import Any

from engine.budget.memory import GiB

BLOCK_SIZES = (1, 8, 16, 32, 64, 128, 256, 512, 1024)  # the --block-size values vLLM accepts
_ELISION = re.compile(r"(?:\.\.\.|…)+$")
# the figure key of the log -> the plan_memory argument it stands for
OWN_FIGURES = {"weights_gib": "weights", "peak_activation_gib": "activation_peak", "non_torch_gib": "non_torch"}


def model_name(printed: str) -> str:
    """A model name as printed, without the elision vLLM adds when it cuts one to width."""
    return _ELISION.sub("", printed.strip()).rstrip("/")


def block_size(facts: dict[str, Any]) -> tuple[int, str]:
    """(block size, where it came from): the flag where the log prints it, else the printed tokens
    over the printed blocks where that is a size vLLM accepts, else vLLM's default 16."""
    if isinstance(facts.get("block_size"), int):
        return int(facts["block_size"]), "log"
    tokens = facts.get("kv_cache_tokens")
    blocks = facts.get("num_gpu_blocks_info", facts.get("gpu_blocks"))
    if isinstance(tokens, int) and isinstance(blocks, int) and blocks > 0 and tokens % blocks == 0:
        size = tokens // blocks
        if size in BLOCK_SIZES:
            return size, f"{tokens:,} tokens / {blocks:,} blocks"
    return 16, "vLLM's default"


def own_figures(facts: dict[str, Any]) -> dict[str, int]:
    """The plan_memory arguments the log measured, in bytes (weights, activation peak, non-torch)."""
    out: dict[str, int] = {}
    for key, argument in OWN_FIGURES.items():
        value = facts.get(key)
        if isinstance(value, int | float) and value >= 0:
            out[argument] = int(value * GiB)
    return out


_HYBRID = re.compile(r"[Mm]amba|padding layers|linear[_ -]attention|\bGDN\b|[Hh]ybrid KV cache|sliding[_ ]window")


def hybrid_hint(text: str) -> bool:
    """Whether a line shows a hybrid KV layout (Mamba state, linear attention, padding layers, windows)."""
    return bool(_HYBRID.search(text[:4096]))


def hybrid_concurrency(printed: float, tokens: int, max_len: int, tolerance: float) -> bool:
    """Whether a printed concurrency above tokens / max-model-len is vLLM's per-group count: with
    Mamba / linear-attention state (one block per request) or sliding windows (a window's blocks),
    a request needs fewer blocks than max-model-len / block size, so vLLM's figure is higher;
    a full-attention model's can never be."""
    return printed > tokens / max_len + tolerance


def graph_in_pool(budget: dict[str, Any], facts: dict[str, Any], tolerance: float) -> float | None:
    """The CUDA-graph GiB vLLM took out of the KV pool, as the log shows it, or None where it did not.
    Since v0.21 vLLM estimates the graph pool before sizing the KV pool and subtracts it (the log says
    so: "CUDA graph memory profiling is enabled ... is equivalent to --gpu-memory-utilization=");
    where that line is cut away, the log's own figures tell: requested - non-KV misses the printed
    pool by the graph figure and requested - non-KV - graph meets it. A graph measured after the pool
    was sized (older releases, the free-memory recap) came out of the 1 - util margin: None."""
    graph = budget.get("cuda_graph_gib")
    if not isinstance(graph, int | float) or graph <= 0:
        return None
    if "equivalent_utilization" in facts:
        return float(graph)
    figures = [budget.get(k) for k in ("requested_gib", "non_kv_gib", "kv_cache_gib")]
    if not all(isinstance(x, int | float) for x in figures):
        return None
    requested, non_kv, kv = (float(x) for x in figures)  # type: ignore[arg-type]
    rest = requested - non_kv
    if abs(rest - kv) > tolerance and abs(rest - graph - kv) <= tolerance:
        return float(graph)
    return None


def tokens_follow_concurrency(facts: dict[str, Any], lines: dict[str, int]) -> bool:
    """Whether the printed KV tokens are vLLM's ``int(concurrency x max-model-len)``, as it prints them
    since it joined the two on one line ("GPU KV cache size: N tokens, Maximum concurrency for M tokens
    per request: Cx"), rather than ``blocks // groups x block size`` (earlier releases: always a
    multiple of the block size, 16 or a hybrid's larger aligned size). Then tokens / max-model-len is
    the concurrency whatever the layout (Mamba, linear attention, windows): judged without the model."""
    tokens = facts.get("kv_cache_tokens")
    if not isinstance(tokens, int) or facts.get("max_concurrency") is None:
        return False
    line = lines.get("kv_cache_tokens")
    return (line is not None and line == lines.get("max_concurrency")) or tokens % 16 != 0
