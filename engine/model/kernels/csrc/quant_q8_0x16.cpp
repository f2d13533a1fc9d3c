
// ---------------------------------------------------------------- Q8_0 interleaved by 16 rows (q8_0x16)
// A many-row GEMM over a Q8_0 weight (a tied LM head is Q8_0 in most K-quant files). The plain
// tiles fold every vpdpbusd's 16 lanes back into 8 blocks of one row and scale each block apart:
// about 8 more instructions per 4 vpdpbusd. Here 16 weight rows share each 32-block's record, so
// the 16 int32 lanes of one vpdpbusd are 16 outputs (row n's 4 products), the activation's 4 bytes
// come broadcast, and a block costs 8 vpdpbusd plus 4 float ops per activation row for 16 outputs.
//
// Record of a 32-block (kX16BlockBytes): the 16 rows' scales as fp32 (64 bytes), then 8 steps of
// 16 rows x 4 bytes: step j holds values 4j..4j+3 of row 0, of row 1, ... Each quant byte is stored
// xor 0x80 (q + 128, unsigned for vpdpbusd); the -128 * sum(activations) comes back through the
// activation sums (s32). Lossless: the fp16 scales widen exactly and the xor is its own inverse.
// Layout: [ceil(N / 16) groups][K / 32 blocks][kX16BlockBytes]; rows past N are zero with scale 0.
namespace kvscope_quant {

constexpr int64_t kX16Rows = 16, kX16BlockBytes = 16 * 4 + 16 * 32;
#if defined(KVQ_VNNI)
constexpr int kX16MaxRows = 8;
#else
constexpr int kX16MaxRows = 4;
#endif

inline void pack_q8_0x16(const uint8_t* W, int64_t N, int64_t nb, uint8_t* out) {
  const int64_t groups = (N + kX16Rows - 1) / kX16Rows;
  at::parallel_for(0, groups, 64, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t k = 0; k < nb; ++k) {
        uint8_t* rec = out + (g * nb + k) * kX16BlockBytes;
        float scales[kX16Rows];
        for (int n = 0; n < kX16Rows; ++n) {
          const int64_t row = g * kX16Rows + n;
          const uint8_t* src = row < N ? W + (row * nb + k) * 34 : nullptr;
          scales[n] = src ? fp16(src) : 0.f;
          for (int j = 0; j < 8; ++j)
            for (int i = 0; i < 4; ++i) rec[64 + (j * kX16Rows + n) * 4 + i] = (uint8_t)((src ? src[2 + 4 * j + i] : 0) ^ 0x80);
        }
        std::memcpy(rec, scales, sizeof(scales));
      }
  });
}

// The packed weight's row n of block k as integers (the scalar path and dequantize).
inline int8_t x16_quant(const uint8_t* rec, int n, int i) {
  return (int8_t)(rec[64 + ((i >> 2) * kX16Rows + n) * 4 + (i & 3)] ^ 0x80);
}

// The 16 outputs of group g for R activation rows r0..: y[r * ldy + 0..valid).
template <int R>
static void x16_tile(const uint8_t* Wg, int64_t nb, const QuantActs& a, int64_t r0, float* y, int64_t ldy, int valid) {
#if defined(KVQ_VNNI)
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < nb; ++k) {
    const uint8_t* rec = Wg + k * kX16BlockBytes;
    const __m512 dw = _mm512_load_ps((const float*)rec);
    const __m512 dw_off = _mm512_mul_ps(dw, _mm512_set1_ps(-128.f));
    __m512i u[8];
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) u[j] = _mm512_load_si512((const void*)(rec + 64 + 64 * j));
    const int64_t g = k / kGroupBlocks, kk = k % kGroupBlocks;
    const int8_t* q0 = a.qg(g, r0);
    const float* d0 = a.dg(g, r0) + kk;
    const float* s0 = a.s32g(g, r0) + kk;
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const uint8_t* q = (const uint8_t*)(q0 + r * kGroup);
      __m512i s = _mm512_setzero_si512(), t = _mm512_setzero_si512();  // two chains: half the latency
#pragma GCC unroll 4
      for (int j = 0; j < 8; j += 2) {
        s = _mm512_dpbusd_epi32(s, u[j], _mm512_set1_epi32((int)load_u32(q + act_pos(kk, 4 * j))));
        t = _mm512_dpbusd_epi32(t, u[j + 1], _mm512_set1_epi32((int)load_u32(q + act_pos(kk, 4 * j + 4))));
      }
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(s, t));
      acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(dw, _mm512_set1_ps(d0[r * kGroupBlocks])), acc[r]);
      acc[r] = _mm512_fmadd_ps(dw_off, _mm512_set1_ps(s0[r * kGroupBlocks]), acc[r]);
    }
  }
  const __mmask16 keep = valid >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << valid) - 1);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ldy, keep, acc[r]);
#else
  // Without VNNI: the reference (the plan offers q8_0x16 only where the VNNI build runs).
  for (int r = 0; r < R; ++r) {
    float acc[kX16Rows] = {};
    for (int64_t k = 0; k < nb; ++k) {
      const uint8_t* rec = Wg + k * kX16BlockBytes;
      const int64_t g = k / kGroupBlocks, kk = k % kGroupBlocks;
      const int8_t* q = a.qg(g, r0 + r);
      const float d = a.dg(g, r0 + r)[kk];
      for (int n = 0; n < kX16Rows; ++n) {
        int dot = 0;
        for (int i = 0; i < 32; ++i) dot += x16_quant(rec, n, i) * q[act_pos(kk, i)];
        float dw;
        std::memcpy(&dw, rec + 4 * n, 4);
        acc[n] += dw * d * (float)dot;
      }
    }
    for (int n = 0; n < valid; ++n) y[r * ldy + n] = acc[n];
  }
#endif
}

static void x16_rows(int R, const uint8_t* Wg, int64_t nb, const QuantActs& a, int64_t r0, float* y, int64_t ldy,
                     int valid) {
  switch (R) {
    case 1: x16_tile<1>(Wg, nb, a, r0, y, ldy, valid); break;
    case 2: x16_tile<2>(Wg, nb, a, r0, y, ldy, valid); break;
    case 3: x16_tile<3>(Wg, nb, a, r0, y, ldy, valid); break;
    case 4: x16_tile<4>(Wg, nb, a, r0, y, ldy, valid); break;
#if defined(KVQ_VNNI)
    case 5: x16_tile<5>(Wg, nb, a, r0, y, ldy, valid); break;
    case 6: x16_tile<6>(Wg, nb, a, r0, y, ldy, valid); break;
    case 7: x16_tile<7>(Wg, nb, a, r0, y, ldy, valid); break;
    case 8: x16_tile<8>(Wg, nb, a, r0, y, ldy, valid); break;
#endif
    default: break;
  }
}

// y[r * ldy + n] for all N rows of a packed weight: groups of 16 rows over torch's threads, each
// group's records (K / 32 x 576 bytes) kept in L1 while every tile of activation rows passes.
inline void matmul_q8_0x16(const uint8_t* P, int64_t N, const QuantActs& a, float* y, int64_t ldy) {
  const int64_t nb = a.K / 32, groups = (N + kX16Rows - 1) / kX16Rows;
  const int64_t tiles = (a.M + kX16MaxRows - 1) / kX16MaxRows;
  const int64_t grain = std::max<int64_t>(1, 256 / std::max<int64_t>(a.M, 1));
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int valid = (int)std::min<int64_t>(kX16Rows, N - g * kX16Rows);
      int64_t r0 = 0;
      for (int64_t t = 0; t < tiles; ++t) {
        const int R = (int)((a.M - r0) / (tiles - t));  // tiles of near-equal size
        x16_rows(R, P + g * nb * kX16BlockBytes, nb, a, r0, y + r0 * ldy + g * kX16Rows, ldy, valid);
        r0 += R;
      }
    }
  });
}

}  // namespace kvscope_quant

static torch::Tensor checked_x16(const torch::Tensor& packed, int64_t N, int64_t K, const char* fn) {
  TORCH_CHECK(K % 32 == 0, fn, ": in-features (", K, ") must be a multiple of 32");
  const int64_t groups = (N + kq::kX16Rows - 1) / kq::kX16Rows;
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.dim() == 3 && packed.size(0) == groups &&
                  packed.size(1) == K / 32 && packed.size(2) == kq::kX16BlockBytes,
              fn, ": a q8_0x16 weight of ", N, " rows and ", K, " in-features must be uint8 [", groups, ", ", K / 32,
              ", ", kq::kX16BlockBytes, "] (pack_q8_0x16's output), got ", packed.scalar_type(), " ", packed.sizes());
  return packed.contiguous();
}

// A Q8_0 weight uint8 [N, K / 32 * 34] -> its q8_0x16 records uint8 [ceil(N / 16), K / 32, 576].
torch::Tensor pack_q8_0x16(torch::Tensor w) {
  const int64_t K = checked_in_features(w, kq::kQ8_0, "pack_q8_0x16");
  w = w.contiguous();
  const int64_t N = w.size(0), nb = K / 32;
  auto out = torch::empty({(N + kq::kX16Rows - 1) / kq::kX16Rows, nb, kq::kX16BlockBytes}, torch::kUInt8);
  if (N > 0 && nb > 0) kq::pack_q8_0x16(w.data_ptr<uint8_t>(), N, nb, out.data_ptr<uint8_t>());
  return out;
}

// The packed weight's rows back as Q8_0 blocks' values in float (the tests' and the plan's check).
torch::Tensor dequantize_q8_0x16(torch::Tensor packed, int64_t N) {
  TORCH_CHECK(packed.dim() == 3, "dequantize_q8_0x16: packed must be 3-D, got ", packed.sizes());
  const int64_t K = packed.size(1) * 32;
  packed = checked_x16(packed, N, K, "dequantize_q8_0x16");
  auto out = torch::empty({N, K}, torch::kFloat);
  const uint8_t* P = packed.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  const int64_t nb = K / 32;
  for (int64_t row = 0; row < N; ++row)
    for (int64_t k = 0; k < nb; ++k) {
      const uint8_t* rec = P + ((row / kq::kX16Rows) * nb + k) * kq::kX16BlockBytes;
      float d;
      std::memcpy(&d, rec + 4 * (row % kq::kX16Rows), 4);
      for (int i = 0; i < 32; ++i) o[row * K + k * 32 + i] = d * (float)kq::x16_quant(rec, (int)(row % kq::kX16Rows), i);
    }
  return out;
}

torch::Tensor q8_0x16_matmul(torch::Tensor x, torch::Tensor packed, int64_t N) {
  const char* fn = "q8_0x16_matmul";
  auto xf = float_rows(x, fn);
  const int64_t M = xf.size(0), K = xf.size(1);
  packed = checked_x16(packed, N, K, fn);
  auto y = torch::empty({M, N}, xf.options());
  if (M == 0 || N == 0) return y;
  kq::QuantActs a;
  kq::quantize_acts(xf.data_ptr<float>(), M, K, K, a);
  kq::matmul_q8_0x16(packed.data_ptr<uint8_t>(), N, a, y.data_ptr<float>(), N);
  return y;
}

// Whether q8_0x16_matmul runs its vpdpbusd path here (else the scalar reference).
bool q8_0x16_native() {
#if defined(KVQ_VNNI)
  return true;
#else
  return false;
#endif
}
