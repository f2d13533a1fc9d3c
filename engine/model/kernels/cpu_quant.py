"""GGUF block-type matmul for CPU: ``y = x @ dequant(W).T`` straight from a GGUF tensor's bytes
(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, ggml's type ids as format codes), with the
activations rounded per 32 values to int8 (ggml's Q8_1: ``d = amax / 127``, the block's sum)
and integer dot products (``vpdpbusd`` on AVX-512 VNNI, ``maddubs``/``madd`` otherwise).

A weight ``[N out, K in]`` is ``uint8 [N, K / block_weights * block_bytes]``: each output row's
blocks in order, exactly the GGUF tensor's bytes. Per-32 activation scales fit every type (the
K-quants' sub-blocks are 32 or 16 weights), so one quantization of ``x`` serves a layer whose
parts have different types (:func:`quant_matmul_segments`, as Q4_K_M files mix Q4_K and Q6_K).

Layout of the quantized activations (``QuantActs`` in the C++): per 128 values (four 32-blocks
A..D) the first halves ``A0..15 B0..15 C0..15 D0..15`` then the second halves. Every format
unpacks a 128-weight group into that order with a few shuffles, so one 64-byte ``vpdpbusd``
gives each 32-block its own four int32 lanes, and a group costs one float FMA per row with the
weight's (sub)scales times the activation scales. The constant parts of the weights (Q4_0's -8,
Q5_0's -16, Q6_K's -32, Q8_0's +128 bias on VNNI, the Q4_1/Q5_1/K-quant minimums) are one more
FMA against the activations' per-block sums. The weight row streams once; it is unpacked once
per block and multiplied into a tile of up to 8 (AVX-512) or 4 (AVX2) activation rows; rows
of ``W`` are split over torch's intra-op threads in big contiguous chunks (``at::parallel_for``).

Builds: the engine compiles with ``-march=native``; ``KVSCOPE_CPU_QUANT_ISA`` = ``native``
(default) | ``avx512`` (no VNNI) | ``avx2`` | ``scalar`` loads the same source compiled with the
wider paths switched off (its own cache entry), so every path is built and tested on one
machine. ``KVSCOPE_CPU_QUANT_KERNEL=0`` switches the kernel off. The C++ (``CORE_SOURCE``,
namespace ``kvscope_quant``) is meant to be #included by other kernels: ``quantize_acts`` and
``matmul_rows`` / ``matmul_range`` (the latter serial, for a caller's own parallel region).

Speed: ``python -m bench.bench_quant``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from types import ModuleType

import torch

from engine.model.kernels.build import BuildReport, CachedKernel, KernelSpec

KERNEL_ENV = "KVSCOPE_CPU_QUANT_KERNEL"
ISA_ENV = "KVSCOPE_CPU_QUANT_ISA"

# ggml's type ids (ggml.h's enum ggml_type), used as the format codes.
FORMAT_IDS = {"q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "q4_k": 12, "q5_k": 13, "q6_k": 14}
FORMAT_NAMES = {code: name for name, code in FORMAT_IDS.items()}
# (weights per block, bytes per block), as ggml-common.h's block structs.
_GEOMETRY = {2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 12: (256, 144), 13: (256, 176),
             14: (256, 210)}

_CPP_CORE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

// One compile-time path: AVX-512 (F/BW/VL, + VNNI where the build has it), AVX2+FMA+F16C, or scalar.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KVQ_AVX512 1
#if defined(__AVX512VNNI__)
#define KVQ_VNNI 1
#endif
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KVQ_AVX2 1
#endif

namespace kvscope_quant {

enum Format : int { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

struct Geometry {
  int64_t weights = 0, bytes = 0;  // per ggml block; zero for an unknown format
};

inline Geometry geometry(int fmt) {
  switch (fmt) {
    case kQ4_0: return {32, 18};
    case kQ4_1: return {32, 20};
    case kQ5_0: return {32, 22};
    case kQ5_1: return {32, 24};
    case kQ8_0: return {32, 34};
    case kQ4_K: return {256, 144};
    case kQ5_K: return {256, 176};
    case kQ6_K: return {256, 210};
    default: return {};
  }
}

inline float fp16(const uint8_t* p) {
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

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// ---------------------------------------------------------------- activations (ggml's Q8_1, per 32)
// Rows padded to whole 128-value groups (zeros). Per group: the four 32-blocks' first halves, then
// their second halves, so a 64-byte load pairs with a format's unpacked weights. d: each block's
// scale on its four dot lanes; s32 / s16: d * sum(q) per 32-block / per 16 values (natural order,
// padded so a 16-float load at any group stays inside the row).
constexpr int64_t kGroup = 128;

struct QuantActs {
  int64_t M = 0, K = 0, groups = 0;
  int64_t q_stride = 0, d_stride = 0, s32_stride = 0, s16_stride = 0;
  std::vector<int8_t> q;
  std::vector<float> d, s32, s16;
  const int8_t* qrow(int64_t r) const { return q.data() + r * q_stride; }
  const float* drow(int64_t r) const { return d.data() + r * d_stride; }
  const float* s32row(int64_t r) const { return s32.data() + r * s32_stride; }
  const float* s16row(int64_t r) const { return s16.data() + r * s16_stride; }
};

// Where value i (0..31) of 32-block kb lands in a row of QuantActs::q.
inline int64_t act_pos(int64_t kb, int i) { return (kb >> 2) * kGroup + (i >> 4) * 64 + (kb & 3) * 16 + (i & 15); }

// One 32-block: d = amax / 127, q = round-half-even(x / d) (as x * (1 / d), like ggml and the tests).
inline void quantize_block(const float* x, QuantActs& a, int64_t r, int64_t kb) {
  int8_t* q = a.q.data() + r * a.q_stride;
  float amax = 0.f;
#if defined(KVQ_AVX512)
  const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
  amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
  const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
  const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(id)));
  const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(id)));
  _mm_storeu_si128((__m128i*)(q + act_pos(kb, 0)), _mm512_cvtepi32_epi8(q0));
  _mm_storeu_si128((__m128i*)(q + act_pos(kb, 16)), _mm512_cvtepi32_epi8(q1));
  const int lo = _mm512_reduce_add_epi32(q0), hi = _mm512_reduce_add_epi32(q1);
#else
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
  int lo = 0, hi = 0;
  for (int i = 0; i < 32; ++i) {
    const int v = (int)std::nearbyint(x[i] * id);
    q[act_pos(kb, i)] = (int8_t)v;
    (i < 16 ? lo : hi) += v;
  }
#endif
  float* dl = a.d.data() + r * a.d_stride + (kb >> 2) * 16 + (kb & 3) * 4;
  dl[0] = dl[1] = dl[2] = dl[3] = d;
  a.s32[r * a.s32_stride + kb] = d * (float)(lo + hi);
  a.s16[r * a.s16_stride + 2 * kb] = d * (float)lo;
  a.s16[r * a.s16_stride + 2 * kb + 1] = d * (float)hi;
}

// x: M rows of K floats (row stride ldx), K a multiple of 32. Reuses a's buffers.
inline void quantize_acts(const float* x, int64_t M, int64_t K, int64_t ldx, QuantActs& a) {
  a.M = M;
  a.K = K;
  a.groups = (K + kGroup - 1) / kGroup;
  a.q_stride = a.groups * kGroup;
  a.d_stride = a.groups * 16;
  a.s32_stride = a.groups * 4 + 12;
  a.s16_stride = a.groups * 8 + 8;
  a.q.assign(M * a.q_stride, 0);
  a.d.assign(M * a.d_stride, 0.f);
  a.s32.assign(M * a.s32_stride, 0.f);
  a.s16.assign(M * a.s16_stride, 0.f);
  const int64_t nb = K / 32;
  at::parallel_for(0, M, std::max<int64_t>(1, 32768 / std::max<int64_t>(K, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t kb = 0; kb < nb; ++kb) quantize_block(x + r * ldx + kb * 32, a, r, kb);
  });
}

// ---------------------------------------------------------------- block formats
// decode(): 32-block j of a ggml block as integers, w[i] = sc[i / 16] * v[i] (+ mn), computed in
// ggml's (and gguf-py's) float order so dequantize() is bit-exact (the build has no -ffast-math
// and no FMA contraction). The SIMD matmul paths unpack a unit (4 ggml blocks of 32, or one
// K-quant block) into groups of 128 weights laid out as the activations (see QuantActs).
struct BlockInts {
  int8_t v[32];
  float sc[2];
  float mn;
};

#if defined(KVQ_AVX512)
struct Group {
  __m512i w0, w1;       // unsigned weight bytes: first / second halves of the 4 blocks
  __m512 s0, s1;        // per-lane float scales of w0's / w1's dot lanes (s1: two-scale formats)
  __m512 mo;            // coefficients of the activation sums (s32: 4 lanes, s16: 8 lanes; rest 0)
  __mmask64 n0, n1;     // Q8_0 without VNNI: the negative weights (w0 / w1 hold |q|)
};
static const __m512i kLane4 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
static inline __m512 lanes4(__m128 v) { return _mm512_permutexvar_ps(kLane4, _mm512_castps128_ps512(v)); }
static inline __m512 zext4(__m128 v) { return _mm512_maskz_mov_ps(0x000F, _mm512_castps128_ps512(v)); }
static inline __m512i low_nibbles(__m512i v) { return _mm512_and_si512(v, _mm512_set1_epi8(15)); }
// 4 unaligned 16-byte pieces p, p + stride, ... as one vector
static inline __m512i gather4x16(const uint8_t* p, int64_t stride) {
  __m512i z = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i*)p));
  z = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i*)(p + stride)), 1);
  z = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i*)(p + 2 * stride)), 2);
  return _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i*)(p + 3 * stride)), 3);
}
static inline __m512i dp(__m512i acc, __m512i w, __m512i a) {
#if defined(KVQ_VNNI)
  return _mm512_dpbusd_epi32(acc, w, a);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, a), _mm512_set1_epi16(1)));
#endif
}
// Both halves into the same lanes (weights below 32: the int16 pair sums cannot saturate).
static inline __m512i dp2(const Group& g, __m512i a0, __m512i a1) {
#if defined(KVQ_VNNI)
  return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), g.w0, a0), g.w1, a1);
#else
  const __m512i s = _mm512_add_epi16(_mm512_maddubs_epi16(g.w0, a0), _mm512_maddubs_epi16(g.w1, a1));
  return _mm512_madd_epi16(s, _mm512_set1_epi16(1));
#endif
}
#elif defined(KVQ_AVX2)
struct Group {
  __m256i w0a, w0b, w1a, w1b;  // first halves of blocks A|B, C|D; second halves of A|B, C|D
  __m256 s0a, s0b, s1a, s1b;   // per-lane float scales of those dot lanes
  __m256 mo;                   // coefficients of the activation sums (s32: 4 lanes, s16: 8; rest 0)
};
static inline __m256i low_nibbles(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(15)); }
static inline __m256 lanes_pair(__m256 v, int i, int j) {  // [v[i] x4, v[j] x4]
  return _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(i, i, i, i, j, j, j, j));
}
static inline __m256 zext4(__m128 v) { return _mm256_insertf128_ps(_mm256_setzero_ps(), v, 0); }
static inline __m256i dp(__m256i w, __m256i a) { return _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), _mm256_set1_epi16(1)); }
static inline __m256i dp2(__m256i w0, __m256i a0, __m256i w1, __m256i a1) {
  const __m256i s = _mm256_add_epi16(_mm256_maddubs_epi16(w0, a0), _mm256_maddubs_epi16(w1, a1));
  return _mm256_madd_epi16(s, _mm256_set1_epi16(1));
}
// The 32 bits of m as 32 bytes, 0x10 where the bit is set (byte i <- bit i), for the 5th bit.
static inline __m256i bits_to_0x10(uint32_t m) {
  const __m256i shuf = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                        2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
  const __m256i b = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)m), shuf), bit);
  return _mm256_and_si256(_mm256_cmpeq_epi8(b, bit), _mm256_set1_epi8(0x10));
}
#endif

static inline __m128 fp16x4(const uint8_t* p, int64_t stride) {
#if defined(__F16C__)
  uint16_t h[4];
  for (int i = 0; i < 4; ++i) std::memcpy(h + i, p + i * stride, 2);
  return _mm_cvtph_ps(_mm_setr_epi16((short)h[0], (short)h[1], (short)h[2], (short)h[3], 0, 0, 0, 0));
#else
  return _mm_setr_ps(fp16(p), fp16(p + stride), fp16(p + 2 * stride), fp16(p + 3 * stride));
#endif
}

// Common to the four 32-weight formats with 4-bit quants (+ a 5th bit): qs at byte offset kQs.
template <int kBytes_, int kQs, int kQh, bool kMin, int kOffset>
struct Small {
  static constexpr int64_t kBlockWeights = 32, kBlockBytes = kBytes_;
  static constexpr int kSub = 1, kUnitBlocks = 4, kGroups = 1;
  static constexpr bool kTwoScales = false, kHasMin = kMin;
  static constexpr int kOff = 32;  // coefficients against s32
  struct Prep {};
  static inline void decode(const uint8_t* b, int, BlockInts& o) {
    const uint8_t* qs = b + kQs;
    const uint32_t qh = kQh >= 0 ? load_u32(b + (kQh >= 0 ? kQh : 0)) : 0u;
    for (int i = 0; i < 16; ++i) {
      const int lo = (qs[i] & 15) | (int)(((qh >> i) & 1) << 4), hi = (qs[i] >> 4) | (int)(((qh >> (i + 16)) & 1) << 4);
      o.v[i] = (int8_t)(lo - kOffset);
      o.v[i + 16] = (int8_t)(hi - kOffset);
    }
    o.sc[0] = o.sc[1] = fp16(b);
    o.mn = kMin ? fp16(b + 2) : 0.f;
  }
  static inline void prepare(const uint8_t*, Prep&) {}
#if defined(KVQ_AVX512)
  static inline void group(const uint8_t* u, const Prep&, int, Group& g) {
    const __m512i z = gather4x16(u + kQs, kBytes_);
    g.w0 = low_nibbles(z);
    g.w1 = low_nibbles(_mm512_srli_epi16(z, 4));
    if (kQh >= 0) {
      uint64_t m0 = 0, m1 = 0;
      for (int i = 0; i < 4; ++i) {
        const uint64_t h = load_u32(u + i * kBytes_ + (kQh >= 0 ? kQh : 0));
        m0 |= (h & 0xFFFF) << (16 * i);
        m1 |= (h >> 16) << (16 * i);
      }
      g.w0 = _mm512_mask_add_epi8(g.w0, (__mmask64)m0, g.w0, _mm512_set1_epi8(16));
      g.w1 = _mm512_mask_add_epi8(g.w1, (__mmask64)m1, g.w1, _mm512_set1_epi8(16));
    }
    const __m128 d = fp16x4(u, kBytes_);
    g.s0 = lanes4(d);
    g.mo = zext4(kMin ? fp16x4(u + 2, kBytes_) : _mm_mul_ps(d, _mm_set1_ps(-(float)kOffset)));
  }
#elif defined(KVQ_AVX2)
  static inline void group(const uint8_t* u, const Prep&, int, Group& g) {
    __m256i x[4];  // blocks' qs: [A|B], [C|D] (first halves in the low nibbles, second in the high)
    const __m256i ab = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)(u + kQs))),
                                               _mm_loadu_si128((const __m128i*)(u + kBytes_ + kQs)), 1);
    const __m256i cd = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)(u + 2 * kBytes_ + kQs))),
        _mm_loadu_si128((const __m128i*)(u + 3 * kBytes_ + kQs)), 1);
    x[0] = low_nibbles(ab);
    x[1] = low_nibbles(cd);
    x[2] = low_nibbles(_mm256_srli_epi16(ab, 4));
    x[3] = low_nibbles(_mm256_srli_epi16(cd, 4));
    if (kQh >= 0) {
      uint32_t h[4];
      for (int i = 0; i < 4; ++i) h[i] = load_u32(u + i * kBytes_ + (kQh >= 0 ? kQh : 0));
      x[0] = _mm256_or_si256(x[0], bits_to_0x10((h[0] & 0xFFFF) | (h[1] << 16)));
      x[1] = _mm256_or_si256(x[1], bits_to_0x10((h[2] & 0xFFFF) | (h[3] << 16)));
      x[2] = _mm256_or_si256(x[2], bits_to_0x10((h[0] >> 16) | (h[1] & 0xFFFF0000u)));
      x[3] = _mm256_or_si256(x[3], bits_to_0x10((h[2] >> 16) | (h[3] & 0xFFFF0000u)));
    }
    g.w0a = x[0];
    g.w0b = x[1];
    g.w1a = x[2];
    g.w1b = x[3];
    const __m128 d = fp16x4(u, kBytes_);
    const __m256 d8 = _mm256_castps128_ps256(d);
    g.s0a = lanes_pair(d8, 0, 1);
    g.s0b = lanes_pair(d8, 2, 3);
    g.mo = zext4(kMin ? fp16x4(u + 2, kBytes_) : _mm_mul_ps(d, _mm_set1_ps(-(float)kOffset)));
  }
#endif
};

using FQ4_0 = Small<18, 2, -1, false, 8>;
using FQ4_1 = Small<20, 4, -1, true, 0>;
using FQ5_0 = Small<22, 6, 2, false, 16>;
using FQ5_1 = Small<24, 8, 4, true, 0>;

struct FQ8_0 {
  static constexpr int64_t kBlockWeights = 32, kBlockBytes = 34;
  static constexpr int kSub = 1, kUnitBlocks = 4, kGroups = 1;
  static constexpr bool kTwoScales = false, kHasMin = false;
#if defined(KVQ_VNNI)
  static constexpr int kOff = 32;  // weights biased by +128 to unsigned: subtract 128 * d * s32
#else
  static constexpr int kOff = 0;  // sign trick: |q| times sign-adjusted activations
#endif
  struct Prep {};
  static inline void decode(const uint8_t* b, int, BlockInts& o) {
    std::memcpy(o.v, b + 2, 32);
    o.sc[0] = o.sc[1] = fp16(b);
    o.mn = 0.f;
  }
  static inline void prepare(const uint8_t*, Prep&) {}
#if defined(KVQ_AVX512)
  static inline void group(const uint8_t* u, const Prep&, int, Group& g) {
    const __m512i ab = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(u + 2))),
                                          _mm256_loadu_si256((const __m256i*)(u + 36)), 1);
    const __m512i cd = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(u + 70))),
                                          _mm256_loadu_si256((const __m256i*)(u + 104)), 1);
    g.w0 = _mm512_shuffle_i64x2(ab, cd, _MM_SHUFFLE(2, 0, 2, 0));
    g.w1 = _mm512_shuffle_i64x2(ab, cd, _MM_SHUFFLE(3, 1, 3, 1));
    const __m128 d = fp16x4(u, 34);
    g.s0 = lanes4(d);
#if defined(KVQ_VNNI)
    g.w0 = _mm512_xor_si512(g.w0, _mm512_set1_epi8((char)0x80));
    g.w1 = _mm512_xor_si512(g.w1, _mm512_set1_epi8((char)0x80));
    g.mo = zext4(_mm_mul_ps(d, _mm_set1_ps(-128.f)));
#else
    g.n0 = _mm512_movepi8_mask(g.w0);
    g.n1 = _mm512_movepi8_mask(g.w1);
    g.w0 = _mm512_abs_epi8(g.w0);
    g.w1 = _mm512_abs_epi8(g.w1);
    g.mo = _mm512_setzero_ps();
#endif
  }
#elif defined(KVQ_AVX2)
  static inline void group(const uint8_t* u, const Prep&, int, Group& g) {  // signed weights
    const __m256i a = _mm256_loadu_si256((const __m256i*)(u + 2)), b = _mm256_loadu_si256((const __m256i*)(u + 36));
    const __m256i c = _mm256_loadu_si256((const __m256i*)(u + 70)), d = _mm256_loadu_si256((const __m256i*)(u + 104));
    g.w0a = _mm256_permute2x128_si256(a, b, 0x20);
    g.w1a = _mm256_permute2x128_si256(a, b, 0x31);
    g.w0b = _mm256_permute2x128_si256(c, d, 0x20);
    g.w1b = _mm256_permute2x128_si256(c, d, 0x31);
    const __m256 d8 = _mm256_castps128_ps256(fp16x4(u, 34));
    g.s0a = lanes_pair(d8, 0, 1);
    g.s0b = lanes_pair(d8, 2, 3);
    g.mo = _mm256_setzero_ps();
  }
#endif
};

// Q4_K / Q5_K: d, dmin (fp16), 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32, (Q5_K: 32
// bytes of 5th bits, bit j of byte l for weight l of sub-block j), 128 bytes of nibbles: bytes
// 32c..32c+31 hold sub-block 2c in the low nibbles and 2c+1 in the high ones.
inline void kquant_scales(const uint8_t* s, uint8_t sc[8], uint8_t mn[8]) {
  const uint32_t u0 = load_u32(s), u1 = load_u32(s + 4), u2 = load_u32(s + 8);
  const uint32_t sc_lo = u0 & 0x3f3f3f3fu, mn_lo = u1 & 0x3f3f3f3fu;
  const uint32_t sc_hi = (u2 & 0x0f0f0f0fu) | ((u0 >> 2) & 0x30303030u);
  const uint32_t mn_hi = ((u2 >> 4) & 0x0f0f0f0fu) | ((u1 >> 2) & 0x30303030u);
  std::memcpy(sc, &sc_lo, 4);
  std::memcpy(sc + 4, &sc_hi, 4);
  std::memcpy(mn, &mn_lo, 4);
  std::memcpy(mn + 4, &mn_hi, 4);
}

template <bool kFive>
struct KQuant45 {
  static constexpr int64_t kBlockWeights = 256, kBlockBytes = kFive ? 176 : 144;
  static constexpr int kSub = 8, kUnitBlocks = 1, kGroups = 2;
  static constexpr bool kTwoScales = false, kHasMin = true;
  static constexpr int kOff = 32;
  static constexpr int kQs = kFive ? 48 : 16;
  static inline void decode(const uint8_t* b, int j, BlockInts& o) {
    uint8_t sc[8], mn[8];
    kquant_scales(b + 4, sc, mn);
    const uint8_t* qs = b + kQs + 32 * (j >> 1);
    const int shift = 4 * (j & 1);
    for (int i = 0; i < 32; ++i) {
      int v = (qs[i] >> shift) & 15;
      if (kFive) v |= ((b[16 + i] >> j) & 1) << 4;
      o.v[i] = (int8_t)v;
    }
    o.sc[0] = o.sc[1] = fp16(b) * (float)sc[j];
    o.mn = -(fp16(b + 2) * (float)mn[j]);
  }
#if defined(KVQ_AVX512)
  struct Prep {
    __m256 sc, mn;  // d * scale, -dmin * min of the 8 sub-blocks
  };
  static inline void prepare(const uint8_t* b, Prep& p) {
    uint8_t sc[8], mn[8];
    kquant_scales(b + 4, sc, mn);
    uint64_t s8, m8;
    std::memcpy(&s8, sc, 8);
    std::memcpy(&m8, mn, 8);
    p.sc = _mm256_mul_ps(_mm256_set1_ps(fp16(b)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)s8))));
    p.mn = _mm256_mul_ps(_mm256_set1_ps(-fp16(b + 2)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)m8))));
  }
  static inline void group(const uint8_t* b, const Prep& p, int gi, Group& g) {
    // group gi: sub-blocks 4gi..4gi+3 = low/high nibbles of qs[64gi..64gi+31] and qs[64gi+32..64gi+63]
    const __m512i l = _mm512_loadu_si512((const void*)(b + kQs + 64 * gi));
    const __m512i cnt = _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0);
    g.w0 = low_nibbles(_mm512_srlv_epi64(_mm512_shuffle_i64x2(l, l, _MM_SHUFFLE(2, 2, 0, 0)), cnt));
    g.w1 = low_nibbles(_mm512_srlv_epi64(_mm512_shuffle_i64x2(l, l, _MM_SHUFFLE(3, 3, 1, 1)), cnt));
    if (kFive) {  // lane k of the group: bit 4gi + k of qh[l]
      const __m512i bits = _mm512_set_epi32(0x08080808, 0x08080808, 0x08080808, 0x08080808, 0x04040404, 0x04040404,
                                            0x04040404, 0x04040404, 0x02020202, 0x02020202, 0x02020202, 0x02020202,
                                            0x01010101, 0x01010101, 0x01010101, 0x01010101);
      const __m512i bm = gi ? _mm512_slli_epi32(bits, 4) : bits;
      const __m512i h0 = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(b + 16)));
      const __m512i h1 = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(b + 32)));
      g.w0 = _mm512_mask_add_epi8(g.w0, _mm512_test_epi8_mask(h0, bm), g.w0, _mm512_set1_epi8(16));
      g.w1 = _mm512_mask_add_epi8(g.w1, _mm512_test_epi8_mask(h1, bm), g.w1, _mm512_set1_epi8(16));
    }
    const __m512 sc = _mm512_castps256_ps512(p.sc);
    g.s0 = _mm512_permutexvar_ps(_mm512_add_epi32(kLane4, _mm512_set1_epi32(4 * gi)), sc);
    g.mo = zext4(gi ? _mm256_extractf128_ps(p.mn, 1) : _mm256_castps256_ps128(p.mn));
  }
#elif defined(KVQ_AVX2)
  struct Prep {
    __m256 sc, mn;
  };
  static inline void prepare(const uint8_t* b, Prep& p) {
    uint8_t sc[8], mn[8];
    kquant_scales(b + 4, sc, mn);
    uint64_t s8, m8;
    std::memcpy(&s8, sc, 8);
    std::memcpy(&m8, mn, 8);
    p.sc = _mm256_mul_ps(_mm256_set1_ps(fp16(b)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)s8))));
    p.mn = _mm256_mul_ps(_mm256_set1_ps(-fp16(b + 2)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)m8))));
  }
  static inline __m256i nibble_pair(const uint8_t* p) {  // [p[0..15] low nibbles, p[0..15] high nibbles]
    const __m256i t = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)p));
    return low_nibbles(_mm256_srlv_epi64(t, _mm256_set_epi64x(4, 4, 0, 0)));
  }
  static inline __m256i fifth(__m256i w, __m128i h, int bit_a, int bit_b) {  // bits of qh for lanes A|B
    const __m256i bm = _mm256_setr_m128i(_mm_set1_epi8((char)(1 << bit_a)), _mm_set1_epi8((char)(1 << bit_b)));
    const __m256i t = _mm256_and_si256(_mm256_broadcastsi128_si256(h), bm);
    return _mm256_or_si256(w, _mm256_and_si256(_mm256_cmpeq_epi8(t, bm), _mm256_set1_epi8(0x10)));
  }
  static inline void group(const uint8_t* b, const Prep& p, int gi, Group& g) {
    const uint8_t* qs = b + kQs + 64 * gi;
    g.w0a = nibble_pair(qs);       // sub-blocks 4gi, 4gi+1: weights 0..15
    g.w0b = nibble_pair(qs + 32);  // 4gi+2, 4gi+3: weights 0..15
    g.w1a = nibble_pair(qs + 16);
    g.w1b = nibble_pair(qs + 48);
    if (kFive) {
      const __m128i h0 = _mm_loadu_si128((const __m128i*)(b + 16)), h1 = _mm_loadu_si128((const __m128i*)(b + 32));
      g.w0a = fifth(g.w0a, h0, 4 * gi, 4 * gi + 1);
      g.w0b = fifth(g.w0b, h0, 4 * gi + 2, 4 * gi + 3);
      g.w1a = fifth(g.w1a, h1, 4 * gi, 4 * gi + 1);
      g.w1b = fifth(g.w1b, h1, 4 * gi + 2, 4 * gi + 3);
    }
    g.s0a = lanes_pair(p.sc, 4 * gi, 4 * gi + 1);
    g.s0b = lanes_pair(p.sc, 4 * gi + 2, 4 * gi + 3);
    g.mo = zext4(gi ? _mm256_extractf128_ps(p.mn, 1) : _mm256_castps256_ps128(p.mn));
  }
#else
  struct Prep {};
  static inline void prepare(const uint8_t*, Prep&) {}
#endif
};

using FQ4_K = KQuant45<false>;
using FQ5_K = KQuant45<true>;

// Q6_K: ql[128] (low 4 bits), qh[64] (high 2 bits), int8 scales[16] (one per 16 weights), fp16 d.
// Half n (128 weights) = 32-blocks A..D: A = ql[64n + l] low nibble, B = ql[64n + 32 + l] low,
// C = ql[64n + l] high, D = ql[64n + 32 + l] high, their 2 high bits at bits 0-1 / 2-3 / 4-5 / 6-7
// of qh[32n + l]; w = d * scale[i / 16] * (q - 32).
struct FQ6_K {
  static constexpr int64_t kBlockWeights = 256, kBlockBytes = 210;
  static constexpr int kSub = 8, kUnitBlocks = 1, kGroups = 2;
  static constexpr bool kTwoScales = true, kHasMin = false;
  static constexpr int kOff = 16;  // -32 * d * scale against s16
  static inline void decode(const uint8_t* b, int j, BlockInts& o) {
    const int n = j >> 2, k = j & 3;
    const uint8_t* ql = b + 64 * n + 32 * (k & 1);
    const uint8_t* qh = b + 128 + 32 * n;
    const float d = fp16(b + 208);
    for (int i = 0; i < 32; ++i) {
      const int lo = (ql[i] >> (4 * (k >> 1))) & 15, hi = (qh[i] >> (2 * k)) & 3;
      o.v[i] = (int8_t)((lo | (hi << 4)) - 32);
    }
    o.sc[0] = d * (float)(int8_t)b[192 + 2 * j];
    o.sc[1] = d * (float)(int8_t)b[192 + 2 * j + 1];
    o.mn = 0.f;
  }
#if defined(KVQ_AVX512)
  struct Prep {
    __m512 sc;  // d * scale of the 16 sub-blocks of 16
  };
  static inline void prepare(const uint8_t* b, Prep& p) {
    p.sc = _mm512_mul_ps(_mm512_set1_ps(fp16(b + 208)),
                         _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(b + 192)))));
  }
  static inline void group(const uint8_t* b, const Prep& p, int n, Group& g) {
    const __m512i l = _mm512_loadu_si512((const void*)(b + 64 * n));  // [ql0..15, ql16..31, ql32..47, ql48..63]
    const __m512i cnt = _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0);
    g.w0 = low_nibbles(_mm512_srlv_epi64(_mm512_shuffle_i64x2(l, l, _MM_SHUFFLE(2, 0, 2, 0)), cnt));
    g.w1 = low_nibbles(_mm512_srlv_epi64(_mm512_shuffle_i64x2(l, l, _MM_SHUFFLE(3, 1, 3, 1)), cnt));
    // lane k takes bits 2k, 2k+1 of qh: rotate each dword so they land on bits 4, 5 of their byte
    const __m512i rot = _mm512_set_epi32(30, 30, 30, 30, 0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4);
    const __m512i mask = _mm512_set1_epi8(0x30);
    const __m512i h0 = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(b + 128 + 32 * n)));
    const __m512i h1 = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(b + 144 + 32 * n)));
    g.w0 = _mm512_or_si512(g.w0, _mm512_and_si512(_mm512_rolv_epi32(h0, rot), mask));
    g.w1 = _mm512_or_si512(g.w1, _mm512_and_si512(_mm512_rolv_epi32(h1, rot), mask));
    const __m512i even = _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6);
    const __m512i base = _mm512_set1_epi32(8 * n);
    g.s0 = _mm512_permutexvar_ps(_mm512_add_epi32(even, base), p.sc);
    g.s1 = _mm512_permutexvar_ps(_mm512_add_epi32(even, _mm512_add_epi32(base, _mm512_set1_epi32(1))), p.sc);
    const __m512i first8 = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 0, 0, 0, 0, 0, 0, 0, 0);
    g.mo = _mm512_mul_ps(_mm512_maskz_permutexvar_ps(0x00FF, _mm512_add_epi32(first8, base), p.sc),
                         _mm512_set1_ps(-32.f));
  }
#elif defined(KVQ_AVX2)
  struct Prep {
    __m256 sc[2];  // d * scale, sub-blocks 0..7 and 8..15
  };
  static inline void prepare(const uint8_t* b, Prep& p) {
    const __m256 d = _mm256_set1_ps(fp16(b + 208));
    p.sc[0] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(b + 192)))));
    p.sc[1] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(b + 200)))));
  }
  static inline void group(const uint8_t* b, const Prep& p, int n, Group& g) {
    const uint8_t* ql = b + 64 * n;
    const __m256i x = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)ql)),
                                              _mm_loadu_si128((const __m128i*)(ql + 32)), 1);
    const __m256i y = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)(ql + 16))),
                                              _mm_loadu_si128((const __m128i*)(ql + 48)), 1);
    const __m256i mask = _mm256_set1_epi8(0x30);
    const __m256i left = _mm256_setr_epi32(4, 4, 4, 4, 2, 2, 2, 2), right = _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2);
    const __m256i h0 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(b + 128 + 32 * n)));
    const __m256i h1 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(b + 144 + 32 * n)));
    g.w0a = _mm256_or_si256(low_nibbles(x), _mm256_and_si256(_mm256_sllv_epi32(h0, left), mask));  // A|B 0..15
    g.w0b = _mm256_or_si256(low_nibbles(_mm256_srli_epi16(x, 4)), _mm256_and_si256(_mm256_srlv_epi32(h0, right), mask));
    g.w1a = _mm256_or_si256(low_nibbles(y), _mm256_and_si256(_mm256_sllv_epi32(h1, left), mask));
    g.w1b = _mm256_or_si256(low_nibbles(_mm256_srli_epi16(y, 4)), _mm256_and_si256(_mm256_srlv_epi32(h1, right), mask));
    const __m256 s = p.sc[n];
    g.s0a = lanes_pair(s, 0, 2);
    g.s0b = lanes_pair(s, 4, 6);
    g.s1a = lanes_pair(s, 1, 3);
    g.s1b = lanes_pair(s, 5, 7);
    g.mo = _mm256_mul_ps(s, _mm256_set1_ps(-32.f));
  }
#else
  struct Prep {};
  static inline void prepare(const uint8_t*, Prep&) {}
#endif
};

// ---------------------------------------------------------------- one weight row x R activation rows
#if defined(KVQ_AVX512)
constexpr int kMaxRows = 8;

template <class F>
static inline __m512i dot_group(const Group& g, __m512i a0, __m512i a1) {
  if constexpr (std::is_same_v<F, FQ8_0>) {
#if !defined(KVQ_VNNI)
    // |q| x activations negated where q < 0; the halves apart (|q| * a pair sums reach 32512)
    const __m512i z = _mm512_setzero_si512(), ones = _mm512_set1_epi16(1);
    const __m512i p0 = _mm512_madd_epi16(_mm512_maddubs_epi16(g.w0, _mm512_mask_sub_epi8(a0, g.n0, z, a0)), ones);
    const __m512i p1 = _mm512_madd_epi16(_mm512_maddubs_epi16(g.w1, _mm512_mask_sub_epi8(a1, g.n1, z, a1)), ones);
    return _mm512_add_epi32(p0, p1);
#endif
  }
  return dp2(g, a0, a1);
}

// y[r * ldy] for r < R: unit u's groups unpacked once, then used by every row.
template <class F, int R>
static void tile(const uint8_t* wrow, int64_t units, const uint8_t* tail, const QuantActs& a, int64_t r0, float* y,
                 int64_t ldy) {
  constexpr int NA = R <= 2 ? 2 : 1;  // independent accumulator chains per row (groups alternate)
  __m512 acc[R][NA], off[R];
  for (int r = 0; r < R; ++r) {
    for (int k = 0; k < NA; ++k) acc[r][k] = _mm512_setzero_ps();
    off[r] = _mm512_setzero_ps();
  }
  const int8_t* q0 = a.qrow(r0);
  const float* d0 = a.drow(r0);
  const float* so = F::kOff == 16 ? a.s16row(r0) : a.s32row(r0);
  const int64_t so_stride = F::kOff == 16 ? a.s16_stride : a.s32_stride;
  const int64_t n_units = units + (tail != nullptr);
  for (int64_t u = 0; u < n_units; ++u) {
    const uint8_t* ub = u < units ? wrow + u * F::kUnitBlocks * F::kBlockBytes : tail;
    typename F::Prep p;
    F::prepare(ub, p);
    for (int gk = 0; gk < F::kGroups; ++gk) {
      Group g;
      F::group(ub, p, gk, g);
      const int64_t gi = u * F::kGroups + gk;
      const int k = NA == 1 ? 0 : (int)(gi & 1);
      for (int r = 0; r < R; ++r) {
        const int8_t* q = q0 + r * a.q_stride + gi * kGroup;
        const __m512i a0 = _mm512_loadu_si512((const void*)q), a1 = _mm512_loadu_si512((const void*)(q + 64));
        const __m512 da = _mm512_loadu_ps(d0 + r * a.d_stride + gi * 16);
        if constexpr (F::kTwoScales) {
          const __m512i z = _mm512_setzero_si512();
          __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(dp(z, g.w0, a0)), g.s0);
          t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dp(z, g.w1, a1)), g.s1, t);
          acc[r][k] = _mm512_fmadd_ps(t, da, acc[r][k]);
        } else {
          acc[r][k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_group<F>(g, a0, a1)), _mm512_mul_ps(g.s0, da), acc[r][k]);
        }
        if constexpr (F::kOff != 0)
          off[r] = _mm512_fmadd_ps(g.mo, _mm512_loadu_ps(so + r * so_stride + gi * (F::kOff == 16 ? 8 : 4)), off[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    __m512 s = _mm512_add_ps(acc[r][0], off[r]);
    if (NA > 1) s = _mm512_add_ps(s, acc[r][NA - 1]);
    y[r * ldy] = _mm512_reduce_add_ps(s);
  }
}
#elif defined(KVQ_AVX2)
constexpr int kMaxRows = 4;  // 16 ymm registers

static inline float hsum(__m256 s) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

template <class F>
static inline __m256i dot_pair(__m256i w0, __m256i a0, __m256i w1, __m256i a1) {
  if constexpr (std::is_same_v<F, FQ8_0>) {  // sign trick; the halves apart (pair sums reach 32512)
    const __m256i p0 = dp(_mm256_sign_epi8(w0, w0), _mm256_sign_epi8(a0, w0));
    return _mm256_add_epi32(p0, dp(_mm256_sign_epi8(w1, w1), _mm256_sign_epi8(a1, w1)));
  }
  return dp2(w0, a0, w1, a1);
}

template <class F, int R>
static void tile(const uint8_t* wrow, int64_t units, const uint8_t* tail, const QuantActs& a, int64_t r0, float* y,
                 int64_t ldy) {
  __m256 acc[R], off[R];
  for (int r = 0; r < R; ++r) acc[r] = off[r] = _mm256_setzero_ps();
  const int8_t* q0 = a.qrow(r0);
  const float* d0 = a.drow(r0);
  const float* so = F::kOff == 16 ? a.s16row(r0) : a.s32row(r0);
  const int64_t so_stride = F::kOff == 16 ? a.s16_stride : a.s32_stride;
  const int64_t n_units = units + (tail != nullptr);
  for (int64_t u = 0; u < n_units; ++u) {
    const uint8_t* ub = u < units ? wrow + u * F::kUnitBlocks * F::kBlockBytes : tail;
    typename F::Prep p;
    F::prepare(ub, p);
    for (int gk = 0; gk < F::kGroups; ++gk) {
      Group g;
      F::group(ub, p, gk, g);
      const int64_t gi = u * F::kGroups + gk;
      for (int r = 0; r < R; ++r) {
        const int8_t* q = q0 + r * a.q_stride + gi * kGroup;
        const __m256i a0a = _mm256_loadu_si256((const __m256i*)q), a0b = _mm256_loadu_si256((const __m256i*)(q + 32));
        const __m256i a1a = _mm256_loadu_si256((const __m256i*)(q + 64)), a1b = _mm256_loadu_si256((const __m256i*)(q + 96));
        const float* dr = d0 + r * a.d_stride + gi * 16;
        const __m256 da = _mm256_loadu_ps(dr), db = _mm256_loadu_ps(dr + 8);
        if constexpr (F::kTwoScales) {
          __m256 ta = _mm256_mul_ps(_mm256_cvtepi32_ps(dp(g.w0a, a0a)), g.s0a);
          ta = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dp(g.w1a, a1a)), g.s1a, ta);
          __m256 tb = _mm256_mul_ps(_mm256_cvtepi32_ps(dp(g.w0b, a0b)), g.s0b);
          tb = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dp(g.w1b, a1b)), g.s1b, tb);
          acc[r] = _mm256_fmadd_ps(ta, da, acc[r]);
          acc[r] = _mm256_fmadd_ps(tb, db, acc[r]);
        } else {
          const __m256i pa = dot_pair<F>(g.w0a, a0a, g.w1a, a1a), pb = dot_pair<F>(g.w0b, a0b, g.w1b, a1b);
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pa), _mm256_mul_ps(g.s0a, da), acc[r]);
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pb), _mm256_mul_ps(g.s0b, db), acc[r]);
        }
        if constexpr (F::kOff != 0)
          off[r] = _mm256_fmadd_ps(g.mo, _mm256_loadu_ps(so + r * so_stride + gi * (F::kOff == 16 ? 8 : 4)), off[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) y[r * ldy] = hsum(_mm256_add_ps(acc[r], off[r]));
}
#else
constexpr int kMaxRows = 4;

template <class F, int R>
static void tile(const uint8_t* wrow, int64_t units, const uint8_t* tail, const QuantActs& a, int64_t r0, float* y,
                 int64_t ldy) {
  float acc[R] = {};
  BlockInts b;
  const int64_t nblk = units * F::kUnitBlocks + (tail != nullptr ? F::kUnitBlocks : 0);
  for (int64_t blk = 0; blk < nblk; ++blk) {
    const uint8_t* bp = blk < units * F::kUnitBlocks ? wrow + blk * F::kBlockBytes
                                                     : tail + (blk - units * F::kUnitBlocks) * F::kBlockBytes;
    for (int j = 0; j < F::kSub; ++j) {
      F::decode(bp, j, b);
      const int64_t kb = blk * F::kSub + j;
      for (int r = 0; r < R; ++r) {
        const int8_t* q = a.qrow(r0 + r) + act_pos(kb, 0);
        int lo = 0, hi = 0;
        for (int i = 0; i < 16; ++i) {
          lo += b.v[i] * q[i];
          hi += b.v[16 + i] * q[64 + i];
        }
        const float da = a.drow(r0 + r)[(kb >> 2) * 16 + (kb & 3) * 4];
        acc[r] += da * (b.sc[0] * (float)lo + b.sc[1] * (float)hi);
        if (F::kHasMin) acc[r] += b.mn * a.s32row(r0 + r)[kb];
      }
    }
  }
  for (int r = 0; r < R; ++r) y[r * ldy] = acc[r];
}
#endif

template <class F>
static void tile_rows(int R, const uint8_t* wrow, int64_t units, const uint8_t* tail, const QuantActs& a, int64_t r0,
                      float* y, int64_t ldy) {
  switch (R) {
    case 1: tile<F, 1>(wrow, units, tail, a, r0, y, ldy); break;
    case 2: tile<F, 2>(wrow, units, tail, a, r0, y, ldy); break;
    case 3: tile<F, 3>(wrow, units, tail, a, r0, y, ldy); break;
    case 4: tile<F, 4>(wrow, units, tail, a, r0, y, ldy); break;
#if defined(KVQ_AVX512)
    case 5: tile<F, 5>(wrow, units, tail, a, r0, y, ldy); break;
    case 6: tile<F, 6>(wrow, units, tail, a, r0, y, ldy); break;
    case 7: tile<F, 7>(wrow, units, tail, a, r0, y, ldy); break;
    case 8: tile<F, 8>(wrow, units, tail, a, r0, y, ldy); break;
#endif
    default: break;
  }
}

// Output rows n0..n1 of one weight, serially: chunks of weight rows that stay in L1 times
// tiles of activation rows. A row whose last unit is partial (K not a multiple of 128) has it
// copied, zero-padded, to a local unit: zero bytes are zero weights with zero scales.
template <class F>
static void range_fmt(const uint8_t* W, int64_t n0, int64_t n1, const QuantActs& a, float* y, int64_t ldy) {
  const int64_t nblk = a.K / F::kBlockWeights, row_bytes = nblk * F::kBlockBytes;
  const int64_t units = nblk / F::kUnitBlocks, rest = nblk % F::kUnitBlocks;
  alignas(64) uint8_t tail[F::kUnitBlocks * F::kBlockBytes + 64];
  const int64_t chunk = std::max<int64_t>(1, 16384 / std::max<int64_t>(row_bytes, 1));
  const int64_t tiles = (a.M + kMaxRows - 1) / kMaxRows;
  for (int64_t c0 = n0; c0 < n1; c0 += chunk) {
    const int64_t c1 = std::min(n1, c0 + chunk);
    int64_t r0 = 0;
    for (int64_t t = 0; t < tiles; ++t) {
      const int R = (int)((a.M - r0) / (tiles - t));  // tiles of near-equal size
      for (int64_t n = c0; n < c1; ++n) {
        const uint8_t* wrow = W + n * row_bytes;
        const uint8_t* tp = nullptr;
        if (rest) {
          std::memset(tail, 0, sizeof(tail));
          std::memcpy(tail, wrow + units * F::kUnitBlocks * F::kBlockBytes, rest * F::kBlockBytes);
          tp = tail;
        }
        tile_rows<F>(R, wrow, units, tp, a, r0, y + r0 * ldy + n, ldy);
      }
      r0 += R;
    }
  }
}

// y[r * ldy + n] = dot(x row r, dequantized weight row n) for n in [n0, n1): serial, for a caller
// that splits the work itself (e.g. inside its own at::parallel_for). False for an unknown format.
inline bool matmul_range(const uint8_t* W, int fmt, int64_t n0, int64_t n1, const QuantActs& a, float* y,
                         int64_t ldy) {
  if (n1 <= n0 || a.M == 0) return true;
  switch (fmt) {
    case kQ4_0: range_fmt<FQ4_0>(W, n0, n1, a, y, ldy); return true;
    case kQ4_1: range_fmt<FQ4_1>(W, n0, n1, a, y, ldy); return true;
    case kQ5_0: range_fmt<FQ5_0>(W, n0, n1, a, y, ldy); return true;
    case kQ5_1: range_fmt<FQ5_1>(W, n0, n1, a, y, ldy); return true;
    case kQ8_0: range_fmt<FQ8_0>(W, n0, n1, a, y, ldy); return true;
    case kQ4_K: range_fmt<FQ4_K>(W, n0, n1, a, y, ldy); return true;
    case kQ5_K: range_fmt<FQ5_K>(W, n0, n1, a, y, ldy); return true;
    case kQ6_K: range_fmt<FQ6_K>(W, n0, n1, a, y, ldy); return true;
    default: return false;
  }
}

// Several weights sharing the activations, outputs side by side (segment i at column col).
struct Segment {
  const uint8_t* W;
  int fmt;
  int64_t N, col;
};

inline void matmul_segments(const Segment* seg, int n_seg, const QuantActs& a, float* y, int64_t ldy) {
  int64_t total = 0, bytes = 0;
  for (int i = 0; i < n_seg; ++i) {
    total += seg[i].N;
    bytes += seg[i].N * (a.K / geometry(seg[i].fmt).weights) * geometry(seg[i].fmt).bytes;
  }
  if (total == 0 || a.M == 0) return;
  // each thread a contiguous run of rows; none shorter than ~32 KiB of weights (a fork costs µs)
  const int64_t row_bytes = std::max<int64_t>(1, bytes / total);
  const int64_t grain = std::max<int64_t>(1, (32768 / std::max<int64_t>(a.M, 1)) / row_bytes);
  at::parallel_for(0, total, grain, [&](int64_t b, int64_t e) {
    int64_t start = 0;
    for (int i = 0; i < n_seg; ++i) {
      const int64_t lo = std::max(b, start), hi = std::min(e, start + seg[i].N);
      if (lo < hi) matmul_range(seg[i].W, seg[i].fmt, lo - start, hi - start, a, y + seg[i].col, ldy);
      start += seg[i].N;
    }
  });
}

// The brief's entry point: all N rows of one weight, over torch's intra-op threads.
inline void matmul_rows(const uint8_t* W, int fmt, int64_t N, const QuantActs& a, float* y, int64_t ldy) {
  const Segment s{W, fmt, N, 0};
  matmul_segments(&s, 1, a, y, ldy);
}

// ---------------------------------------------------------------- dequantize (bit-exact with gguf-py)
template <class F>
static void dequant_row(const uint8_t* row, int64_t K, float* out) {
  BlockInts b;
  for (int64_t blk = 0; blk < K / F::kBlockWeights; ++blk)
    for (int j = 0; j < F::kSub; ++j) {
      F::decode(row + blk * F::kBlockBytes, j, b);
      float* o = out + blk * F::kBlockWeights + j * 32;
      for (int i = 0; i < 32; ++i) o[i] = F::kHasMin ? b.sc[i >> 4] * (float)b.v[i] + b.mn : b.sc[i >> 4] * (float)b.v[i];
    }
}

inline bool dequantize_row(const uint8_t* row, int fmt, int64_t K, float* out) {
  switch (fmt) {
    case kQ4_0: dequant_row<FQ4_0>(row, K, out); return true;
    case kQ4_1: dequant_row<FQ4_1>(row, K, out); return true;
    case kQ5_0: dequant_row<FQ5_0>(row, K, out); return true;
    case kQ5_1: dequant_row<FQ5_1>(row, K, out); return true;
    case kQ8_0: dequant_row<FQ8_0>(row, K, out); return true;
    case kQ4_K: dequant_row<FQ4_K>(row, K, out); return true;
    case kQ5_K: dequant_row<FQ5_K>(row, K, out); return true;
    case kQ6_K: dequant_row<FQ6_K>(row, K, out); return true;
    default: return false;
  }
}

inline std::string isa_name() {
#if defined(KVQ_VNNI)
  return "avx512_vnni";
#elif defined(KVQ_AVX512)
  return "avx512";
#elif defined(KVQ_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

}  // namespace kvscope_quant
"""

# The torch-facing functions (global names, bound by load_inline). Other kernels #include
# CORE_SOURCE alone and call kvscope_quant:: directly.
_CPP_BINDINGS = r"""
namespace kq = kvscope_quant;

static const char* format_name(int64_t fmt) {
  switch (fmt) {
    case kq::kQ4_0: return "q4_0";
    case kq::kQ4_1: return "q4_1";
    case kq::kQ5_0: return "q5_0";
    case kq::kQ5_1: return "q5_1";
    case kq::kQ8_0: return "q8_0";
    case kq::kQ4_K: return "q4_k";
    case kq::kQ5_K: return "q5_k";
    case kq::kQ6_K: return "q6_k";
    default: return "?";
  }
}

static kq::Geometry checked_geometry(int64_t fmt, const char* fn) {
  const kq::Geometry g = kq::geometry((int)fmt);
  TORCH_CHECK(g.weights > 0, fn, ": unknown format ", fmt, " (ggml type ids: q4_0=2, q4_1=3, q5_0=6, q5_1=7, q8_0=8, ",
              "q4_k=12, q5_k=13, q6_k=14)");
  return g;
}

static torch::Tensor float_rows(const torch::Tensor& x, const char* fn) {
  TORCH_CHECK(x.dim() == 2, fn, ": x must be 2-D [rows, in], got ", x.sizes());
  TORCH_CHECK(x.is_floating_point(), fn, ": x must be float32 or bfloat16, got ", x.scalar_type());
  return x.to(torch::kFloat).contiguous();
}

static torch::Tensor checked_weight(const torch::Tensor& w, int64_t fmt, int64_t K, const char* fn) {
  const kq::Geometry g = checked_geometry(fmt, fn);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8, fn, ": a ", format_name(fmt),
              " weight must be uint8 [out, in / ", g.weights, " * ", g.bytes, "], got ", w.scalar_type(), " ", w.sizes());
  TORCH_CHECK(K % g.weights == 0, fn, ": in-features (", K, ") must be a multiple of ", format_name(fmt), "'s ",
              g.weights, "-weight blocks");
  TORCH_CHECK(w.size(1) == K / g.weights * g.bytes, fn, ": ", format_name(fmt), " weight has ", w.size(1),
              " bytes a row; in-features ", K, " need ", K / g.weights * g.bytes, " (", g.bytes, " bytes per ",
              g.weights, " weights)");
  return w.contiguous();
}

torch::Tensor quant_matmul_segments(torch::Tensor x, std::vector<torch::Tensor> ws, std::vector<int64_t> fmts) {
  const char* fn = "quant_matmul_segments";
  TORCH_CHECK(ws.size() == fmts.size() && !ws.empty(), fn, ": need one format per weight (", ws.size(), " weights, ",
              fmts.size(), " formats)");
  auto xf = float_rows(x, fn);
  const int64_t M = xf.size(0), K = xf.size(1);
  std::vector<kq::Segment> seg;
  int64_t col = 0;
  for (size_t i = 0; i < ws.size(); ++i) {
    ws[i] = checked_weight(ws[i], fmts[i], K, fn);
    seg.push_back({ws[i].data_ptr<uint8_t>(), (int)fmts[i], ws[i].size(0), col});
    col += ws[i].size(0);
  }
  auto y = torch::empty({M, col}, xf.options());
  if (M == 0 || col == 0) return y;
  kq::QuantActs a;
  kq::quantize_acts(xf.data_ptr<float>(), M, K, K, a);
  kq::matmul_segments(seg.data(), (int)seg.size(), a, y.data_ptr<float>(), col);
  return y;
}

torch::Tensor quant_matmul(torch::Tensor x, torch::Tensor w, int64_t fmt) {
  return quant_matmul_segments(x, {w}, {fmt});
}

static int64_t checked_in_features(const torch::Tensor& w, int64_t fmt, const char* fn) {
  const kq::Geometry g = checked_geometry(fmt, fn);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.size(1) % g.bytes == 0, fn, ": a ",
              format_name(fmt), " weight must be uint8 [out, a multiple of ", g.bytes, " bytes], got ", w.scalar_type(),
              " ", w.sizes());
  return w.size(1) / g.bytes * g.weights;
}

torch::Tensor dequantize(torch::Tensor w, int64_t fmt) {
  const int64_t K = checked_in_features(w, fmt, "dequantize");
  w = w.contiguous();
  const int64_t N = w.size(0), rb = w.size(1);
  auto out = torch::empty({N, K}, torch::kFloat);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, std::max<int64_t>(1, 65536 / std::max<int64_t>(K, 1)), [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) kq::dequantize_row(wp + n * rb, (int)fmt, K, op + n * K);
  });
  return out;
}

// rows: any shape of int64 indices into w's rows; the result is rows.shape + [K] (an embedding lookup).
torch::Tensor dequantize_rows(torch::Tensor w, int64_t fmt, torch::Tensor rows) {
  const char* fn = "dequantize_rows";
  const int64_t K = checked_in_features(w, fmt, fn);
  TORCH_CHECK(rows.scalar_type() == torch::kLong || rows.scalar_type() == torch::kInt, fn,
              ": rows must be int64 or int32 indices, got ", rows.scalar_type());
  w = w.contiguous();
  auto idx = rows.to(torch::kLong).contiguous();
  const int64_t N = w.size(0), rb = w.size(1), R = idx.numel();
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < R; ++i)
    TORCH_CHECK(ip[i] >= 0 && ip[i] < N, fn, ": row index ", ip[i], " out of range for a weight of ", N, " rows");
  std::vector<int64_t> shape(rows.sizes().begin(), rows.sizes().end());
  shape.push_back(K);
  auto out = torch::empty(shape, torch::kFloat);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, R, std::max<int64_t>(1, 65536 / std::max<int64_t>(K, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) kq::dequantize_row(wp + ip[r] * rb, (int)fmt, K, op + r * K);
  });
  return out;
}

// What the matmul multiplies: x rounded per 32-block (q int8 [M, K] in natural order, d [M, K / 32]).
std::vector<torch::Tensor> quantize_activations(torch::Tensor x) {
  auto xf = float_rows(x, "quantize_activations");
  const int64_t M = xf.size(0), K = xf.size(1);
  TORCH_CHECK(K % 32 == 0, "quantize_activations: in-features (", K, ") must be a multiple of 32");
  kq::QuantActs a;
  kq::quantize_acts(xf.data_ptr<float>(), M, K, K, a);
  auto q = torch::empty({M, K}, torch::kChar);
  auto d = torch::empty({M, K / 32}, torch::kFloat);
  int8_t* qp = q.data_ptr<int8_t>();
  float* dp = d.data_ptr<float>();
  for (int64_t r = 0; r < M; ++r)
    for (int64_t kb = 0; kb < K / 32; ++kb) {
      for (int i = 0; i < 32; ++i) qp[r * K + kb * 32 + i] = a.qrow(r)[kq::act_pos(kb, i)];
      dp[r * (K / 32) + kb] = a.drow(r)[(kb >> 2) * 16 + (kb & 3) * 4];
    }
  return {q, d};
}

std::string isa() { return kq::isa_name(); }
"""

CORE_SOURCE = _CPP_CORE
SOURCE = _CPP_CORE + _CPP_BINDINGS
FUNCTIONS = ("quant_matmul", "quant_matmul_segments", "dequantize", "dequantize_rows", "quantize_activations", "isa")

# No -ffast-math: dequantize() is bit-exact with gguf-py only without reassociation or FMA contraction.
_BASE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-math-errno")
# Each build a separate cache entry; the narrower ones switch the wider paths off on this CPU.
ISA_FLAGS = {
    "native": _BASE_FLAGS,
    "avx512": (*_BASE_FLAGS, "-mno-avx512vnni"),
    "avx2": (*_BASE_FLAGS, "-mno-avx512f"),
    "scalar": (*_BASE_FLAGS, "-mno-avx512f", "-mno-avx2", "-mno-fma", "-mno-f16c"),
}
ISAS = tuple(ISA_FLAGS)

KERNELS = {isa: CachedKernel(KernelSpec(name="kvscope_cpu_quant" if isa == "native" else f"kvscope_cpu_quant_{isa}",
                                        source=SOURCE, functions=FUNCTIONS, cflags=flags), KERNEL_ENV)
           for isa, flags in ISA_FLAGS.items()}


def selected_isa() -> str:
    """``$KVSCOPE_CPU_QUANT_ISA`` (``native`` when unset); an unknown value is an error."""
    isa = os.environ.get(ISA_ENV, "native").strip().lower() or "native"
    if isa not in ISA_FLAGS:
        raise ValueError(f"{ISA_ENV}={isa!r}: expected one of {', '.join(ISAS)}")
    return isa


def load_kernel(isa: str | None = None, log: Callable[[str], None] | None = None) -> ModuleType | None:
    """The compiled module for ``isa`` (default :func:`selected_isa`), or None when it cannot be
    built here or ``KVSCOPE_CPU_QUANT_KERNEL=0`` turns it off (checked on every call)."""
    return KERNELS[isa or selected_isa()].get(log)


def unavailable_reason(isa: str | None = None) -> str | None:
    """Why :func:`load_kernel` gave None (switched off, or the build's error)."""
    return KERNELS[isa or selected_isa()].unavailable_reason


def ensure_built(log: Callable[[str], None] | None = None) -> BuildReport | None:
    """Build or load the selected build now (``engine build-kernels``); None when switched off."""
    return KERNELS[selected_isa()].ensure_built(log)


def format_id(fmt: int | str) -> int:
    """ggml's type id for ``fmt`` (``"q4_k"`` or 12)."""
    code = FORMAT_IDS.get(fmt.lower()) if isinstance(fmt, str) else fmt
    if code not in _GEOMETRY:
        raise ValueError(f"unknown block format {fmt!r}; known: {', '.join(FORMAT_IDS)}")
    return code


def block_geometry(fmt: int | str) -> tuple[int, int]:
    """(weights per block, bytes per block) of ``fmt``."""
    return _GEOMETRY[format_id(fmt)]


def row_bytes(fmt: int | str, in_features: int) -> int:
    """Bytes of one output row of ``in_features`` weights (a multiple of the block size)."""
    weights, nbytes = block_geometry(fmt)
    if in_features % weights:
        raise ValueError(f"{in_features} in-features is not a multiple of {FORMAT_NAMES[format_id(fmt)]}'s "
                         f"{weights}-weight blocks")
    return in_features // weights * nbytes


def _kernel(isa: str | None) -> ModuleType:
    kernel = load_kernel(isa)
    if kernel is None:
        raise RuntimeError(f"CPU quant kernel unavailable: {unavailable_reason(isa)}")
    return kernel


def quant_matmul(x: torch.Tensor, w: torch.Tensor, fmt: int | str, isa: str | None = None) -> torch.Tensor:
    """``x [M, K] @ dequant(w).T`` as float32 ``[M, N]``, ``x`` rounded per 32 values to int8."""
    return _kernel(isa).quant_matmul(x, w, format_id(fmt))


def quant_matmul_segments(x: torch.Tensor, ws: Sequence[torch.Tensor], fmts: Sequence[int | str],
                          isa: str | None = None) -> torch.Tensor:
    """Several weights sharing ``x`` (quantized once): float32 ``[M, sum N_i]``, outputs side by side."""
    return _kernel(isa).quant_matmul_segments(x, list(ws), [format_id(f) for f in fmts])


def dequantize(w: torch.Tensor, fmt: int | str, isa: str | None = None) -> torch.Tensor:
    """float32 ``[N, K]`` of ``fmt`` blocks (bit-exact with gguf-py's dequantize)."""
    return _kernel(isa).dequantize(w, format_id(fmt))


def dequantize_rows(w: torch.Tensor, fmt: int | str, rows: torch.Tensor, isa: str | None = None) -> torch.Tensor:
    """float32 ``rows.shape + [K]``: only the weight rows ``rows`` names (an embedding lookup)."""
    return _kernel(isa).dequantize_rows(w, format_id(fmt), rows)


def quantize_activations(x: torch.Tensor, isa: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """What the matmul multiplies: ``(q int8 [M, K], d float32 [M, K / 32])``, ``x ~ q * d``."""
    q, d = _kernel(isa).quantize_activations(x)
    return q, d
