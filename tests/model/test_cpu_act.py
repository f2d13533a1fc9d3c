"""SiLU-and-multiply in one C++ pass (engine/model/kernels/cpu_act.py), and the MLP block that
feeds it a bf16 gate/up GEMM's output as it is (engine/model/families/llama.py ``mlp_block`` by the
kernel plan's routes): the same numbers as torch's separate ops, in every dtype pair."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model.families.llama import DecoderLayer
from engine.model.kernels import cpu_act
from engine.model.kernels.cpu_act import silu_and_mul
from engine.model.plan.routes import build_route
from engine.modelspec.readers import load_model_config

DTYPES = (torch.float32, torch.bfloat16)


@pytest.fixture(scope="module")
def act_kernel() -> object:
    module = cpu_act.KERNEL.get()
    if module is None:
        pytest.skip(f"the SiLU kernel is not built here: {cpu_act.KERNEL.unavailable_reason}")
    return module


@pytest.mark.parametrize("in_dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_the_kernel_computes_torchs_silu_and_mul(act_kernel: object, in_dtype: torch.dtype,
                                                 out_dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    # a slice of a wider tensor: rows strided as a fused projection's output may be
    gate_up = (4 * torch.randn(37, 2 * 96 + 8, generator=generator)).to(in_dtype)[:, : 2 * 96]
    expected = (F.silu(gate_up[:, :96].float()) * gate_up[:, 96:].float()).to(out_dtype)
    out = silu_and_mul(gate_up, out_dtype)
    assert out.dtype == out_dtype and out.shape == (37, 96) and out.is_contiguous()
    if out_dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    else:  # the same float32 product rounded once: at most one bf16 step apart, almost always equal
        ulp = expected.float().abs().clamp_min(1e-30) * 2.0**-7
        assert ((out.float() - expected.float()).abs() <= ulp).all()
        assert (out == expected).float().mean() > 0.99


def test_without_the_kernel_torch_runs_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    gate_up = torch.randn(5, 16, generator=torch.Generator().manual_seed(1))
    monkeypatch.setenv(cpu_act.KERNEL_ENV, "0")
    assert torch.equal(silu_and_mul(gate_up, torch.float32), F.silu(gate_up[:, :8]) * gate_up[:, 8:])
    widened = silu_and_mul(gate_up.to(torch.bfloat16), torch.float32)
    assert widened.dtype == torch.float32


def test_the_plan_routed_mlp_block_matches_the_separate_ops(act_kernel: object) -> None:
    """Gate/up and down by the plan's bf16 GEMMs: the block hands SiLU-and-multiply the bf16
    output and the down GEMM bf16 rows; the result equals the float32 round trip it replaced."""
    config = load_model_config("smollm2-135m")
    layer = DecoderLayer(config, torch.float32, "cpu")
    generator = torch.Generator().manual_seed(2)
    for p in layer.parameters():
        p.data.copy_(torch.randn(p.shape, generator=generator) * (1.0 if p.dim() == 1 else 0.05))
    gate_route, _ = build_route([(1 << 62, "bf16")], layer.gate_up_proj, None, None, "gate_up")
    down_route, _ = build_route([(1 << 62, "bf16")], layer.down_proj, None, None, "down")
    assert gate_route.computes_in(300) == torch.bfloat16 and gate_route.native(torch.ones(2, 576)).dtype == torch.bfloat16
    layer.projections["gate_up_proj"].route, layer.projections["down_proj"].route = gate_route, down_route
    hidden = torch.randn(300, config.hidden_size, generator=generator)
    out = layer.mlp_block(hidden)
    assert out.dtype == torch.float32
    x = F.rms_norm(hidden, (config.hidden_size,), layer.post_attention_layernorm, layer.eps)
    gate, up = gate_route(x).split(config.intermediate_size, dim=-1)  # float32 out of the bf16 GEMM
    before = hidden + down_route(F.silu(gate) * up)
    torch.testing.assert_close(out, before, rtol=0, atol=2e-3 * before.abs().max().item())
