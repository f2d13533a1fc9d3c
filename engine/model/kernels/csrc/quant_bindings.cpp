
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

// passes 2: x's remainder after its int8 rounding is rounded and multiplied again (~15-bit activations),
// for a single row (kTwoPassMaxRows); more rows round once.
torch::Tensor quant_matmul_segments(torch::Tensor x, std::vector<torch::Tensor> ws, std::vector<int64_t> fmts,
                                    int64_t passes) {
  const char* fn = "quant_matmul_segments";
  TORCH_CHECK(ws.size() == fmts.size() && !ws.empty(), fn, ": need one format per weight (", ws.size(), " weights, ",
              fmts.size(), " formats)");
  TORCH_CHECK(passes == 1 || passes == 2, fn, ": passes is 1 or 2, got ", passes);
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
  kq::quantize_acts(xf.data_ptr<float>(), M, K, K, a, passes);
  kq::matmul_segments(seg.data(), (int)seg.size(), a, y.data_ptr<float>(), col);
  return y;
}

torch::Tensor quant_matmul(torch::Tensor x, torch::Tensor w, int64_t fmt) {
  return quant_matmul_segments(x, {w}, {fmt}, 1);
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
      const int64_t g = kb / kq::kGroupBlocks, k = kb % kq::kGroupBlocks;
      for (int i = 0; i < 32; ++i) qp[r * K + kb * 32 + i] = a.qg(g, r)[kq::act_pos(k, i)];
      dp[r * (K / 32) + kb] = a.dg(g, r)[k];
    }
  return {q, d};
}

std::string isa() { return kq::isa_name(); }
