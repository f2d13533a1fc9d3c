"""RMSNorm as one C++ call on CPU.

torch's CPU ``rms_norm`` is a composite of about a dozen aten ops (pow, mean, add,
rsqrt, mul, casts); at decode sizes (one 576-wide row) each costs its dispatch,
so the 61 norms of a SmolLM2 step took ~3 ms of a ~25 ms int4 single-stream
step (AVX2 Zen 3, 1 thread). This kernel does the same arithmetic (float32
accumulation, ``x * rsqrt(mean(x^2) + eps) * w``) in one pass per row, rows
split over torch's intra-op threads. Built through the shared kernel cache;
without it, ``F.rms_norm`` runs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.model.kernels.build import BuildReport, CachedKernel, KernelSpec

KERNEL_ENV = "KVSCOPE_CPU_NORM_KERNEL"

_CPP_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>

template <typename T>
static void rms_rows(const T* x, const T* w, T* out, int64_t rows, int64_t width, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * width;
      T* o = out + r * width;
      float total = 0.f;
#pragma omp simd reduction(+ : total)
      for (int64_t d = 0; d < width; ++d) {
        const float v = static_cast<float>(xr[d]);
        total += v * v;
      }
      const float inv = 1.f / std::sqrt(total / static_cast<float>(width) + eps);
#pragma omp simd
      for (int64_t d = 0; d < width; ++d)
        o[d] = static_cast<T>(static_cast<float>(xr[d]) * inv * static_cast<float>(w[d]));
    }
  });
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.size(-1) == weight.size(0), "rms_norm: width mismatch");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "rms_norm: x and weight dtypes differ");
  auto xc = x.contiguous();
  auto wc = weight.contiguous();
  auto out = torch::empty_like(xc);
  const int64_t width = xc.size(-1);
  const int64_t rows = width == 0 ? 0 : xc.numel() / width;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "rms_norm", [&] {
    rms_rows<scalar_t>(xc.data_ptr<scalar_t>(), wc.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, width,
                       static_cast<float>(eps));
  });
  return out;
}
"""

SPEC = KernelSpec(name="kvscope_cpu_norm", source=_CPP_SOURCE, functions=("rms_norm",))
KERNEL = CachedKernel(SPEC, KERNEL_ENV)


def ensure_built(log: Callable[[str], None] | None = None) -> BuildReport | None:
    """Build or load the kernel now (startup's background thread, ``engine build-kernels``)."""
    return KERNEL.ensure_built(log)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.rms_norm(x, (width,), weight, eps)``, through the kernel on CPU when it is built."""
    if x.device.type == "cpu" and x.dtype == weight.dtype:
        module = KERNEL.get()  # None when KVSCOPE_CPU_NORM_KERNEL=0 or not built here
        if module is not None:
            return module.rms_norm(x, weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)
