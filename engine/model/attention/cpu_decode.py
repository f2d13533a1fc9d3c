"""A C++ paged-attention kernel for pure-decode batches on CPU.

The torch backend gathers every sequence's whole context out of the paged
cache (``kv_cache[block_tables]``) in every layer and then runs SDPA over the
copy; with 16 sequences of 600 tokens that gather plus SDPA is ~60% of a decode
step. This kernel reads K and V in place through the block table, one
(sequence, KV head) pair per task on torch's intra-op thread pool, and never
copies the context. A sliding-window layer's call reads only the window's
positions (the older keys are never touched, not just masked).

Quantized caches (engine/model/attention/kv_quant.py) are read in place too: int8 rows
are widened and multiplied by the fp32 scale stored right after them, fp8 bytes
go through a 256-entry table; the query and output stay in the model's dtype.
With one byte per element the kernel streams a quarter of fp32's K/V bytes.

It is compiled once per CPU type and torch version into kvscope's kernel cache
(:mod:`engine.model.kernels.build`, shared by every checkout and venv). When no compiler or ninja is
available, :func:`load_kernel` returns None and the torch path is used; the
reason is :func:`unavailable_reason`, for the startup event.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch

from engine.model.kernels.build import BuildReport, CachedKernel, KernelSpec

_CPP_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

// How one head's stored K or V row becomes head_dim floats. kExtra: stored
// elements after the values (int8's fp32 scale), so a head's row is
// head_dim + kExtra elements wide.
template <typename kv_t>
struct CastRow {
  static constexpr int64_t kExtra = 0;
  inline void operator()(const kv_t* src, float* dst, int64_t n) const {
#pragma omp simd
    for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<float>(src[d]);
  }
};

struct Int8Row {  // symmetric int8 times the row's own scale (its 4 bytes follow the values)
  static constexpr int64_t kExtra = 4;
  inline void operator()(const int8_t* src, float* dst, int64_t n) const {
    float s;
    std::memcpy(&s, src + n, sizeof s);
#pragma omp simd
    for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<float>(src[d]) * s;
  }
};

struct TableRow {  // fp8 (scale 1.0): each byte's float value from a 256-entry table
  static constexpr int64_t kExtra = 0;
  const float* table;
  inline void operator()(const uint8_t* src, float* dst, int64_t n) const {
#pragma omp simd
    for (int64_t d = 0; d < n; ++d) dst[d] = table[src[d]];
  }
};

template <typename kv_t, typename q_t, typename Row>
static void decode_kernel(const q_t* q, const kv_t* kv, const int32_t* block_tables, const int32_t* seq_lens,
                          q_t* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                          int64_t block_size, int64_t max_blocks, float scale, Row load_row,
                          int64_t window = 0) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t row_width = head_dim + Row::kExtra;      // one head's stored row
  const int64_t token_stride = num_kv_heads * row_width;  // next slot in a block
  const int64_t kv_stride = block_size * token_stride;   // K -> V of the same block
  const int64_t block_stride = 2 * kv_stride;
  // A task is one sequence with all its KV heads, so it streams each token's
  // K and V rows contiguously; with few sequences, split heads too so every
  // thread has work (single-stream decode).
  const int64_t heads_per_task = num_seqs >= 2 * at::get_num_threads() ? num_kv_heads : 1;
  const int64_t tasks_per_seq = num_kv_heads / heads_per_task;
  const int64_t rows = heads_per_task * group;  // query heads handled by one task
  at::parallel_for(0, num_seqs * tasks_per_seq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(rows * head_dim), acc(rows * head_dim), row(heads_per_task * head_dim), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / tasks_per_seq, h0 = (task % tasks_per_seq) * heads_per_task;
      // A sliding-window layer (window > 0) reads only the last `window` positions: the query
      // sits at seq_len - 1 and sees keys first ... seq_len - 1.
      const int64_t first = window > 0 ? std::max<int64_t>(0, seq_lens[s] - window) : 0;
      const int64_t len = seq_lens[s] - first;
      const int32_t* table = block_tables + s * max_blocks;
      scores.assign(rows * std::max<int64_t>(len, 1), 0.f);
      // query rows of heads h0*group ... (h0+heads_per_task)*group - 1, in order
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t d = 0; d < head_dim; ++d)
          qf[r * head_dim + d] = static_cast<float>(q[(s * num_heads + h0 * group + r) * head_dim + d]) * scale;
      for (int64_t t = 0; t < len; ++t) {
        const int64_t p = first + t;  // the key's position
        const kv_t* k = kv + table[p / block_size] * block_stride + (p % block_size) * token_stride + h0 * row_width;
        for (int64_t h = 0; h < heads_per_task; ++h) load_row(k + h * row_width, row.data() + h * head_dim, head_dim);
        for (int64_t r = 0; r < rows; ++r) {
          const float* qr = qf.data() + r * head_dim;
          const float* kr = row.data() + (r / group) * head_dim;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < head_dim; ++d) dot += qr[d] * kr[d];
          scores[r * len + t] = dot;
        }
      }
      const int64_t softmax_rows = len > 0 ? rows : 0;  // an empty context has nothing to normalise
      for (int64_t r = 0; r < softmax_rows; ++r) {
        float* sc = scores.data() + r * len;
        float peak = sc[0];
        for (int64_t t = 1; t < len; ++t) peak = std::max(peak, sc[t]);
        // Vectorised exp (glibc's libmvec, enabled by -ffast-math): scalar expf was half the kernel.
#pragma omp simd
        for (int64_t t = 0; t < len; ++t) sc[t] = expf(sc[t] - peak);
        float total = 0.f;
#pragma omp simd reduction(+ : total)
        for (int64_t t = 0; t < len; ++t) total += sc[t];
        const float inv = 1.f / total;
#pragma omp simd
        for (int64_t t = 0; t < len; ++t) sc[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const int64_t p = first + t;
        const kv_t* v = kv + table[p / block_size] * block_stride + kv_stride + (p % block_size) * token_stride +
                        h0 * row_width;
        for (int64_t h = 0; h < heads_per_task; ++h) load_row(v + h * row_width, row.data() + h * head_dim, head_dim);
        for (int64_t r = 0; r < rows; ++r) {
          const float p = scores[r * len + t];
          const float* vr = row.data() + (r / group) * head_dim;
          float* a = acc.data() + r * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) a[d] += p * vr[d];
        }
      }
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t d = 0; d < head_dim; ++d)
          out[(s * num_heads + h0 * group + r) * head_dim + d] = static_cast<q_t>(acc[r * head_dim + d]);
    }
  });
}

// kv_cache: float32/bf16/fp16 [NB,2,BS,KVH,D] (query is cast to it); int8 [NB,2,BS,KVH,D+4] with an fp32
// scale per row; fp8 e4m3/e5m2 [NB,2,BS,KVH,D] decoded through fp8_table (256 floats). Quantized caches
// keep the query's dtype for the query and the output.
torch::Tensor paged_decode(torch::Tensor query, torch::Tensor kv_cache, torch::Tensor block_tables,
                           torch::Tensor seq_lens, double scale, torch::Tensor fp8_table, int64_t window) {
  TORCH_CHECK(query.dim() == 3 && kv_cache.dim() == 5, "query [S,H,D], kv_cache [NB,2,BS,KVH,W]");
  const auto kv_type = kv_cache.scalar_type();
  const bool is_int8 = kv_type == at::ScalarType::Char;
  const bool is_fp8 = kv_type == at::ScalarType::Float8_e4m3fn || kv_type == at::ScalarType::Float8_e5m2;
  query = (is_int8 || is_fp8) ? query.contiguous() : query.contiguous().to(kv_type);
  kv_cache = kv_cache.contiguous();
  block_tables = block_tables.to(torch::kInt32).contiguous();
  seq_lens = seq_lens.to(torch::kInt32).contiguous();
  auto out = torch::empty_like(query);
  const int64_t S = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t BS = kv_cache.size(2), KVH = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == D + (is_int8 ? 4 : 0), "kv_cache row width does not match the head dim");
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t MB = block_tables.size(1);
  const float sc = static_cast<float>(scale);
  if (is_int8) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode_int8", [&] {
      decode_kernel<int8_t, scalar_t>(query.data_ptr<scalar_t>(), kv_cache.data_ptr<int8_t>(), tables, lens,
                                      out.data_ptr<scalar_t>(), S, H, KVH, D, BS, MB, sc, Int8Row{}, window);
    });
  } else if (is_fp8) {
    TORCH_CHECK(fp8_table.scalar_type() == at::kFloat && fp8_table.numel() == 256, "fp8_table: 256 floats");
    auto table = fp8_table.contiguous();
    const auto* bytes = static_cast<const uint8_t*>(kv_cache.data_ptr());
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode_fp8", [&] {
      decode_kernel<uint8_t, scalar_t>(query.data_ptr<scalar_t>(), bytes, tables, lens, out.data_ptr<scalar_t>(),
                                       S, H, KVH, D, BS, MB, sc, TableRow{table.data_ptr<float>()}, window);
    });
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, kv_type, "paged_decode", [&] {
      decode_kernel<scalar_t, scalar_t>(query.data_ptr<scalar_t>(), kv_cache.data_ptr<scalar_t>(), tables, lens,
                                        out.data_ptr<scalar_t>(), S, H, KVH, D, BS, MB, sc, CastRow<scalar_t>{}, window);
    });
  }
  return out;
}
"""

SPEC = KernelSpec(name="kvscope_cpu_decode", source=_CPP_SOURCE, functions=("paged_decode",))

KERNEL = CachedKernel(SPEC, "KVSCOPE_CPU_DECODE_KERNEL")


def load_kernel(log: Callable[[str], None] | None = None) -> ModuleType | None:
    """The compiled module (with ``paged_decode``), or None when it cannot be built
    here or ``KVSCOPE_CPU_DECODE_KERNEL=0`` turns it off. Built once per CPU type
    and torch version into the shared kernel cache (engine/model/kernels/build.py)."""
    return KERNEL.get(log)


def unavailable_reason() -> str | None:
    """Why :func:`load_kernel` gave None (switched off, or the build's error)."""
    return KERNEL.unavailable_reason


_NO_TABLE = torch.empty(0)
_FP8_TABLES: dict[torch.dtype, torch.Tensor] = {}


def fp8_table(dtype: torch.dtype) -> torch.Tensor:
    """The float value of each of the 256 bytes of an fp8 ``dtype``: the kernel
    decodes fp8 by table lookup rather than bit manipulation per element."""
    if dtype not in _FP8_TABLES:
        _FP8_TABLES[dtype] = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    return _FP8_TABLES[dtype]


def ensure_built(log: Callable[[str], None] | None = None) -> BuildReport | None:
    """Build or load the kernel now (startup's background thread, ``engine build-kernels``);
    None when it is switched off."""
    return KERNEL.ensure_built(log)


def paged_decode(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """Attention of one query row per sequence over its paged context (only its last
    ``sliding_window`` positions for a sliding-window layer). A plain cache returns its
    own dtype; an int8/fp8 cache returns the query's dtype."""
    kernel = load_kernel()
    assert kernel is not None
    table = fp8_table(kv_cache.dtype) if kv_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else _NO_TABLE
    return kernel.paged_decode(query, kv_cache, block_tables, seq_lens, scale, table,  # type: ignore[attr-defined]
                               sliding_window or 0)
