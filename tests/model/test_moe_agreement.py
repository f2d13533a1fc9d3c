"""Mixture-of-experts families (Qwen3-MoE with every layer sparse, Qwen3-MoE with a dense
layer and unrenormalised top-k, Mixtral) from tiny random-weight checkpoints built here with
transformers (tests/model/tiny_moe.py: 2 layers, 8 experts, top-2), through kvscope's real
path (HF-folder config, safetensors loader, the registry's model class, the paged cache on
scattered blocks, chunked prefill beside decodes, a preemption with recompute:
tests/model/test_family_agreement.py's ``run_kvscope``) against transformers in fp32; the
expert counts the runner hands to the step event against transformers' own router top-k;
the exact total / active parameter counts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.model.runner import ModelRunner, ScheduledSeq
from engine.modelspec.readers import load_model_config
from tests.model.test_family_agreement import (
    BLOCK_SIZE,
    NEW_TOKENS,
    NUM_BLOCKS,
    prompts,
    reference,
    run_kvscope,
)
from tests.model.tiny_moe import MOE_SHAPES, VARIANT_NAMES, save_tiny_moe

# Measured (fp32, AVX-512 BF16 Zen 4, 2 threads, shared machine): see the test's print; the
# same 1e-4 as the dense families: a routing flip or a missing renormalisation moves the
# logits by far more (test_unrenormalised_routing_is_caught).
MAX_LOGIT_DIFF = 1e-4


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, object]]:
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("tiny-moe")
    return {variant: (root / variant, save_tiny_moe(variant, root / variant)) for variant in VARIANT_NAMES}


def _runner(folder: Path) -> ModelRunner:
    runner = ModelRunner(load_model_config(str(folder)), dtype="float32", block_size=BLOCK_SIZE,
                         attention_backend="torch")
    runner.load_weights()
    runner.allocate_kv_cache(NUM_BLOCKS)
    return runner


@pytest.mark.parametrize("variant", VARIANT_NAMES)
def test_agrees_with_transformers_through_paging_and_preemption(variant: str, tiny_moe) -> None:
    folder, hf_model = tiny_moe[variant]
    config = load_model_config(str(folder))
    assert config.architecture == {"mixtral": "mixtral"}.get(variant, "qwen3_moe")
    assert (config.num_experts, config.num_experts_per_tok) == (8, 2)
    assert config.num_moe_layers == (1 if variant == "qwen3moe-mixed" else 2)
    runner = _runner(folder)
    prompt_ids = prompts(config.vocab_size)
    ours_tokens, ours_rows = run_kvscope(runner, prompt_ids)
    worst, margin = 0.0, float("inf")
    for prompt, tokens, rows in zip(prompt_ids, ours_tokens, ours_rows, strict=True):
        ref_tokens, ref_rows = reference(hf_model, prompt)
        assert tokens == ref_tokens
        worst = max(worst, float((rows - ref_rows).abs().max()))
        top2 = ref_rows.topk(2, dim=-1).values
        margin = min(margin, float((top2[:, 0] - top2[:, 1]).min()))
    print(f"\n{variant}: 3 prompts x {NEW_TOKENS} greedy tokens equal; max |logit diff| {worst:.2e}; "
          f"smallest top-1 margin {margin:.2e}")
    assert worst < MAX_LOGIT_DIFF
    assert margin > 100 * worst


@pytest.mark.parametrize("variant", ["qwen3moe", "mixtral"])
def test_expert_counts_equal_the_routers_top_k(variant: str, tiny_moe) -> None:
    """The counts the runner takes after a step (what the step event carries) are, per MoE
    layer, the bincount of transformers' own router top-k over the step's tokens: two
    prompts' prefills in one step here."""
    folder, hf_model = tiny_moe[variant]
    runner = _runner(folder)
    first, second = prompts(runner.model_config.vocab_size)[:2]
    runner.logits_for([ScheduledSeq("a", first, 0, list(range(0, 16))),
                       ScheduledSeq("b", second, 0, list(range(16, 32)))])
    counts = runner.last_expert_counts
    expected = [[0] * MOE_SHAPES["num_experts"] for _ in range(2)]
    with torch.inference_mode():
        for prompt in (first, second):
            out = hf_model(torch.tensor([prompt]), output_router_logits=True)
            for layer, logits in enumerate(out.router_logits):
                top = logits.reshape(len(prompt), -1).topk(MOE_SHAPES["num_experts_per_tok"], dim=-1).indices
                for expert, n in enumerate(torch.bincount(top.reshape(-1), minlength=8).tolist()):
                    expected[layer][expert] += n
    assert counts == expected
    assert all(sum(row) == 2 * (len(first) + len(second)) for row in counts)
    runner.logits_for([ScheduledSeq("a", [5], len(first), list(range(0, 16)))])  # the next step: its own counts
    assert [sum(row) for row in runner.last_expert_counts] == [2, 2]


def test_unrenormalised_routing_is_caught(tiny_moe) -> None:
    """The comparison can fail: Qwen3-MoE run with the wrong ``norm_topk_prob`` misses by far more than the bound."""
    import dataclasses

    folder, hf_model = tiny_moe["qwen3moe"]
    config = dataclasses.replace(load_model_config(str(folder)), norm_topk_prob=False)
    runner = ModelRunner(config, dtype="float32", block_size=BLOCK_SIZE, attention_backend="torch")
    runner.load_weights()
    runner.allocate_kv_cache(NUM_BLOCKS)
    prompt = prompts(config.vocab_size)[1]
    ours = runner.logits_for([ScheduledSeq("x", prompt, 0, list(range(16)))])["x"]
    with torch.inference_mode():
        ref = hf_model(torch.tensor([prompt])).logits[0, -1].float()
    assert float((ours - ref).abs().max()) > 100 * MAX_LOGIT_DIFF


def test_exact_total_and_active_parameter_counts(tiny_moe) -> None:
    for variant, (folder, hf_model) in tiny_moe.items():
        config = load_model_config(str(folder))
        total = sum(p.numel() for p in hf_model.parameters())
        experts = sum(p.numel() for n, p in hf_model.named_parameters() if ".experts." in n)
        assert (config.num_parameters, config.expert_parameters) == (total, experts), variant
        assert config.num_active_parameters == total - experts * 6 // 8, variant  # 2 of 8 experts run
