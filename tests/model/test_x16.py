"""Block weights interleaved by 16 rows (engine/model/kernels/csrc/quant_x16.cpp): every format
packed losslessly (its dequantize equals gguf-py's), the same sums as the plain block kernel within
float32 order on every ISA build here (the vpdpbusd path and the scalar reference), row counts that
are not a multiple of 16, mixed-format segments, reads that stay inside the weight, and the kernel
plan offering it only where it is native."""

from __future__ import annotations

import pytest
import torch

from engine.model.kernels import cpu_quant
from tests.model.test_cpu_quant import (
    FORMATS,
    SMALL_FORMATS,
    _before_guard_page,
    check_matmul,
    gguf_dequantize,
    isa_kernels_or_skip,
    random_blocks,
)


@pytest.fixture(scope="module")
def kernels() -> dict[str, object]:
    return isa_kernels_or_skip()


def _in_features(fmt: str) -> int:
    return 640 if fmt in SMALL_FORMATS else 512


@pytest.mark.parametrize("fmt", FORMATS)
def test_packing_is_lossless(kernels: dict[str, object], fmt: str) -> None:
    rows, in_features = 37, _in_features(fmt)
    blocks = random_blocks(fmt, rows, in_features, seed=rows)
    dense = gguf_dequantize(blocks, fmt)
    code = cpu_quant.format_id(fmt)
    for isa, kernel in kernels.items():
        packed = kernel.pack_x16(blocks, code)  # type: ignore[attr-defined]
        assert packed.shape[:2] == (3, in_features // 32), (isa, fmt)
        assert torch.equal(kernel.dequantize_x16(packed, rows, code), dense), (isa, fmt)  # type: ignore[attr-defined]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 9, 64])
def test_matmul_matches_the_plain_block_kernel(kernels: dict[str, object], fmt: str, m: int) -> None:
    """Against the activations rounded to int8 only float32 summation order differs (bound 1e-5
    relative RMS), and against float32 activations the int8 rounding (bound 1e-2)."""
    rows, in_features = 21, _in_features(fmt)
    blocks = random_blocks(fmt, rows, in_features, seed=m)
    dense = gguf_dequantize(blocks, fmt)
    x = torch.randn(m, in_features, generator=torch.Generator().manual_seed(m))
    code = cpu_quant.format_id(fmt)
    for isa, kernel in kernels.items():
        packed = kernel.pack_x16(blocks, code)  # type: ignore[attr-defined]
        got = kernel.x16_matmul_segments(x, [packed], [rows], [code])  # type: ignore[attr-defined]
        check_matmul(kernel, x, got, dense, (isa, fmt, m))
        plain = kernel.quant_matmul(x, blocks, code)  # type: ignore[attr-defined]
        assert torch.allclose(got, plain, rtol=1e-4, atol=1e-4), (isa, fmt, m)


def test_mixed_formats_side_by_side(kernels: dict[str, object]) -> None:
    """A fused projection whose parts differ (Gemma 3's QKV: Q5_0 and Q8_0; Q4_K_M's Q4_K and Q6_K)."""
    parts = [("q5_0", 20), ("q8_0", 7), ("q6_k", 16), ("q4_k", 3)]
    blocks = [random_blocks(fmt, rows, 512, seed=i) for i, (fmt, rows) in enumerate(parts)]
    codes = [cpu_quant.format_id(fmt) for fmt, _ in parts]
    x = torch.randn(11, 512, generator=torch.Generator().manual_seed(0))
    for isa, kernel in kernels.items():
        packs = [kernel.pack_x16(b, c) for b, c in zip(blocks, codes, strict=True)]  # type: ignore[attr-defined]
        got = kernel.x16_matmul_segments(x, packs, [r for _, r in parts], codes)  # type: ignore[attr-defined]
        want = kernel.quant_matmul_segments(x, blocks, codes, 1)  # type: ignore[attr-defined]
        assert got.shape == (11, 46) and torch.allclose(got, want, rtol=1e-4, atol=1e-4), isa


def test_native_only_on_the_vnni_build(kernels: dict[str, object]) -> None:
    for isa, kernel in kernels.items():
        assert kernel.x16_native() == (kernel.isa() == "avx512_vnni"), isa  # type: ignore[attr-defined]


def test_reads_stay_inside_the_weight(kernels: dict[str, object]) -> None:
    code = cpu_quant.format_id("q6_k")
    blocks = random_blocks("q6_k", 21, 256, seed=3)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(0))
    for isa, kernel in kernels.items():
        packed = kernel.pack_x16(blocks, code)  # type: ignore[attr-defined]
        want = kernel.x16_matmul_segments(x, [packed], [21], [code])  # type: ignore[attr-defined]
        guarded_blocks, blocks_map = _before_guard_page(blocks)
        assert torch.equal(kernel.pack_x16(guarded_blocks, code), packed), isa  # type: ignore[attr-defined]
        guarded, packed_map = _before_guard_page(packed)
        assert torch.equal(kernel.x16_matmul_segments(x, [guarded], [21], [code]), want), isa  # type: ignore[attr-defined]
        del guarded, guarded_blocks
        blocks_map.close()  # type: ignore[attr-defined]
        packed_map.close()  # type: ignore[attr-defined]


def test_a_wrong_packed_shape_is_named() -> None:
    if cpu_quant.load_kernel() is None:
        pytest.skip("CPU quant kernel unavailable")
    blocks = random_blocks("q8_0", 20, 64, seed=0)
    packed = cpu_quant.pack_x16(blocks, "q8_0")
    with pytest.raises(RuntimeError, match=r"x16 q8_0 weight of 40 rows and 64 in-features must be uint8 \[3, 2, 576\]"):
        cpu_quant.x16_matmul_segments(torch.randn(2, 64), [packed], [40], ["q8_0"])
    with pytest.raises(RuntimeError, match="must be a multiple of 32"):
        cpu_quant.x16_matmul_segments(torch.randn(2, 48), [packed], [20], ["q8_0"])


def test_the_plan_offers_it_where_native_and_holds_one_copy() -> None:
    from engine.model.layers.quantized_linear import BlockPart, QuantizedLinear, bind_kernels
    from engine.model.plan import candidates

    kernel = cpu_quant.load_kernel()
    if kernel is None:
        pytest.skip("CPU quant kernel unavailable")
    native = cpu_quant.x16_native()
    weight = torch.zeros(27, 640)
    q = QuantizedLinear((BlockPart("q5_0", random_blocks("q5_0", 20, 640, seed=1)),
                         BlockPart("q8_0", random_blocks("q8_0", 7, 640, seed=2))), 640, "gguf")
    bind_kernels([q], None, kernel)
    offered = candidates.candidates_for(weight, q, None, native_bf16=False, group="qkv")
    assert ("x16" in offered) == native, offered
    if native:
        impl = candidates.implementation("x16", weight, q, None, "qkv")
        x = torch.randn(3, 640)
        assert torch.allclose(impl.call(x), q.matmul(x), rtol=1e-4, atol=1e-4)
        (held,) = impl.extra.values()
        assert set(impl.extra) == {"x16"} and held.numel() == 3 * 20 * 576  # 2 + 1 groups of records, held once


def test_packing_into_a_shared_buffer_matches(kernels: dict[str, object]) -> None:
    """pack_x16_into a view of one buffer (the plan's one held copy per projection) gives pack_x16's bytes."""
    for isa, kernel in kernels.items():
        blocks = {fmt: random_blocks(fmt, 19, 512, seed=5) for fmt in ("q4_k", "q6_k", "q8_0")}
        shapes = {fmt: cpu_quant.x16_shape(19, 512, fmt, isa) for fmt in blocks}
        buffer = torch.zeros(sum(int(torch.tensor(s).prod()) for s in shapes.values()), dtype=torch.uint8)
        at = 0
        for fmt, b in blocks.items():
            n = int(torch.tensor(shapes[fmt]).prod())
            view = buffer[at:at + n].view(shapes[fmt])
            kernel.pack_x16_into(b, cpu_quant.format_id(fmt), view)  # type: ignore[attr-defined]
            assert torch.equal(view, kernel.pack_x16(b, cpu_quant.format_id(fmt))), (isa, fmt)  # type: ignore[attr-defined]
            at += n
