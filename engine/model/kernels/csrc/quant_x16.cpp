
// ---------------------------------------------------------------- block weights interleaved by 16 rows (x16)
// A many-row GEMM over any block format. The plain tiles fold every vpdpbusd's 16 lanes back into 8
// blocks of one row and scale each block apart: about 8 more instructions per 4 vpdpbusd. Here 16
// weight rows share each 32-block's record, so the 16 int32 lanes of one vpdpbusd are 16 outputs
// (row n's 4 products), the activation's 4 bytes come broadcast, and a 32-block costs 8 vpdpbusd
// plus 4-6 float ops per activation row for 16 outputs.
//
// Every format's 32-block j is w[i] = sc[i / 16] * v[i] (+ mn) with int8 v (the core's decode()),
// so one record serves all: the 16 rows' scales as fp32 (the values 16..31's apart for Q6_K, whose
// scales are per 16), their minimums where the format has them (Q4_1, Q5_1, Q4_K, Q5_K), then 8
// steps of 16 rows x 4 bytes: step j holds v[4j..4j+3] of row 0, of row 1, ... Each v is stored xor
// 0x80 (v + 128, unsigned for vpdpbusd); the -128 * sum(activations) comes back through the
// activation sums. Lossless: d * sc and dmin * m are exact in fp32 (an 11-bit mantissa times a
// 6- or 8-bit integer), and the xor is its own inverse.
// Layout: [ceil(N / 16) groups][K / 32 blocks][record]; rows past N are zero with scale 0.
namespace kvscope_quant {

constexpr int64_t kX16Rows = 16, kX16Quants = 16 * 32;
#if defined(KVQ_VNNI)
constexpr int kX16MaxRows = 8;
#else
constexpr int kX16MaxRows = 4;
#endif

struct X16Kind {
  bool two_scales, has_min;
  constexpr int floats() const { return 1 + (int)two_scales + (int)has_min; }  // 16-float arrays before the quants
  constexpr int64_t record_bytes() const { return 64 * floats() + kX16Quants; }
};

template <class F>
constexpr X16Kind x16_kind() {
  return {F::kTwoScales, F::kHasMin};
}

inline X16Kind x16_kind(int fmt) {
  switch (fmt) {
    case kQ4_0: return x16_kind<FQ4_0>();
    case kQ4_1: return x16_kind<FQ4_1>();
    case kQ5_0: return x16_kind<FQ5_0>();
    case kQ5_1: return x16_kind<FQ5_1>();
    case kQ8_0: return x16_kind<FQ8_0>();
    case kQ4_K: return x16_kind<FQ4_K>();
    case kQ5_K: return x16_kind<FQ5_K>();
    default: return x16_kind<FQ6_K>();
  }
}

template <class F>
static void pack_x16_fmt(const uint8_t* W, int64_t N, int64_t K, uint8_t* out) {
  constexpr X16Kind kind = x16_kind<F>();
  const int64_t nb = K / 32, row_bytes = K / F::kBlockWeights * F::kBlockBytes, rec_bytes = kind.record_bytes();
  const int64_t groups = (N + kX16Rows - 1) / kX16Rows;
  at::parallel_for(0, groups, 16, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t k = 0; k < nb; ++k) {
        uint8_t* rec = out + (g * nb + k) * rec_bytes;
        float lo[kX16Rows], hi[kX16Rows], mn[kX16Rows];
        for (int n = 0; n < kX16Rows; ++n) {
          const int64_t row = g * kX16Rows + n;
          BlockInts b{};
          if (row < N) {
            const int64_t blk = k * 32 / F::kBlockWeights, sub = k % F::kSub;
            F::decode(W + row * row_bytes + blk * F::kBlockBytes, (int)sub, b);
          }
          lo[n] = b.sc[0];
          hi[n] = b.sc[1];
          mn[n] = b.mn;
          uint8_t* dst = rec + 64 * kind.floats() + 4 * n;  // step j of row n at dst + 64 j
          for (int j = 0; j < 8; ++j) {
            const uint32_t v = load_u32((const uint8_t*)b.v + 4 * j) ^ 0x80808080u;
            std::memcpy(dst + 64 * j, &v, 4);
          }
        }
        std::memcpy(rec, lo, 64);
        if (kind.two_scales) std::memcpy(rec + 64, hi, 64);
        if (kind.has_min) std::memcpy(rec + 64 * (1 + (int)kind.two_scales), mn, 64);
      }
  });
}

inline bool pack_x16(const uint8_t* W, int fmt, int64_t N, int64_t K, uint8_t* out) {
  switch (fmt) {
    case kQ4_0: pack_x16_fmt<FQ4_0>(W, N, K, out); return true;
    case kQ4_1: pack_x16_fmt<FQ4_1>(W, N, K, out); return true;
    case kQ5_0: pack_x16_fmt<FQ5_0>(W, N, K, out); return true;
    case kQ5_1: pack_x16_fmt<FQ5_1>(W, N, K, out); return true;
    case kQ8_0: pack_x16_fmt<FQ8_0>(W, N, K, out); return true;
    case kQ4_K: pack_x16_fmt<FQ4_K>(W, N, K, out); return true;
    case kQ5_K: pack_x16_fmt<FQ5_K>(W, N, K, out); return true;
    case kQ6_K: pack_x16_fmt<FQ6_K>(W, N, K, out); return true;
    default: return false;
  }
}

// Row n's value i of a record, and its scale and minimum (dequantize and the scalar path).
inline int8_t x16_value(const uint8_t* rec, X16Kind kind, int n, int i) {
  return (int8_t)(rec[64 * kind.floats() + ((i >> 2) * kX16Rows + n) * 4 + (i & 3)] ^ 0x80);
}
inline float x16_float(const uint8_t* rec, int array, int n) {
  float v;
  std::memcpy(&v, rec + 64 * array + 4 * n, 4);
  return v;
}
inline float x16_scale(const uint8_t* rec, X16Kind kind, int n, int i) {
  return x16_float(rec, kind.two_scales && i >= 16 ? 1 : 0, n);
}
inline float x16_min(const uint8_t* rec, X16Kind kind, int n) {
  return kind.has_min ? x16_float(rec, 1 + (int)kind.two_scales, n) : 0.f;
}

// The 16 outputs of one group for R activation rows r0..: y[r * ldy + 0..valid).
template <bool kTwo, bool kMin, int R>
static void x16_tile(const uint8_t* Wg, int64_t nb, const QuantActs& a, int64_t r0, float* y, int64_t ldy, int valid) {
  constexpr X16Kind kind{kTwo, kMin};
  constexpr int64_t rec_bytes = kind.record_bytes();
#if defined(KVQ_VNNI)
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512 m128 = _mm512_set1_ps(-128.f);
  for (int64_t k = 0; k < nb; ++k) {
    const uint8_t* rec = Wg + k * rec_bytes;
    const __m512 s_lo = _mm512_load_ps((const float*)rec);
    const __m512 s_hi = kTwo ? _mm512_load_ps((const float*)(rec + 64)) : s_lo;
    // the weights' constant part per activation sum: -128 * scale (the xor), + the minimum
    const __m512 off_lo = kMin ? _mm512_fmadd_ps(s_lo, m128, _mm512_load_ps((const float*)(rec + 64 * (1 + kTwo))))
                               : _mm512_mul_ps(s_lo, m128);
    const __m512 off_hi = _mm512_mul_ps(s_hi, m128);
    __m512i u[8];
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) u[j] = _mm512_load_si512((const void*)(rec + 64 * kind.floats() + 64 * j));
    const int64_t g = k / kGroupBlocks, kk = k % kGroupBlocks;
    const int8_t* q0 = a.qg(g, r0);
    const float* d0 = a.dg(g, r0) + kk;
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const uint8_t* q = (const uint8_t*)(q0 + r * kGroup);
      __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();  // values 0..15 and 16..31
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        lo = _mm512_dpbusd_epi32(lo, u[j], _mm512_set1_epi32((int)load_u32(q + act_pos(kk, 4 * j))));
        hi = _mm512_dpbusd_epi32(hi, u[j + 4], _mm512_set1_epi32((int)load_u32(q + act_pos(kk, 4 * j + 16))));
      }
      const __m512 d = _mm512_set1_ps(d0[r * kGroupBlocks]);
      if constexpr (kTwo) {
        const float* s16 = a.s16g(g, r0 + r);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), _mm512_mul_ps(s_lo, d), acc[r]);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_mul_ps(s_hi, d), acc[r]);
        acc[r] = _mm512_fmadd_ps(off_lo, _mm512_set1_ps(s16[kk]), acc[r]);
        acc[r] = _mm512_fmadd_ps(off_hi, _mm512_set1_ps(s16[kGroupBlocks + kk]), acc[r]);
      } else {
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(lo, hi)), _mm512_mul_ps(s_lo, d), acc[r]);
        acc[r] = _mm512_fmadd_ps(off_lo, _mm512_set1_ps(a.s32g(g, r0 + r)[kk]), acc[r]);
      }
    }
  }
  const __mmask16 keep = valid >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << valid) - 1);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ldy, keep, acc[r]);
#else
  // Without VNNI: the reference (the plan offers x16 only where the VNNI build runs).
  for (int r = 0; r < R; ++r) {
    float acc[kX16Rows] = {};
    for (int64_t k = 0; k < nb; ++k) {
      const uint8_t* rec = Wg + k * rec_bytes;
      const int64_t g = k / kGroupBlocks, kk = k % kGroupBlocks;
      const int8_t* q = a.qg(g, r0 + r);
      for (int n = 0; n < kX16Rows; ++n) {
        int lo = 0, hi = 0;
        for (int i = 0; i < 16; ++i) {
          lo += x16_value(rec, kind, n, i) * q[act_pos(kk, i)];
          hi += x16_value(rec, kind, n, 16 + i) * q[act_pos(kk, 16 + i)];
        }
        acc[n] += a.dg(g, r0 + r)[kk] * (x16_scale(rec, kind, n, 0) * (float)lo + x16_scale(rec, kind, n, 16) * (float)hi);
        if (kMin) acc[n] += x16_min(rec, kind, n) * a.s32g(g, r0 + r)[kk];
      }
    }
    for (int n = 0; n < valid; ++n) y[r * ldy + n] = acc[n];
  }
#endif
}

template <bool kTwo, bool kMin>
static void x16_rows(int R, const uint8_t* Wg, int64_t nb, const QuantActs& a, int64_t r0, float* y, int64_t ldy,
                     int valid) {
  switch (R) {
    case 1: x16_tile<kTwo, kMin, 1>(Wg, nb, a, r0, y, ldy, valid); break;
    case 2: x16_tile<kTwo, kMin, 2>(Wg, nb, a, r0, y, ldy, valid); break;
    case 3: x16_tile<kTwo, kMin, 3>(Wg, nb, a, r0, y, ldy, valid); break;
    case 4: x16_tile<kTwo, kMin, 4>(Wg, nb, a, r0, y, ldy, valid); break;
#if defined(KVQ_VNNI)
    case 5: x16_tile<kTwo, kMin, 5>(Wg, nb, a, r0, y, ldy, valid); break;
    case 6: x16_tile<kTwo, kMin, 6>(Wg, nb, a, r0, y, ldy, valid); break;
    case 7: x16_tile<kTwo, kMin, 7>(Wg, nb, a, r0, y, ldy, valid); break;
    case 8: x16_tile<kTwo, kMin, 8>(Wg, nb, a, r0, y, ldy, valid); break;
#endif
    default: break;
  }
}

// One group of 16 rows times every tile of activation rows (the group's records stay in L1).
static void x16_group(const uint8_t* Wg, X16Kind kind, int64_t nb, const QuantActs& a, float* y, int64_t ldy,
                      int valid) {
  const int64_t tiles = (a.M + kX16MaxRows - 1) / kX16MaxRows;
  int64_t r0 = 0;
  for (int64_t t = 0; t < tiles; ++t) {
    const int R = (int)((a.M - r0) / (tiles - t));  // tiles of near-equal size
    float* yr = y + r0 * ldy;
    if (kind.two_scales)
      x16_rows<true, false>(R, Wg, nb, a, r0, yr, ldy, valid);
    else if (kind.has_min)
      x16_rows<false, true>(R, Wg, nb, a, r0, yr, ldy, valid);
    else
      x16_rows<false, false>(R, Wg, nb, a, r0, yr, ldy, valid);
    r0 += R;
  }
}

struct X16Segment {
  const uint8_t* P;
  X16Kind kind;
  int64_t N, col;
};

// Several packed weights sharing the activations, outputs side by side (segment i at column col):
// all segments' groups over torch's threads.
inline void matmul_x16_segments(const X16Segment* seg, int n_seg, const QuantActs& a, float* y, int64_t ldy) {
  const int64_t nb = a.K / 32;
  std::vector<int64_t> first(n_seg + 1, 0);  // each segment's first group in the combined range
  for (int i = 0; i < n_seg; ++i) first[i + 1] = first[i] + (seg[i].N + kX16Rows - 1) / kX16Rows;
  const int64_t grain = std::max<int64_t>(1, 256 / std::max<int64_t>(a.M, 1));
  at::parallel_for(0, first[n_seg], grain, [&](int64_t b, int64_t e) {
    int i = 0;
    for (int64_t gg = b; gg < e; ++gg) {
      while (gg >= first[i + 1]) ++i;
      const int64_t g = gg - first[i];
      const int valid = (int)std::min<int64_t>(kX16Rows, seg[i].N - g * kX16Rows);
      x16_group(seg[i].P + g * nb * seg[i].kind.record_bytes(), seg[i].kind, nb, a, y + seg[i].col + g * kX16Rows,
                ldy, valid);
    }
  });
}

}  // namespace kvscope_quant

static int64_t x16_groups(int64_t N) { return (N + kq::kX16Rows - 1) / kq::kX16Rows; }

static torch::Tensor checked_x16(const torch::Tensor& packed, int64_t N, int64_t K, int64_t fmt, const char* fn) {
  checked_geometry(fmt, fn);
  TORCH_CHECK(K % 32 == 0, fn, ": in-features (", K, ") must be a multiple of 32");
  const int64_t rec = kq::x16_kind((int)fmt).record_bytes();
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.dim() == 3 && packed.size(0) == x16_groups(N) &&
                  packed.size(1) == K / 32 && packed.size(2) == rec,
              fn, ": an x16 ", format_name(fmt), " weight of ", N, " rows and ", K, " in-features must be uint8 [",
              x16_groups(N), ", ", K / 32, ", ", rec, "] (pack_x16's output), got ", packed.scalar_type(), " ",
              packed.sizes());
  return packed.contiguous();
}

// A weight's blocks uint8 [N, row bytes] -> its x16 records in ``out`` (uint8 [ceil(N / 16), K / 32,
// record bytes], contiguous: a view of a caller's buffer that holds several weights' records).
void pack_x16_into(torch::Tensor w, int64_t fmt, torch::Tensor out) {
  const int64_t K = checked_in_features(w, fmt, "pack_x16_into");
  w = w.contiguous();
  const int64_t N = w.size(0);
  TORCH_CHECK(out.is_contiguous(), "pack_x16_into: out must be contiguous");
  checked_x16(out, N, K, fmt, "pack_x16_into");
  if (N > 0 && K > 0) kq::pack_x16(w.data_ptr<uint8_t>(), (int)fmt, N, K, out.data_ptr<uint8_t>());
}

torch::Tensor pack_x16(torch::Tensor w, int64_t fmt) {
  const int64_t K = checked_in_features(w, fmt, "pack_x16");
  auto out = torch::empty({x16_groups(w.size(0)), K / 32, kq::x16_kind((int)fmt).record_bytes()}, torch::kUInt8);
  pack_x16_into(w, fmt, out);
  return out;
}

// The packed weight's values in float32 [N, K], as dequantize() gives them from the blocks.
torch::Tensor dequantize_x16(torch::Tensor packed, int64_t N, int64_t fmt) {
  TORCH_CHECK(packed.dim() == 3, "dequantize_x16: packed must be 3-D, got ", packed.sizes());
  const int64_t K = packed.size(1) * 32;
  packed = checked_x16(packed, N, K, fmt, "dequantize_x16");
  const kq::X16Kind kind = kq::x16_kind((int)fmt);
  auto out = torch::empty({N, K}, torch::kFloat);
  const uint8_t* P = packed.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  const int64_t nb = K / 32;
  for (int64_t row = 0; row < N; ++row)
    for (int64_t k = 0; k < nb; ++k) {
      const uint8_t* rec = P + ((row / kq::kX16Rows) * nb + k) * kind.record_bytes();
      const int n = (int)(row % kq::kX16Rows);
      for (int i = 0; i < 32; ++i) {
        const float w = kq::x16_scale(rec, kind, n, i) * (float)kq::x16_value(rec, kind, n, i);
        o[row * K + k * 32 + i] = kind.has_min ? w + kq::x16_min(rec, kind, n) : w;
      }
    }
  return out;
}

torch::Tensor x16_matmul_segments(torch::Tensor x, std::vector<torch::Tensor> packs, std::vector<int64_t> rows,
                                  std::vector<int64_t> fmts) {
  const char* fn = "x16_matmul_segments";
  TORCH_CHECK(!packs.empty() && packs.size() == rows.size() && packs.size() == fmts.size(), fn,
              ": need one row count and one format per packed weight (", packs.size(), ", ", rows.size(), ", ",
              fmts.size(), ")");
  auto xf = float_rows(x, fn);
  const int64_t M = xf.size(0), K = xf.size(1);
  std::vector<kq::X16Segment> seg;
  int64_t col = 0;
  for (size_t i = 0; i < packs.size(); ++i) {
    packs[i] = checked_x16(packs[i], rows[i], K, fmts[i], fn);
    seg.push_back({packs[i].data_ptr<uint8_t>(), kq::x16_kind((int)fmts[i]), rows[i], col});
    col += rows[i];
  }
  auto y = torch::empty({M, col}, xf.options());
  if (M == 0 || col == 0) return y;
  kq::QuantActs a;
  kq::quantize_acts(xf.data_ptr<float>(), M, K, K, a);
  kq::matmul_x16_segments(seg.data(), (int)seg.size(), a, y.data_ptr<float>(), col);
  return y;
}

// Bytes of one 32-block record of 16 rows in ``fmt`` (the packed tensor's last dimension).
int64_t x16_record_bytes(int64_t fmt) {
  checked_geometry(fmt, "x16_record_bytes");
  return kq::x16_kind((int)fmt).record_bytes();
}

// Whether x16 runs its vpdpbusd path here (else the scalar reference).
bool x16_native() {
#if defined(KVQ_VNNI)
  return true;
#else
  return false;
#endif
}
