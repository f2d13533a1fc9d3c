"""The log's own figures first (issue 50): vLLM's elided model names, the block size read from
the log's tokens and blocks, its measured weights / activation / non-torch in kvscope's plan (a
quantised model plans no negative pool), hybrid concurrency not called wrong, and the unknown
lines the issue lists (TileLang, bare FutureWarnings, the CPU backend's reserved-cores warning)."""

from __future__ import annotations

from pathlib import Path

from logparse.explain import explain
from logparse.options import Options
from logparse.parser import iter_records
from logparse.reconcile import block_size, model_name
from tests.paths import DATA

CORPUS = DATA / "vllm-logs"
PUBLIC = DATA / "vllm-logs-public"


def test_elided_model_names_resolve(tmp_path: Path) -> None:
    assert model_name("Qwen/Qwen3-8B...") == "Qwen/Qwen3-8B" and model_name("Qwen3-8B…") == "Qwen3-8B"
    log = tmp_path / "banner.log"
    log.write_text("(APIServer pid=1) INFO 05-01 10:00:00 [api_server.py:1] vLLM server version 0.15.0, serving "
                   "model Qwen/Qwen3-8B...\n")
    exp = explain(log, Options(gpu="h100"))
    assert exp.plan["model"] is not None and "Qwen/Qwen3-8B (from log)" in exp.plan["model_source"]


def test_block_size_read_from_tokens_over_blocks(tmp_path: Path) -> None:
    assert block_size({"kv_cache_tokens": 1_007_616, "num_gpu_blocks_info": 15_744}) == (64, "1,007,616 tokens / "
                                                                                         "15,744 blocks")
    assert block_size({"kv_cache_tokens": 1000, "num_gpu_blocks_info": 7}) == (16, "vLLM's default")
    log = tmp_path / "b64.log"
    log.write_text(
        "(EngineCore_DP0 pid=7) INFO 05-01 10:00:00 [kv_cache_utils.py:1] GPU KV cache size: 1,007,616 tokens\n"
        "(APIServer pid=1) INFO 05-01 10:00:01 [loggers.py:1] Engine 000: vllm cache_config_info with initialization "
        "after num_gpu_blocks is: 15744\n")
    exp = explain(log, Options(model="llama-3.1-8b", gpu="h100"))
    assert exp.facts["block_size"] == 64 and exp.plan["inputs"]["block_size"] == 64
    assert exp.plan["inputs"]["block_size_source"] == "1,007,616 tokens / 15,744 blocks"


def test_the_logs_own_figures_feed_the_plan_and_a_quantised_model_plans_a_pool(tmp_path: Path) -> None:
    # a 70B checkpoint in 4 bits: 37.5 GiB of weights as vLLM measured them, not 131 GiB of bf16 parameters
    log = tmp_path / "awq.log"
    log.write_text(
        "INFO 03-27 10:29:01 [worker.py:267] the current vLLM instance can use total_gpu_memory (79.25GiB) x "
        "gpu_memory_utilization (0.90) = 71.33GiB\n"
        "INFO 03-27 10:29:01 [worker.py:267] model weights take 37.50GiB; non_torch_memory takes 0.28GiB; PyTorch "
        "activation peak memory takes 1.52GiB; the rest of the memory reserved for KV Cache is 32.03GiB.\n")
    exp = explain(log, Options(model="llama-3.1-70b"))
    assert exp.plan["inputs"]["from_log"] == ["activation_peak", "non_torch", "weights"]
    rows = {r["item"]: r for r in exp.plan["rows"]}
    assert abs(rows["weights_gib"]["kvscope"] - 37.5) < 1e-6 and abs(rows["kv_cache_gib"]["kvscope"] - 32.03) < 0.01
    assert exp.kvscope_plan is not None and exp.kvscope_plan.kv_pool_bytes > 0


def test_hybrid_concurrency_is_not_a_failed_check() -> None:
    # Mamba state takes one block per request: vLLM's 5.23x is above 188,640 / 131,072 = 1.44, and the log's
    # "to fit Mamba cache blocks" line says why; a log that names no hybrid layout keeps its check (ok False)
    name = "v0.18dev-hybrid-mamba-model-unknowngpu-tp1-cudagraph-capping.log"
    (check,) = [c for c in explain(CORPUS / name).checks if c.id == "concurrency"]
    assert check.ok is None and "KV cache groups" in check.detail
    (full,) = [c for c in explain(CORPUS / "v0.6.4-llama3.1-8b-rtx3090-tp1-20k-ok.log").checks if c.id == "concurrency"]
    assert full.ok is True


def test_unknown_lines_of_the_issue_are_classed(tmp_path: Path) -> None:
    assert all(r.noise == "tilelang" or r.pattern is not None for r in iter_records(PUBLIC / "v0.2x-tilelang-compile-tp8.log"))
    log = tmp_path / "misc.log"
    log.write_text(
        "FutureWarning: `torch.cuda.amp.custom_fwd(args...)` is deprecated.\n"
        "(EngineCore pid=9) WARNING 05-01 10:00:00 [cpu_worker.py:1] VLLM_CPU_NUM_OF_RESERVED_CPU is less than the "
        "minimum requirement\n")
    first, second = iter_records(log)
    assert first.noise == "python-warning" and second.pattern_id == "cpu_reserved_cpus_low"


def test_a_graph_estimate_vllm_took_from_the_pool_leaves_kvscopes_pool_too() -> None:
    # v0.27.1 (gpustack/runner#251): "CUDA graph memory profiling is enabled ... 0.8200 is equivalent to 0.8048":
    # the 0.36 GiB estimate was subtracted before the 6.87 GiB pool was sized, so kvscope's pool leaves it out too
    log = CORPUS / "v0.27.1-unknown-model-unknowngpu-tp2-gpustack-cudagraph-profiling.log"
    exp = explain(log, Options(model="llama-3.1-8b", gpu_memory_gib=24.0))
    plan = exp.kvscope_plan
    assert plan is not None and "cuda_graph" in exp.plan["inputs"]["from_log"]
    graph = int(0.36 * 2**30)
    assert plan.cuda_graph_bytes == graph and not plan.kv_pool_overridden
    non_kv = plan.weights_bytes + plan.activation_peak_bytes + plan.non_torch_bytes
    assert abs(plan.kv_pool_bytes - (plan.requested_bytes - non_kv - graph)) <= 2
    rows = {r["item"]: r for r in exp.plan["rows"]}
    assert rows["cuda_graph_gib"]["vllm"] == 0.36 and abs(rows["cuda_graph_gib"]["kvscope"] - 0.36) < 1e-6


def _recap(kv_in_use: str) -> str:
    return ("(Worker_TP0 pid=5) INFO 07-14 09:50:23 [gpu_worker.py:855] Free memory on device (77.57/79.11 GiB) on "
            "startup. Desired GPU memory utilization is (0.92, 72.78 GiB). Actual usage is 7.39 GiB for weight, 1.54 "
            "GiB for peak activation, 0.6 GiB for non-torch memory, and 2.04 GiB for CUDAGraph memory. Replace "
            "gpu_memory_utilization config with `--kv-cache-memory=65565989131` (61.06 GiB) to fit into requested "
            f"memory. Current kv cache memory in use is {kv_in_use} GiB.\n")


def test_the_logs_own_figures_tell_whether_the_graph_left_the_pool(tmp_path: Path) -> None:
    # the free-memory recap's format (vllm#48601): 72.78 - (7.39 + 1.54 + 0.6) = 63.25 GiB is the pool printed
    # there, so its 2.04 GiB graph came out of the 1 - util margin; a pool of 61.21 = 63.25 - 2.04 took it in
    public = explain(PUBLIC / "v0.2x-mrv2-tp4-free-memory-cudagraph-2.04-gib.log", Options(model="llama-3.1-8b"))
    assert public.kvscope_plan is not None and public.kvscope_plan.cuda_graph_bytes == 0
    assert "cuda_graph" not in public.plan["inputs"]["from_log"]
    log = tmp_path / "graph-in-pool.log"
    log.write_text(_recap("61.21"))
    exp = explain(log, Options(model="llama-3.1-8b"))
    assert exp.kvscope_plan is not None and exp.kvscope_plan.cuda_graph_bytes == int(2.04 * 2**30)
    rows = {r["item"]: r for r in exp.plan["rows"]}
    assert abs(rows["kv_cache_gib"]["kvscope"] - 61.21) < 0.01 and abs(rows["kv_cache_gib"]["vllm"] - 61.21) < 1e-9


def test_hybrid_concurrency_printed_with_its_tokens_is_judged_without_the_model(tmp_path: Path) -> None:
    # later releases print the tokens the concurrency implies, int(concurrency x max-model-len), so a hybrid
    # GDN model's figures hold as tokens / max-model-len for any layout: 1,676,933 / 262,144 = 6.397 -> 6.40x
    # on one line (wtdcode/vllm-backport#36), 302,921 / 131,072 = 2.311 -> 2.31x (no multiple of 16)
    for name, printed in (("vunknown-backport-hybrid-kv-one-line-concurrency.log", 6.40),
                          ("vunknown-hybrid-gdn-bare-kv-tokens-concurrency.log", 2.31)):
        (check,) = [c for c in explain(PUBLIC / name).checks if c.id == "concurrency"]
        assert check.ok is True and check.expected == printed, (name, check.detail)
    # the same form beside a hybrid layout's padding line: judged, and a concurrency the tokens do not
    # give is a failed check, not excused as per-group blocks
    log = tmp_path / "hybrid-new.log"
    line = ("(EngineCore pid=7) INFO 08-18 14:15:02 [kv_cache_utils.py:1733] GPU KV cache size: 1,676,933 tokens, "
            "Maximum concurrency for 262,144 tokens per request: {}x\n")
    padding = "(EngineCore pid=7) WARNING 08-18 14:15:02 [kv_cache_utils.py:1208] Add 3 padding layers, may waste at " \
              "most 6.25% KV cache memory\n"
    for printed, ok in (("6.40", True), ("7.40", False)):
        log.write_text(padding + line.format(printed))
        exp = explain(log)
        (check,) = [c for c in exp.checks if c.id == "concurrency"]
        assert check.ok is ok, check.detail
        (layout,) = [c for c in exp.checks if c.id == "hybrid_layout"]
        assert layout.ok is None and "concurrency x max-model-len" in layout.detail
