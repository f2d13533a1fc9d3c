"""GGUF block-type matmul kernels (engine/model/kernels/cpu_quant.py): every format on every ISA
build this CPU can run, against gguf-py's dequantize; dequantize bit-exact; the real Gemma 3 270M
file's tensors; the error messages."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.model.kernels import cpu_quant

FORMATS = tuple(cpu_quant.FORMAT_IDS)
SMALL_FORMATS = tuple(f for f in FORMATS if cpu_quant.block_geometry(f)[0] == 32)
# Byte offsets of each format's fp16 fields (ggml-common.h): (scale, min or None).
FP16_FIELDS = {"q4_0": (0, None), "q4_1": (0, 2), "q5_0": (0, None), "q5_1": (0, 2), "q8_0": (0, None),
               "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208, None)}
# Error bounds (relative RMS over the output): against the activations the kernel rounded to int8
# only float32 summation order differs; against float32 activations the int8 rounding (half a step
# of amax / 127 per value) adds ~0.3%.
INT8_REF_RTOL = 1e-5
FP32_REF_RTOL = 1e-2


def _isa_kernels() -> dict[str, object]:
    """Each build that compiles here, once per distinct path (an AVX2-only CPU has no avx512 path)."""
    found: dict[str, object] = {}
    for isa in cpu_quant.ISAS:
        kernel = cpu_quant.load_kernel(isa)
        if kernel is not None and kernel.isa() not in {k.isa() for k in found.values()}:  # type: ignore[attr-defined]
            found[isa] = kernel
    return found


def isa_kernels_or_skip() -> dict[str, object]:
    """:func:`_isa_kernels`, or skip the module when no build compiles here."""
    found = _isa_kernels()
    if not found:
        pytest.skip(f"CPU quant kernel unavailable: {cpu_quant.unavailable_reason('native')}")
    return found


@pytest.fixture(scope="module")
def kernels() -> dict[str, object]:
    return isa_kernels_or_skip()


def random_blocks(fmt: str, rows: int, in_features: int, seed: int) -> torch.Tensor:
    """Valid ``fmt`` bytes ``[rows, row_bytes]``: random quants and scale bytes, fp16 scales in a
    sane range (symmetric formats with either sign, minimums either sign)."""
    rng = np.random.default_rng(seed)
    weights, nbytes = cpu_quant.block_geometry(fmt)
    nblk = in_features // weights
    blocks = rng.integers(0, 256, size=(rows, nblk, nbytes), dtype=np.uint8)
    scale_at, min_at = FP16_FIELDS[fmt]
    scale = rng.uniform(0.002, 0.02, size=(rows, nblk)).astype(np.float16)
    if min_at is None and fmt != "q6_k":
        scale *= rng.choice(np.array([-1, 1], dtype=np.float16), size=scale.shape)
    if fmt == "q6_k":
        scale /= 16  # its int8 sub-scales go to +-128
    blocks[..., scale_at : scale_at + 2] = scale[..., None].view(np.uint8)
    if min_at is not None:
        low = rng.uniform(-0.1, 0.1, size=(rows, nblk)).astype(np.float16)
        if fmt in ("q4_k", "q5_k"):
            low = np.abs(low) / 8  # dmin, times a 6-bit min
        blocks[..., min_at : min_at + 2] = low[..., None].view(np.uint8)
    return torch.from_numpy(blocks.reshape(rows, nblk * nbytes))


def gguf_dequantize(blocks: torch.Tensor, fmt: str) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return torch.from_numpy(np.ascontiguousarray(dequantize(blocks.numpy(), GGMLQuantizationType[fmt.upper()])))


def rounded_activations(x: torch.Tensor) -> torch.Tensor:
    """x rounded per 32 values as the kernel does: d = amax / 127, q = round-half-even(x * (1 / d))."""
    rows, k = x.shape
    xb = x.float().reshape(rows, k // 32, 32)
    d = xb.abs().amax(dim=-1, keepdim=True) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    return (torch.round(xb * inv) * d).reshape(rows, k)


def rel_rms(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp(min=1e-30))


def check_matmul(kernel: object, x: torch.Tensor, got: torch.Tensor, dense: torch.Tensor, what: object) -> None:
    assert got.dtype == torch.float32 and got.shape == (x.shape[0], dense.shape[0]), what
    ref8 = rounded_activations(x).double() @ dense.double().T
    ref32 = x.double() @ dense.double().T
    assert rel_rms(got, ref8) < INT8_REF_RTOL, (what, rel_rms(got, ref8))
    assert rel_rms(got, ref32) < FP32_REF_RTOL, (what, rel_rms(got, ref32))


# ---------------------------------------------------------------------- layout and names
def test_geometry_and_names() -> None:
    assert cpu_quant.block_geometry("q4_k") == (256, 144) and cpu_quant.block_geometry(13) == (256, 176)
    assert cpu_quant.block_geometry("Q6_K") == (256, 210) and cpu_quant.block_geometry("q5_0") == (32, 22)
    assert cpu_quant.FORMAT_NAMES[cpu_quant.format_id("q8_0")] == "q8_0"
    assert cpu_quant.row_bytes("q4_0", 640) == 20 * 18
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    for name, code in cpu_quant.FORMAT_IDS.items():
        qtype = GGMLQuantizationType[name.upper()]
        assert int(qtype) == code and GGML_QUANT_SIZES[qtype] == cpu_quant.block_geometry(code)
    with pytest.raises(ValueError, match="unknown block format"):
        cpu_quant.format_id("q3_k")
    with pytest.raises(ValueError, match="multiple of q4_k's 256"):
        cpu_quant.row_bytes("q4_k", 640)


def test_isa_selection(monkeypatch: pytest.MonkeyPatch, kernels: dict[str, object]) -> None:
    monkeypatch.setenv(cpu_quant.ISA_ENV, "scalar")
    assert cpu_quant.selected_isa() == "scalar"
    if "scalar" in kernels:
        assert cpu_quant.load_kernel().isa() == "scalar"  # type: ignore[union-attr]
    monkeypatch.setenv(cpu_quant.ISA_ENV, "sse9")
    with pytest.raises(ValueError, match="KVSCOPE_CPU_QUANT_ISA"):
        cpu_quant.selected_isa()
    monkeypatch.delenv(cpu_quant.ISA_ENV)
    monkeypatch.setenv(cpu_quant.KERNEL_ENV, "0")
    assert cpu_quant.load_kernel() is None and cpu_quant.ensure_built() is None
    assert cpu_quant.unavailable_reason() == "KVSCOPE_CPU_QUANT_KERNEL=0"


# ---------------------------------------------------------------------- dequantize
@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_bit_exact(kernels: dict[str, object], fmt: str) -> None:
    k = 512 if fmt in SMALL_FORMATS else 768
    blocks = random_blocks(fmt, 13, k, seed=cpu_quant.format_id(fmt))
    expected = gguf_dequantize(blocks, fmt)
    rows = torch.tensor([[12, 0], [5, 5], [3, 11]])
    for isa, kernel in kernels.items():
        got = kernel.dequantize(blocks, cpu_quant.format_id(fmt))  # type: ignore[attr-defined]
        assert got.shape == (13, k) and torch.equal(got, expected), isa
        picked = kernel.dequantize_rows(blocks, cpu_quant.format_id(fmt), rows)  # type: ignore[attr-defined]
        assert picked.shape == (3, 2, k) and torch.equal(picked, expected[rows]), isa


# ---------------------------------------------------------------------- activations
def test_activation_rounding_matches_the_reference(kernels: dict[str, object]) -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 640, generator=gen) * torch.logspace(-3, 2, 640)
    x[1, :32] = 0.0  # an all-zero block: scale 0, quants 0
    for isa, kernel in kernels.items():
        q, d = kernel.quantize_activations(x)  # type: ignore[attr-defined]
        assert q.dtype == torch.int8 and d.shape == (5, 20)
        got = (q.float().reshape(5, 20, 32) * d[..., None]).reshape(5, 640)
        assert torch.equal(got, rounded_activations(x)), isa
        assert float(d[1, 0]) == 0.0 and not q[1, :32].any()


# ---------------------------------------------------------------------- matmul
# K = 256 * k for every format; 640 (Gemma 3 270M's hidden size) for the 32-weight ones.
@pytest.mark.parametrize(("fmt", "in_features"), [(f, k) for f in FORMATS for k in (256, 1024)]
                         + [(f, 640) for f in SMALL_FORMATS])
def test_matmul_matches_gguf_dequantize(kernels: dict[str, object], fmt: str, in_features: int) -> None:
    out = 67  # odd: no assumption on the output count
    blocks = random_blocks(fmt, out, in_features, seed=in_features + cpu_quant.format_id(fmt))
    dense = gguf_dequantize(blocks, fmt)
    gen = torch.Generator().manual_seed(in_features)
    for rows in (1, 3, 8, 17, 64):  # single rows, tiles and their tails
        x = torch.randn(rows, in_features, generator=gen)
        for isa, kernel in kernels.items():
            got = kernel.quant_matmul(x, blocks, cpu_quant.format_id(fmt))  # type: ignore[attr-defined]
            check_matmul(kernel, x, got, dense, (isa, fmt, rows))


@pytest.mark.parametrize("fmt", SMALL_FORMATS)
def test_small_blocks_in_features_not_a_multiple_of_128(kernels: dict[str, object], fmt: str) -> None:
    """32-weight formats take any multiple of 32 (a last partial group of 1..3 blocks)."""
    for in_features in (32, 96, 160, 576):
        blocks = random_blocks(fmt, 9, in_features, seed=in_features)
        dense = gguf_dequantize(blocks, fmt)
        x = torch.randn(5, in_features, generator=torch.Generator().manual_seed(in_features))
        for isa, kernel in kernels.items():
            got = kernel.quant_matmul(x, blocks, cpu_quant.format_id(fmt))  # type: ignore[attr-defined]
            check_matmul(kernel, x, got, dense, (isa, fmt, in_features))


def test_bf16_activations(kernels: dict[str, object]) -> None:
    blocks = random_blocks("q4_k", 40, 512, seed=1)
    dense = gguf_dequantize(blocks, "q4_k")
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(1)).bfloat16()
    for isa, kernel in kernels.items():
        got = kernel.quant_matmul(x, blocks, 12)  # type: ignore[attr-defined]
        check_matmul(kernel, x.float(), got, dense, isa)


def test_segments_with_mixed_types(kernels: dict[str, object]) -> None:
    """A fused projection whose parts have different types (as Q4_K_M files mix Q4_K and Q6_K)."""
    k = 1024
    parts = [("q4_k", 33), ("q6_k", 16), ("q8_0", 7), ("q5_0", 21), ("q5_k", 8), ("q4_1", 5), ("q5_1", 3),
             ("q4_0", 9)]
    blocks = [random_blocks(fmt, n, k, seed=i) for i, (fmt, n) in enumerate(parts)]
    dense = torch.cat([gguf_dequantize(b, fmt) for b, (fmt, _) in zip(blocks, parts, strict=True)])
    gen = torch.Generator().manual_seed(7)
    for rows in (1, 6, 17):
        x = torch.randn(rows, k, generator=gen)
        for isa, kernel in kernels.items():
            got = kernel.quant_matmul_segments(x, blocks, [cpu_quant.format_id(f) for f, _ in parts], 1)  # type: ignore[attr-defined]
            check_matmul(kernel, x, got, dense, (isa, rows))
            alone = kernel.quant_matmul(x, blocks[1], 14)  # type: ignore[attr-defined]
            assert torch.equal(got[:, 33:49], alone), isa  # the same sums, whichever way it is called


def test_two_passes_round_the_remainder_again(kernels: dict[str, object]) -> None:
    """passes=2 on one row: what the int8 rounding left of x is rounded and multiplied too, the two
    products summed; with an outlier channel (Gemma 3's down-projection inputs) the error drops ~100x.
    More rows (where the second row's work would no longer hide behind the weights' streaming) round once."""
    k, rows = 512, 1
    parts = [("q6_k", 24), ("q4_k", 8), ("q5_0", 9)]
    blocks = [random_blocks(fmt, n, k, seed=20 + i) for i, (fmt, n) in enumerate(parts)]
    codes = [cpu_quant.format_id(f) for f, _ in parts]
    dense = torch.cat([gguf_dequantize(b, fmt) for b, (fmt, _) in zip(blocks, parts, strict=True)])
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(11))
    x[:, 37] = 60.0  # one outlier sets its block's scale: the rest of the block keeps ~2 levels
    exact = x.double() @ dense.double().T
    for isa, kernel in kernels.items():
        one = kernel.quant_matmul_segments(x, blocks, codes, 1)  # type: ignore[attr-defined]
        two = kernel.quant_matmul_segments(x, blocks, codes, 2)  # type: ignore[attr-defined]
        rest = x - rounded_activations(x)
        want = one + kernel.quant_matmul_segments(rest, blocks, codes, 1)  # type: ignore[attr-defined]
        assert torch.allclose(two, want, rtol=1e-5, atol=1e-5 * float(want.abs().max())), isa
        assert rel_rms(two, exact) < rel_rms(one, exact) / 50, (isa, rel_rms(two, exact), rel_rms(one, exact))
        assert torch.equal(cpu_quant.quant_matmul_segments(x, blocks, codes, isa=isa, passes=2), two), isa
        batch = torch.cat([x, x])
        assert torch.equal(kernel.quant_matmul_segments(batch, blocks, codes, 2),  # type: ignore[attr-defined]
                           kernel.quant_matmul_segments(batch, blocks, codes, 1)), isa  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="passes is 1 or 2"):
        next(iter(kernels.values())).quant_matmul_segments(x, blocks, codes, 3)  # type: ignore[attr-defined]


def test_python_wrappers_follow_the_isa_setting(monkeypatch: pytest.MonkeyPatch, kernels: dict[str, object]) -> None:
    blocks = random_blocks("q6_k", 12, 256, seed=5)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(5))
    want = {isa: k.quant_matmul(x, blocks, 14) for isa, k in kernels.items()}  # type: ignore[attr-defined]
    for isa in kernels:
        monkeypatch.setenv(cpu_quant.ISA_ENV, isa)
        assert torch.equal(cpu_quant.quant_matmul(x, blocks, "q6_k"), want[isa])
        assert torch.equal(cpu_quant.quant_matmul_segments(x, [blocks], ["q6_k"]), want[isa])
    assert torch.equal(cpu_quant.dequantize(blocks, "q6_k"), gguf_dequantize(blocks, "q6_k"))
    assert torch.equal(cpu_quant.dequantize_rows(blocks, 14, torch.tensor([2])), gguf_dequantize(blocks, "q6_k")[2:3])


def test_empty_inputs(kernels: dict[str, object]) -> None:
    kernel = next(iter(kernels.values()))
    assert kernel.quant_matmul(torch.zeros(0, 256), random_blocks("q4_k", 3, 256, 0), 12).shape == (0, 3)  # type: ignore[attr-defined]
    assert kernel.quant_matmul(torch.zeros(2, 256), torch.zeros(0, 144, dtype=torch.uint8), 12).shape == (2, 0)  # type: ignore[attr-defined]


# ---------------------------------------------------------------------- errors
def test_errors_name_what_was_expected(kernels: dict[str, object]) -> None:
    kernel = next(iter(kernels.values()))
    w = random_blocks("q4_k", 4, 512, seed=0)
    x = torch.randn(2, 512)
    with pytest.raises(RuntimeError, match=r"q4_k weight has 288 bytes a row; in-features 256 need 144"):
        kernel.quant_matmul(torch.randn(2, 256), w, 12)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match=r"in-features \(640\) must be a multiple of q4_k's 256-weight blocks"):
        kernel.quant_matmul(torch.randn(2, 640), random_blocks("q4_0", 4, 640, 0), 12)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="must be uint8"):
        kernel.quant_matmul(x, w.to(torch.int16), 12)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="x must be 2-D"):
        kernel.quant_matmul(x[0], w, 12)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="x must be float32 or bfloat16"):
        kernel.quant_matmul(x.long(), w, 12)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="unknown format 10"):
        kernel.quant_matmul(x, w, 10)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="one format per weight"):
        kernel.quant_matmul_segments(x, [w, w], [12], 1)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="a multiple of 144 bytes"):
        kernel.dequantize(w[:, :100], 12)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="row index 4 out of range for a weight of 4 rows"):
        kernel.dequantize_rows(w, 12, torch.tensor([0, 4]))  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="row index -1 out of range"):
        kernel.dequantize_rows(w, 12, torch.tensor([-1]))  # type: ignore[attr-defined]


# ---------------------------------------------------------------------- the real file
def test_gemma3_270m_tensors(kernels: dict[str, object]) -> None:
    """One tensor of each type the Q4_K_M file has (Q4_K, Q5_0, Q6_K, Q8_0) against gguf-py's
    dequantize, and rows of its Q8_0 embedding. The tensors are found with the engine's header
    reader: gguf.GGUFReader takes ~25 s here decoding the 262k-token vocabulary."""
    from engine.modelspec.gguf_header import TensorInfo, read_gguf_header
    from tests.model.gemma3_fixtures import gemma3_gguf_or_skip

    path = gemma3_gguf_or_skip()
    header = read_gguf_header(path)
    data = np.memmap(path, dtype=np.uint8, mode="r")

    def blocks_of(info: TensorInfo) -> torch.Tensor:
        fmt = cpu_quant.FORMAT_NAMES[info.ggml_type]
        width = cpu_quant.row_bytes(fmt, info.dims[0])  # dims are ggml's (in, out)
        start = header.data_start + info.offset
        return torch.from_numpy(np.array(data[start : start + info.dims[1] * width])).view(info.dims[1], width)

    picked = {}
    for info in header.tensors:
        fmt = cpu_quant.FORMAT_NAMES.get(info.ggml_type)
        if fmt is not None and fmt not in picked and info.name.startswith("blk."):
            picked[fmt] = info
    assert {"q4_k", "q6_k", "q5_0", "q8_0"} <= set(picked), sorted(picked)
    gen = torch.Generator().manual_seed(0)
    for fmt, info in picked.items():
        blocks = blocks_of(info)
        dense = gguf_dequantize(blocks, fmt)
        x = torch.randn(3, dense.shape[1], generator=gen)
        for isa, kernel in kernels.items():
            assert torch.equal(kernel.dequantize(blocks, info.ggml_type), dense), (isa, info.name)  # type: ignore[attr-defined]
            got = kernel.quant_matmul(x, blocks, info.ggml_type)  # type: ignore[attr-defined]
            check_matmul(kernel, x, got, dense, (isa, info.name))
    embedding = next(info for info in header.tensors if info.name == "token_embd.weight")
    tokens = torch.tensor([2, 106, 262143, 9])
    rows = blocks_of(embedding)
    for isa, kernel in kernels.items():
        got = kernel.dequantize_rows(rows, embedding.ggml_type, tokens)  # type: ignore[attr-defined]
        assert torch.equal(got, gguf_dequantize(rows[tokens], "q8_0")), isa


# ---------------------------------------------------------------------- bounds
def _before_guard_page(data: torch.Tensor) -> tuple[torch.Tensor, object]:
    """A copy of ``data`` (uint8) ending exactly where an inaccessible page begins: a kernel that
    reads past its last byte faults. Returns the tensor and the mapping that keeps it alive."""
    import ctypes
    import mmap

    page = mmap.PAGESIZE
    nbytes = data.numel()
    pages = -(-nbytes // page) + 1
    buf = mmap.mmap(-1, pages * page, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.mprotect(base + (pages - 1) * page, page, 0) == 0, ctypes.get_errno()  # PROT_NONE
    start = (pages - 1) * page - nbytes
    view = np.frombuffer(buf, dtype=np.uint8, count=nbytes, offset=start)
    view[:] = data.numpy().reshape(-1)
    return torch.from_numpy(view).view(data.shape), buf


def test_reads_stay_inside_the_weight(kernels: dict[str, object]) -> None:
    """Every format, ISA and tail (partial last groups included) with the weight's last byte
    just before a PROT_NONE page."""
    for fmt in FORMATS:
        for in_features in ((32, 96, 160, 640, 288) if fmt in SMALL_FORMATS else (256, 768)):
            blocks = random_blocks(fmt, 3, in_features, seed=in_features)
            guarded, mapping = _before_guard_page(blocks)
            x = torch.randn(2, in_features, generator=torch.Generator().manual_seed(0))
            for isa, kernel in kernels.items():
                code = cpu_quant.format_id(fmt)
                want = kernel.quant_matmul(x, blocks, code)  # type: ignore[attr-defined]
                assert torch.equal(kernel.quant_matmul(x, guarded, code), want), (isa, fmt)  # type: ignore[attr-defined]
                assert torch.equal(kernel.dequantize_rows(guarded, code, torch.tensor([2])),  # type: ignore[attr-defined]
                                   kernel.dequantize(blocks, code)[2:])  # type: ignore[attr-defined]
            del guarded
            mapping.close()  # type: ignore[attr-defined]
