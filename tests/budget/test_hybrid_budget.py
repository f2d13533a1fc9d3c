"""The budget formula for models with sliding-window layers: vLLM V1's hybrid layout
(kv_cache_utils.get_kv_cache_config_from_groups, _report_kv_cache_config,
get_max_concurrency_for_kv_cache_config; kv_cache_interface's max_memory_usage_bytes).

Every expected number is worked by hand in the comment above it, or printed by a real
vLLM log (tests/data/vllm-logs/index.tsv names its source).

Gemma 3 27B (config.json): 62 layers, 16 KV heads of dim 128, bf16, window 1024, five
sliding layers then one full: full layers 5, 11, ..., 59 (10), sliding 52.
  one layer per token   = 2 (K, V) x 16 x 128 x 2 B = 8,192 B
  page (16 tokens)      = 131,072 B
  grouping              : group size = 10 (the full layers; 52 >= 1.5 x 10), sliding
                          52 -> ceil(52 / 10) = 6 groups (9, 9, 9, 9, 8, 8 layers), full 1 group
                          -> 7 groups, G = 10 (8 padding layers: vLLM warns "Add 8 padding
                          layers, may waste at most 15.38%")
  block                 = page x G = 1,310,720 B
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from engine.budget.memory import GiB, MemoryPlan, blocks_per_request, check_plan_fits, plan_memory
from engine.config import EngineConfig
from engine.errors import BudgetError
from engine.modelspec.presets import MODEL_PRESETS
from engine.modelspec.readers import load_model_config
from engine.sim.simulate import build_setup

G27 = MODEL_PRESETS["gemma-3-27b"]
G4 = MODEL_PRESETS["gemma-3-4b"]


def plan27(pool_gib: float, max_model_len: int, **kw: Any) -> MemoryPlan:
    return plan_memory(model=G27, total_bytes=100 * GiB, gpu_memory_utilization=0.9, max_model_len=max_model_len,
                       kv_cache_memory_bytes=int(pool_gib * GiB), check_fits=False, **kw)


def test_presets_shapes_and_exact_parameter_counts() -> None:
    # 4B: q = 8 x 256 = 2048, kv = 4 x 256 = 1024; per layer: attention 2560 x 2048 + 2 x 2560 x 1024
    # + 2048 x 2560 = 15,728,640; MLP 3 x 2560 x 10240 = 78,643,200; four norms 4 x 2560 + q/k norms
    # 2 x 256 = 10,752 -> 94,382,592 x 34 = 3,209,008,128; embedding (tied) 262,208 x 2560 =
    # 671,252,480; final norm 2560 -> 3,880,263,168.
    assert G4.num_parameters == 3_880_263_168
    # 27B: q = 32 x 128 = 4096, kv = 16 x 128 = 2048; attention 3 x 22,020,096 = 66,060,288; MLP
    # 3 x 5376 x 21504 = 346,816,512; norms 4 x 5376 + 2 x 128 = 21,760 -> 412,898,560 x 62 =
    # 25,599,710,720; embedding 262,208 x 5376 = 1,409,630,208; final norm 5376 -> 27,009,346,304.
    assert G27.num_parameters == 27_009_346_304
    for model, layers, full in ((G4, 34, [5, 11, 17, 23, 29]), (G27, 62, list(range(5, 62, 6)))):
        assert model.layer_types is not None and len(model.layer_types) == layers
        assert [i for i, t in enumerate(model.layer_types) if t == "full_attention"] == full
        assert model.sliding_window == 1024 and model.vocab_size == 262_208
        assert model.max_position_embeddings == 131_072
    assert load_model_config("google/gemma-3-27b-it") is G27


def test_blocks_per_request_follows_vllms_max_memory_usage() -> None:
    # full attention: ceil(4096 / 16) = 256; window 1024 with 8192-token chunks: min(1023 + 8192, 4096)
    # = 4096 -> 256 + 1 = 257; at 131,072: min(9215, 131072) = 9215 -> ceil(9215 / 16) = 576 + 1 = 577
    assert blocks_per_request(None, 4096, 16, 8192) == 256
    assert blocks_per_request(1024, 4096, 16, 8192) == 257
    assert blocks_per_request(1024, 131_072, 16, 8192) == 577
    # a 100-token model: min(9215, 100) = 100 -> 7 + 1 (the window may straddle a block)
    assert blocks_per_request(1024, 100, 16, 8192) == 8


def test_gemma3_27b_reproduces_a_real_vllm_log() -> None:
    # The log (v0.11 ROCm, gemma-3-27b-it, max_model_len 4096, max_num_batched_tokens 8192) printed
    # "Available KV cache memory: 109.86 GiB", "GPU KV cache size: 205,696 tokens", "Maximum
    # concurrency for 4,096 tokens per request: 50.05x" and num_gpu_blocks 89994.
    # By hand: 109.86 GiB / 131,072 B = 899,973 pages // G 10 = 89,997 blocks (the printed GiB is
    # rounded: 89,994 blocks is 109.856 GiB); tokens = 89,997 // 7 groups x 16 = 12,856 x 16 = 205,696;
    # blocks per request = 256 (full) + 6 x 257 (sliding) = 1,798; 89,997 / 1,798 = 50.054 -> 50.05x.
    plan = plan27(109.86, 4096)
    assert plan.kv_cache_layout == "hybrid"
    assert plan.page_size_bytes == 131_072 and plan.layers_per_group == 10
    assert [len(g.layers) for g in plan.kv_cache_groups] == [9, 9, 9, 9, 8, 8, 10]
    assert [g.kind for g in plan.kv_cache_groups] == ["sliding_window"] * 6 + ["full_attention"]
    assert plan.num_blocks == 89_997 and abs(plan.num_blocks - 89_994) <= 4
    assert plan.kv_cache_tokens == 205_696
    assert plan.blocks_per_request == 1_798
    assert f"{plan.max_concurrency:.2f}" == "50.05"
    # vLLM's own block count gives the same two lines
    exact = plan.with_num_blocks(89_994)
    assert exact.kv_cache_tokens == 205_696 and f"{exact.max_concurrency:.2f}" == "50.05"


def test_gemma3_27b_20_gib_hybrid_against_full_attention() -> None:
    # Hybrid, 20 GiB pool, 131,072-token requests: 20 x 2^30 / 131,072 = 163,840 pages // 10 = 16,384
    # blocks; tokens 16,384 // 7 = 2,340 x 16 = 37,440; per request 8,192 + 6 x 577 = 11,654 blocks;
    # concurrency 16,384 / 11,654 = 1.4059.
    hybrid = plan27(20, 131_072)
    assert (hybrid.num_blocks, hybrid.kv_cache_tokens, hybrid.blocks_per_request) == (16_384, 37_440, 11_654)
    assert hybrid.max_concurrency == pytest.approx(16_384 / 11_654)
    assert hybrid.block_bytes == 1_310_720 and hybrid.bytes_per_token == 81_920
    # Full attention everywhere: 2 x 62 x 16 x 128 x 2 = 507,904 B per token, 8,126,464 B per block;
    # 21,474,836,480 / 8,126,464 = 2,642.6 -> 2,642 blocks, 42,272 tokens, 42,272 / 131,072 = 0.3225x.
    full = plan27(20, 131_072, disable_hybrid_kv_cache_manager=True)
    assert full.kv_cache_layout == "full_attention" and full.kv_cache_groups == ()
    assert (full.num_blocks, full.kv_cache_tokens, full.bytes_per_token) == (2_642, 42_272, 507_904)
    assert full.max_concurrency == pytest.approx(42_272 / 131_072)
    # the flag is exactly the full-attention formula: the same model without its windows
    plain = dataclasses.replace(G27, layer_types=None, sliding_window=None)
    same = plan_memory(model=plain, total_bytes=100 * GiB, gpu_memory_utilization=0.9, max_model_len=131_072,
                       kv_cache_memory_bytes=20 * GiB, check_fits=False)
    assert same.to_json() == full.to_json()
    assert "kv_cache_groups" not in same.to_json() and "kv_cache_layout" not in same.kv_cache_data().to_dict()


def test_gemma3_4b_matches_a_real_logs_size_and_concurrency_lines() -> None:
    # ovg-project/kvcached#215 (vLLM 0.11, gemma-3-4b-it, A100): "GPU KV cache size: 317,136 tokens",
    # "Maximum concurrency for 3,072 tokens per request: 102.78x", "Add 1 padding layers, may waste
    # at most 3.45%". 4B: 29 sliding + 5 full layers -> group size 5, ceil(29 / 5) = 6 sliding groups
    # (one padding layer: 1 / 29 = 3.45%) + 1 full = 7 groups. 317,136 / 16 = 19,821 = blocks // 7, so
    # the pool held 138,747 ... 138,753 blocks; per request: 3072 / 16 = 192 (full) + 6 x (192 + 1)
    # (min(1023 + mnbt, 3072) = 3072 for any mnbt >= 2049, 3071 -> also 192 for 2048) = 1,350;
    # 138,747 / 1,350 = 102.776 and 138,753 / 1,350 = 102.780: both print 102.78x.
    base = plan_memory(model=G4, total_bytes=100 * GiB, gpu_memory_utilization=0.9, max_model_len=3072,
                       kv_cache_memory_bytes=10 * GiB, check_fits=False)
    assert len(base.kv_cache_groups) == 7 and base.layers_per_group == 5 and base.blocks_per_request == 1_350
    for n in range(138_747, 138_754):
        plan = base.with_num_blocks(n)
        assert plan.kv_cache_tokens == 317_136
        assert f"{plan.max_concurrency:.2f}" == "102.78"
    # read as one full-attention table those tokens would mean 317,136 / 3,072 = 103.23x: not what vLLM printed
    assert f"{317_136 / 3072:.2f}" != "102.78"


def test_a_hybrid_pool_too_small_for_one_request_is_refused_with_vllms_estimate() -> None:
    # 10 GiB: 81,920 pages // 10 = 8,192 blocks < 11,654 per 131,072-token request. The longest length
    # that fits: for L >= 9,215 the sliding groups hold 6 x 577 = 3,462 blocks, so ceil(L / 16) <= 4,730
    # -> L <= 75,680 (vLLM's _estimate_max_model_len_from_groups binary-searches the same sum).
    plan = plan27(10, 131_072)
    assert plan.num_blocks == 8_192
    with pytest.raises(BudgetError, match=r"lower --max-model-len to 75,680 or less"):
        check_plan_fits(plan)
    # a 36,032-token pool (fewer tokens than one request) still serves a 131,072-token request
    # in a hybrid layout: the windows hold 577 blocks each, not 8,192
    ok = plan27(20, 131_072)
    assert ok.kv_cache_tokens < ok.max_model_len
    check_plan_fits(ok)


def test_simulator_uses_the_budgets_hybrid_pool() -> None:
    # engine simulate on the 27B preset with a 20 GiB pool: the scheduler gets the 16,384 blocks above
    # and the model's 7 groups.
    setup = build_setup("gemma-3-27b", "h100-80gb",
                        EngineConfig(max_model_len=131_072, kv_cache_memory_bytes=20 * GiB))
    assert setup.plan.num_blocks == 16_384 and setup.scheduler.num_blocks == 16_384
    assert len(setup.scheduler.kv_cache_groups) == 7
    assert setup.plan.kv_cache_data().to_dict()["blocks_per_request"] == 11_654
