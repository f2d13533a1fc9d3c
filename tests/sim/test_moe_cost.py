"""The roofline cost model of a mixture-of-experts model (engine/events/roofline.py, read by
``engine simulate``'s CostModel and /metrics' MFU estimates): FLOPs over the active
parameters, and of the expert weights only the experts a step's tokens are routed to."""

from __future__ import annotations

import dataclasses

import pytest

from engine.events.roofline import Roofline
from engine.modelspec.presets import MODEL_PRESETS
from engine.sim.simulate import build_setup

QWEN3_MOE = MODEL_PRESETS["qwen3-30b-a3b"]


def test_a_step_computes_over_active_parameters_and_reads_the_routed_experts() -> None:
    setup = build_setup(QWEN3_MOE, "H100")
    roofline = setup.cost.roofline
    weights, experts = setup.plan.weights_bytes, roofline.expert_weights_bytes
    assert experts == weights * QWEN3_MOE.expert_parameters // QWEN3_MOE.num_parameters  # 54 GiB of 56.9 in bf16
    assert roofline.flops(1) == 2.0 * 3_353_032_704
    # one decode token runs 8 of each layer's 128 experts: 1/16 of the expert weights
    assert roofline.read_bytes(0, 1) == pytest.approx(weights - experts + experts / 16, abs=1)
    # a 512-token prefill routes (uniformly) to every expert: all the weights
    assert roofline.read_bytes(0, 512) == pytest.approx(weights, rel=1e-9)
    assert roofline.read_bytes(0) == weights  # no token count given: everything (the dense reading)
    assert roofline.experts_read(32) == pytest.approx(1 - (120 / 128) ** 32)  # 87.3%


def test_moe_decode_is_cheaper_than_the_same_weights_dense() -> None:
    """Decoding one sequence reads ~6.2 GiB of Qwen3-30B-A3B's 56.9 GiB of weights (bf16: the 2.9 GiB
    outside the experts and 8/128 of the experts' 54): the simulated step is ~0.11 of a dense model of
    the same size's, and its FLOPs 1/9."""
    moe = build_setup(QWEN3_MOE, "H100").cost
    dense = dataclasses.replace(moe, expert_parameters=0, expert_weights_bytes=0, num_experts=0, experts_per_token=0)
    ratio = moe.step_seconds(1, 1024) / dense.step_seconds(1, 1024)
    assert 0.10 < ratio < 0.12
    assert moe.compute_seconds(4096) / dense.compute_seconds(4096) == pytest.approx(3_353_032_704 / 30_532_122_624)


def test_a_dense_roofline_is_unchanged() -> None:
    dense = Roofline(1000, 2000, 10)
    assert (dense.flops(3), dense.read_bytes(5), dense.read_bytes(5, 3)) == (6000.0, 2050, 2050)
