
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

// The unpackers and dot helpers must inline into the tile loops: a call there spills the
// accumulators and the unpacked weights to the stack (and costs a vzeroupper).
#define KVQ_INLINE inline __attribute__((always_inline))

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
// Rows padded to whole groups of 32-blocks (zeros), stored group by group, each group's rows
// side by side ([group][row][...]): a tile of rows then reads one unit of every row at fixed
// offsets from one pointer per array. Within a group the blocks are interleaved 4 bytes at a
// time, so int32 lane l of a vpdpbusd belongs to block l % (blocks per group):
// * AVX-512: 8 blocks (256 values), 32 bytes per 4 values: b0[0..3] b1[0..3] .. b7[0..3] b0[4..7]
//   ..; a 64-byte dot folded once gives the 8 blocks' dots in the 8 lanes of a ymm.
// * AVX2 and scalar: 4 blocks (128 values): their values 0..15 as b0[0..3] b1[0..3] b2[0..3]
//   b3[0..3] b0[4..7] .., then 16..31 the same way; a 4-float broadcast scales a row's lanes.
// Per group and row: d, each block's scale; s32, d * sum(q) per block; s16, d * sum(q) of the
// blocks' values 0..15, then of their values 16..31.
#if defined(KVQ_AVX512)
constexpr int64_t kGroup = 256;
#else
constexpr int64_t kGroup = 128;
#endif
constexpr int64_t kGroupBlocks = kGroup / 32;

struct QuantActs {
  int64_t M = 0, K = 0, groups = 0;  // M: activation rows (tokens * passes)
  int64_t passes = 1;  // 2: rows 2t and 2t + 1 hold token t's int8 values and its remainder rounded again
  std::vector<int8_t> q;      // [groups][M][kGroup]
  std::vector<float> d, s32;  // [groups][M][kGroupBlocks]
  std::vector<float> s16;     // [groups][M][2 * kGroupBlocks]
  const int8_t* qg(int64_t g, int64_t r) const { return q.data() + (g * M + r) * kGroup; }
  const float* dg(int64_t g, int64_t r) const { return d.data() + (g * M + r) * kGroupBlocks; }
  const float* s32g(int64_t g, int64_t r) const { return s32.data() + (g * M + r) * kGroupBlocks; }
  const float* s16g(int64_t g, int64_t r) const { return s16.data() + (g * M + r) * 2 * kGroupBlocks; }
};

// Where value i (0..31) of block k (0 .. kGroupBlocks - 1) lands in its group.
inline int64_t act_pos(int64_t k, int i) {
#if defined(KVQ_AVX512)
  return (i >> 2) * 32 + k * 4 + (i & 3);
#else
  return (i >> 4) * 64 + ((i & 15) >> 2) * 16 + k * 4 + (i & 3);
#endif
}

// One 32-block: d = amax / 127, q = round-half-even(x * (1 / d)) (like ggml, and the tests);
// rest (when given): x - d * q, what the rounding left.
inline void quantize_block(const float* x, QuantActs& a, int64_t r, int64_t kb, float* rest = nullptr) {
  int8_t v[32];
  float amax = 0.f;
  int lo = 0, hi = 0;
#if defined(KVQ_AVX512)
  const __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
  amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
  const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
  const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, _mm512_set1_ps(id)));
  const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, _mm512_set1_ps(id)));
  _mm_storeu_si128((__m128i*)v, _mm512_cvtepi32_epi8(q0));
  _mm_storeu_si128((__m128i*)(v + 16), _mm512_cvtepi32_epi8(q1));
  lo = _mm512_reduce_add_epi32(q0);
  hi = _mm512_reduce_add_epi32(q1);
#else
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
  for (int i = 0; i < 32; ++i) {
    v[i] = (int8_t)std::nearbyint(x[i] * id);
    (i < 16 ? lo : hi) += v[i];
  }
#endif
  const int64_t g = kb / kGroupBlocks, k = kb % kGroupBlocks, at = g * a.M + r;
  int8_t* q = a.q.data() + at * kGroup;
  for (int c = 0; c < 8; ++c) std::memcpy(q + act_pos(k, 4 * c), v + 4 * c, 4);
  a.d[at * kGroupBlocks + k] = d;
  a.s32[at * kGroupBlocks + k] = d * (float)(lo + hi);
  a.s16[at * 2 * kGroupBlocks + k] = d * (float)lo;
  a.s16[at * 2 * kGroupBlocks + kGroupBlocks + k] = d * (float)hi;
  if (rest != nullptr)
    for (int i = 0; i < 32; ++i) rest[i] = x[i] - d * (float)v[i];
}

// A second pass for at most this many rows: one row's extra integer work hides behind the weights'
// streaming (+27 % on Gemma 3's down projections at 1 row; at 4 rows +104 %, Zen 4 AVX-512 VNNI).
constexpr int64_t kTwoPassMaxRows = 1;

// x: M rows of K floats (row stride ldx), K a multiple of 32. Reuses a's buffers. passes 2 (for M up
// to kTwoPassMaxRows, else 1): each block's remainder rounded again into the next row (error ~1/250
// of one rounding's; the matmul sums the pair).
inline void quantize_acts(const float* x, int64_t M, int64_t K, int64_t ldx, QuantActs& a, int64_t passes = 1) {
  if (M > kTwoPassMaxRows) passes = 1;
  a.passes = passes;
  a.M = M * passes;
  a.K = K;
  a.groups = (K + kGroup - 1) / kGroup;
  a.q.assign(a.groups * a.M * kGroup, 0);
  a.d.assign(a.groups * a.M * kGroupBlocks, 0.f);
  a.s32.assign(a.groups * a.M * kGroupBlocks, 0.f);
  a.s16.assign(a.groups * a.M * 2 * kGroupBlocks, 0.f);
  const int64_t nb = K / 32;
  at::parallel_for(0, M, std::max<int64_t>(1, 32768 / std::max<int64_t>(K, 1)), [&](int64_t r0, int64_t r1) {
    float rest[32];
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t kb = 0; kb < nb; ++kb) {
        if (passes == 1) {
          quantize_block(x + r * ldx + kb * 32, a, r, kb);
        } else {
          quantize_block(x + r * ldx + kb * 32, a, 2 * r, kb, rest);
          quantize_block(rest, a, 2 * r + 1, kb);
        }
      }
  });
}

// ---------------------------------------------------------------- block formats
// decode(): 32-block j of a ggml block as integers, w[i] = sc[i / 16] * v[i] (+ mn), computed in
// ggml's (and gguf-py's) float order so dequantize() is bit-exact (the build has no -ffast-math
// and no FMA contraction); the scalar matmul uses it too. The SIMD paths unpack a unit (4 ggml
// blocks of 32, or one K-quant block) into groups laid out as the activations, with the
// coefficients of the activation sums (mo: minimums, or -offset * d for the formats stored
// unsigned; Q6_K: -32 times its scales).
struct BlockInts {
  int8_t v[32];
  float sc[2];
  float mn;
};

#if defined(KVQ_AVX512)
// A unit (8 blocks, 256 weights) unpacked as the activations: w[c] holds values 8c..8c+7 of the 8
// blocks, lane 8t + b = block b's values 8c + 4t .. 8c + 4t + 3.
struct Unit {
  __m512i w[4];        // unsigned weight bytes (Q8_0 without VNNI: |q|)
  __m256 s0, s1;       // the blocks' scales (two-scale formats: s0 for values 0..15, s1 for 16..31)
  __m256 mo;           // coefficients of the blocks' activation sums (s32): minimums, or -offset * d
  __mmask64 neg[4];    // Q8_0 without VNNI: where q < 0
};
constexpr int kStepBlocks = 8;  // 32-blocks per unpacked unit
static KVQ_INLINE __m512i low_nibbles(__m512i v) { return _mm512_and_si512(v, _mm512_set1_epi8(15)); }
static KVQ_INLINE __mmask64 bytes_mask(int64_t n) {  // the first n (clamped to 0..64) bytes
  return n >= 64 ? ~0ull : n <= 0 ? 0ull : (1ull << n) - 1;
}
static KVQ_INLINE __m512i dp(__m512i acc, __m512i w, __m512i a) {
#if defined(KVQ_VNNI)
  return _mm512_dpbusd_epi32(acc, w, a);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, a), _mm512_set1_epi16(1)));
#endif
}
static KVQ_INLINE __m256 upper8(__m512 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }
static KVQ_INLINE __m256i fold(__m512i v) { return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1)); }
// Shuffle tables computed at compile time (constant data: no guarded statics in the hot loops).
struct alignas(64) Lanes32 {
  int32_t v[16];
};
struct alignas(64) Bytes64 {
  uint8_t v[64];
};
template <class Fn>
constexpr Lanes32 lanes32(Fn f) {  // lane l = f(l)
  Lanes32 t{};
  for (int l = 0; l < 16; ++l) t.v[l] = f(l);
  return t;
}
template <class Fn>
constexpr Bytes64 bytes64(Fn f) {  // byte p = f(p)
  Bytes64 t{};
  for (int p = 0; p < 64; ++p) t.v[p] = (uint8_t)f(p);
  return t;
}
static KVQ_INLINE __m512i ld(const Lanes32& t) { return _mm512_load_si512((const void*)t.v); }
static KVQ_INLINE __m512i ld(const Bytes64& t) { return _mm512_load_si512((const void*)t.v); }
static KVQ_INLINE __m256 fp16x8(const uint8_t* p, int64_t stride, int n = 8) {  // n < 8: the rest 0
  uint16_t h[8] = {};
  for (int i = 0; i < n && i < 8; ++i) std::memcpy(h + i, p + i * stride, 2);
  return _mm256_cvtph_ps(_mm_setr_epi16((short)h[0], (short)h[1], (short)h[2], (short)h[3], (short)h[4], (short)h[5],
                                        (short)h[6], (short)h[7]));
}
// 4 unaligned 16-byte pieces p, p + stride, ... as one vector
static KVQ_INLINE __m512i gather4x16(const uint8_t* p, int64_t stride) {
  __m512i z = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i*)p));
  z = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i*)(p + stride)), 1);
  z = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i*)(p + 2 * stride)), 2);
  return _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i*)(p + 3 * stride)), 3);
}
// Q5_0/Q5_1: hv holds the 8 blocks' 5th-bit words twice (dword l = block l % 8's); the byte mask of
// w[c]: byte i of lane 8t + b is bit 8c + 4t + i of block b's word.
#if defined(__AVX512BITALG__)
static KVQ_INLINE __mmask64 fifth_mask(__m512i hv, int c) {
  static constexpr Bytes64 kBits = bytes64([](int p) { return ((p >> 2) & 1) * 32 + 4 * (p >> 5) + (p & 3); });
  return _mm512_bitshuffle_epi64_mask(hv, _mm512_add_epi8(ld(kBits), _mm512_set1_epi8((char)(8 * c))));
}
#else
static KVQ_INLINE __mmask64 fifth_mask(__m512i hv, int c) {  // shift the lane's 4 bits to byte 0, copy it, test bit i
  static constexpr Lanes32 kShift = lanes32([](int l) { return 4 * (l >> 3); });
  static constexpr Bytes64 kByte0 = bytes64([](int p) { return p & 12; });
  const __m512i cnt = _mm512_add_epi32(ld(kShift), _mm512_set1_epi32(8 * c));
  const __m512i b0 = _mm512_shuffle_epi8(_mm512_srlv_epi32(hv, cnt), ld(kByte0));
  return _mm512_test_epi8_mask(b0, _mm512_set1_epi32(0x08040201));
}
#endif
#elif defined(KVQ_AVX2)
constexpr int kStepBlocks = 4;  // 32-blocks per unpacked group
struct Group {
  __m256i w0a, w0b, w1a, w1b;  // values 0..15 of 4 blocks (lanes: block l % 4) in two parts, then 16..31
  __m256 s0, s1;               // scales of the w0* / w1* dot lanes; s1: two-scale formats
  __m256 mo;                   // coefficients of the activation sums: s32 (lanes 0..3, rest 0) or s16
};
static KVQ_INLINE __m256 zext4(__m128 v) { return _mm256_insertf128_ps(_mm256_setzero_ps(), v, 0); }
static KVQ_INLINE __m256i low_nibbles(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(15)); }
static KVQ_INLINE __m256i mb(__m256i w, __m256i a) { return _mm256_maddubs_epi16(w, a); }
static KVQ_INLINE __m256i madd1(__m256i s) { return _mm256_madd_epi16(s, _mm256_set1_epi16(1)); }
static KVQ_INLINE __m256i cast128(__m128i v) { return _mm256_castsi128_si256(v); }
// Two 8-byte pieces of p as dwords [p0, p1, q0, q1] in the low half.
static KVQ_INLINE __m256i two_pieces(const uint8_t* p, const uint8_t* q) {
  return cast128(_mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i*)p), _mm_loadl_epi64((const __m128i*)q)));
}
// Lanes of 4 bytes: byte i of lane 4j + b = 0x10 where bit `first` + 4j + i of h[b] is set (j = 0, 1).
static KVQ_INLINE __m256i fifth_bits(__m256i hv, int first) {
  const __m256i pick = _mm256_set1_epi32(0x01010101 * (first >> 3));  // byte first / 8 of each word
  const __m256i bytes = _mm256_shuffle_epi8(hv, _mm256_add_epi8(
      _mm256_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12, 0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12),
      pick));
  const __m256i bit = _mm256_setr_epi32(0x08040201, 0x08040201, 0x08040201, 0x08040201, (int)0x80402010u,
                                        (int)0x80402010u, (int)0x80402010u, (int)0x80402010u);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit), _mm256_set1_epi8(0x10));
}
#endif

#if !defined(KVQ_AVX512) && !defined(KVQ_AVX2)
constexpr int kStepBlocks = 4;
#else
static KVQ_INLINE __m128 fp16x4(const uint8_t* p, int64_t stride) {
#if defined(__F16C__)
  uint16_t h[4];
  for (int i = 0; i < 4; ++i) std::memcpy(h + i, p + i * stride, 2);
  return _mm_cvtph_ps(_mm_setr_epi16((short)h[0], (short)h[1], (short)h[2], (short)h[3], 0, 0, 0, 0));
#else
  return _mm_setr_ps(fp16(p), fp16(p + stride), fp16(p + 2 * stride), fp16(p + 3 * stride));
#endif
}
#endif

// The four 32-weight formats with 4-bit quants (+ a 5th bit at kQh): qs at byte offset kQs, low
// nibbles values 0..15, high nibbles 16..31; stored unsigned, w = d * (q - kOffset) or d * q + m.
template <int kBytes_, int kQs, int kQh, bool kMin, int kOffset>
struct Small {
  static constexpr int64_t kBlockWeights = 32, kBlockBytes = kBytes_;
  static constexpr int kSub = 1, kGroups = 1;
  static constexpr int kUnitBlocks = kStepBlocks, kOffPer = kStepBlocks;  // offset coefficients against s32
  static constexpr bool kTwoScales = false, kHasMin = kMin;
  struct Prep {};
  static KVQ_INLINE void decode(const uint8_t* b, int, BlockInts& o) {
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
  static KVQ_INLINE void prepare(const uint8_t*, Prep&) {}
#if defined(KVQ_AVX512)
#if defined(__AVX512VBMI__)
  // Byte gathers over a unit (8 blocks, at most 192 bytes): byte p of a gathered vector comes from
  // unit byte source(kind, p), out of bytes 0..127 or, past 127, out of 64..191 (two two-source
  // byte permutes, blended). Kinds 0, 1: the blocks' qs bytes 4t + i, 8 + 4t + i at lane 8t + b;
  // kind 2: the 8 d (bytes 0..15), the 8 m (16..31), the 8 words of 5th bits (32..63).
  struct Gather {
    Bytes64 first, second;
    uint64_t from_second;
  };
  static constexpr int source(int kind, int p) {
    if (kind < 2) return ((p >> 2) & 7) * kBytes_ + kQs + 8 * kind + 4 * (p >> 5) + (p & 3);
    if (p < 16) return (p >> 1) * kBytes_ + (p & 1);
    if (p < 32) return kMin ? ((p - 16) >> 1) * kBytes_ + 2 + (p & 1) : 0;
    return kQh >= 0 ? ((p - 32) >> 2) * kBytes_ + (kQh >= 0 ? kQh : 0) + (p & 3) : 0;
  }
  static constexpr Gather gather_table(int kind) {
    Gather t{};
    for (int p = 0; p < 64; ++p) {
      const int o = source(kind, p);
      t.first.v[p] = (uint8_t)(o < 128 ? o : 0);
      t.second.v[p] = (uint8_t)(o < 128 ? 0 : o - 64);
      if (o >= 128) t.from_second |= 1ull << p;
    }
    return t;
  }
#endif
  // nblocks < 8: the row's last, partial unit, read in place (the missing blocks read as zeros:
  // zero weights with zero scales).
  static KVQ_INLINE void unit(const uint8_t* u, int nblocks, Unit& g) {
    __m512i x0, x1, hv = _mm512_setzero_si512();
    __m256 d, m;
#if defined(__AVX512VBMI__)
    static constexpr Gather kQs0 = gather_table(0), kQs1 = gather_table(1), kMeta = gather_table(2);
    const int64_t nbytes = nblocks * kBytes_;
    const __m512i b0 = _mm512_maskz_loadu_epi8(bytes_mask(nbytes), u);
    const __m512i b1 = _mm512_maskz_loadu_epi8(bytes_mask(nbytes - 64), u + 64);
    const __m512i b2 = _mm512_maskz_loadu_epi8(bytes_mask(nbytes - 128), u + 128);
    auto gather = [&](const Gather& t) {
      return _mm512_mask_blend_epi8((__mmask64)t.from_second, _mm512_permutex2var_epi8(b0, ld(t.first), b1),
                                    _mm512_permutex2var_epi8(b1, ld(t.second), b2));
    };
    x0 = gather(kQs0);
    x1 = gather(kQs1);
    const __m512i meta = gather(kMeta);
    d = _mm256_cvtph_ps(_mm512_castsi512_si128(meta));
    m = _mm256_cvtph_ps(_mm512_extracti32x4_epi32(meta, 1));
    hv = _mm512_shuffle_i64x2(meta, meta, _MM_SHUFFLE(3, 2, 3, 2));
#else
    // the blocks' qs as 8 x 16 bytes (dword 4b + j), lane 8t + b <- dword t (x0) or 2 + t (x1) of block b
    alignas(64) uint8_t padded[8 * kBytes_];
    if (nblocks < 8) {  // gathers below read whole blocks: copy the partial unit, zero-padded
      std::memset(padded, 0, sizeof(padded));
      std::memcpy(padded, u, nblocks * kBytes_);
      u = padded;
    }
    static constexpr Lanes32 pick_t = lanes32([](int l) { return ((l & 7) < 4 ? 4 * (l & 7) : 16 + 4 * ((l & 7) - 4)) + (l >> 3); });
    const __m512i pick = ld(pick_t);
    const __m512i lo = gather4x16(u + kQs, kBytes_), hi = gather4x16(u + 4 * kBytes_ + kQs, kBytes_);
    x0 = _mm512_permutex2var_epi32(lo, pick, hi);
    x1 = _mm512_permutex2var_epi32(lo, _mm512_add_epi32(pick, _mm512_set1_epi32(2)), hi);
    d = fp16x8(u, kBytes_);
    m = kMin ? fp16x8(u + 2, kBytes_) : d;
    if (kQh >= 0) {
      int32_t h[8];
      for (int i = 0; i < 8; ++i) h[i] = (int32_t)load_u32(u + i * kBytes_ + (kQh >= 0 ? kQh : 0));
      hv = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)h));
    }
#endif
    g.w[0] = low_nibbles(x0);
    g.w[1] = low_nibbles(x1);
    g.w[2] = low_nibbles(_mm512_srli_epi16(x0, 4));
    g.w[3] = low_nibbles(_mm512_srli_epi16(x1, 4));
    if (kQh >= 0)
      for (int c = 0; c < 4; ++c) g.w[c] = _mm512_mask_add_epi8(g.w[c], fifth_mask(hv, c), g.w[c], _mm512_set1_epi8(16));
    g.s0 = d;
    g.mo = kMin ? m : _mm256_mul_ps(d, _mm256_set1_ps(-(float)kOffset));
  }
#elif defined(KVQ_AVX2)
  static KVQ_INLINE void group(const uint8_t* u, const Prep&, int, Group& g) {
    auto qs = [&](int i) { return _mm_loadu_si128((const __m128i*)(u + i * kBytes_ + kQs)); };
    const __m256i x0 = _mm256_inserti128_si256(cast128(qs(0)), qs(2), 1), x1 = _mm256_inserti128_si256(cast128(qs(1)), qs(3), 1);
    const __m256i order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
    const __m256i a = _mm256_permutevar8x32_epi32(_mm256_unpacklo_epi32(x0, x1), order);  // dwords 0, 1 of A..D
    const __m256i b = _mm256_permutevar8x32_epi32(_mm256_unpackhi_epi32(x0, x1), order);  // dwords 2, 3
    g.w0a = low_nibbles(a);
    g.w0b = low_nibbles(b);
    g.w1a = low_nibbles(_mm256_srli_epi16(a, 4));
    g.w1b = low_nibbles(_mm256_srli_epi16(b, 4));
    if (kQh >= 0) {
      uint32_t h[4];
      for (int i = 0; i < 4; ++i) h[i] = load_u32(u + i * kBytes_ + (kQh >= 0 ? kQh : 0));
      const __m256i hv = _mm256_broadcastsi128_si256(_mm_setr_epi32((int)h[0], (int)h[1], (int)h[2], (int)h[3]));
      g.w0a = _mm256_or_si256(g.w0a, fifth_bits(hv, 0));
      g.w0b = _mm256_or_si256(g.w0b, fifth_bits(hv, 8));
      g.w1a = _mm256_or_si256(g.w1a, fifth_bits(hv, 16));
      g.w1b = _mm256_or_si256(g.w1b, fifth_bits(hv, 24));
    }
    const __m128 d = fp16x4(u, kBytes_);
    g.s0 = _mm256_broadcast_ps(&d);
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
  static constexpr int kSub = 1, kUnitBlocks = kStepBlocks, kGroups = 1;
  static constexpr bool kTwoScales = false, kHasMin = false;
#if defined(KVQ_VNNI)
  static constexpr int kOffPer = kStepBlocks;  // weights stored +128 (unsigned): subtract 128 * d * s32
#else
  static constexpr int kOffPer = 0;  // sign trick: |q| times the activations negated where q < 0
#endif
  struct Prep {};
  static KVQ_INLINE void decode(const uint8_t* b, int, BlockInts& o) {
    std::memcpy(o.v, b + 2, 32);
    o.sc[0] = o.sc[1] = fp16(b);
    o.mn = 0.f;
  }
  static KVQ_INLINE void prepare(const uint8_t*, Prep&) {}
#if defined(KVQ_AVX512)
  static KVQ_INLINE void unit(const uint8_t* u, int nblocks, Unit& g) {  // nblocks < 8: the missing ones read as 0
    auto quants = [&](int b) {
      return b < nblocks ? _mm256_loadu_si256((const __m256i*)(u + 34 * b + 2)) : _mm256_setzero_si256();
    };
    auto pair = [&](int b) {  // blocks b, b + 1: their quants as dwords 0..7, 8..15
      return _mm512_inserti64x4(_mm512_castsi256_si512(quants(b)), quants(b + 1), 1);
    };
    const __m512i z01 = pair(0), z23 = pair(2), z45 = pair(4), z67 = pair(6);
    // lane 4v + b (b < 4): dword v of block b, v = 0..3 (then 4..7 with + 4)
    static constexpr Lanes32 first_t = lanes32([](int l) {
      const int v = l >> 2, b = l & 3;
      return b < 2 ? 8 * b + v : 16 + 8 * (b - 2) + v;
    });
    const __m512i first = ld(first_t);
    // lane 8t + b: dword 2c + t of block b, out of the 4-block vectors (blocks 0..3, then 4..7)
    static constexpr Lanes32 second_t = lanes32([](int l) {
      const int t = l >> 3, b = l & 7;
      return b < 4 ? 4 * t + b : 16 + 4 * t + b - 4;
    });
    const __m512i second = ld(second_t);
    const __m512i four = _mm512_set1_epi32(4), eight = _mm512_set1_epi32(8);
    const __m512i p0 = _mm512_permutex2var_epi32(z01, first, z23), p1 = _mm512_permutex2var_epi32(z01, _mm512_add_epi32(first, four), z23);
    const __m512i p2 = _mm512_permutex2var_epi32(z45, first, z67), p3 = _mm512_permutex2var_epi32(z45, _mm512_add_epi32(first, four), z67);
    g.w[0] = _mm512_permutex2var_epi32(p0, second, p2);
    g.w[1] = _mm512_permutex2var_epi32(p0, _mm512_add_epi32(second, eight), p2);
    g.w[2] = _mm512_permutex2var_epi32(p1, second, p3);
    g.w[3] = _mm512_permutex2var_epi32(p1, _mm512_add_epi32(second, eight), p3);
    g.s0 = fp16x8(u, 34, nblocks);
#if defined(KVQ_VNNI)
    for (int c = 0; c < 4; ++c) g.w[c] = _mm512_xor_si512(g.w[c], _mm512_set1_epi8((char)0x80));
    g.mo = _mm256_mul_ps(g.s0, _mm256_set1_ps(-128.f));
#else
    for (int c = 0; c < 4; ++c) {
      g.neg[c] = _mm512_movepi8_mask(g.w[c]);
      g.w[c] = _mm512_abs_epi8(g.w[c]);
    }
#endif
  }
#elif defined(KVQ_AVX2)
  static KVQ_INLINE void group(const uint8_t* u, const Prep&, int, Group& g) {  // signed weights
    auto ld = [&](int i) { return _mm256_loadu_si256((const __m256i*)(u + 2 + 34 * i)); };
    const __m256i a = ld(0), b = ld(1), c = ld(2), d = ld(3);
    const __m256i t0 = _mm256_unpacklo_epi32(a, b), t1 = _mm256_unpackhi_epi32(a, b);
    const __m256i t2 = _mm256_unpacklo_epi32(c, d), t3 = _mm256_unpackhi_epi32(c, d);
    const __m256i u0 = _mm256_unpacklo_epi64(t0, t2), u1 = _mm256_unpackhi_epi64(t0, t2);  // dwords 0|4, 1|5
    const __m256i u2 = _mm256_unpacklo_epi64(t1, t3), u3 = _mm256_unpackhi_epi64(t1, t3);  // dwords 2|6, 3|7
    g.w0a = _mm256_permute2x128_si256(u0, u1, 0x20);
    g.w1a = _mm256_permute2x128_si256(u0, u1, 0x31);
    g.w0b = _mm256_permute2x128_si256(u2, u3, 0x20);
    g.w1b = _mm256_permute2x128_si256(u2, u3, 0x31);
    const __m128 s = fp16x4(u, 34);
    g.s0 = _mm256_broadcast_ps(&s);
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
  static constexpr int kSub = 8, kUnitBlocks = 1, kGroups = 2, kOffPer = kStepBlocks;  // minimums against s32
  static constexpr bool kTwoScales = false, kHasMin = true;
  static constexpr int kQs = kFive ? 48 : 16;
  static KVQ_INLINE void decode(const uint8_t* b, int j, BlockInts& o) {
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
#if defined(KVQ_AVX512) || defined(KVQ_AVX2)
  struct Prep {
    __m256 sc, mn;  // d * scale, -dmin * min of the 8 sub-blocks
  };
  static KVQ_INLINE void prepare(const uint8_t* b, Prep& p) {
    uint8_t sc[8], mn[8];
    kquant_scales(b + 4, sc, mn);
    uint64_t s8, m8;
    std::memcpy(&s8, sc, 8);
    std::memcpy(&m8, mn, 8);
    p.sc = _mm256_mul_ps(_mm256_set1_ps(fp16(b)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)s8))));
    p.mn = _mm256_mul_ps(_mm256_set1_ps(-fp16(b + 2)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)m8))));
  }
#else
  struct Prep {};
  static KVQ_INLINE void prepare(const uint8_t*, Prep&) {}
#endif
#if defined(KVQ_AVX512)
  static KVQ_INLINE void unit(const uint8_t* b, int, Unit& g) {  // whole K-quant blocks only
    Prep p;
    prepare(b, p);
    // w[c] lane 8t + k: sub-block k's values 8c + 4t..: qs dword 8 (k / 2) + 2c + t, high nibbles for odd k
    static constexpr Lanes32 idx_t = lanes32([](int l) { return 8 * ((l & 7) >> 1) + (l >> 3); });
    const __m512i idx = ld(idx_t);
    static constexpr Lanes32 cnt_t = lanes32([](int l) { return 4 * (l & 1); });
    const __m512i cnt = ld(cnt_t);
    const __m512i q0 = _mm512_loadu_si512((const void*)(b + kQs)), q1 = _mm512_loadu_si512((const void*)(b + kQs + 64));
    for (int c = 0; c < 4; ++c)
      g.w[c] = low_nibbles(_mm512_srlv_epi32(_mm512_permutex2var_epi32(q0, _mm512_add_epi32(idx, _mm512_set1_epi32(2 * c)), q1), cnt));
    if (kFive) {  // bit k of qh byte 8c + 4t + i
      static constexpr Lanes32 hidx_t = lanes32([](int l) { return l >> 3; });
      const __m512i hidx = ld(hidx_t);
      static constexpr Lanes32 bit_t = lanes32([](int l) { return (int)(0x01010101u << (l & 7)); });
      const __m512i bit = ld(bit_t);
      const __m512i qh = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(b + 16)));
      for (int c = 0; c < 4; ++c) {
        const __m512i h = _mm512_permutexvar_epi32(_mm512_add_epi32(hidx, _mm512_set1_epi32(2 * c)), qh);
        g.w[c] = _mm512_mask_add_epi8(g.w[c], _mm512_test_epi8_mask(h, bit), g.w[c], _mm512_set1_epi8(16));
      }
    }
    g.s0 = p.sc;
    g.mo = p.mn;
  }
#elif defined(KVQ_AVX2)
  // dwords j, j + 1 (A, B: low / high nibbles) and 8 + j, 9 + j (C, D) of the group's qs -> lanes 4j + b
  static KVQ_INLINE __m256i nibbles(const uint8_t* qs) {
    const __m256i t = _mm256_permutevar8x32_epi32(two_pieces(qs, qs + 32), _mm256_setr_epi32(0, 0, 2, 2, 1, 1, 3, 3));
    return low_nibbles(_mm256_srlv_epi32(t, _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4)));
  }
  static KVQ_INLINE __m256i fifth(__m256i w, const uint8_t* qh, __m256i bm) {
    const __m256i h = _mm256_permutevar8x32_epi32(cast128(_mm_loadl_epi64((const __m128i*)qh)),
                                                  _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
    return _mm256_or_si256(w, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(h, bm), bm), _mm256_set1_epi8(0x10)));
  }
  static KVQ_INLINE void group(const uint8_t* b, const Prep& p, int gi, Group& g) {
    const uint8_t* qs = b + kQs + 64 * gi;
    g.w0a = nibbles(qs);
    g.w0b = nibbles(qs + 8);
    g.w1a = nibbles(qs + 16);
    g.w1b = nibbles(qs + 24);
    if (kFive) {
      const __m256i bits = _mm256_setr_epi32(0x01010101, 0x02020202, 0x04040404, 0x08080808, 0x01010101, 0x02020202,
                                             0x04040404, 0x08080808);
      const __m256i bm = gi ? _mm256_slli_epi32(bits, 4) : bits;
      g.w0a = fifth(g.w0a, b + 16, bm);
      g.w0b = fifth(g.w0b, b + 24, bm);
      g.w1a = fifth(g.w1a, b + 32, bm);
      g.w1b = fifth(g.w1b, b + 40, bm);
    }
    const __m256i pick = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 0, 1, 2, 3), _mm256_set1_epi32(4 * gi));
    g.s0 = _mm256_permutevar8x32_ps(p.sc, pick);
    g.mo = zext4(gi ? _mm256_extractf128_ps(p.mn, 1) : _mm256_castps256_ps128(p.mn));
  }
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
  static constexpr int kSub = 8, kUnitBlocks = 1, kGroups = 2, kOffPer = 2 * kStepBlocks;  // -32 d scale vs s16
  static constexpr bool kTwoScales = true, kHasMin = false;
  static KVQ_INLINE void decode(const uint8_t* b, int j, BlockInts& o) {
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
  struct Prep {};
  static KVQ_INLINE void prepare(const uint8_t*, Prep&) {}
  static KVQ_INLINE void unit(const uint8_t* b, int, Unit& g) {  // whole K-quant blocks only (mo: -32 s0, -32 s1)
    // w[c] lane 8t + k, block k = 4n + j: ql dword 16n + 8 (j & 1) + 2c + t (high nibbles for j >= 2),
    // qh dword 8n + 2c + t, bits 2j, 2j + 1 rotated onto 4, 5
    static constexpr Lanes32 lidx_t = lanes32([](int l) { return 16 * ((l & 7) >> 2) + 8 * (l & 1) + (l >> 3); });
    const __m512i lidx = ld(lidx_t);
    static constexpr Lanes32 lcnt_t = lanes32([](int l) { return 4 * ((l & 3) >> 1); });
    const __m512i lcnt = ld(lcnt_t);
    static constexpr Lanes32 hidx_t = lanes32([](int l) { return 8 * ((l & 7) >> 2) + (l >> 3); });
    const __m512i hidx = ld(hidx_t);
    static constexpr Lanes32 rot_t = lanes32([](int l) { return (int)((0x1e000204u >> (8 * (l & 3))) & 0xff); });
    const __m512i rot = ld(rot_t);
    const __m512i l0 = _mm512_loadu_si512((const void*)b), l1 = _mm512_loadu_si512((const void*)(b + 64));
    const __m512i qh = _mm512_loadu_si512((const void*)(b + 128));
    for (int c = 0; c < 4; ++c) {
      const __m512i two_c = _mm512_set1_epi32(2 * c);
      const __m512i lo = low_nibbles(_mm512_srlv_epi32(_mm512_permutex2var_epi32(l0, _mm512_add_epi32(lidx, two_c), l1), lcnt));
      const __m512i hi = _mm512_rolv_epi32(_mm512_permutexvar_epi32(_mm512_add_epi32(hidx, two_c), qh), rot);
      g.w[c] = _mm512_or_si512(lo, _mm512_and_si512(hi, _mm512_set1_epi8(0x30)));
    }
    const __m512 sc = _mm512_mul_ps(_mm512_set1_ps(fp16(b + 208)),
                                    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(b + 192)))));
    static constexpr Lanes32 even_t = lanes32([](int l) { return 2 * (l & 7); });
    const __m512i even = ld(even_t);
    g.s0 = _mm512_castps512_ps256(_mm512_permutexvar_ps(even, sc));
    g.s1 = _mm512_castps512_ps256(_mm512_permutexvar_ps(_mm512_add_epi32(even, _mm512_set1_epi32(1)), sc));
  }
#elif defined(KVQ_AVX2)
  struct Prep {
    __m256 sc[2];  // d * scale, sub-blocks 0..7 and 8..15
  };
  static KVQ_INLINE void prepare(const uint8_t* b, Prep& p) {
    const __m256 d = _mm256_set1_ps(fp16(b + 208));
    p.sc[0] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(b + 192)))));
    p.sc[1] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(b + 200)))));
  }
  // values 4j..4j+7 of blocks A..D (j = 0, 2 / 4, 6 of the half): ql at ql + j and ql + 32 + j, qh at qh + j
  static KVQ_INLINE __m256i part(const uint8_t* ql, const uint8_t* qh) {
    const __m256i t = _mm256_permutevar8x32_epi32(two_pieces(ql, ql + 32), _mm256_setr_epi32(0, 2, 0, 2, 1, 3, 1, 3));
    const __m256i lo = low_nibbles(_mm256_srlv_epi32(t, _mm256_setr_epi32(0, 0, 4, 4, 0, 0, 4, 4)));
    const __m256i h = _mm256_permutevar8x32_epi32(cast128(_mm_loadl_epi64((const __m128i*)qh)),
                                                  _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
    // bits 2k, 2k+1 onto 4, 5: left by 4, 2, 0 for A..C, right by 2 for D (counts past 31 give 0)
    const __m256i hb = _mm256_or_si256(_mm256_sllv_epi32(h, _mm256_setr_epi32(4, 2, 0, 32, 4, 2, 0, 32)),
                                       _mm256_srlv_epi32(h, _mm256_setr_epi32(32, 32, 32, 2, 32, 32, 32, 2)));
    return _mm256_or_si256(lo, _mm256_and_si256(hb, _mm256_set1_epi8(0x30)));
  }
  static KVQ_INLINE void group(const uint8_t* b, const Prep& p, int n, Group& g) {
    const uint8_t* ql = b + 64 * n;
    const uint8_t* qh = b + 128 + 32 * n;
    g.w0a = part(ql, qh);
    g.w0b = part(ql + 8, qh + 8);
    g.w1a = part(ql + 16, qh + 16);
    g.w1b = part(ql + 24, qh + 24);
    g.s0 = _mm256_permutevar8x32_ps(p.sc[n], _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6));
    g.s1 = _mm256_permutevar8x32_ps(p.sc[n], _mm256_setr_epi32(1, 3, 5, 7, 1, 3, 5, 7));
    g.mo = _mm256_mul_ps(_mm256_blend_ps(g.s0, g.s1, 0xF0), _mm256_set1_ps(-32.f));  // vs s16: firsts, seconds
  }
#else
  struct Prep {};
  static KVQ_INLINE void prepare(const uint8_t*, Prep&) {}
#endif
};

// ---------------------------------------------------------------- one weight row x R activation rows
// y[r * ldy] for r < R: each unit's groups unpacked once and used by every row; the constant parts
// of the weights (mo, one float per 32 or 16 weights) are dotted with the activation sums at the end.
#if defined(KVQ_AVX512)
constexpr int kMaxRows = 8;

static KVQ_INLINE float hsum(__m256 s) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

static KVQ_INLINE __m512i mb(__m512i w, __m512i a) { return _mm512_maddubs_epi16(w, a); }
static KVQ_INLINE __m512i madd1(__m512i s) { return _mm512_madd_epi16(s, _mm512_set1_epi16(1)); }

// The 8 blocks' integer dots with one row (one-scale formats).
template <class F>
static KVQ_INLINE __m256i unit_dot(const Unit& g, const __m512i* a) {
  if constexpr (std::is_same_v<F, FQ8_0>) {
#if !defined(KVQ_VNNI)
    // |q| x activations negated where q < 0; each part apart (|q| * a pair sums reach 32512)
    const __m512i z = _mm512_setzero_si512();
    __m512i s = z;
    for (int c = 0; c < 4; ++c) s = _mm512_add_epi32(s, madd1(mb(g.w[c], _mm512_mask_sub_epi8(a[c], g.neg[c], z, a[c]))));
    return fold(s);
#endif
  }
#if defined(KVQ_VNNI)
  const __m512i z = _mm512_setzero_si512();
  return fold(_mm512_add_epi32(dp(dp(z, g.w[0], a[0]), g.w[1], a[1]), dp(dp(z, g.w[2], a[2]), g.w[3], a[3])));
#else  // weights below 32: four products per int16 lane stay below 32767
  return fold(madd1(_mm512_add_epi16(_mm512_add_epi16(mb(g.w[0], a[0]), mb(g.w[1], a[1])),
                                     _mm512_add_epi16(mb(g.w[2], a[2]), mb(g.w[3], a[3])))));
#endif
}

// Values 0..15 and 16..31 of the 8 blocks apart (two-scale formats; 6-bit weights: two products
// per int16 lane stay below 32767).
static KVQ_INLINE void unit_dot_halves(const Unit& g, const __m512i* a, __m256i& first, __m256i& second) {
#if defined(KVQ_VNNI)
  const __m512i z = _mm512_setzero_si512();
  first = fold(dp(dp(z, g.w[0], a[0]), g.w[1], a[1]));
  second = fold(dp(dp(z, g.w[2], a[2]), g.w[3], a[3]));
#else
  first = fold(madd1(_mm512_add_epi16(mb(g.w[0], a[0]), mb(g.w[1], a[1]))));
  second = fold(madd1(_mm512_add_epi16(mb(g.w[2], a[2]), mb(g.w[3], a[3]))));
#endif
}

// Per unit and row: the 8 blocks' dots scaled by weight and activation scales, plus the weights'
// constant parts (g.mo, or -32 * the scales for Q6_K) times the activation sums, one FMA each.
template <class F, int R>
static void tile(const uint8_t* wrow, int64_t units, int rest, const uint8_t*, const QuantActs& a, int64_t r0, float* y,
                 int64_t ldy) {
  const int64_t n_units = units + (rest > 0);
  auto step = [&](int64_t u, __m256* acc) __attribute__((always_inline)) {  // unit u into the rows' accumulators
    Unit g;
    const uint8_t* ub = wrow + u * F::kUnitBlocks * F::kBlockBytes;
    if (u < units)
      F::unit(ub, F::kUnitBlocks, g);
    else
      F::unit(ub, rest, g);
    const int8_t* qu = a.qg(u, r0);  // unit u of rows r0.. (rows at fixed offsets)
    const float* du = a.dg(u, r0);
    const float* su = F::kTwoScales ? a.s16g(u, r0) : a.s32g(u, r0);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int8_t* q = qu + r * kGroup;
      __m512i x[4];
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) x[c] = _mm512_loadu_si512((const void*)(q + 64 * c));
      const __m256 da = _mm256_loadu_ps(du + r * 8);
      if constexpr (F::kTwoScales) {
        __m256i first, second;
        unit_dot_halves(g, x, first, second);
        const __m256 t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(second), g.s1, _mm256_mul_ps(_mm256_cvtepi32_ps(first), g.s0));
        const float* s = su + r * 16;
        const __m256 o = _mm256_fmadd_ps(g.s1, _mm256_loadu_ps(s + 8), _mm256_mul_ps(g.s0, _mm256_loadu_ps(s)));
        acc[r] = _mm256_fmadd_ps(o, _mm256_set1_ps(-32.f), _mm256_fmadd_ps(t, da, acc[r]));
      } else {
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(unit_dot<F>(g, x)), _mm256_mul_ps(g.s0, da), acc[r]);
        if constexpr (F::kOffPer > 0) acc[r] = _mm256_fmadd_ps(g.mo, _mm256_loadu_ps(su + r * 8), acc[r]);
      }
    }
  };
  __m256 acc[R], acc2[R];  // few rows: units alternate between two chains (indices fixed: registers)
  for (int r = 0; r < R; ++r) acc[r] = acc2[r] = _mm256_setzero_ps();
  constexpr bool kTwoChains = R <= 2;
  for (int64_t u = 0; u < n_units; u += kTwoChains ? 2 : 1) {
    step(u, acc);
    if (kTwoChains && u + 1 < n_units) step(u + 1, acc2);
  }
  for (int r = 0; r < R; ++r) y[r * ldy] = hsum(kTwoChains ? _mm256_add_ps(acc[r], acc2[r]) : acc[r]);
}
#elif defined(KVQ_AVX2)
constexpr int kMaxRows = 4;  // 16 ymm registers

static KVQ_INLINE float hsum(__m256 s) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

static KVQ_INLINE __m256i signed_dot(__m256i w, __m256i a) {
  return madd1(mb(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w)));
}

template <class F, int R>
static void tile(const uint8_t* wrow, int64_t units, int, const uint8_t* tail, const QuantActs& a, int64_t r0,
                 float* y, int64_t ldy) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const int64_t n_units = units + (tail != nullptr);
  for (int64_t u = 0; u < n_units; ++u) {
    const uint8_t* ub = u < units ? wrow + u * F::kUnitBlocks * F::kBlockBytes : tail;
    typename F::Prep p;
    F::prepare(ub, p);
    for (int gk = 0; gk < F::kGroups; ++gk) {
      const int64_t gi = u * F::kGroups + gk;
      Group g;
      F::group(ub, p, gk, g);
      const int8_t* qu = a.qg(gi, r0);  // group gi of rows r0.. (rows at fixed offsets)
      const float* du = a.dg(gi, r0);
      const float* su = F::kTwoScales ? a.s16g(gi, r0) : a.s32g(gi, r0);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int8_t* q = qu + r * kGroup;
        auto ld = [&](int o) { return _mm256_loadu_si256((const __m256i*)(q + o)); };
        const __m256 da = _mm256_broadcast_ps((const __m128*)(du + r * 4));
        if constexpr (std::is_same_v<F, FQ8_0>) {  // halves apart: |q| * a pair sums reach 32512
          const __m256i s = _mm256_add_epi32(_mm256_add_epi32(signed_dot(g.w0a, ld(0)), signed_dot(g.w0b, ld(32))),
                                             _mm256_add_epi32(signed_dot(g.w1a, ld(64)), signed_dot(g.w1b, ld(96))));
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(g.s0, da), acc[r]);
        } else if constexpr (F::kTwoScales) {  // 6-bit weights: two products per int16 lane stay below 32767
          const __m256i s0 = madd1(_mm256_add_epi16(mb(g.w0a, ld(0)), mb(g.w0b, ld(32))));
          const __m256i s1 = madd1(_mm256_add_epi16(mb(g.w1a, ld(64)), mb(g.w1b, ld(96))));
          const __m256 t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), g.s1, _mm256_mul_ps(_mm256_cvtepi32_ps(s0), g.s0));
          acc[r] = _mm256_fmadd_ps(g.mo, _mm256_loadu_ps(su + r * 8), _mm256_fmadd_ps(t, da, acc[r]));
        } else {  // weights below 32: four products per int16 lane stay below 32767
          const __m256i s = _mm256_add_epi16(_mm256_add_epi16(mb(g.w0a, ld(0)), mb(g.w0b, ld(32))),
                                             _mm256_add_epi16(mb(g.w1a, ld(64)), mb(g.w1b, ld(96))));
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(madd1(s)), _mm256_mul_ps(g.s0, da), acc[r]);
          if constexpr (F::kOffPer > 0)
            acc[r] = _mm256_fmadd_ps(g.mo, _mm256_broadcast_ps((const __m128*)(su + r * 4)), acc[r]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) y[r * ldy] = hsum(acc[r]);
}
#else
constexpr int kMaxRows = 4;

template <class F, int R>
static void tile(const uint8_t* wrow, int64_t units, int, const uint8_t* tail, const QuantActs& a, int64_t r0,
                 float* y, int64_t ldy) {
  float acc[R] = {};
  BlockInts b;
  const int64_t nblk = units * F::kUnitBlocks + (tail != nullptr ? F::kUnitBlocks : 0);
  for (int64_t blk = 0; blk < nblk; ++blk) {
    const uint8_t* bp = blk < units * F::kUnitBlocks ? wrow + blk * F::kBlockBytes
                                                     : tail + (blk - units * F::kUnitBlocks) * F::kBlockBytes;
    for (int j = 0; j < F::kSub; ++j) {
      F::decode(bp, j, b);
      const int64_t kb = blk * F::kSub + j, gi = kb / kGroupBlocks, k = kb % kGroupBlocks;
      for (int r = 0; r < R; ++r) {
        const int8_t* q = a.qg(gi, r0 + r);
        int lo = 0, hi = 0;
        for (int i = 0; i < 16; ++i) {
          lo += b.v[i] * q[act_pos(k, i)];
          hi += b.v[16 + i] * q[act_pos(k, 16 + i)];
        }
        acc[r] += a.dg(gi, r0 + r)[k] * (b.sc[0] * (float)lo + b.sc[1] * (float)hi);
        if (F::kHasMin) acc[r] += b.mn * a.s32g(gi, r0 + r)[k];
      }
    }
  }
  for (int r = 0; r < R; ++r) y[r * ldy] = acc[r];
}
#endif

template <class F>
static void tile_rows(int R, const uint8_t* wrow, int64_t units, int rest, const uint8_t* tail, const QuantActs& a,
                      int64_t r0, float* y, int64_t ldy) {
  switch (R) {
    case 1: tile<F, 1>(wrow, units, rest, tail, a, r0, y, ldy); break;
    case 2: tile<F, 2>(wrow, units, rest, tail, a, r0, y, ldy); break;
    case 3: tile<F, 3>(wrow, units, rest, tail, a, r0, y, ldy); break;
    case 4: tile<F, 4>(wrow, units, rest, tail, a, r0, y, ldy); break;
#if defined(KVQ_AVX512)
    case 5: tile<F, 5>(wrow, units, rest, tail, a, r0, y, ldy); break;
    case 6: tile<F, 6>(wrow, units, rest, tail, a, r0, y, ldy); break;
    case 7: tile<F, 7>(wrow, units, rest, tail, a, r0, y, ldy); break;
    case 8: tile<F, 8>(wrow, units, rest, tail, a, r0, y, ldy); break;
#endif
    default: break;
  }
}

// Output rows n0..n1 of one weight, serially: chunks of weight rows that stay in L1 times
// tiles of activation rows. A row's last, partial unit of 32-blocks (K not a multiple of the
// group) is read in place with masked loads on AVX-512; AVX2 and scalar copy it, zero-padded, to
// a local unit (zero bytes are zero weights with zero scales).
template <class F>
static void range_fmt(const uint8_t* W, int64_t n0, int64_t n1, const QuantActs& a, float* y, int64_t ldy) {
  const int64_t nblk = a.K / F::kBlockWeights, row_bytes = nblk * F::kBlockBytes;
  const int64_t units = nblk / F::kUnitBlocks, rest = nblk % F::kUnitBlocks;
#if !defined(KVQ_AVX512)
  alignas(64) uint8_t tail[F::kUnitBlocks * F::kBlockBytes + 64];
#endif
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
#if !defined(KVQ_AVX512)
        if (rest) {
          std::memset(tail, 0, sizeof(tail));
          std::memcpy(tail, wrow + units * F::kUnitBlocks * F::kBlockBytes, rest * F::kBlockBytes);
          tp = tail;
        }
#endif
        tile_rows<F>(R, wrow, units, (int)rest, tp, a, r0, y + r0 * ldy + n, ldy);
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

// y[r * ldy + col + n] for every activation row r of a (two per token when a.passes is 2).
inline void matmul_activation_rows(const Segment* seg, int n_seg, const QuantActs& a, float* y, int64_t ldy) {
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

// Each token's outputs in y [tokens, ldy]: with two passes, the sum of its two rows' products
// (segments side by side from column 0, as the callers lay them out).
inline void matmul_segments(const Segment* seg, int n_seg, const QuantActs& a, float* y, int64_t ldy) {
  if (a.passes == 1) return matmul_activation_rows(seg, n_seg, a, y, ldy);
  int64_t width = 0;
  for (int i = 0; i < n_seg; ++i) width = std::max(width, seg[i].col + seg[i].N);
  static thread_local std::vector<float> rows;
  rows.assign(a.M * width, 0.f);
  matmul_activation_rows(seg, n_seg, a, rows.data(), width);
  for (int64_t t = 0; t < a.M / 2; ++t) {
    const float* first = rows.data() + 2 * t * width;
    for (int64_t n = 0; n < width; ++n) y[t * ldy + n] = first[n] + first[width + n];
  }
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
