"""Weights kept only in the formats the kernel plan uses (issue 34): a float weight no step size
multiplies by (the GGUF blocks' GEMV, or a bf16/int8 copy, everywhere; the fused layer never
past its GEMV limit on it) is dropped, ``weights_bytes`` and phase C count what is held, the
logits do not change, and a later plan that multiplies by it makes it again from the blocks,
exactly. A one-layer model of SmolLM2's attention shapes (random weights set to their Q4_1
blocks' values, as a GGUF's are): well under a second once the kernels are built."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.model.kernels import cpu_gemv, cpu_layer
from engine.model.layers.projection_linear import holds_nothing
from engine.model.loading import weight_blocks
from engine.model.plan.kernel_plan import STEP_CLASSES, Cell, KernelPlan
from engine.model.runner import ModelRunner, ScheduledSeq

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
GROUP = {"qkv_proj": "qkv", "o_proj": "o", "gate_up_proj": "gate_up", "down_proj": "down"}


@pytest.fixture
def gguf_like_runner(smollm_config) -> ModelRunner:
    config = dataclasses.replace(smollm_config, num_layers=1, vocab_size=2048, intermediate_size=512)
    runner = ModelRunner(config, dtype="float32", quantization="int4", load_format="dummy")
    runner.load_weights()
    with torch.no_grad():
        for projection in runner.model.layers[0].projections.values():
            q = projection.blocks
            projection.weight.copy_(cpu_gemv.dequantize(q.blocks, q.fmt))
            q.source = "gguf"  # the float weights are now exactly the blocks' values, as a GGUF's
    runner.allocate_kv_cache(64)
    assert runner.enable_cpu_decode_kernel() is None
    return runner


def _plan(past_one_row: dict[str, str]) -> KernelPlan:
    """The GEMV at one row for every group; past it ``past_one_row[group]`` (default the GEMV)."""
    cells = [Cell(g, sc.name, sc.rows, "test", chosen="gemv" if sc.lo == 1 else past_one_row.get(g, "gemv"))
             for sc in STEP_CLASSES for g in ("qkv", "o", "gate_up", "down", "head")]
    return KernelPlan(cells=cells, fused_max_rows=cpu_layer.MAX_ROWS, isa="test")


def _logits(runner: ModelRunner) -> torch.Tensor:
    prompt = ScheduledSeq("p", list(range(100, 140)), 0, [0, 1, 2])
    decode = ScheduledSeq("d", [7], 40, [0, 1, 2])
    return torch.stack([runner.logits_for([prompt])["p"], runner.logits_for([decode])["d"]])


def _float_bytes(layer: torch.nn.Module, names) -> int:
    return sum(getattr(layer, n).numel() * 4 for n in names)


def test_float_weights_the_plan_never_uses_are_dropped_and_made_again(gguf_like_runner, cpu_layer_kernel) -> None:
    runner = gguf_like_runner
    model, layer = runner.model, runner.model.layers[0]
    originals = {n: getattr(layer, n).detach().clone() for n in PROJECTIONS}
    model.routing.install_plan(_plan({"head": "torch"}))
    everything = model.weights_bytes() + model.routing.dropped_float_bytes()
    reference = _logits(runner)
    # the GEMV at every step size and the fused layer within its GEMV limit: no float weight is read
    model.routing.install_plan(_plan({}))
    assert model.routing.dropped_float_bytes() == _float_bytes(layer, PROJECTIONS)
    assert model.weights_bytes() == everything - model.routing.dropped_float_bytes()
    assert torch.equal(_logits(runner), reference)
    # a plan that multiplies by QKV's float weight past one row: made again, exactly; gate/up's
    # packed bf16 copy serves every size past the GEMV (the fused layer runs its GEMV at every
    # size it serves): its float stays dropped, and no dense bf16 copy is kept beside the packed one
    model.routing.install_plan(_plan({"qkv": "torch", "gate_up": "bf16"}))
    assert torch.equal(layer.qkv_proj, originals["qkv_proj"])
    assert model.routing.dropped_float_bytes() == _float_bytes(layer, ("o_proj", "gate_up_proj", "down_proj"))
    bf16_copy = layer.gate_up_proj_bf16_packed if hasattr(layer, "gate_up_proj_bf16_packed") else layer.gate_up_proj_bf16
    assert not (hasattr(layer, "gate_up_proj_bf16_packed") and hasattr(layer, "gate_up_proj_bf16"))
    assert model.weights_bytes() == everything - model.routing.dropped_float_bytes() + bf16_copy.numel() * 2
    # a re-measurement starts from every float weight
    assert weight_blocks.restore_float_weights(model) == 3 and model.routing.dropped_float_bytes() == 0
    assert all(torch.equal(getattr(layer, n), originals[n]) for n in PROJECTIONS)


def test_the_tied_heads_float_weight_is_dropped_when_no_step_multiplies_by_it(gguf_like_runner,
                                                                                cpu_layer_kernel) -> None:
    """A tied head whose blocks are the file's (as Gemma 3's Q8_0 embedding): a plan that runs the
    GEMV at one row and its own packed fp32 copy past it never reads the float embedding, so it is
    not held (Gemma 3 270M: 640 MiB less); the embedding reads its rows from the blocks, the logits
    hold, and a plan that multiplies by the float weight makes it again, exactly."""
    runner = gguf_like_runner
    model = runner.model
    q = model.projections["head"].blocks
    with torch.no_grad():
        model.embed_tokens.copy_(q.dequantize())
    q.source, model._embed_blocks = "gguf", q  # what engine/model/loading/gguf_blocks.py sets for a tied GGUF head
    original = model.embed_tokens.detach().clone()
    model.routing.install_plan(_plan({"head": "torch"}))
    assert not holds_nothing(model.embed_tokens)
    reference = _logits(runner)
    model.routing.install_plan(_plan({"head": "fp32pack"}))
    assert holds_nothing(model.embed_tokens)
    assert model.routing.dropped_float_bytes() == _float_bytes(model.layers[0], PROJECTIONS) + original.numel() * 4
    torch.testing.assert_close(_logits(runner), reference, rtol=1e-4, atol=1e-4)  # oneDNN's sum order
    model.routing.install_plan(_plan({"head": "torch"}))
    assert torch.equal(model.embed_tokens, original)


def test_a_packed_weight_is_never_dropped(gguf_like_runner) -> None:
    """Blocks packed here from higher-precision floats cannot make those floats again: kept."""
    runner = gguf_like_runner
    for projection in runner.model.layers[0].projections.values():
        projection.blocks.source = "packed"
    runner.model.routing.install_plan(_plan({}))
    assert runner.model.routing.dropped_float_bytes() == 0


@pytest.mark.slow  # two engine starts of the bundled model (one measuring its plan): ~15 s quiet
def test_phase_c_counts_what_the_plan_keeps(tmp_path, monkeypatch) -> None:
    """Phase C's weights_bytes under this machine's plan is the constants' weights plus the plan's
    copies less the float weights it dropped; where the plan runs the GGUF blocks at every step
    size for every layer projection (Zen 4's, AVX2's), none of their float weights is held."""
    from engine.model.memory import profile_cache
    from engine.model.plan import setting
    from tests.model.test_kernel_plan import _phase_events

    monkeypatch.setenv(profile_cache.PROFILE_CACHE_ENV, str(tmp_path))
    planned = _phase_events(dtype="float32")  # with the plan off, auto would be the ISA rule: bf16 on Zen 4
    monkeypatch.setenv(setting.PLAN_ENV, "off")
    constants = _phase_events(dtype="float32")
    c, off = planned["C"], constants["C"]
    dropped = c["kernel_plan_dropped_bytes"]
    assert c["weights_bytes"] == off["weights_bytes"] + c["kernel_plan_bytes"] - dropped
    plan = KernelPlan.from_json(planned["F"]["kernel_plan"])
    if all(plan.gemv_limit(g) >= 1 << 62 for g in GROUP.values()):
        from engine.modelspec.readers import load_model_config

        config = load_model_config("smollm2-135m")
        h, i, q, kv = config.hidden_size, config.intermediate_size, config.num_attention_heads, config.num_kv_heads
        per_layer = (q + 2 * kv) * config.head_dim * h + h * q * config.head_dim + 2 * i * h + h * i
        # the tied head's float (the embedding) too, where no step size multiplies by it
        head = config.vocab_size * h * 4 if all(c != "torch" for _, c in plan.choices("head")) else 0
        assert dropped == config.num_layers * per_layer * 4 + head
