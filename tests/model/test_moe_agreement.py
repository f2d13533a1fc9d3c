"""Mixture-of-experts families (Qwen3-MoE with every layer sparse, Qwen3-MoE with a dense
layer and unrenormalised top-k, Mixtral) from tiny random-weight checkpoints built here with
transformers (tests/model/tiny_moe.py: 2 layers, 8 experts, top-2), through kvscope's real
path (HF-folder config, safetensors loader, the registry's model class, the paged cache on
scattered blocks, chunked prefill beside decodes, a preemption with recompute:
tests/model/test_family_agreement.py's ``run_kvscope``) against transformers in fp32; the
expert counts the runner hands to the step event against transformers' own router top-k;
the exact total / active parameter counts (of the checkpoints and of the presets, on the meta device)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.model.runner import ModelRunner, ScheduledSeq
from engine.modelspec.families import check_gguf_supported
from engine.modelspec.readers import load_model_config
from tests.model.test_family_agreement import (
    BLOCK_SIZE,
    MAX_LOGIT_DIFF,
    NUM_BLOCKS,
    assert_agrees,
    last_row_diff,
    prompts,
)
from tests.model.tiny_moe import MOE_SHAPES, VARIANT_NAMES, save_tiny_moe, write_tiny_moe_gguf

# Measured (fp32, AVX-512 BF16 Zen 4, 2 threads, shared machine): see the test's print; the
# dense families' MAX_LOGIT_DIFF (1e-4, assert_agrees): a routing flip or a missing
# renormalisation moves the logits by far more (test_unrenormalised_routing_is_caught).


class _Checkpoints(dict[str, tuple[Path, object]]):
    """variant -> (HF folder, transformers model), each built on first use (the default suite
    builds only the one it runs)."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root

    def __missing__(self, variant: str) -> tuple[Path, object]:
        self[variant] = (self.root / variant, save_tiny_moe(variant, self.root / variant))
        return self[variant]


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> _Checkpoints:
    pytest.importorskip("transformers")
    return _Checkpoints(tmp_path_factory.mktemp("tiny-moe"))


# The default suite runs one variant of each check (each ~1-2 s on a quiet 2-core machine, like the
# dense families'; ~20 s while the shared machine is loaded); the others are slow.
def _variants(default: str, names: tuple[str, ...] = VARIANT_NAMES) -> list[object]:
    return [v if v == default else pytest.param(v, marks=pytest.mark.slow) for v in names]


def _runner(folder: Path) -> ModelRunner:
    runner = ModelRunner(load_model_config(str(folder)), dtype="float32", block_size=BLOCK_SIZE,
                         attention_backend="torch")
    runner.load_weights()
    runner.allocate_kv_cache(NUM_BLOCKS)
    return runner


@pytest.mark.parametrize(("variant", "source"), [
    *(pytest.param(v, "hf", marks=() if v == "qwen3moe" else pytest.mark.slow) for v in VARIANT_NAMES),
    pytest.param("qwen3moe", "gguf", marks=pytest.mark.slow)])
def test_agrees_with_transformers_through_paging_and_preemption(variant: str, source: str, tiny_moe) -> None:
    """``source`` gguf: the same weights as llama.cpp writes a Qwen3-MoE (architecture qwen3moe,
    experts stacked per projection), through the GGUF loader and the dequantized-weights cache."""
    folder, hf_model = tiny_moe[variant]
    if source == "gguf":
        folder = write_tiny_moe_gguf(hf_model, folder.with_suffix(".gguf"))
        check_gguf_supported(folder)  # the header check before phase C: architecture, tokenizer, types
    config = load_model_config(str(folder))
    assert config.source == source
    assert config.architecture == {"mixtral": "mixtral", "qwen2moe": "qwen2_moe", "gguf": "qwen3moe"}.get(
        source if source == "gguf" else variant, "qwen3_moe")
    assert config.norm_topk_prob is (variant not in ("qwen3moe-mixed", "qwen2moe"))
    assert (config.num_experts, config.num_experts_per_tok) == (8, 2)
    assert config.num_moe_layers == (1 if variant == "qwen3moe-mixed" else 2)
    total = sum(p.numel() for p in hf_model.parameters())
    experts = sum(p.numel() for n, p in hf_model.named_parameters() if ".experts." in n)  # not the shared one
    assert (config.num_parameters, config.expert_parameters) == (total, experts)
    assert config.num_active_parameters == total - experts * 6 // 8  # 2 of 8 experts run
    assert_agrees(_runner(folder), hf_model, f"{variant} ({source})")


@pytest.mark.parametrize("variant", _variants("qwen3moe", ("qwen3moe", "mixtral", "qwen2moe")))
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
    assert last_row_diff(config, hf_model) > 100 * MAX_LOGIT_DIFF


# The presets' config.json facts (engine/modelspec/presets.py) as transformers' configs.
PRESET_CONFIGS = {
    "qwen3-30b-a3b": ("Qwen3MoeConfig", {
        "num_hidden_layers": 48, "hidden_size": 2048, "intermediate_size": 6144, "vocab_size": 151936,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
        "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False}),
    "mixtral-8x7b": ("MixtralConfig", {
        "num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 14336, "vocab_size": 32000,
        "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
        "tie_word_embeddings": False}),
}


@pytest.mark.parametrize("preset", sorted(PRESET_CONFIGS))
def test_preset_counts_equal_transformers_on_the_meta_device(preset: str) -> None:
    """Exact total, expert and active counts of the MoE presets against transformers' model of the
    same config built on the meta device (shapes only: nothing allocated, nothing downloaded)."""
    transformers = pytest.importorskip("transformers")
    from engine.modelspec.presets import MODEL_PRESETS

    class_name, fields = PRESET_CONFIGS[preset]
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, class_name)(**fields))
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    config = MODEL_PRESETS[preset]
    assert (config.num_parameters, config.expert_parameters) == (total, experts)
    top_k, num_experts = fields["num_experts_per_tok"], config.num_experts
    assert config.num_active_parameters == total - experts // num_experts * (num_experts - top_k)
    # the model cards' figures: Qwen3-30B-A3B 30.5B total / 3.3B activated; Mixtral 46.7B / 12.9B
    assert (round(total / 1e9, 1), round(config.num_active_parameters / 1e9, 1)) == {
        "qwen3-30b-a3b": (30.5, 3.4), "mixtral-8x7b": (46.7, 12.9)}[preset]


def test_engine_plan_shows_total_active_and_expert_weights(tiny_moe, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from engine.cli import main

    folder, hf_model = tiny_moe["qwen3moe"]
    assert main(["plan", "--model", str(folder), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    total = sum(p.numel() for p in hf_model.parameters())
    experts = sum(p.numel() for n, p in hf_model.named_parameters() if ".experts." in n)
    assert (plan["num_parameters"], plan["expert_parameters"]) == (total, experts)
    assert plan["num_active_parameters"] == total - experts * 6 // 8
    assert (plan["num_experts"], plan["num_experts_per_tok"], plan["num_moe_layers"]) == (8, 2, 2)
    assert main(["plan", "--model", "qwen3-30b-a3b", "--gpu", "H100"]) == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert ("30,532,122,624 parameters, 3,353,032,704 active per token: 8 of 128 experts in 48 MoE layers; "
            "expert weights 28,991,029,248 parameters, 54.00 GiB") in head


def test_tensor_parallelism_is_refused_for_moe_before_loading() -> None:
    from engine.errors import UserError
    from engine.modelspec.families import check_config_supported
    from engine.modelspec.presets import MODEL_PRESETS

    for preset in ("qwen3-30b-a3b", "mixtral-8x7b"):
        check_config_supported(MODEL_PRESETS[preset], 1)
        with pytest.raises(UserError, match=r"--tensor-parallel-size 2 .* does not shard experts yet .* on one rank"):
            check_config_supported(MODEL_PRESETS[preset], 2)
