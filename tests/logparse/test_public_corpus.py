"""The public corpus (tests/data/vllm-logs-public, each file with its thread in README.md): every
excerpt people pasted is parsed end to end, every record is classed (a hand row, the generated
catalogue of vLLM's and its plugins' source, or another program's line by source), and what stays
unknown is named here with the reason, at most 3 % of the corpus's records."""

from __future__ import annotations

import re

import pytest

from logparse.explain import explain
from tests.paths import DATA

PUBLIC = DATA / "vllm-logs-public"
LOGS = sorted(PUBLIC.glob("*.log"))
MAX_UNKNOWN_SHARE = 0.03

# file -> {a fragment of an unknown record's message: why no source can class it}
EXPLAINED_UNKNOWN: dict[str, dict[str, str]] = {
    "vunknown-1cat-fork-journald-cyrillic-sm70-kv-tokens.log": {
        "SM70 exact mixed-dtype Gemma RMSNorm": "a fork's own V100 kernels (1Cat-vLLM): its prints and its logger, "
                                                "in no vLLM or plugin release",
        "Warming up SM70 TurboMind accepted routes": "the same fork's warm-up logger call",
    },
    "v0.1x-omni-stage-tags-worker-free-memory-diffusion-stage.log": {
        "Model runner: ": "vllm-omni's diffusion runner of March 2026; the catalogued vllm-omni is 0.12.0rc1 "
                          "(December 2025), which logs 'Worker N: Model loaded successfully.'",
    },
    "v0.6.x-gaudi-hpu-blocks-buckets.log": {
        "Omitted 25 prompt buckets": "HabanaAI/vllm-fork (the Gaudi fork of 0.6, before the vllm-gaudi plugin): "
                                     "a fork's bucketing line",
    },
    "v0.7.3-ascend-caret-ansi-worker-platform-eager.log": {
        "NPU compilation support pending": "vllm-ascend between its 0.7.3 and 0.11.0 releases (a 0.7.3.post "
                                           "image); neither catalogued release prints it",
    },
}


def _unknown(name: str) -> list[str]:
    exp = explain(PUBLIC / name)
    return [r.text for r in exp.records if r.pattern is None and r.template is None and r.noise is None]


def test_the_corpus_is_large_and_every_file_names_its_thread() -> None:
    readme = (PUBLIC / "README.md").read_text()
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `([^`]+\.log)` \| (\S+) \|", readme, re.M)}
    assert len(LOGS) >= 60
    missing = [p.name for p in LOGS if not p.name.startswith("derived-") and p.name not in rows]
    assert not missing, f"files without a source row in README.md: {missing}"
    assert all(url.startswith("https://github.com/") for url in rows.values())
    assert len(set(rows.values())) == len(rows), "one thread, one excerpt"


@pytest.mark.parametrize("name", [p.name for p in LOGS])
def test_every_unknown_record_is_explained(name: str) -> None:
    allowed = EXPLAINED_UNKNOWN.get(name, {})
    unknown = _unknown(name)
    unexplained = [text[:160] for text in unknown if not any(fragment in text for fragment in allowed)]
    assert not unexplained, f"{name}: unknown records no entry explains: {unexplained}"
    stale = [fragment for fragment in allowed if not any(fragment in text for text in unknown)]
    assert not stale, f"{name}: explained-unknown entries that now match nothing (classed since?): {stale}"


def test_the_unknown_share_of_the_corpus_is_at_most_3_percent() -> None:
    records = unknown = 0
    for path in LOGS:
        coverage = explain(path).coverage
        records += coverage.records
        unknown += coverage.unknown
    assert records > 500
    assert unknown / records <= MAX_UNKNOWN_SHARE, f"{unknown} of {records} records unknown"


# Figures read from public pastes through their prefixes (file -> facts explain must read), and the
# checks those figures pass
FIGURES: dict[str, tuple[dict[str, object], set[str]]] = {
    # a Kubernetes console's border around V0 0.8's budget lines: 79.19 x 0.90 = 71.27; 71.27 - 15.09 = 56.18
    "v0.8.x-k8s-console-border-memory-profiling.log": (
        {"total_gib": 79.19, "weights_gib": 12.55, "kv_cache_gib": 56.18, "gpu_blocks": 7191}, {"requested", "kv_remainder"}),
    # V1 in 0.7: 1,381 blocks x 16 / 2,048 = 10.79x
    "v0.7.1-v1-gpu-blocks-max-concurrency-w8a8-70b.log": ({"gpu_blocks": 1381, "max_concurrency": 10.79}, {"concurrency"}),
    "v0.11.x-engine-core-dp0-kv-tokens-graph-capture-bars.log": (
        {"kv_cache_tokens": 1_587_648, "max_concurrency": 775.22, "max_model_len": 2048}, {"concurrency"}),
    # journald with a Cyrillic month, learned as the log's own prefix: 215,401 / 8,192 = 26.29x
    "vunknown-1cat-fork-journald-cyrillic-sm70-kv-tokens.log": (
        {"kv_cache_gib": 5.35, "kv_cache_tokens": 215_401, "max_concurrency": 26.29}, {"concurrency"}),
    "v0.2x-mrv2-tp4-free-memory-cudagraph-2.04-gib.log": (
        {"total_gib": 79.11, "cuda_graph_gib": 2.04, "kv_cache_gib": 63.25}, {"requested", "kv_remainder"}),
    # TPU and Gaudi executors print their pool as V0's GPU executor does
    "v0.6.x-tpu-ray-repeated-across-cluster-compile.log": ({"gpu_blocks": 18_736, "cpu_blocks": 11_912}, set()),
    "v0.6.x-gaudi-hpu-blocks-buckets.log": ({"gpu_blocks": 3184, "cpu_blocks": 256}, set()),
}


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_figures_are_read_through_the_pastes_prefixes(name: str) -> None:
    facts, passing = FIGURES[name]
    exp = explain(PUBLIC / name)
    assert {k: exp.facts.get(k) for k in facts} == facts
    assert {c.id for c in exp.checks if c.ok is True} >= passing
    assert not [c.id for c in exp.checks if c.ok is False]


def test_prefixes_of_the_pastes_are_read() -> None:
    ansi = explain(PUBLIC / "v0.7.3-ascend-caret-ansi-worker-platform-eager.log")  # '^[[1;36m(VllmWorkerProcess pid=N)^[[0;0m'
    assert {r.process for r in ansi.records} == {"VllmWorkerProcess pid=113915", "VllmWorkerProcess pid=113919"}
    ray = explain(PUBLIC / "v0.6.x-tpu-ray-repeated-across-cluster-compile.log")
    assert ray.coverage.ray_folded == 6  # [repeated 5x] + [repeated 2x] x 2 -> 4 + 1 + 1
    ci = explain(PUBLIC / "v0.1x-buildkite-timestamp-free-memory-cuda1.log")  # '[2026-02-24T20:21:58Z] (EngineCore_DP0 pid=N)'
    assert ci.startup is not None and ci.startup.cause == "free_memory"
