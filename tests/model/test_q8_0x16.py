"""The Q8_0 weight interleaved by 16 rows (engine/model/kernels/csrc/quant_q8_0x16.cpp): lossless
against gguf-py's dequantize, the same sums as the plain Q8_0 matmul within float32 order on every
ISA build here (the vpdpbusd path and the scalar reference), row counts that are not a multiple of
16, reads that stay inside the weight, and the kernel plan offering it only where it is native."""

from __future__ import annotations

import pytest
import torch

from engine.model.kernels import cpu_quant
from tests.model.test_cpu_quant import _before_guard_page, check_matmul, gguf_dequantize, random_blocks


@pytest.fixture(scope="module")
def kernels() -> dict[str, object]:
    from tests.model.test_cpu_quant import _isa_kernels

    found = _isa_kernels()
    if not found:
        pytest.skip(f"CPU quant kernel unavailable: {cpu_quant.unavailable_reason('native')}")
    return found


@pytest.mark.parametrize(("rows", "in_features"), [(37, 640), (16, 32), (5, 96), (48, 256)])
def test_packing_is_lossless(kernels: dict[str, object], rows: int, in_features: int) -> None:
    blocks = random_blocks("q8_0", rows, in_features, seed=rows)
    dense = gguf_dequantize(blocks, "q8_0")
    for isa, kernel in kernels.items():
        packed = kernel.pack_q8_0x16(blocks)  # type: ignore[attr-defined]
        assert packed.shape == (-(-rows // 16), in_features // 32, 576), isa
        assert torch.equal(kernel.dequantize_q8_0x16(packed, rows), dense), isa  # type: ignore[attr-defined]


@pytest.mark.parametrize("m", [1, 3, 8, 9, 17, 64])
def test_matmul_matches_the_plain_q8_0_kernel(kernels: dict[str, object], m: int) -> None:
    """Against the activations rounded to int8 only float32 summation order differs (bound 1e-5
    relative RMS), and against float32 activations the int8 rounding (bound 1e-2)."""
    rows, in_features = 37, 640
    blocks = random_blocks("q8_0", rows, in_features, seed=m)
    dense = gguf_dequantize(blocks, "q8_0")
    x = torch.randn(m, in_features, generator=torch.Generator().manual_seed(m))
    for isa, kernel in kernels.items():
        packed = kernel.pack_q8_0x16(blocks)  # type: ignore[attr-defined]
        got = kernel.q8_0x16_matmul(x, packed, rows)  # type: ignore[attr-defined]
        check_matmul(kernel, x, got, dense, (isa, m))
        plain = kernel.quant_matmul(x, blocks, cpu_quant.format_id("q8_0"))  # type: ignore[attr-defined]
        assert torch.allclose(got, plain, rtol=1e-4, atol=1e-4), (isa, m)


def test_native_only_on_the_vnni_build(kernels: dict[str, object]) -> None:
    for isa, kernel in kernels.items():
        assert kernel.q8_0x16_native() == (kernel.isa() == "avx512_vnni"), isa  # type: ignore[attr-defined]


def test_reads_stay_inside_the_weight(kernels: dict[str, object]) -> None:
    blocks = random_blocks("q8_0", 21, 96, seed=3)
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(0))
    for isa, kernel in kernels.items():
        packed = kernel.pack_q8_0x16(blocks)  # type: ignore[attr-defined]
        want = kernel.q8_0x16_matmul(x, packed, 21)  # type: ignore[attr-defined]
        guarded_blocks, blocks_map = _before_guard_page(blocks)
        assert torch.equal(kernel.pack_q8_0x16(guarded_blocks), packed), isa  # type: ignore[attr-defined]
        guarded, packed_map = _before_guard_page(packed)
        assert torch.equal(kernel.q8_0x16_matmul(x, guarded, 21), want), isa  # type: ignore[attr-defined]
        del guarded, guarded_blocks
        blocks_map.close()  # type: ignore[attr-defined]
        packed_map.close()  # type: ignore[attr-defined]


def test_a_wrong_packed_shape_is_named() -> None:
    if cpu_quant.load_kernel() is None:
        pytest.skip("CPU quant kernel unavailable")
    blocks = random_blocks("q8_0", 20, 64, seed=0)
    packed = cpu_quant.pack_q8_0x16(blocks)
    with pytest.raises(RuntimeError, match=r"q8_0x16 weight of 40 rows and 64 in-features must be uint8 \[3, 2, 576\]"):
        cpu_quant.q8_0x16_matmul(torch.randn(2, 64), packed, 40)
    with pytest.raises(RuntimeError, match="must be a multiple of 32"):
        cpu_quant.q8_0x16_matmul(torch.randn(2, 48), packed, 20)


def test_the_plan_offers_it_for_a_q8_0_weight_where_native() -> None:
    from engine.model.layers.quantized_linear import QuantizedLinear, bind_kernels
    from engine.model.plan import candidates

    if cpu_quant.load_kernel() is None:
        pytest.skip("CPU quant kernel unavailable")
    native = cpu_quant.q8_0x16_native()
    weight = torch.zeros(37, 640)
    for fmt in ("q8_0", "q5_0"):
        q = QuantizedLinear.single(random_blocks(fmt, 37, 640, seed=1), fmt, "gguf")
        bind_kernels([q], None, cpu_quant.load_kernel())
        offered = candidates.candidates_for(weight, q, None, native_bf16=False, group="head")
        assert ("q8_0x16" in offered) == (native and fmt == "q8_0"), (fmt, offered)
    if native:
        impl = candidates.implementation("q8_0x16", weight, q := QuantizedLinear.single(
            random_blocks("q8_0", 37, 640, seed=2), "q8_0", "gguf"), None, "head")
        x = torch.randn(3, 640)
        assert torch.allclose(impl.call(x), cpu_quant.quant_matmul(x, q.blocks, "q8_0"), rtol=1e-4, atol=1e-4)
        assert set(impl.extra) == {"q8_0x16"}
