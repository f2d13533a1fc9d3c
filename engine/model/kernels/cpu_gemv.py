"""Weight-only int8/int4 GEMV for CPU decode: a decode step is bandwidth-bound on weight bytes, so
reading GGUF-style 32-weight blocks (Q8_0: 34 bytes, Q4_1: 20 bytes) instead of float32 is the win.

Formats (exactly ggml's, so a GGUF tensor's bytes are used as they are, row by row):

* ``q8_0``: per block of 32 weights an fp16 scale ``d`` then 32 int8 ``q``; ``w = d * q``.
* ``q4_1``: per block an fp16 ``d``, an fp16 ``m``, then 16 bytes whose low nibbles are
  weights 0..15 and high nibbles 16..31; ``w = d * q + m``.

A weight ``[out, in]`` is ``uint8 [out, in / 32 * block_bytes]``: each output row's blocks in
order, so a row streams contiguously and rows are split over torch's intra-op threads
(``at::parallel_for``). Each block is widened to float32 in registers once and multiplied into
up to 8 activation rows (float32 activations: no activation-quantization error). AVX-512,
AVX2+FMA and scalar paths; ``in`` must be a multiple of 32. ``int8_activations=True`` runs
llama.cpp's route instead (activations rounded per 32-block to int8, ``maddubs`` integer dots;
AVX2 only): measured no faster here, so the model does not use it.

Measured with bench/bench_gemv.py on AVX2 (EPYC Zen 3, 2 cores), 1 thread, weights cycled
through 128 MiB of copies so they stream from memory; the machine was shared with other
engineers' benchmarks (load 6-9 on 2 cores, so absolute numbers are low; ratios are
interleaved medians). µs per call, fp32 F.linear -> q8_0 -> q4_1:

* rows 1: qkv 960x576 477 -> 154 -> 146; down 576x1536 501 -> 210 -> 185;
  head 49152x576 22629 -> 7747 -> 7479 (torch bf16 16204, ``_weight_int8pack_mm`` 91974)
* rows 8: qkv 966 -> 307 -> 275; down 1320 -> 749 -> 719; head 70738 -> 15655 -> 15217
* single-stream decode of SmolLM2-135M (float32 activations, 1 thread): fp32 7.4 tok/s,
  int8 16.7, int4 19.0 (2.3x / 2.6x).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from types import ModuleType

import torch

from engine.model.kernels.build import BuildReport, CachedKernel, KernelSpec

KERNEL_ENV = "KVSCOPE_CPU_GEMV_KERNEL"
# "0" keeps Q4_1 weights row by row with float32 activations (closest to fp32, slower).
INT8_ACTIVATIONS_ENV = "KVSCOPE_CPU_INT8_ACTIVATIONS"
QK = 32  # weights per block
BLOCK_BYTES = {"q8_0": 2 + QK, "q4_1": 4 + QK // 2, "q4_1x8": 4 + QK // 2}
FORMATS = tuple(BLOCK_BYTES)
X8_ROWS = 8  # rows interleaved by the q4_1x8 layout

_CPP_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <cmath>
#include <vector>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

static inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal
      exp = 113;
      while (!(mant & 0x400)) { mant <<= 1; --exp; }
      bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

// ---------------------------------------------------------------- block formats
struct Q8_0 {
  static constexpr int kBytes = 34;
  static inline void scalar(const uint8_t* b, float* w) {
    const float d = half_to_float(b);
    const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
    for (int i = 0; i < 32; ++i) w[i] = d * (float)q[i];
  }
#if defined(__AVX512F__)
  static inline void v512(const uint8_t* b, __m512* w) {
    const __m512 d = _mm512_set1_ps(half_to_float(b));
    const __m128i q0 = _mm_loadu_si128((const __m128i*)(b + 2)), q1 = _mm_loadu_si128((const __m128i*)(b + 18));
    w[0] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)));
    w[1] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)));
  }
#endif
#if defined(__AVX2__)
  static inline void v256(const uint8_t* b, __m256* w) {
    const __m256 d = _mm256_set1_ps(half_to_float(b));
    for (int k = 0; k < 4; ++k) {
      const __m128i q = _mm_loadl_epi64((const __m128i*)(b + 2 + 8 * k));
      w[k] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
    }
  }
  // int8 activations: the 32 signed weights, and their dot with 32 signed activations
  static inline __m256i qbytes(const uint8_t* b) { return _mm256_loadu_si256((const __m256i*)(b + 2)); }
  static inline __m256 idot(__m256i qw, __m256i qa) {
    const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(qw, qw), _mm256_sign_epi8(qa, qw));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(p, _mm256_set1_epi16(1)));
  }
  static inline float offset(const uint8_t*) { return 0.f; }
#endif
};

struct Q4_1 {
  static constexpr int kBytes = 20;
  static inline void scalar(const uint8_t* b, float* w) {
    const float d = half_to_float(b), m = half_to_float(b + 2);
    for (int i = 0; i < 16; ++i) {
      w[i] = d * (float)(b[4 + i] & 15) + m;
      w[i + 16] = d * (float)(b[4 + i] >> 4) + m;
    }
  }
#if defined(__AVX512F__)
  static inline void v512(const uint8_t* b, __m512* w) {
    const __m512 d = _mm512_set1_ps(half_to_float(b)), m = _mm512_set1_ps(half_to_float(b + 2));
    const __m512i t = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(b + 4)));
    w[0] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(t, _mm512_set1_epi32(15))), m);
    w[1] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_srli_epi32(t, 4)), m);
  }
#endif
#if defined(__AVX2__)
  static inline void v256(const uint8_t* b, __m256* w) {
    const __m256 d = _mm256_set1_ps(half_to_float(b)), m = _mm256_set1_ps(half_to_float(b + 2));
    // Each byte widened to an int32 lane holds two weights: low nibble j, high nibble j + 16.
    const __m256i t0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(b + 4)));
    const __m256i t1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(b + 12)));
    const __m256i low = _mm256_set1_epi32(15);
    w[0] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(t0, low)), m);
    w[1] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(t1, low)), m);
    w[2] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(t0, 4)), m);
    w[3] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(t1, 4)), m);
  }
  // int8 activations: the 32 nibbles as unsigned bytes (weights 0..15 low lane, 16..31 high)
  static inline __m256i qbytes(const uint8_t* b) {
    const __m128i t = _mm_loadu_si128((const __m128i*)(b + 4));
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(15));
  }
  static inline __m256 idot(__m256i qw, __m256i qa) {
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(qw, qa), _mm256_set1_epi16(1)));
  }
  static inline float offset(const uint8_t* b) { return half_to_float(b + 2); }  // m
#endif
};

// ---------------------------------------------------------------- one weight row x R activation rows
// y[r * ldy] = dot(weight row, x[r * K ...]) for r < R. The block is widened once, then used R times.
template <class F, int R>
static inline void row_tile(const uint8_t* wrow, int64_t nb, const float* x, int64_t K, float* y, int64_t ldy) {
#if defined(__AVX512F__)
  constexpr int NA = R >= 4 ? 1 : 2;  // independent accumulator chains per row
  __m512 acc[R][NA];
  for (int r = 0; r < R; ++r)
    for (int a = 0; a < NA; ++a) acc[r][a] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512 w[2];
    F::v512(wrow + b * F::kBytes, w);
    for (int r = 0; r < R; ++r) {
      const float* xr = x + r * K + b * 32;
      acc[r][0] = _mm512_fmadd_ps(w[0], _mm512_loadu_ps(xr), acc[r][0]);
      acc[r][1 % NA] = _mm512_fmadd_ps(w[1], _mm512_loadu_ps(xr + 16), acc[r][1 % NA]);
    }
  }
  for (int r = 0; r < R; ++r) {
    __m512 s = acc[r][0];
    for (int a = 1; a < NA; ++a) s = _mm512_add_ps(s, acc[r][a]);
    y[r * ldy] = _mm512_reduce_add_ps(s);
  }
#elif defined(__AVX2__)
  constexpr int NA = R >= 8 ? 1 : (R >= 3 ? 2 : 4);
  __m256 acc[R][NA];
  for (int r = 0; r < R; ++r)
    for (int a = 0; a < NA; ++a) acc[r][a] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256 w[4];
    F::v256(wrow + b * F::kBytes, w);
    for (int r = 0; r < R; ++r) {
      const float* xr = x + r * K + b * 32;
      for (int k = 0; k < 4; ++k) acc[r][k % NA] = _mm256_fmadd_ps(w[k], _mm256_loadu_ps(xr + 8 * k), acc[r][k % NA]);
    }
  }
  for (int r = 0; r < R; ++r) {
    __m256 s = acc[r][0];
    for (int a = 1; a < NA; ++a) s = _mm256_add_ps(s, acc[r][a]);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    y[r * ldy] = _mm_cvtss_f32(h);
  }
#else
  float acc[R] = {0.f};
  float w[32];
  for (int64_t b = 0; b < nb; ++b) {
    F::scalar(wrow + b * F::kBytes, w);
    for (int r = 0; r < R; ++r) {
      const float* xr = x + r * K + b * 32;
      float s = 0.f;
      for (int i = 0; i < 32; ++i) s += w[i] * xr[i];
      acc[r] += s;
    }
  }
  for (int r = 0; r < R; ++r) y[r * ldy] = acc[r];
#endif
}

#if defined(__AVX2__)
// Activations quantized per 32-block like ggml's Q8_1: qa = round(x / da), sa = da * sum(qa).
// One weight row x R activation rows: sum_b dw*da*dot(qw, qa) (+ m * sa for Q4_1).
template <class F, int R>
static inline void row_tile_i8(const uint8_t* wrow, int64_t nb, const int8_t* qa, const float* da, const float* sa,
                               int64_t K, float* y, int64_t ldy) {
  constexpr int NA = R >= 4 ? 1 : 2;  // independent accumulator chains per row (blocks alternate)
  __m256 acc[R][NA];
  float off[R];
  for (int r = 0; r < R; ++r) {
    off[r] = 0.f;
    for (int a = 0; a < NA; ++a) acc[r][a] = _mm256_setzero_ps();
  }
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = wrow + b * F::kBytes;
    const __m256i qw = F::qbytes(blk);
    const float dw = half_to_float(blk), m = F::offset(blk);
    for (int r = 0; r < R; ++r) {
      const __m256i q = _mm256_loadu_si256((const __m256i*)(qa + r * K + b * 32));
      const int a = NA == 1 ? 0 : (int)(b & 1);
      acc[r][a] = _mm256_fmadd_ps(_mm256_set1_ps(dw * da[r * nb + b]), F::idot(qw, q), acc[r][a]);
      off[r] += m * sa[r * nb + b];
    }
  }
  for (int r = 0; r < R; ++r) {
    __m256 s = acc[r][0];
    for (int a = 1; a < NA; ++a) s = _mm256_add_ps(s, acc[r][a]);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    y[r * ldy] = _mm_cvtss_f32(h) + off[r];
  }
}

static void quantize_rows_q8(const float* x, int64_t M, int64_t K, int8_t* qa, float* da, float* sa) {
  const int64_t nb = K / 32;
  for (int64_t i = 0; i < M * nb; ++i) {
    const float* xb = x + i * 32;
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
    int sum = 0;
    for (int j = 0; j < 32; ++j) {
      const int q = (int)std::nearbyint(xb[j] * id);
      qa[i * 32 + j] = (int8_t)q;
      sum += q;
    }
    da[i] = d;
    sa[i] = d * (float)sum;
  }
}

template <class F>
static void gemv_rows_i8(const uint8_t* W, int64_t N, int64_t K, const float* x, int64_t M, float* y) {
  const int64_t nb = K / 32, row_bytes = nb * F::kBytes;
  std::vector<int8_t> qa(M * K);
  std::vector<float> da(M * nb), sa(M * nb);
  quantize_rows_q8(x, M, K, qa.data(), da.data(), sa.data());
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* wrow = W + n * row_bytes;
      for (int64_t r = 0; r < M;) {
        const int64_t left = M - r;
        const int8_t* q = qa.data() + r * K;
        const float *d = da.data() + r * nb, *s = sa.data() + r * nb;
        float* yr = y + r * N + n;
        if (left >= 4) { row_tile_i8<F, 4>(wrow, nb, q, d, s, K, yr, N); r += 4; }
        else if (left == 3) { row_tile_i8<F, 3>(wrow, nb, q, d, s, K, yr, N); r += 3; }
        else if (left == 2) { row_tile_i8<F, 2>(wrow, nb, q, d, s, K, yr, N); r += 2; }
        else { row_tile_i8<F, 1>(wrow, nb, q, d, s, K, yr, N); r += 1; }
      }
    }
  });
}
#endif

template <class F>
static void gemv_rows(const uint8_t* W, int64_t N, int64_t K, const float* x, int64_t M, float* y) {
  const int64_t nb = K / 32, row_bytes = nb * F::kBytes;
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* wrow = W + n * row_bytes;
      int64_t r = 0;
      for (; r + 8 <= M; r += 8) row_tile<F, 8>(wrow, nb, x + r * K, K, y + r * N + n, N);
      const float* xr = x + r * K;
      float* yr = y + r * N + n;
      switch (M - r) {
        case 1: row_tile<F, 1>(wrow, nb, xr, K, yr, N); break;
        case 2: row_tile<F, 2>(wrow, nb, xr, K, yr, N); break;
        case 3: row_tile<F, 3>(wrow, nb, xr, K, yr, N); break;
        case 4: row_tile<F, 4>(wrow, nb, xr, K, yr, N); break;
        case 5: row_tile<F, 5>(wrow, nb, xr, K, yr, N); break;
        case 6: row_tile<F, 6>(wrow, nb, xr, K, yr, N); break;
        case 7: row_tile<F, 7>(wrow, nb, xr, K, yr, N); break;
        default: break;
      }
    }
  });
}

template <class F>
static torch::Tensor gemv(torch::Tensor x, torch::Tensor w, int64_t int8_activations, const char* name) {
  TORCH_CHECK(x.dim() == 2, name, ": x must be [rows, in]");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8, name, ": weight blocks must be uint8 [out, bytes]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % 32 == 0, name, ": in-features (", K, ") must be a multiple of 32");
  TORCH_CHECK(w.size(1) == K / 32 * F::kBytes, name, ": weight has ", w.size(1), " bytes a row, in-features ", K,
              " need ", K / 32 * F::kBytes);
  auto xf = x.to(torch::kFloat).contiguous();
  w = w.contiguous();
  auto y = torch::empty({M, N}, xf.options());
  if (M > 0 && N > 0) {
#if defined(__AVX2__)
    if (int8_activations) {
      gemv_rows_i8<F>(w.data_ptr<uint8_t>(), N, K, xf.data_ptr<float>(), M, y.data_ptr<float>());
      return x.scalar_type() == torch::kFloat ? y : y.to(x.scalar_type());
    }
#endif
    gemv_rows<F>(w.data_ptr<uint8_t>(), N, K, xf.data_ptr<float>(), M, y.data_ptr<float>());
  }
  return x.scalar_type() == torch::kFloat ? y : y.to(x.scalar_type());
}

// ---------------------------------------------------------------- Q4_1 interleaved by 8 rows ("q4_1x8")
// The same Q4_1 blocks reordered so 8 output rows are one vector: for rows 8g..8g+7 and block b,
// 160 bytes at ((g * nb) + b) * 160: the 8 rows' fp16 d, their 8 fp16 m, then 4 chunks of 32 bytes,
// chunk c holding row i's quant bytes 4c..4c+3 at 4i (low nibbles: weights 4c.., high: 16 + 4c..).
// A 32-bit lane is one row, so a broadcast of 4 activation bytes and one maddubs give all 8 rows'
// partial dots without a horizontal sum. Activations are rounded per 32-block to int8 (ggml's
// Q8_1: qa, da, sa = da * sum(qa)); y = sum_b d*da*dot(q, qa) + m*sa, 8 rows at a time.
static constexpr int64_t kX8Bytes = 8 * 20;

static inline void x8_scalar(const uint8_t* g, int64_t nb, const float* x, float* y, int64_t ldy, int64_t R,
                             int64_t K) {
  for (int64_t r = 0; r < R; ++r)
    for (int i = 0; i < 8; ++i) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* p = g + b * kX8Bytes;
        const float d = half_to_float(p + 2 * i), m = half_to_float(p + 16 + 2 * i);
        const float* xb = x + r * K + b * 32;
        for (int c = 0; c < 4; ++c)
          for (int k = 0; k < 4; ++k) {
            const uint8_t q = p[32 + 32 * c + 4 * i + k];
            acc += (d * (float)(q & 15) + m) * xb[4 * c + k] + (d * (float)(q >> 4) + m) * xb[16 + 4 * c + k];
          }
      }
      y[r * ldy + i] = acc;
    }
}

#if defined(__AVX2__)
static inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

template <int R>
static inline void x8_tile(const uint8_t* g, int64_t nb, const int8_t* qa, const float* da, const float* sa,
                           int64_t K, float* y, int64_t ldy) {
  __m256 acc[R], accm[R];
  for (int r = 0; r < R; ++r) acc[r] = accm[r] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = g + b * kX8Bytes;
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
    const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 16)));
    __m256i wl[4], wh[4];
    for (int c = 0; c < 4; ++c) {
      const __m256i t = _mm256_loadu_si256((const __m256i*)(p + 32 + 32 * c));
      wl[c] = _mm256_and_si256(t, low);
      wh[c] = _mm256_and_si256(_mm256_srli_epi16(t, 4), low);
    }
    for (int r = 0; r < R; ++r) {
      const int8_t* a = qa + r * K + b * 32;
      // 8 products of at most 15 * 127 * 2 each lane: the int16 sums stay below 32767.
      __m256i s = _mm256_maddubs_epi16(wl[0], bcast4(a));
      s = _mm256_add_epi16(s, _mm256_maddubs_epi16(wh[0], bcast4(a + 16)));
      for (int c = 1; c < 4; ++c) {
        s = _mm256_add_epi16(s, _mm256_maddubs_epi16(wl[c], bcast4(a + 4 * c)));
        s = _mm256_add_epi16(s, _mm256_maddubs_epi16(wh[c], bcast4(a + 16 + 4 * c)));
      }
      const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(s, ones));
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(da[r * nb + b])), dot, acc[r]);
      accm[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(sa[r * nb + b]), accm[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * ldy, _mm256_add_ps(acc[r], accm[r]));
}
#endif

static void gemv_rows_q4_1x8(const uint8_t* W, int64_t N, int64_t K, const float* x, int64_t M, float* y) {
  const int64_t nb = K / 32, group_bytes = nb * kX8Bytes;
#if defined(__AVX2__)
  std::vector<int8_t> qa(M * K);
  std::vector<float> da(M * nb), sa(M * nb);
  quantize_rows_q8(x, M, K, qa.data(), da.data(), sa.data());
  at::parallel_for(0, N / 8, 4, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* wg = W + g * group_bytes;
      for (int64_t r = 0; r < M;) {
        const int64_t left = M - r;
        const int8_t* q = qa.data() + r * K;
        const float *d = da.data() + r * nb, *s = sa.data() + r * nb;
        float* yr = y + r * N + 8 * g;
        if (left >= 4) { x8_tile<4>(wg, nb, q, d, s, K, yr, N); r += 4; }
        else if (left == 3) { x8_tile<3>(wg, nb, q, d, s, K, yr, N); r += 3; }
        else if (left == 2) { x8_tile<2>(wg, nb, q, d, s, K, yr, N); r += 2; }
        else { x8_tile<1>(wg, nb, q, d, s, K, yr, N); r += 1; }
      }
    }
  });
#else
  at::parallel_for(0, N / 8, 4, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) x8_scalar(W + g * group_bytes, nb, x, y + 8 * g, N, M, K);
  });
#endif
}

torch::Tensor gemv_q4_1x8(torch::Tensor x, torch::Tensor w, int64_t) {
  TORCH_CHECK(x.dim() == 2, "gemv_q4_1x8: x must be [rows, in]");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8, "gemv_q4_1x8: weight blocks must be uint8 [out, bytes]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % 32 == 0 && N % 8 == 0, "gemv_q4_1x8: in-features (", K, ") must be a multiple of 32 and out-features (",
              N, ") of 8");
  TORCH_CHECK(w.size(1) == K / 32 * 20, "gemv_q4_1x8: weight has ", w.size(1), " bytes a row, in-features ", K,
              " need ", K / 32 * 20);
  auto xf = x.to(torch::kFloat).contiguous();
  w = w.contiguous();
  auto y = torch::empty({M, N}, xf.options());
  if (M > 0 && N > 0) gemv_rows_q4_1x8(w.data_ptr<uint8_t>(), N, K, xf.data_ptr<float>(), M, y.data_ptr<float>());
  return x.scalar_type() == torch::kFloat ? y : y.to(x.scalar_type());
}

// int8_activations: 1 quantizes x per 32-block to int8 first (AVX2/AVX-512 builds; ignored by the scalar one)
torch::Tensor gemv_q8_0(torch::Tensor x, torch::Tensor w, int64_t int8_activations) {
  return gemv<Q8_0>(x, w, int8_activations, "gemv_q8_0");
}
torch::Tensor gemv_q4_1(torch::Tensor x, torch::Tensor w, int64_t int8_activations) {
  return gemv<Q4_1>(x, w, int8_activations, "gemv_q4_1");
}

std::string isa() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "scalar";
#endif
}
"""

SPEC = KernelSpec(name="kvscope_cpu_gemv", source=_CPP_SOURCE, functions=("gemv_q8_0", "gemv_q4_1", "gemv_q4_1x8", "isa"))

KERNEL = CachedKernel(SPEC, KERNEL_ENV)


def load_kernel(log: Callable[[str], None] | None = None) -> ModuleType | None:
    """The compiled module (``gemv_q8_0``, ``gemv_q4_1``, ``isa``), or None when it cannot
    be built here or ``KVSCOPE_CPU_GEMV_KERNEL=0`` turns it off (checked on every call)."""
    return KERNEL.get(log)


def unavailable_reason() -> str | None:
    """Why :func:`load_kernel` gave None (switched off, or the build's error)."""
    return KERNEL.unavailable_reason


def ensure_built(log: Callable[[str], None] | None = None) -> BuildReport | None:
    """Build or load the kernel now (startup's background thread, ``engine build-kernels``);
    None when it is switched off."""
    return KERNEL.ensure_built(log)


def gemv(x: torch.Tensor, blocks: torch.Tensor, fmt: str, int8_activations: bool = False) -> torch.Tensor:
    """``x [rows, in] @ W.T`` for ``W`` in ``fmt`` blocks ``[out, in/32*bytes]``; float32
    (or ``x``'s dtype) ``[rows, out]``. ``int8_activations`` quantizes ``x`` per 32-block
    first (:func:`quantize_activations_q8`). Needs the kernel (:func:`load_kernel`)."""
    kernel = load_kernel()
    assert kernel is not None, unavailable_reason()
    fn = getattr(kernel, f"gemv_{fmt}")
    return fn(x, blocks, int(int8_activations))


def quantize_activations_q8(x: torch.Tensor) -> torch.Tensor:
    """What the kernel's ``int8_activations`` path multiplies: ``x`` rounded per 32-block to
    ``da * round(x / da)`` with ``da = amax / 127`` (float32, the reference for tests)."""
    rows, k = x.shape
    xb = x.float().reshape(rows, k // QK, QK)
    d = xb.abs().amax(dim=-1, keepdim=True) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    return (torch.round(xb * inv) * d).reshape(rows, k)


# ---------------------------------------------------------------------- packing (torch)
def _check_in_features(weight: torch.Tensor) -> None:
    if weight.dim() != 2 or weight.shape[1] % QK:
        raise ValueError(f"block quantization needs [out, in] with in a multiple of {QK}, got {tuple(weight.shape)}")


def _half_bytes(values: torch.Tensor) -> torch.Tensor:
    """fp16 values ``[out, nb]`` -> their bytes ``[out, nb, 2]`` (little-endian, as ggml)."""
    return values.to(torch.float16).contiguous().view(torch.uint8).view(*values.shape, 2)


def quantize_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """ggml's Q8_0 of a float weight: ``d = amax / 127`` (fp16) per 32, ``q = round(w / d)``."""
    _check_in_features(weight)
    out, k = weight.shape
    w = weight.float().reshape(out, k // QK, QK)
    d = (w.abs().amax(dim=-1) / 127.0).to(torch.float16)
    inv = torch.where(d.float() > 0, 1.0 / d.float(), torch.zeros_like(d, dtype=torch.float32))
    q = torch.round(w * inv[..., None]).clamp(-127, 127).to(torch.int8)
    blocks = torch.cat([_half_bytes(d), q.view(torch.uint8)], dim=-1)
    return blocks.reshape(out, -1).contiguous()


def quantize_q4_1(weight: torch.Tensor) -> torch.Tensor:
    """ggml's Q4_1 of a float weight: ``m = min``, ``d = (max - min) / 15`` (both fp16) per 32,
    ``q = round((w - m) / d)`` in 0..15 (computed with the fp16-rounded ``d`` and ``m``)."""
    _check_in_features(weight)
    out, k = weight.shape
    w = weight.float().reshape(out, k // QK, QK)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    d = ((hi - lo) / 15.0).to(torch.float16)
    m = lo.to(torch.float16)
    inv = torch.where(d.float() > 0, 1.0 / d.float(), torch.zeros_like(d, dtype=torch.float32))
    q = torch.round((w - m.float()[..., None]) * inv[..., None]).clamp(0, 15).to(torch.uint8)
    packed = q[..., : QK // 2] | (q[..., QK // 2 :] << 4)
    blocks = torch.cat([_half_bytes(d), _half_bytes(m), packed], dim=-1)
    return blocks.reshape(out, -1).contiguous()


def int8_activations_enabled() -> bool:
    return os.environ.get(INT8_ACTIVATIONS_ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def interleave_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_1 blocks ``[out, in/32*20]`` (``out`` a multiple of 8) reordered into the kernel's
    ``q4_1x8`` layout (same bytes, same shape): per 8 rows and block, the 8 ``d``, the 8
    ``m``, then 4 chunks of the 8 rows' quant bytes 4c..4c+3."""
    out, width = blocks.shape
    if out % X8_ROWS or width % BLOCK_BYTES["q4_1"]:
        raise ValueError(f"q4_1x8 needs [out, in/32*20] with out a multiple of {X8_ROWS}, got {tuple(blocks.shape)}")
    nb = width // BLOCK_BYTES["q4_1"]
    b = blocks.reshape(out // X8_ROWS, X8_ROWS, nb, 20).transpose(1, 2)  # [groups, nb, 8 rows, 20]
    quants = b[..., 4:].reshape(*b.shape[:3], 4, 4).transpose(2, 3)  # [groups, nb, 4 chunks, 8 rows, 4]
    parts = [b[..., 0:2].flatten(2), b[..., 2:4].flatten(2), quants.flatten(2)]
    return torch.cat(parts, dim=-1).reshape(out, width).contiguous()


def deinterleave_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`interleave_q4_1`: ggml's row-by-row Q4_1 blocks."""
    out, width = blocks.shape
    nb, groups = width // BLOCK_BYTES["q4_1"], out // X8_ROWS
    g = blocks.reshape(groups, nb, X8_ROWS * 20)
    d = g[..., 0:16].reshape(groups, nb, X8_ROWS, 2)
    m = g[..., 16:32].reshape(groups, nb, X8_ROWS, 2)
    quants = g[..., 32:].reshape(groups, nb, 4, X8_ROWS, 4).transpose(2, 3).reshape(groups, nb, X8_ROWS, 16)
    rows = torch.cat([d, m, quants], dim=-1).transpose(1, 2)  # [groups, 8 rows, nb, 20]
    return rows.reshape(out, width).contiguous()


def dequantize(blocks: torch.Tensor, fmt: str) -> torch.Tensor:
    """float32 ``[out, in]`` of ``fmt`` blocks (the torch reference and fallback)."""
    if fmt == "q4_1x8":
        return dequantize(deinterleave_q4_1(blocks), "q4_1")
    size = BLOCK_BYTES[fmt]
    out = blocks.shape[0]
    b = blocks.reshape(out, -1, size)
    d = b[..., 0:2].contiguous().view(torch.float16).float()  # [out, nb, 1]
    if fmt == "q8_0":
        q = b[..., 2:].contiguous().view(torch.int8).float()
        return (d * q).reshape(out, -1)
    m = b[..., 2:4].contiguous().view(torch.float16).float()
    nibbles = b[..., 4:]
    q = torch.cat([nibbles & 15, nibbles >> 4], dim=-1).float()
    return (d * q + m).reshape(out, -1)
