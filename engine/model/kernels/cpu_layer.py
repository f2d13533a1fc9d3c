"""One decoder layer of a pure-decode CPU step as a single C++ call.

With the weights read as GGUF blocks (cpu_gemv) a single-stream step of
SmolLM2-135M spends ~13 ms in kernels and ~10 ms in dispatch: each of the 30
layers makes about 20 Python -> aten calls (norm, qkv, split, rotary, two cache
writes, attention, o_proj, residual, norm, gate/up, split, SiLU, multiply, down,
residual), ~15 µs each on a 2-core Zen 3. This module runs the same layer,
in the same order and arithmetic, in one call:

    x = rms_norm(h, ln1); qkv = x @ Wqkv (+ b); rotate Q, K; write K, V at the
    slots; a = paged_decode(Q); h += a @ Wo; x = rms_norm(h, ln2);
    h += (silu(x @ Wg) * (x @ Wu)) @ Wd

It is compiled from the cpu_gemv, cpu_norm and cpu_decode sources plus the glue
below, so there is one copy of each kernel's arithmetic. Each projection uses the
GEMV at every size it serves under the kernel plan (which times the layer against the
op-by-op path at each step class and stops it where it loses); with the plan off, for as many
rows as the GEMV wins (``GEMV_MAX_ROWS``, 8 on AVX2) and torch's float32 GEMM (``at::mm_out``,
as ``F.linear``) for more, so a decode batch of up to ``MAX_ROWS`` sequences saves its ~10 ms
of dispatch too. It serves float32 activations with a float32, bf16 or int8 KV cache and
q8_0/q4_1/q4_1x8 projections; any other step takes the layer-by-op path.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch

from engine.model.attention import cpu_decode
from engine.model.kernels import cpu_gemv, cpu_norm
from engine.model.kernels.build import BuildReport, CachedKernel, KernelSpec

KERNEL_ENV = "KVSCOPE_CPU_LAYER_KERNEL"
# Pure-decode steps of up to this many sequences run fused (the scheduler's default
# --max-num-seqs); each projection picks GEMV or float GEMM by rows inside the call.
MAX_ROWS = 256
FORMAT_CODES = {"q8_0": 0, "q4_1": 1, "q4_1x8": 2}
KV_DTYPES = (torch.float32, torch.bfloat16, torch.int8)

_GLUE = r"""
// One projection into y [M, N]: the GEMV over its blocks (fmt 0: q8_0, 1: q4_1, 2: q4_1x8) for at most
// `limit` rows (the kernel plan's: every row the layer serves; the fallback constants': where it wins on
// AVX2); torch's float32 GEMM over `w_float` for more.
static void project(const torch::Tensor& w, int64_t fmt, const torch::Tensor& w_float, int64_t limit,
                    const float* x, int64_t M, int64_t K, float* y) {
  const int64_t N = w.size(0);
  if (M > limit) {
    auto opts = torch::TensorOptions().dtype(torch::kFloat);
    auto xt = torch::from_blob(const_cast<float*>(x), {M, K}, opts);
    auto yt = torch::from_blob(y, {M, N}, opts);
    at::mm_out(yt, xt, w_float.t());
    return;
  }
  if (fmt == 0) {
    TORCH_CHECK(w.size(1) == K / 32 * Q8_0::kBytes, "decode_layer: q8_0 weight width");
    gemv_rows<Q8_0>(w.data_ptr<uint8_t>(), N, K, x, M, y);
  } else if (fmt == 2) {
    TORCH_CHECK(w.size(1) == K / 32 * 20 && N % 8 == 0, "decode_layer: q4_1x8 weight shape");
    gemv_rows_q4_1x8(w.data_ptr<uint8_t>(), N, K, x, M, y);
  } else {
    TORCH_CHECK(w.size(1) == K / 32 * Q4_1::kBytes, "decode_layer: q4_1 weight width");
    gemv_rows<Q4_1>(w.data_ptr<uint8_t>(), N, K, x, M, y);
  }
}

// How the cache stores a K or V element.
enum class KvStore { kFloat, kInt8, kBFloat16 };

// Store one head's K or V row (head_dim floats) in a float32, bf16 (rounded to nearest even, as
// torch's .to(bfloat16)) or int8 cache row.
static inline void store_row(const float* src, void* dst, int64_t D, KvStore kind) {
  if (kind == KvStore::kFloat) {
    std::memcpy(dst, src, D * sizeof(float));
    return;
  }
  if (kind == KvStore::kBFloat16) {
    c10::BFloat16* b = static_cast<c10::BFloat16*>(dst);
    for (int64_t d = 0; d < D; ++d) b[d] = c10::BFloat16(src[d]);
    return;
  }
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(src[d]));
  const float scale = amax / 127.f, inv = scale > 0.f ? 1.f / scale : 0.f;
  int8_t* q = static_cast<int8_t*>(dst);
  for (int64_t d = 0; d < D; ++d) q[d] = (int8_t)std::max(-127.f, std::min(127.f, std::nearbyint(src[d] * inv)));
  std::memcpy(q + D, &scale, sizeof scale);
}

// hidden [M, H] float32 -> the layer's output [M, H]. cos/sin_signed [M, D]: the rotary
// factors (x * cos + roll(x, D/2) * sin_signed). kv_cache [NB, 2, BS, KVH, W] float32 or int8.
// Each projection comes as (blocks, format, float weight, GEMV row limit).
torch::Tensor decode_layer(torch::Tensor hidden, torch::Tensor ln1, torch::Tensor ln2,
                           torch::Tensor w_qkv, int64_t f_qkv, torch::Tensor wf_qkv, int64_t l_qkv,
                           torch::Tensor qkv_bias,
                           torch::Tensor w_o, int64_t f_o, torch::Tensor wf_o, int64_t l_o,
                           torch::Tensor w_gate_up, int64_t f_gate_up, torch::Tensor wf_gate_up, int64_t l_gate_up,
                           torch::Tensor w_down, int64_t f_down, torch::Tensor wf_down, int64_t l_down,
                           torch::Tensor cos, torch::Tensor sin_signed,
                           torch::Tensor kv_cache, torch::Tensor slot_mapping, torch::Tensor block_tables,
                           torch::Tensor seq_lens, int64_t num_heads, int64_t num_kv_heads, double eps,
                           double scale) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == torch::kFloat, "decode_layer: hidden [M, H] float32");
  const bool int8 = kv_cache.scalar_type() == at::ScalarType::Char;
  const bool bf16 = kv_cache.scalar_type() == at::ScalarType::BFloat16;
  TORCH_CHECK(int8 || bf16 || kv_cache.scalar_type() == torch::kFloat,
              "decode_layer: float32, bfloat16 or int8 KV cache");
  const KvStore kind = int8 ? KvStore::kInt8 : bf16 ? KvStore::kBFloat16 : KvStore::kFloat;
  hidden = hidden.contiguous();
  const int64_t M = hidden.size(0), H = hidden.size(1), D = cos.size(-1);
  const int64_t QH = num_heads, KVH = num_kv_heads, NQ = QH * D, NKV = KVH * D, NQKV = NQ + 2 * NKV;
  const int64_t I2 = w_gate_up.size(0), I = I2 / 2;
  const int64_t BS = kv_cache.size(2), W = kv_cache.size(4);
  TORCH_CHECK(kv_cache.size(3) == KVH && W == D + (int8 ? 4 : 0), "decode_layer: kv_cache shape");
  TORCH_CHECK(w_qkv.size(0) == NQKV && w_o.size(0) == H && w_down.size(0) == H, "decode_layer: weight shapes");
  auto opts = hidden.options();
  auto x = torch::empty({M, std::max(H, I)}, opts);
  auto qkv = torch::empty({M, NQKV}, opts);
  auto gu = torch::empty({M, I2}, opts);
  auto out = torch::empty({M, H}, opts);
  float* xp = x.data_ptr<float>();
  float* qkvp = qkv.data_ptr<float>();
  const float* cp = cos.contiguous().data_ptr<float>();
  const float* sp = sin_signed.contiguous().data_ptr<float>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const float e = static_cast<float>(eps);

  rms_rows<float>(hidden.data_ptr<float>(), ln1.data_ptr<float>(), xp, M, H, e);
  project(w_qkv, f_qkv, wf_qkv, l_qkv, xp, M, H, qkvp);
  if (qkv_bias.numel() > 0) {
    const float* b = qkv_bias.data_ptr<float>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < NQKV; ++n) qkvp[m * NQKV + n] += b[n];
  }
  // Rotary on the Q and K heads (they sit side by side), then K and V into the cache.
  std::vector<float> tmp(D);
  char* cache = static_cast<char*>(kv_cache.data_ptr());
  const int64_t elem = int8 ? 1 : bf16 ? 2 : 4, token_stride = KVH * W * elem, kv_stride = BS * token_stride;
  for (int64_t m = 0; m < M; ++m) {
    const float* c = cp + m * D;
    const float* s = sp + m * D;
    for (int64_t h = 0; h < QH + KVH; ++h) {
      float* r = qkvp + m * NQKV + h * D;
      for (int64_t d = 0; d < D; ++d) tmp[d] = r[d] * c[d] + r[(d + D / 2) % D] * s[d];
      std::memcpy(r, tmp.data(), D * sizeof(float));
    }
    const int64_t slot = slots[m];
    if (slot < 0) continue;
    char* k_dst = cache + (slot / BS) * 2 * kv_stride + (slot % BS) * token_stride;
    for (int64_t h = 0; h < KVH; ++h) {
      store_row(qkvp + m * NQKV + NQ + h * D, k_dst + h * W * elem, D, kind);
      store_row(qkvp + m * NQKV + NQ + NKV + h * D, k_dst + kv_stride + h * W * elem, D, kind);
    }
  }
  // Attention over the paged context: the query is Q's slice of each qkv row, copied
  // to [M, QH, D] (the kernel reads rows of num_heads * head_dim).
  auto q = qkv.narrow(1, 0, NQ).contiguous();
  auto attn = torch::empty({M, NQ}, opts);
  auto tables = block_tables.to(torch::kInt32).contiguous();
  auto lens = seq_lens.to(torch::kInt32).contiguous();
  const float sc = static_cast<float>(scale);
  if (int8) {
    decode_kernel<int8_t, float>(q.data_ptr<float>(), kv_cache.data_ptr<int8_t>(), tables.data_ptr<int32_t>(),
                                 lens.data_ptr<int32_t>(), attn.data_ptr<float>(), M, QH, KVH, D, BS,
                                 tables.size(1), sc, Int8Row{});
  } else if (bf16) {
    decode_kernel<c10::BFloat16, float>(q.data_ptr<float>(), kv_cache.data_ptr<c10::BFloat16>(),
                                        tables.data_ptr<int32_t>(), lens.data_ptr<int32_t>(), attn.data_ptr<float>(),
                                        M, QH, KVH, D, BS, tables.size(1), sc, CastRow<c10::BFloat16>{});
  } else {
    decode_kernel<float, float>(q.data_ptr<float>(), kv_cache.data_ptr<float>(), tables.data_ptr<int32_t>(),
                                lens.data_ptr<int32_t>(), attn.data_ptr<float>(), M, QH, KVH, D, BS,
                                tables.size(1), sc, CastRow<float>{});
  }
  float* op = out.data_ptr<float>();
  const float* hp = hidden.data_ptr<float>();
  project(w_o, f_o, wf_o, l_o, attn.data_ptr<float>(), M, NQ, op);
#pragma omp simd
  for (int64_t i = 0; i < M * H; ++i) op[i] += hp[i];
  rms_rows<float>(op, ln2.data_ptr<float>(), xp, M, H, e);
  float* gup = gu.data_ptr<float>();
  project(w_gate_up, f_gate_up, wf_gate_up, l_gate_up, xp, M, H, gup);
  for (int64_t m = 0; m < M; ++m) {  // silu(gate) * up, into x [M, I]
    const float* g = gup + m * I2;
    float* a = xp + m * I;
#pragma omp simd
    for (int64_t i = 0; i < I; ++i) a[i] = g[i] / (1.f + expf(-g[i])) * g[I + i];  // libmvec's vector expf
  }
  auto down = torch::empty({M, H}, opts);
  float* dp = down.data_ptr<float>();
  project(w_down, f_down, wf_down, l_down, xp, M, I, dp);
#pragma omp simd
  for (int64_t i = 0; i < M * H; ++i) op[i] += dp[i];
  return out;
}
"""

SPEC = KernelSpec(
    name="kvscope_cpu_layer",
    source="\n".join([cpu_gemv.SPEC.source, cpu_norm.SPEC.source, cpu_decode.SPEC.source, _GLUE]),
    functions=("decode_layer",),
)
KERNEL = CachedKernel(SPEC, KERNEL_ENV)


def ensure_built(log: Callable[[str], None] | None = None) -> BuildReport | None:
    """Build or load the kernel now (startup's background thread, ``engine build-kernels``)."""
    return KERNEL.ensure_built(log)


def load_kernel() -> ModuleType | None:
    return KERNEL.get()
