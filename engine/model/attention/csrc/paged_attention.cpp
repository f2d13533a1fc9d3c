
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

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

// Any head dim: a horizontal sum per key and query row (decode_kernel below runs the tiled
// kernel for the compiled head dims).
template <typename kv_t, typename q_t, typename Row>
static void decode_kernel_rows(const q_t* q, const kv_t* kv, const int32_t* block_tables, const int32_t* seq_lens,
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

// Chunked-prefill attention over the paged cache, flash style: every prefill row of the step in
// one call, reading K and V in place through the block table (no gather copy, no padded mask).
// A task is a tile of up to kTile query rows of one sequence times the `group` query heads of
// one KV head; it walks the keys its rows can see (causal; the window's for a sliding-window
// layer) kKeys positions at a time with an online softmax, so no score matrix is held. Scores
// of kVec query vectors are taken together (each transposed K row loaded once for all of them),
// and each vector's output stays in registers across the tile's keys: ~95 GFLOP/s on 2 Zen 4
// cores (AVX-512) for a 500-token causal chunk, where torch's flash SDPA ran ~45. Tasks are
// sorted by their work and pulled from a shared counter: a causal chunk's last tiles see far
// more keys than its first, and a static split left one thread idle.
typedef float v16 __attribute__((vector_size(64)));  // GCC lowers it to the ISA's registers (2 ymm on AVX2)
constexpr int64_t kTile = 16;  // query rows per task
constexpr int64_t kKeys = 16;  // key positions per softmax step: one v16 of scores
constexpr int kVec = 4;        // query vectors scored together

static inline v16 splat(float x) { return v16{} + x; }
static inline v16 load_v16(const float* p) {
  v16 r;
  std::memcpy(&r, p, sizeof r);
  return r;
}
static inline void store_v16(float* p, v16 x) { std::memcpy(p, &x, sizeof x); }
typedef int i16 __attribute__((vector_size(64)));  // 16 int lanes: shuffle indices, exponents

// e^x for x <= 0 (softmax weights), 16 lanes in registers: a libmvec call inside a loop spills
// every live register, and its results depend on how the loop was peeled. 2^n * e^r with r in
// [-ln2/2, ln2/2], degree-6 Taylor (relative error ~2e-7). Inputs below -87 give ~1e-38, not 0:
// callers zero masked lanes.
constexpr float kExpTaylor[] = {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f};  // after 1/720, Horner

static inline v16 exp_v16(v16 x) {
#if defined(__AVX512F__)
  __m512 v = _mm512_max_ps((__m512)x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  v = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), v);  // ln 2 in two parts (Cody-Waite)
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), v);
  __m512 p = _mm512_set1_ps(1.f / 720);
  for (float c : kExpTaylor) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return (v16)_mm512_scalef_ps(p, n);
#else
  x = x < splat(-87.f) ? splat(-87.f) : x;
  const i16 n = __builtin_convertvector(x * splat(1.44269504f) - splat(0.5f), i16);  // rounded: x <= 0
  const v16 nf = __builtin_convertvector(n, v16);
  const v16 r = x - nf * splat(0.693145752f) - nf * splat(1.42860677e-6f);
  v16 p = splat(1.f / 720);
  for (float c : kExpTaylor) p = p * r + splat(c);
  const i16 bits = (n + 127) << 23;  // 2^n, n >= -126 after the clamp
  v16 two_n;
  std::memcpy(&two_n, &bits, sizeof bits);
  return p * two_n;
#endif
}

struct PrefillTask {
  int64_t seq, kv_head, row0, rows, cost;
};

// The tasks of a prefill call: tiles of `tile` query rows of one sequence times one KV head,
// costliest first (a causal chunk's last tiles see far more keys than its first; workers pull
// them from a shared counter).
static std::vector<PrefillTask> prefill_tasks(const int64_t* q_start, const int32_t* seq_lens, int64_t num_seqs,
                                              int64_t num_kv_heads, int64_t window, int64_t tile) {
  std::vector<PrefillTask> tasks;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t n = q_start[s + 1] - q_start[s], base = seq_lens[s] - n;  // row r sits at base + r
    for (int64_t r0 = 0; r0 < n; r0 += tile) {
      const int64_t rows = std::min(tile, n - r0);
      const int64_t hi = base + r0 + rows;  // keys [lo, hi)
      const int64_t lo = window > 0 ? std::max<int64_t>(0, base + r0 - window + 1) : 0;
      for (int64_t h = 0; h < num_kv_heads; ++h) tasks.push_back({s, h, r0, rows, rows * (hi - lo)});
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const PrefillTask& a, const PrefillTask& b) { return a.cost > b.cost; });
  return tasks;
}

template <int D, typename kv_t, typename Row>
static void prefill_kernel(const float* q, const kv_t* kv, const int32_t* block_tables, const int32_t* seq_lens,
                           const int64_t* q_start, float* out, int64_t num_seqs, int64_t num_heads,
                           int64_t num_kv_heads, int64_t block_size, int64_t max_blocks, float scale, Row load_row,
                           int64_t window) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t row_width = D + Row::kExtra;
  const int64_t token_stride = num_kv_heads * row_width;
  const int64_t kv_stride = block_size * token_stride;
  const int64_t block_stride = 2 * kv_stride;
  const std::vector<PrefillTask> tasks = prefill_tasks(q_start, seq_lens, num_seqs, num_kv_heads, window, kTile);
  std::atomic<int64_t> next{0};
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  const int64_t vectors = kTile * group;  // query vectors of one task
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(vectors * D), acc(vectors * D), keys_t(D * kKeys), values(kKeys * D), row(D),
        peak(vectors), total(vectors);
    for (int64_t worker = begin; worker < end; ++worker) {
      for (int64_t i = next.fetch_add(1); i < num_tasks; i = next.fetch_add(1)) {
        const PrefillTask& t = tasks[i];
        const int64_t n = q_start[t.seq + 1] - q_start[t.seq], base = seq_lens[t.seq] - n;
        const int32_t* table = block_tables + t.seq * max_blocks;
        const int64_t nv = t.rows * group;
        // vector v = r * group + g: row row0 + r of the chunk, query head kv_head * group + g
        for (int64_t v = 0; v < nv; ++v) {
          const float* src =
              q + ((q_start[t.seq] + t.row0 + v / group) * num_heads + t.kv_head * group + v % group) * D;
          for (int d = 0; d < D; ++d) qf[v * D + d] = src[d] * scale;
        }
        std::fill(acc.begin(), acc.begin() + nv * D, 0.f);
        std::fill(peak.begin(), peak.begin() + nv, -INFINITY);
        std::fill(total.begin(), total.begin() + nv, 0.f);
        const int64_t hi = base + t.row0 + t.rows;
        const int64_t lo = window > 0 ? std::max<int64_t>(0, base + t.row0 - window + 1) : 0;
        for (int64_t k0 = lo - lo % kKeys; k0 < hi; k0 += kKeys) {
          for (int64_t j = 0; j < kKeys; ++j) {  // K transposed (one dim's kKeys values side by side), V as rows
            const int64_t p = k0 + j;
            if (p < lo || p >= hi) {  // zeros keep the unused lanes finite; they are masked below
              for (int d = 0; d < D; ++d) keys_t[d * kKeys + j] = values[j * D + d] = 0.f;
              continue;
            }
            const kv_t* k = kv + table[p / block_size] * block_stride + (p % block_size) * token_stride +
                            t.kv_head * row_width;
            load_row(k, row.data(), D);
            for (int d = 0; d < D; ++d) keys_t[d * kKeys + j] = row[d];
            load_row(k + kv_stride, values.data() + j * D, D);
          }
          for (int64_t v0 = 0; v0 < nv; v0 += kVec) {
            const int nq = static_cast<int>(std::min<int64_t>(kVec, nv - v0));
            const float* qv = qf.data() + v0 * D;
            v16 s0 = {}, s1 = {}, s2 = {}, s3 = {};
            for (int d = 0; d < D; ++d) {
              const v16 k = load_v16(keys_t.data() + d * kKeys);
              s0 += splat(qv[d]) * k;
              if (nq > 1) s1 += splat(qv[D + d]) * k;
              if (nq > 2) s2 += splat(qv[2 * D + d]) * k;
              if (nq > 3) s3 += splat(qv[3 * D + d]) * k;
            }
            const v16 scores[kVec] = {s0, s1, s2, s3};
            for (int u = 0; u < nq; ++u) {
              const int64_t v = v0 + u, pos = base + t.row0 + v / group;
              // the keys this row sees in the tile: [jlo, jhi); the rest score -inf
              const int64_t jlo = (window > 0 ? pos - window + 1 : 0) - k0, jhi = pos + 1 - k0;
              float sc[kKeys];
              std::memcpy(sc, &scores[u], sizeof sc);
              float tile_peak = -INFINITY;
#pragma omp simd reduction(max : tile_peak)
              for (int j = 0; j < kKeys; ++j) {
                sc[j] = (j >= jlo && j < jhi) ? sc[j] : -INFINITY;
                tile_peak = std::max(tile_peak, sc[j]);
              }
              if (tile_peak == -INFINITY) continue;  // nothing visible to this row here
              const float new_peak = std::max(peak[v], tile_peak);
              float w[kKeys], sum = 0.f;
              // vectorised exp (libmvec under -ffast-math): a scalar expf per key was most of the time
#pragma omp simd reduction(+ : sum)
              for (int j = 0; j < kKeys; ++j) {
                w[j] = expf(sc[j] - new_peak);
                sum += w[j];
              }
              float* a = acc.data() + v * D;
              if (peak[v] != new_peak) {
                const float shrink = expf(peak[v] - new_peak);  // 0 on the first tile (peak -inf)
                total[v] *= shrink;
                for (int d = 0; d < D; ++d) a[d] *= shrink;
                peak[v] = new_peak;
              }
              total[v] += sum;
              v16 r[D / 16];  // this vector's output, in registers across the tile's keys
              for (int c = 0; c < D / 16; ++c) r[c] = load_v16(a + 16 * c);
              for (int j = 0; j < kKeys; ++j) {
                const v16 wj = splat(w[j]);
                const float* vr = values.data() + j * D;
                for (int c = 0; c < D / 16; ++c) r[c] += wj * load_v16(vr + 16 * c);
              }
              for (int c = 0; c < D / 16; ++c) store_v16(a + 16 * c, r[c]);
            }
          }
        }
        for (int64_t v = 0; v < nv; ++v) {
          float* dst = out + ((q_start[t.seq] + t.row0 + v / group) * num_heads + t.kv_head * group + v % group) * D;
          const float inv = total[v] > 0.f ? 1.f / total[v] : 0.f;
          for (int d = 0; d < D; ++d) dst[d] = acc[v * D + d] * inv;
        }
      }
    }
  });
}

// The head dims compiled in (each a multiple of 16: whole v16 registers); others use torch's SDPA.
template <typename kv_t, typename Row>
static void prefill_for_head_dim(int64_t D, const float* q, const kv_t* kv, const int32_t* tables,
                                 const int32_t* lens, const int64_t* starts, float* out, int64_t S, int64_t H,
                                 int64_t KVH, int64_t BS, int64_t MB, float scale, Row row, int64_t window) {
  switch (D) {
    case 64: return prefill_kernel<64>(q, kv, tables, lens, starts, out, S, H, KVH, BS, MB, scale, row, window);
    case 128: return prefill_kernel<128>(q, kv, tables, lens, starts, out, S, H, KVH, BS, MB, scale, row, window);
    case 256: return prefill_kernel<256>(q, kv, tables, lens, starts, out, S, H, KVH, BS, MB, scale, row, window);
    default: TORCH_CHECK(false, "paged_prefill: head dim ", D, " is not compiled in (64, 128, 256)");
  }
}

// Decode attention for a compiled head dim, 16 keys at a time (a tile of a 16-token block, every KV
// head of the task: contiguous in the cache): each head's K rows are widened into a float tile and
// each query row's 16 dot products summed across lanes together by a butterfly of shuffles (~3
// instructions a key, where a horizontal sum per key took ~10); p·V keeps up to kDecodeRows rows'
// outputs in registers across a tile's keys instead of reloading and storing them at every key.
// Float32 sums throughout, like decode_kernel_rows.
static inline v16 shuffle2(v16 a, v16 b, i16 idx) { return __builtin_shuffle(a, b, idx); }

// Lane j of the result: the sum of part[j]'s 16 lanes.
static inline v16 lane_sums(const v16* part) {
  // level with stride w: lanes whose (k / w) is even take a's, the others b's; x + y pairs them
  const i16 x1 = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
  const i16 y1 = {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31};
  const i16 x2 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
  const i16 y2 = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
  const i16 x3 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
  const i16 y3 = {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31};
  const i16 x4 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const i16 y4 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
  v16 l1[8], l2[4], l3[2];
  for (int i = 0; i < 8; ++i) l1[i] = shuffle2(part[2 * i], part[2 * i + 1], x1) + shuffle2(part[2 * i], part[2 * i + 1], y1);
  for (int i = 0; i < 4; ++i) l2[i] = shuffle2(l1[2 * i], l1[2 * i + 1], x2) + shuffle2(l1[2 * i], l1[2 * i + 1], y2);
  for (int i = 0; i < 2; ++i) l3[i] = shuffle2(l2[2 * i], l2[2 * i + 1], x3) + shuffle2(l2[2 * i], l2[2 * i + 1], y3);
  return shuffle2(l3[0], l3[1], x4) + shuffle2(l3[0], l3[1], y4);
}

template <int D, typename kv_t, typename q_t, typename Row>
static void decode_kernel_tiled(const q_t* q, const kv_t* kv, const int32_t* block_tables, const int32_t* seq_lens,
                                q_t* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                                int64_t block_size, int64_t max_blocks, float scale, Row load_row, int64_t window) {
  constexpr int C = D / 16;
  constexpr int kDecodeRows = D <= 64 ? 4 : (D <= 128 ? 2 : 1);  // p·V rows in registers together
  const int64_t group = num_heads / num_kv_heads;
  const int64_t row_width = D + Row::kExtra;
  const int64_t token_stride = num_kv_heads * row_width;
  const int64_t kv_stride = block_size * token_stride;
  const int64_t block_stride = 2 * kv_stride;
  // A task is one sequence with all its KV heads; with few sequences, one head, so every thread has work.
  const int64_t heads_per_task = num_seqs >= 2 * at::get_num_threads() ? num_kv_heads : 1;
  const int64_t tasks_per_seq = num_kv_heads / heads_per_task;
  const int64_t rows = heads_per_task * group;  // query rows of one task
  at::parallel_for(0, num_seqs * tasks_per_seq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(rows * D), keys(16 * D), vrow(D), acc(rows * D), scores;
    const kv_t* tile[16];   // the current tile's K rows (head 0 of the task); V is kv_stride further
    const kv_t* ahead[16];  // the next tile's, prefetched while this one is summed
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / tasks_per_seq, h0 = (task % tasks_per_seq) * heads_per_task;
      const int64_t first = window > 0 ? std::max<int64_t>(0, seq_lens[s] - window) : 0;
      const int64_t len = seq_lens[s] - first, padded = (len + 15) / 16 * 16;
      const int32_t* table = block_tables + s * max_blocks;
      // The rows of keys t0 ... t0 + 15 (fewer at the end): one division per tile, not per key.
      auto tile_rows = [&](int64_t t0, const kv_t** out_rows) -> int64_t {
        const int64_t n = std::max<int64_t>(0, std::min<int64_t>(16, len - t0));
        int64_t blk = (first + t0) / block_size, off = (first + t0) % block_size;
        for (int64_t j = 0; j < n; ++j) {
          out_rows[j] = kv + table[blk] * block_stride + off * token_stride + h0 * row_width;
          if (++off == block_size) off = 0, ++blk;
        }
        return n;
      };
      auto prefetch = [&](const kv_t* row) {
        const char* bytes = reinterpret_cast<const char*>(row);
        for (int64_t b = 0; b < static_cast<int64_t>(row_width * sizeof(kv_t)); b += 64) __builtin_prefetch(bytes + b);
      };
      scores.resize(rows * std::max<int64_t>(padded, 16));
      // row r: query head h0 * group + r (KV head h0 + r / group)
      for (int64_t r = 0; r < rows; ++r)
        for (int d = 0; d < D; ++d) qf[r * D + d] = static_cast<float>(q[(s * num_heads + h0 * group + r) * D + d]) * scale;
      // q·K, 16 keys at a time with every head of the task (a tile of a block is contiguous in the cache)
      int64_t nt = tile_rows(0, tile);
      for (int64_t t0 = 0; t0 < len; t0 += 16) {
        const int64_t next = tile_rows(t0 + 16, ahead);
        for (int64_t h = 0; h < heads_per_task; ++h) {
          for (int64_t j = 0; j < next; ++j) prefetch(ahead[j] + h * row_width);
          for (int64_t j = 0; j < 16; ++j) {
            if (j < nt) load_row(tile[j] + h * row_width, keys.data() + j * D, D);
            else std::fill(keys.begin() + j * D, keys.begin() + (j + 1) * D, 0.f);
          }
          for (int64_t r = h * group; r < (h + 1) * group; ++r) {
            v16 qr[C], part[16];
            for (int c = 0; c < C; ++c) qr[c] = load_v16(qf.data() + r * D + 16 * c);
            for (int j = 0; j < 16; ++j) {
              const float* k = keys.data() + j * D;
              v16 sum = qr[0] * load_v16(k);
              for (int c = 1; c < C; ++c) sum += qr[c] * load_v16(k + 16 * c);
              part[j] = sum;
            }
            store_v16(scores.data() + r * padded + t0, lane_sums(part));
          }
        }
        std::copy(ahead, ahead + next, tile);
        nt = next;
      }
      // softmax over each row's len scores, 16 at a time; the last tile's lanes past len are masked
      const int64_t tail = len % 16;  // 0: the last tile is full
      for (int64_t r = 0; r < (len > 0 ? rows : 0); ++r) {  // an empty context has nothing to normalise
        float* sc = scores.data() + r * padded;
        for (int64_t t = len; t < padded; ++t) sc[t] = -INFINITY;
        v16 peak = splat(-INFINITY);
        for (int64_t t = 0; t < padded; t += 16) {
          const v16 x = load_v16(sc + t);
          peak = x > peak ? x : peak;
        }
        float top = peak[0];
        for (int l = 1; l < 16; ++l) top = std::max(top, peak[l]);
        v16 total = {};
        for (int64_t t = 0; t < padded; t += 16) {
          v16 e = exp_v16(load_v16(sc + t) - splat(top));
          if (t + 16 > len)
            for (int64_t l = tail; l < 16; ++l) e[l] = 0.f;  // past the context (exp_v16 gives ~1e-38, not 0)
          store_v16(sc + t, e);
          total += e;
        }
        float sum = 0.f;
        for (int l = 0; l < 16; ++l) sum += total[l];
        const v16 inv = splat(1.f / sum);
        for (int64_t t = 0; t < padded; t += 16) store_v16(sc + t, load_v16(sc + t) * inv);
      }
      // p·V in the same order; kDecodeRows rows' outputs stay in registers across a tile's keys
      std::fill(acc.begin(), acc.end(), 0.f);
      nt = tile_rows(0, tile);
      for (int64_t t0 = 0; t0 < len; t0 += 16) {
        const int64_t next = tile_rows(t0 + 16, ahead);
        for (int64_t h = 0; h < heads_per_task; ++h) {
          for (int64_t j = 0; j < next; ++j) prefetch(ahead[j] + kv_stride + h * row_width);
          for (int64_t r0 = h * group; r0 < (h + 1) * group; r0 += kDecodeRows) {
            const int64_t nr = std::min<int64_t>(kDecodeRows, (h + 1) * group - r0);
            v16 o[kDecodeRows][C];
            for (int u = 0; u < kDecodeRows; ++u)
              for (int c = 0; c < C; ++c) o[u][c] = u < nr ? load_v16(acc.data() + (r0 + u) * D + 16 * c) : v16{};
            for (int64_t j = 0; j < nt; ++j) {
              load_row(tile[j] + kv_stride + h * row_width, vrow.data(), D);
              v16 v[C];
              for (int c = 0; c < C; ++c) v[c] = load_v16(vrow.data() + 16 * c);
              for (int u = 0; u < kDecodeRows; ++u) {
                if (u >= nr) break;
                const v16 w = splat(scores[(r0 + u) * padded + t0 + j]);
                for (int c = 0; c < C; ++c) o[u][c] += w * v[c];
              }
            }
            for (int u = 0; u < nr; ++u)
              for (int c = 0; c < C; ++c) store_v16(acc.data() + (r0 + u) * D + 16 * c, o[u][c]);
          }
        }
        std::copy(ahead, ahead + next, tile);
        nt = next;
      }
      for (int64_t r = 0; r < rows; ++r) {
        q_t* dst = out + (s * num_heads + h0 * group + r) * D;
        for (int d = 0; d < D; ++d) dst[d] = static_cast<q_t>(acc[r * D + d]);
      }
    }
  });
}

// Decode attention: the tiled kernel for the compiled head dims, the per-row one for others.
template <typename kv_t, typename q_t, typename Row>
static void decode_kernel(const q_t* q, const kv_t* kv, const int32_t* block_tables, const int32_t* seq_lens,
                          q_t* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                          int64_t block_size, int64_t max_blocks, float scale, Row load_row, int64_t window = 0) {
  switch (head_dim) {
    case 64:
      return decode_kernel_tiled<64>(q, kv, block_tables, seq_lens, out, num_seqs, num_heads, num_kv_heads,
                                     block_size, max_blocks, scale, load_row, window);
    case 128:
      return decode_kernel_tiled<128>(q, kv, block_tables, seq_lens, out, num_seqs, num_heads, num_kv_heads,
                                      block_size, max_blocks, scale, load_row, window);
    case 256:
      return decode_kernel_tiled<256>(q, kv, block_tables, seq_lens, out, num_seqs, num_heads, num_kv_heads,
                                      block_size, max_blocks, scale, load_row, window);
    default:
      return decode_kernel_rows(q, kv, block_tables, seq_lens, out, num_seqs, num_heads, num_kv_heads, head_dim,
                                block_size, max_blocks, scale, load_row, window);
  }
}

// The same walk with both products on AVX512-BF16's vdpbf16ps (32 bf16 multiplies into 16 float
// sums per instruction, twice float32 FMA's work). Lanes hold 16 query vectors rather than 16 keys:
// each key's bf16 row is broadcast as dim pairs straight from a staged copy of the cache row (no
// transpose), and the online softmax runs down the lanes, 16 vectors at once. V is staged with
// consecutive keys' values interleaved (the pairs p·V sums over). Only q and the softmax weights are
// rounded (K and V are stored in bf16): the rounding torch's bf16 flash SDPA does too.
#if defined(__AVX512BF16__)
constexpr bool kBf16Dot = true;

static inline uint32_t bf16_bits(float x) {  // round to nearest even; inputs are finite
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}

static inline __m512i bf16_pairs(__m512 lo, __m512 hi) {  // lane i: bf16(lo[i]) | bf16(hi[i]) << 16
  const __m512i a = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(lo));
  const __m512i b = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(hi));
  return _mm512_or_si512(a, _mm512_slli_epi32(b, 16));
}

constexpr int64_t kTileB = 32;  // query rows per task

template <int D>
static void prefill_kernel_bf16(const float* q, const uint16_t* kv, const int32_t* block_tables,
                                const int32_t* seq_lens, const int64_t* q_start, float* out, int64_t num_seqs,
                                int64_t num_heads, int64_t num_kv_heads, int64_t block_size, int64_t max_blocks,
                                float scale, int64_t window) {
  constexpr int P = D / 2;                                // dim pairs
  constexpr int C = D / 16;                               // output registers of one query vector
  constexpr int kV = D <= 64 ? 4 : (D <= 128 ? 2 : 1);  // vectors whose outputs stay in registers together
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * D;
  const int64_t kv_stride = block_size * token_stride;
  const int64_t block_stride = 2 * kv_stride;
  const std::vector<PrefillTask> tasks = prefill_tasks(q_start, seq_lens, num_seqs, num_kv_heads, window, kTileB);
  std::atomic<int64_t> next{0};
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  const int64_t lanes = (kTileB * group + 15) / 16 * 16;  // query vectors of one task, padded to whole registers
  static const uint16_t zeros[D] = {};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> qt(lanes / 16 * P * 16), kbuf(kKeys * P), vt(kKeys / 2 * C * 16), wbuf(kKeys / 2 * 16);
    std::vector<float> acc(lanes * D), peak(lanes), total(lanes), shrink(16);
    std::vector<int32_t> pos(lanes);
    const uint16_t* vrow[kKeys];
    for (int64_t worker = begin; worker < end; ++worker) {
      for (int64_t i = next.fetch_add(1); i < num_tasks; i = next.fetch_add(1)) {
        const PrefillTask& t = tasks[i];
        const int64_t n = q_start[t.seq + 1] - q_start[t.seq], base = seq_lens[t.seq] - n;
        const int32_t* table = block_tables + t.seq * max_blocks;
        const int64_t nv = t.rows * group, groups = (nv + 15) / 16;
        // qt[g][m][lane]: dims 2m, 2m+1 of vector 16g + lane (row v / group, head v % group), scaled, as bf16
        for (int64_t v = 0; v < groups * 16; ++v) {
          uint32_t* dst = qt.data() + (v / 16) * P * 16 + v % 16;
          if (v >= nv) {
            for (int m = 0; m < P; ++m) dst[m * 16] = 0;
            pos[v] = -1;  // sees no key
            continue;
          }
          const float* src =
              q + ((q_start[t.seq] + t.row0 + v / group) * num_heads + t.kv_head * group + v % group) * D;
          for (int m = 0; m < P; ++m) dst[m * 16] = bf16_bits(src[2 * m] * scale) | bf16_bits(src[2 * m + 1] * scale) << 16;
          pos[v] = static_cast<int32_t>(base + t.row0 + v / group);
        }
        std::fill(acc.begin(), acc.begin() + groups * 16 * D, 0.f);
        std::fill(peak.begin(), peak.begin() + groups * 16, -INFINITY);
        std::fill(total.begin(), total.begin() + groups * 16, 0.f);
        const int64_t hi = base + t.row0 + t.rows;
        const int64_t lo = window > 0 ? std::max<int64_t>(0, base + t.row0 - window + 1) : 0;
        for (int64_t k0 = lo - lo % kKeys; k0 < hi; k0 += kKeys) {
          for (int64_t j = 0; j < kKeys; ++j) {  // stage the tile's K rows; zeros where no row sees the key
            const int64_t p = k0 + j;
            if (p < lo || p >= hi) {
              std::memset(kbuf.data() + j * P, 0, D * sizeof(uint16_t));
              vrow[j] = zeros;
              continue;
            }
            const uint16_t* k = kv + table[p / block_size] * block_stride + (p % block_size) * token_stride +
                                t.kv_head * D;
            std::memcpy(kbuf.data() + j * P, k, D * sizeof(uint16_t));
            vrow[j] = k + kv_stride;
          }
          for (int64_t jp = 0; jp < kKeys / 2; ++jp) {  // vt[jp][c][i]: dim 16c + i of keys 2jp, 2jp + 1
            for (int c = 0; c < C; ++c) {
              const __m512i a = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(vrow[2 * jp] + 16 * c)));
              const __m512i b = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(vrow[2 * jp + 1] + 16 * c)));
              _mm512_storeu_si512(vt.data() + (jp * C + c) * 16, _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
            }
          }
          for (int64_t g = 0; g < groups; ++g) {
            const int32_t first_pos = pos[g * 16], last_pos = pos[std::min<int64_t>(nv, g * 16 + 16) - 1];
            if (last_pos < k0 || (window > 0 && first_pos - window + 1 >= k0 + kKeys)) continue;  // nothing visible
            __m512 s[kKeys];
            for (int j = 0; j < kKeys; ++j) s[j] = _mm512_setzero_ps();
            const uint32_t* qg = qt.data() + g * P * 16;
            for (int m = 0; m < P; ++m) {
              const __m512bh qm = (__m512bh)_mm512_loadu_si512(qg + m * 16);
              for (int j = 0; j < kKeys; ++j)
                s[j] = _mm512_dpbf16_ps(s[j], qm, (__m512bh)_mm512_set1_epi32(static_cast<int>(kbuf[j * P + m])));
            }
            const __m512i posv = _mm512_loadu_si512(pos.data() + g * 16);
            const __m512i lov = _mm512_sub_epi32(posv, _mm512_set1_epi32(static_cast<int>(window > 0 ? window - 1 : 0)));
            const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
            __m512 tile_peak = neg_inf;
            __mmask16 seen[kKeys];
            for (int j = 0; j < kKeys; ++j) {
              const __m512i p = _mm512_set1_epi32(static_cast<int>(k0 + j));
              seen[j] = _mm512_cmple_epi32_mask(p, posv);
              if (window > 0) seen[j] &= _mm512_cmpge_epi32_mask(p, lov);
              tile_peak = _mm512_max_ps(tile_peak, _mm512_mask_mov_ps(neg_inf, seen[j], s[j]));
            }
            const __m512 old_peak = _mm512_loadu_ps(peak.data() + g * 16);
            const __m512 new_peak = _mm512_max_ps(old_peak, tile_peak);
            _mm512_storeu_ps(peak.data() + g * 16, new_peak);
            // a lane that has seen no key yet subtracts 0 (its weights are masked to 0 anyway)
            const __m512 ref = _mm512_mask_mov_ps(new_peak, _mm512_cmp_ps_mask(new_peak, neg_inf, _CMP_EQ_OQ),
                                                  _mm512_setzero_ps());
            const __m512 shrink_v = (__m512)exp_v16((v16)_mm512_sub_ps(old_peak, ref));  // ~0 where old_peak is -inf
            _mm512_storeu_ps(shrink.data(), shrink_v);
            __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(total.data() + g * 16), shrink_v);
            for (int j = 0; j < kKeys; ++j) {
              s[j] = _mm512_maskz_mov_ps(seen[j], (__m512)exp_v16((v16)_mm512_sub_ps(s[j], ref)));
              sum = _mm512_add_ps(sum, s[j]);
            }
            _mm512_storeu_ps(total.data() + g * 16, sum);
            for (int jp = 0; jp < kKeys / 2; ++jp) _mm512_storeu_si512(wbuf.data() + jp * 16, bf16_pairs(s[2 * jp], s[2 * jp + 1]));
            const int64_t in_group = std::min<int64_t>(16, nv - g * 16);
            for (int64_t u0 = 0; u0 < in_group; u0 += kV) {
              float* a = acc.data() + (g * 16 + u0) * D;
              __m512 r[kV][C];
              for (int u = 0; u < kV; ++u) {
                const __m512 f = _mm512_set1_ps(shrink[u0 + u]);
                for (int c = 0; c < C; ++c) r[u][c] = _mm512_mul_ps(_mm512_loadu_ps(a + u * D + 16 * c), f);
              }
              for (int jp = 0; jp < kKeys / 2; ++jp) {
                for (int c = 0; c < C; ++c) {
                  const __m512bh vc = (__m512bh)_mm512_loadu_si512(vt.data() + (jp * C + c) * 16);
                  for (int u = 0; u < kV; ++u)
                    r[u][c] = _mm512_dpbf16_ps(
                        r[u][c], (__m512bh)_mm512_set1_epi32(static_cast<int>(wbuf[jp * 16 + u0 + u])), vc);
                }
              }
              for (int u = 0; u < kV; ++u)
                for (int c = 0; c < C; ++c) _mm512_storeu_ps(a + u * D + 16 * c, r[u][c]);
            }
          }
        }
        for (int64_t v = 0; v < nv; ++v) {
          float* dst = out + ((q_start[t.seq] + t.row0 + v / group) * num_heads + t.kv_head * group + v % group) * D;
          const float inv = total[v] > 0.f ? 1.f / total[v] : 0.f;
          for (int d = 0; d < D; ++d) dst[d] = acc[v * D + d] * inv;
        }
      }
    }
  });
}
#else
constexpr bool kBf16Dot = false;
#endif
