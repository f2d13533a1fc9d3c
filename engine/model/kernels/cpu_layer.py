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

``decode_layer_gemma3`` is Gemma 3's layer from the same pieces: Q and K RMS-normed per
head before the rotation, the attention output and the MLP output each RMS-normed
before their residual adds, a pre-MLP norm, GELU(tanh) for SiLU, and a sliding-window
bound on the attention (``window`` > 0: a layer sees its last ``window`` positions).

It is compiled from the cpu_gemv, cpu_norm, cpu_decode and cpu_quant (its ``CORE_SOURCE``)
sources plus the glue below, so there is one copy of each kernel's arithmetic. A projection
is a list of row segments, each a block tensor and a format code, multiplied as the op-by-op
path multiplies it (engine/model/layers/quantized_linear.py ``bind_kernels``): one q8_0/q4_1/q4_1x8
tensor through cpu_gemv's GEMV (codes below ``QUANT_CODE_BASE``), any other (a K-quant, or a
fused QKV whose Q/K are Q5_0 and V Q8_0) through cpu_quant's segments, the input rounded to
int8 once per projection (codes ``QUANT_CODE_BASE`` + the ggml type id; ``TWO_PASS_CODE_BASE`` + the id
where the projection rounds its input twice). Each projection uses
the GEMV at every size it serves under the kernel plan (which times the layer against the
op-by-op path at each step class and stops it where it loses); with the plan off, for as many
rows as the GEMV wins (``GEMV_MAX_ROWS``, 8 on AVX2) and torch's float32 GEMM (``at::mm_out``,
as ``F.linear``) for more, so a decode batch of up to ``MAX_ROWS`` sequences saves its ~10 ms
of dispatch too. It serves float32 activations with a float32, bf16 or int8 KV cache; any
other step takes the layer-by-op path.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from engine.model.attention import cpu_decode
from engine.model.kernels import cpu_gemv, cpu_norm, cpu_quant
from engine.model.kernels.build import BuildReport, CachedKernel, KernelSpec

if TYPE_CHECKING:
    from engine.model.layers.quantized_linear import QuantizedLinear

KERNEL_ENV = "KVSCOPE_CPU_LAYER_KERNEL"
# Pure-decode steps of up to this many sequences run fused (the scheduler's default
# --max-num-seqs); each projection picks GEMV or float GEMM by rows inside the call.
MAX_ROWS = 256
# cpu_gemv's formats: one block tensor, float32 activations (the GEMV module's codes).
FORMAT_CODES = {"q8_0": 0, "q4_1": 1, "q4_1x8": 2}
# cpu_quant's formats are this plus ggml's type id (q4_k: 112), so the C++ tells the two apart;
# from TWO_PASS_CODE_BASE the same formats with the input rounded twice (QuantizedLinear.activation_passes).
QUANT_CODE_BASE = 100
TWO_PASS_CODE_BASE = 200
KV_DTYPES = (torch.float32, torch.bfloat16, torch.int8)
# (segment blocks, format codes, float weight past the GEMV limit, GEMV row limit): one projection's arguments.
ProjectionArgs = tuple[list[torch.Tensor], list[int], torch.Tensor, int]

_GLUE = r"""
namespace kq = kvscope_quant;

// Format codes below kQuantBase: cpu_gemv's (one tensor); from it: kQuantBase + a ggml type id (cpu_quant);
// from kTwoPassBase: the same with the input's remainder rounded and multiplied again (two int8 passes).
constexpr int64_t kQuantBase = 100, kTwoPassBase = 200;

// One projection: its row segments (blocks, format codes), the float weight and the GEMV row limit.
struct Proj {
  const std::vector<torch::Tensor>& w;
  const std::vector<int64_t>& fmt;
  const torch::Tensor& w_float;
  int64_t limit;
};

// cpu_gemv's GEMV (fmt 0: q8_0, 1: q4_1, 2: q4_1x8) over one tensor, float32 activations.
static void gemv_project(const torch::Tensor& w, int64_t fmt, const float* x, int64_t M, int64_t K, float* y) {
  const int64_t N = w.size(0);
  if (fmt == 0) {
    TORCH_CHECK(w.size(1) == K / 32 * Q8_0::kBytes, "decode_layer: q8_0 weight width");
    gemv_rows<Q8_0>(w.data_ptr<uint8_t>(), N, K, x, M, y);
  } else if (fmt == 2) {
    TORCH_CHECK(w.size(1) == K / 32 * 20 && N % 8 == 0, "decode_layer: q4_1x8 weight shape");
    gemv_rows_q4_1x8(w.data_ptr<uint8_t>(), N, K, x, M, y);
  } else {
    TORCH_CHECK(fmt == 1 && w.size(1) == K / 32 * Q4_1::kBytes, "decode_layer: q4_1 weight width");
    gemv_rows<Q4_1>(w.data_ptr<uint8_t>(), N, K, x, M, y);
  }
}

// cpu_quant's segments side by side in y [M, N]: x rounded to int8 once for all of them (the
// op-by-op path's quant_matmul_segments).
static void quant_project(const Proj& p, const float* x, int64_t M, int64_t K, int64_t N, float* y) {
  std::vector<kq::Segment> seg;
  int64_t col = 0;
  const int64_t base = p.fmt[0] >= kTwoPassBase ? kTwoPassBase : kQuantBase;
  for (size_t i = 0; i < p.w.size(); ++i) {
    TORCH_CHECK(p.fmt[i] >= base && p.fmt[i] < base + 100, "decode_layer: segment ", i, " format code ", p.fmt[i],
                " is not in its projection's pass range (", base, " + a ggml type id)");
    const int fmt = static_cast<int>(p.fmt[i] - base);
    const kq::Geometry g = kq::geometry(fmt);
    TORCH_CHECK(g.weights > 0 && K % g.weights == 0 && p.w[i].size(1) == K / g.weights * g.bytes &&
                    p.w[i].is_contiguous(), "decode_layer: segment ", i, " (format code ", p.fmt[i],
                ") does not fit ", K, " in-features");
    seg.push_back({p.w[i].data_ptr<uint8_t>(), fmt, p.w[i].size(0), col});
    col += p.w[i].size(0);
  }
  TORCH_CHECK(col == N, "decode_layer: segments of ", col, " rows for ", N, " outputs");
  static thread_local kq::QuantActs acts;  // its buffers are reused from call to call
  kq::quantize_acts(x, M, K, K, acts, base == kTwoPassBase ? 2 : 1);
  kq::matmul_segments(seg.data(), static_cast<int>(seg.size()), acts, y, N);
}

// x [M, K] -> y [M, N]: the blocks for at most `limit` rows (the kernel plan's: every row the layer
// serves; the fallback constants': where the GEMV wins on AVX2), torch's float32 GEMM for more.
static void project(const Proj& p, const float* x, int64_t M, int64_t K, int64_t N, float* y) {
  TORCH_CHECK(!p.w.empty() && p.w.size() == p.fmt.size(), "decode_layer: one format code per segment");
  if (M > p.limit) {
    auto opts = torch::TensorOptions().dtype(torch::kFloat);
    auto xt = torch::from_blob(const_cast<float*>(x), {M, K}, opts);
    auto yt = torch::from_blob(y, {M, N}, opts);
    at::mm_out(yt, xt, p.w_float.t());
    return;
  }
  if (p.fmt[0] >= kQuantBase) return quant_project(p, x, M, K, N, y);
  TORCH_CHECK(p.w.size() == 1 && p.w[0].size(0) == N, "decode_layer: a GEMV format is one tensor of ", N, " rows");
  gemv_project(p.w[0], p.fmt[0], x, M, K, y);
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

// A layer's head counts and widths (a qkv row: Q heads, K heads, V heads).
struct Heads {
  int64_t QH, KVH, D, NQ, NKV, NQKV;
  Heads(int64_t qh, int64_t kvh, int64_t d) : QH(qh), KVH(kvh), D(d), NQ(qh * d), NKV(kvh * d), NQKV(qh * d + 2 * kvh * d) {}
};

// The paged cache [NB, 2, BS, KVH, W]: float32, bf16 or int8 (W = D + 4: the row's scale after it).
struct KvCache {
  KvStore kind;
  char* base;
  int64_t elem, W, token_stride, kv_stride, BS;
};

static KvCache kv_view(const torch::Tensor& kv_cache, const Heads& h) {
  const auto st = kv_cache.scalar_type();
  TORCH_CHECK(st == torch::kFloat || st == at::ScalarType::BFloat16 || st == at::ScalarType::Char,
              "decode_layer: float32, bfloat16 or int8 KV cache");
  const KvStore kind = st == at::ScalarType::Char ? KvStore::kInt8
                       : st == at::ScalarType::BFloat16 ? KvStore::kBFloat16 : KvStore::kFloat;
  const int64_t elem = kind == KvStore::kInt8 ? 1 : kind == KvStore::kBFloat16 ? 2 : 4;
  const int64_t W = kv_cache.size(4), BS = kv_cache.size(2);
  TORCH_CHECK(kv_cache.size(3) == h.KVH && W == h.D + (kind == KvStore::kInt8 ? 4 : 0), "decode_layer: kv_cache shape");
  const int64_t token_stride = h.KVH * W * elem;
  return {kind, static_cast<char*>(kv_cache.data_ptr()), elem, W, token_stride, BS * token_stride, BS};
}

// Rotary on each row's Q and K heads (side by side: x * cos + roll(x, D/2) * sin_signed), then K and
// V into the cache at the row's slot (a negative slot: padding, not stored).
static void rotate_and_store(float* qkv, int64_t M, const Heads& h, const torch::Tensor& cos,
                             const torch::Tensor& sin_signed, const KvCache& kv, const torch::Tensor& slot_mapping) {
  TORCH_CHECK(cos.size(-1) == h.D && slot_mapping.scalar_type() == torch::kLong, "decode_layer: rotary / slots");
  auto cc = cos.contiguous(), sc = sin_signed.contiguous();
  const float* cp = cc.data_ptr<float>();
  const float* sp = sc.data_ptr<float>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t D = h.D;
  std::vector<float> tmp(D);
  for (int64_t m = 0; m < M; ++m) {
    const float* c = cp + m * D;
    const float* s = sp + m * D;
    for (int64_t hd = 0; hd < h.QH + h.KVH; ++hd) {
      float* r = qkv + m * h.NQKV + hd * D;
      for (int64_t d = 0; d < D; ++d) tmp[d] = r[d] * c[d] + r[(d + D / 2) % D] * s[d];
      std::memcpy(r, tmp.data(), D * sizeof(float));
    }
    const int64_t slot = slots[m];
    if (slot < 0) continue;
    char* k_dst = kv.base + (slot / kv.BS) * 2 * kv.kv_stride + (slot % kv.BS) * kv.token_stride;
    for (int64_t hd = 0; hd < h.KVH; ++hd) {
      store_row(qkv + m * h.NQKV + h.NQ + hd * D, k_dst + hd * kv.W * kv.elem, D, kv.kind);
      store_row(qkv + m * h.NQKV + h.NQ + h.NKV + hd * D, k_dst + kv.kv_stride + hd * kv.W * kv.elem, D, kv.kind);
    }
  }
}

// Attention of each row's Q (qkv's first NQ columns) over its sequence's paged context -> [M, NQ];
// window > 0: only the last `window` positions (a sliding-window layer).
static torch::Tensor attend(const torch::Tensor& qkv, const Heads& h, const torch::Tensor& kv_cache,
                            const KvCache& kv, const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                            double scale, int64_t window) {
  const int64_t M = qkv.size(0);
  auto q = qkv.narrow(1, 0, h.NQ).contiguous();  // the kernel reads rows of num_heads * head_dim
  auto attn = torch::empty({M, h.NQ}, qkv.options());
  auto tables = block_tables.to(torch::kInt32).contiguous();
  auto lens = seq_lens.to(torch::kInt32).contiguous();
  const float sc = static_cast<float>(scale);
  const float* qp = q.data_ptr<float>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  float* ap = attn.data_ptr<float>();
  const int64_t MB = tables.size(1);
  if (kv.kind == KvStore::kInt8) {
    decode_kernel<int8_t, float>(qp, kv_cache.data_ptr<int8_t>(), tp, lp, ap, M, h.QH, h.KVH, h.D, kv.BS, MB, sc,
                                 Int8Row{}, window);
  } else if (kv.kind == KvStore::kBFloat16) {
    decode_kernel<c10::BFloat16, float>(qp, kv_cache.data_ptr<c10::BFloat16>(), tp, lp, ap, M, h.QH, h.KVH, h.D,
                                        kv.BS, MB, sc, CastRow<c10::BFloat16>{}, window);
  } else {
    decode_kernel<float, float>(qp, kv_cache.data_ptr<float>(), tp, lp, ap, M, h.QH, h.KVH, h.D, kv.BS, MB, sc,
                                CastRow<float>{}, window);
  }
  return attn;
}

// out[i] += add[i] over n floats (a residual).
static inline void add_into(float* out, const float* add, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] += add[i];
}

// act [M, I] = f(gate) * up of gu [M, 2I]: SiLU (Llama) or GELU with the tanh approximation (Gemma).
static void gated_activation(const float* gu, int64_t M, int64_t I, bool gelu, float* act) {
  const float k_beta = 0.7978845608028654f, k_kappa = 0.044715f;  // sqrt(2 / pi), as torch's gelu(tanh)
  for (int64_t m = 0; m < M; ++m) {
    const float* g = gu + m * 2 * I;
    float* a = act + m * I;
    if (gelu) {
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) {
        const float x = g[i];
        a[i] = 0.5f * x * (1.f + tanhf(k_beta * (x + k_kappa * x * x * x))) * g[I + i];
      }
    } else {
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) a[i] = g[i] / (1.f + expf(-g[i])) * g[I + i];  // libmvec's vector expf
    }
  }
}

// What both layer calls set up: hidden checked and made contiguous, the heads, the cache view, and the
// buffers the layer writes: x (a normed row, then the MLP's activation), qkv, gu (gate and up side by
// side), out (the layer's output) and proj (the O or down projection before its residual).
struct LayerBuffers {
  torch::Tensor hidden;
  Heads h;
  int64_t M, H, I2, I;
  KvCache kv;
  torch::Tensor x, qkv, gu, out, proj;
};

static LayerBuffers layer_buffers(const char* fn, const torch::Tensor& hidden, int64_t num_heads,
                                  int64_t num_kv_heads, const torch::Tensor& cos, const torch::Tensor& wf_gate_up,
                                  const torch::Tensor& kv_cache) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == torch::kFloat, fn, ": hidden [M, H] float32");
  auto in = hidden.contiguous();
  const Heads h(num_heads, num_kv_heads, cos.size(-1));
  const int64_t M = in.size(0), H = in.size(1), I2 = wf_gate_up.size(0), I = I2 / 2;
  const KvCache kv = kv_view(kv_cache, h);
  auto opts = in.options();
  return {in, h, M, H, I2, I, kv, torch::empty({M, std::max(H, I)}, opts), torch::empty({M, h.NQKV}, opts),
          torch::empty({M, I2}, opts), torch::empty({M, H}, opts), torch::empty({M, H}, opts)};
}

// hidden [M, H] float32 -> the layer's output [M, H]. cos/sin_signed [M, D]: the rotary
// factors (x * cos + roll(x, D/2) * sin_signed). kv_cache [NB, 2, BS, KVH, W] float32, bf16 or int8.
// Each projection comes as (segment blocks, format codes, float weight, GEMV row limit).
torch::Tensor decode_layer(torch::Tensor hidden, torch::Tensor ln1, torch::Tensor ln2,
                           std::vector<torch::Tensor> w_qkv, std::vector<int64_t> f_qkv, torch::Tensor wf_qkv,
                           int64_t l_qkv, torch::Tensor qkv_bias,
                           std::vector<torch::Tensor> w_o, std::vector<int64_t> f_o, torch::Tensor wf_o, int64_t l_o,
                           std::vector<torch::Tensor> w_gate_up, std::vector<int64_t> f_gate_up,
                           torch::Tensor wf_gate_up, int64_t l_gate_up,
                           std::vector<torch::Tensor> w_down, std::vector<int64_t> f_down, torch::Tensor wf_down,
                           int64_t l_down,
                           torch::Tensor cos, torch::Tensor sin_signed,
                           torch::Tensor kv_cache, torch::Tensor slot_mapping, torch::Tensor block_tables,
                           torch::Tensor seq_lens, int64_t num_heads, int64_t num_kv_heads, double eps,
                           double scale, int64_t window) {
  const LayerBuffers b = layer_buffers("decode_layer", hidden, num_heads, num_kv_heads, cos, wf_gate_up, kv_cache);
  const Heads& h = b.h;
  const int64_t M = b.M, H = b.H, I2 = b.I2, I = b.I;
  float* xp = b.x.data_ptr<float>();
  float* qkvp = b.qkv.data_ptr<float>();
  float* op = b.out.data_ptr<float>();
  float* pp = b.proj.data_ptr<float>();
  const float e = static_cast<float>(eps);

  rms_rows<float>(b.hidden.data_ptr<float>(), ln1.data_ptr<float>(), xp, M, H, e);
  project({w_qkv, f_qkv, wf_qkv, l_qkv}, xp, M, H, h.NQKV, qkvp);
  if (qkv_bias.numel() > 0) {
    const float* b = qkv_bias.data_ptr<float>();
    for (int64_t m = 0; m < M; ++m) add_into(qkvp + m * h.NQKV, b, h.NQKV);
  }
  rotate_and_store(qkvp, M, h, cos, sin_signed, b.kv, slot_mapping);
  auto attn = attend(b.qkv, h, kv_cache, b.kv, block_tables, seq_lens, scale, window);
  project({w_o, f_o, wf_o, l_o}, attn.data_ptr<float>(), M, h.NQ, H, op);
  add_into(op, b.hidden.data_ptr<float>(), M * H);
  rms_rows<float>(op, ln2.data_ptr<float>(), xp, M, H, e);
  float* gup = b.gu.data_ptr<float>();
  project({w_gate_up, f_gate_up, wf_gate_up, l_gate_up}, xp, M, H, I2, gup);
  gated_activation(gup, M, I, false, xp);
  project({w_down, f_down, wf_down, l_down}, xp, M, I, H, pp);
  add_into(op, pp, M * H);
  return b.out;
}

// Gemma 3's layer: as decode_layer, with Q and K RMS-normed per head (q_norm / k_norm) before the
// rotation, the attention output normed (ln_post_attn) before its residual, ln_pre_ff before the
// MLP, GELU(tanh) as the gate, and the MLP output normed (ln_post_ff) before its residual.
torch::Tensor decode_layer_gemma3(torch::Tensor hidden, torch::Tensor ln_in, torch::Tensor ln_post_attn,
                                  torch::Tensor ln_pre_ff, torch::Tensor ln_post_ff, torch::Tensor q_norm,
                                  torch::Tensor k_norm,
                                  std::vector<torch::Tensor> w_qkv, std::vector<int64_t> f_qkv, torch::Tensor wf_qkv,
                                  int64_t l_qkv,
                                  std::vector<torch::Tensor> w_o, std::vector<int64_t> f_o, torch::Tensor wf_o,
                                  int64_t l_o,
                                  std::vector<torch::Tensor> w_gate_up, std::vector<int64_t> f_gate_up,
                                  torch::Tensor wf_gate_up, int64_t l_gate_up,
                                  std::vector<torch::Tensor> w_down, std::vector<int64_t> f_down,
                                  torch::Tensor wf_down, int64_t l_down,
                                  torch::Tensor cos, torch::Tensor sin_signed,
                                  torch::Tensor kv_cache, torch::Tensor slot_mapping, torch::Tensor block_tables,
                                  torch::Tensor seq_lens, int64_t num_heads, int64_t num_kv_heads, double eps,
                                  double scale, int64_t window) {
  const LayerBuffers b = layer_buffers("decode_layer_gemma3", hidden, num_heads, num_kv_heads, cos, wf_gate_up,
                                       kv_cache);
  const Heads& h = b.h;
  TORCH_CHECK(q_norm.numel() == h.D && k_norm.numel() == h.D, "decode_layer_gemma3: q_norm / k_norm width");
  const int64_t M = b.M, H = b.H, I2 = b.I2, I = b.I;
  float* xp = b.x.data_ptr<float>();
  float* qkvp = b.qkv.data_ptr<float>();
  float* op = b.out.data_ptr<float>();
  float* pp = b.proj.data_ptr<float>();
  const float e = static_cast<float>(eps);

  rms_rows<float>(b.hidden.data_ptr<float>(), ln_in.data_ptr<float>(), xp, M, H, e);
  project({w_qkv, f_qkv, wf_qkv, l_qkv}, xp, M, H, h.NQKV, qkvp);
  for (int64_t m = 0; m < M; ++m) {  // QK-norm in place: each Q head, then each K head (rows of D)
    float* row = qkvp + m * h.NQKV;
    rms_rows<float>(row, q_norm.data_ptr<float>(), row, h.QH, h.D, e);
    rms_rows<float>(row + h.NQ, k_norm.data_ptr<float>(), row + h.NQ, h.KVH, h.D, e);
  }
  rotate_and_store(qkvp, M, h, cos, sin_signed, b.kv, slot_mapping);
  auto attn = attend(b.qkv, h, kv_cache, b.kv, block_tables, seq_lens, scale, window);
  project({w_o, f_o, wf_o, l_o}, attn.data_ptr<float>(), M, h.NQ, H, pp);
  rms_rows<float>(pp, ln_post_attn.data_ptr<float>(), op, M, H, e);
  add_into(op, b.hidden.data_ptr<float>(), M * H);
  rms_rows<float>(op, ln_pre_ff.data_ptr<float>(), xp, M, H, e);
  float* gup = b.gu.data_ptr<float>();
  project({w_gate_up, f_gate_up, wf_gate_up, l_gate_up}, xp, M, H, I2, gup);
  gated_activation(gup, M, I, true, xp);
  project({w_down, f_down, wf_down, l_down}, xp, M, I, H, pp);
  rms_rows<float>(pp, ln_post_ff.data_ptr<float>(), pp, M, H, e);
  add_into(op, pp, M * H);
  return b.out;
}
"""

SPEC = KernelSpec(
    name="kvscope_cpu_layer",
    source="\n".join([cpu_gemv.SPEC.source, cpu_norm.SPEC.source, cpu_decode.SPEC.source, cpu_quant.CORE_SOURCE,
                      _GLUE]),
    functions=("decode_layer", "decode_layer_gemma3"),
)
KERNEL = CachedKernel(SPEC, KERNEL_ENV)


def ensure_built(log: Callable[[str], None] | None = None) -> BuildReport | None:
    """Build or load the kernel now (startup's background thread, ``engine build-kernels``)."""
    return KERNEL.ensure_built(log)


def load_kernel() -> ModuleType | None:
    return KERNEL.get()


def segment_codes(q: QuantizedLinear) -> list[int] | None:
    """The format code of each of ``q``'s parts, as the op-by-op path multiplies them
    (``bind_kernels``): the GEMV module's for one q8_0/q4_1/q4_1x8 part where it is bound,
    cpu_quant's (int8 activations) for the rest; None for a format neither kernel reads."""
    gemv_kernel, _ = q.kernels
    if len(q.parts) == 1 and q.fmt in FORMAT_CODES and gemv_kernel is not None:
        return [FORMAT_CODES[q.fmt]]
    if any(p.fmt not in cpu_quant.FORMAT_IDS for p in q.parts):
        return None
    base = TWO_PASS_CODE_BASE if q.activation_passes == 2 else QUANT_CODE_BASE
    return [base + cpu_quant.FORMAT_IDS[p.fmt] for p in q.parts]


def projection_args(q: QuantizedLinear | None, weight: torch.Tensor) -> ProjectionArgs | None:
    """One projection's arguments to the layer call (its blocks, their codes, ``weight`` for steps
    past the GEMV limit, that limit), or None where ``q`` has no bound kernel."""
    if q is None or q.gemv is None:
        return None
    codes = segment_codes(q)
    if codes is None:
        return None
    return [p.blocks for p in q.parts], codes, weight, q.max_rows
