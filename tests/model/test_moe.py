"""The sparse MoE block (engine/model/layers/moe.py) against transformers' Qwen3-MoE block on the
same weights, and its expert counts against the router's own top-k."""

from __future__ import annotations

import pytest
import torch

from engine.events.folds.expert_load import ExpertLoad
from engine.model.layers.moe import ExpertCounter, grouped_experts, route


def _hf_block(norm_topk_prob: bool, seed: int = 0):
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = transformers.Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32, num_experts=8,
                                         num_experts_per_tok=2, norm_topk_prob=norm_topk_prob)
    config._experts_implementation = "eager"  # transformers' plain loop over active experts, the reference
    block = Qwen3MoeSparseMoeBlock(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    return block


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_grouped_experts_equal_transformers_block(norm_topk_prob: bool) -> None:
    block = _hf_block(norm_topk_prob)
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected = block(x[None])[0]
        weights, ids = route(x, block.gate.weight, 2, norm_topk_prob)
        ours, counts = grouped_experts(x, block.experts.gate_up_proj, block.experts.down_proj, weights, ids)
        _, hf_weights, hf_ids = block.gate(x)
    assert torch.equal(ids, hf_ids)
    assert float((weights - hf_weights).abs().max()) < 1e-6
    assert float((ours - expected).abs().max()) < 1e-5
    # the counts the step event carries are the router's: each token once per chosen expert
    assert counts.tolist() == torch.bincount(hf_ids.reshape(-1), minlength=8).tolist()
    assert int(counts.sum()) == 37 * 2


def test_an_idle_expert_runs_nothing_and_counts_zero() -> None:
    block = _hf_block(True)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    ids = torch.tensor([[0, 5], [5, 0], [0, 5]])
    weights = torch.full((3, 2), 0.5)
    with torch.inference_mode():
        out, counts = grouped_experts(x, block.experts.gate_up_proj, block.experts.down_proj, weights, ids)
        expected = block.experts(x, ids, weights)
    assert counts.tolist() == [3, 0, 0, 0, 0, 3, 0, 0]
    assert float((out - expected).abs().max()) < 1e-5


def test_the_fold_sums_a_window_and_names_the_hot_expert() -> None:
    counter = ExpertCounter([0, 1], num_experts=4)
    load = ExpertLoad(window=2)
    steps = [
        [[4, 0, 0, 0], [1, 1, 1, 1]],
        [[4, 0, 0, 0], [2, 2, 0, 0]],
        [[0, 2, 1, 1], [1, 1, 1, 1]],  # the first step leaves the window
    ]
    for step in steps:
        for slot, row in enumerate(step):
            counter.add(slot, torch.tensor(row))
        taken = counter.take()
        assert taken == step
        load.add(taken)
    assert counter.take() is None  # nothing since the last take
    assert load.totals == [[4, 2, 1, 1], [3, 3, 1, 1]]
    assert load.layer_imbalance(0) == pytest.approx(4 / 2)
    hot = load.hot_expert()
    assert hot is not None and (hot.layer, hot.expert, hot.tokens, hot.layer_tokens) == (0, 0, 4, 8)
    assert ExpertLoad.from_dict(load.to_dict()).totals == load.totals
    whole = ExpertLoad(window=None)
    for step in steps:
        whole.add(step)
    assert whole.totals == [[8, 2, 1, 1], [4, 4, 2, 2]] and whole.steps_in_window == 3 and not whole.steps
