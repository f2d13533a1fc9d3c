"""The C++ RMSNorm against torch's F.rms_norm, and its fallback."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model.kernels import cpu_norm


@pytest.fixture(scope="module")
def kernel(cpu_norm_kernel: object) -> object:
    return cpu_norm_kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "width"), [(1, 576), (7, 576), (33, 1536), (2, 17), (3, 1)])
def test_matches_torch(kernel, dtype: torch.dtype, rows: int, width: int) -> None:
    generator = torch.Generator().manual_seed(rows * 1000 + width)
    x = (torch.randn(rows, width, generator=generator) * 3).to(dtype)
    w = torch.randn(width, generator=generator).to(dtype)
    got = kernel.rms_norm(x, w, 1e-5)
    want = F.rms_norm(x.float(), (width,), w.float(), 1e-5)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want, rtol=tolerance, atol=tolerance)
    assert got.dtype == dtype and got.shape == x.shape


def test_non_contiguous_input_and_fallback(kernel, monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(4, 2 * 64)[:, ::2]  # strided rows
    w = torch.randn(64)
    torch.testing.assert_close(cpu_norm.rms_norm(x, w, 1e-6), F.rms_norm(x, (64,), w, 1e-6))
    monkeypatch.setenv(cpu_norm.KERNEL_ENV, "0")
    assert cpu_norm.KERNEL.get() is None and cpu_norm.KERNEL.unavailable_reason == f"{cpu_norm.KERNEL_ENV}=0"
    torch.testing.assert_close(cpu_norm.rms_norm(x, w, 1e-6), F.rms_norm(x, (64,), w, 1e-6))
