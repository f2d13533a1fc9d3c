
// Both prefill entry points' inputs as the kernels read them: float32 query, contiguous cache,
// int32 tables and lengths, int64 row offsets (S + 1 of them, ending at the query's rows).
static void prefill_inputs(torch::Tensor& query, torch::Tensor& kv_cache, torch::Tensor& block_tables,
                           torch::Tensor& seq_lens, torch::Tensor& query_start) {
  query = query.contiguous().to(torch::kFloat);
  kv_cache = kv_cache.contiguous();
  block_tables = block_tables.to(torch::kInt32).contiguous();
  seq_lens = seq_lens.to(torch::kInt32).contiguous();
  query_start = query_start.to(torch::kInt64).contiguous();
  const int64_t S = seq_lens.size(0);
  TORCH_CHECK(query_start.size(0) == S + 1 && query_start[S].item<int64_t>() == query.size(0),
              "query_start: S + 1 offsets ending at the query's rows");
}

// query [T,H,D] (any float dtype; attended in float32), query_start [S+1] int64 (row offsets of each
// sequence's new rows), seq_lens [S] (context including the new rows). Returns float32 [T,H,D].
torch::Tensor paged_prefill(torch::Tensor query, torch::Tensor kv_cache, torch::Tensor block_tables,
                            torch::Tensor seq_lens, torch::Tensor query_start, double scale, torch::Tensor fp8_table,
                            int64_t window) {
  TORCH_CHECK(query.dim() == 3 && kv_cache.dim() == 5, "query [T,H,D], kv_cache [NB,2,BS,KVH,W]");
  const auto kv_type = kv_cache.scalar_type();
  const bool is_int8 = kv_type == at::ScalarType::Char;
  const bool is_fp8 = kv_type == at::ScalarType::Float8_e4m3fn || kv_type == at::ScalarType::Float8_e5m2;
  prefill_inputs(query, kv_cache, block_tables, seq_lens, query_start);
  const int64_t S = seq_lens.size(0), H = query.size(1), D = query.size(2);
  auto out = torch::empty_like(query);
  const int64_t BS = kv_cache.size(2), KVH = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == D + (is_int8 ? 4 : 0), "kv_cache row width does not match the head dim");
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t* starts = query_start.data_ptr<int64_t>();
  const int64_t MB = block_tables.size(1);
  const float sc = static_cast<float>(scale);
  const float* qp = query.data_ptr<float>();
  float* op = out.data_ptr<float>();
  if (is_int8) {
    prefill_for_head_dim<int8_t>(D, qp, kv_cache.data_ptr<int8_t>(), tables, lens, starts, op, S, H, KVH, BS, MB,
                                 sc, Int8Row{}, window);
  } else if (is_fp8) {
    TORCH_CHECK(fp8_table.scalar_type() == at::kFloat && fp8_table.numel() == 256, "fp8_table: 256 floats");
    auto table = fp8_table.contiguous();
    prefill_for_head_dim<uint8_t>(D, qp, static_cast<const uint8_t*>(kv_cache.data_ptr()), tables, lens, starts,
                                  op, S, H, KVH, BS, MB, sc, TableRow{table.data_ptr<float>()}, window);
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, kv_type, "paged_prefill", [&] {
      prefill_for_head_dim<scalar_t>(D, qp, kv_cache.data_ptr<scalar_t>(), tables, lens, starts, op, S, H, KVH, BS,
                                     MB, sc, CastRow<scalar_t>{}, window);
    });
  }
  return out;
}

// paged_prefill with vdpbf16ps over a bf16 cache (above); only where the compiler targets AVX512-BF16.
torch::Tensor paged_prefill_bf16(torch::Tensor query, torch::Tensor kv_cache, torch::Tensor block_tables,
                                 torch::Tensor seq_lens, torch::Tensor query_start, double scale, int64_t window) {
#if defined(__AVX512BF16__)
  TORCH_CHECK(query.dim() == 3 && kv_cache.dim() == 5, "query [T,H,D], kv_cache [NB,2,BS,KVH,D]");
  TORCH_CHECK(kv_cache.scalar_type() == at::kBFloat16, "paged_prefill_bf16 reads a bf16 cache");
  prefill_inputs(query, kv_cache, block_tables, seq_lens, query_start);
  const int64_t S = seq_lens.size(0), H = query.size(1), D = query.size(2);
  TORCH_CHECK(kv_cache.size(4) == D, "kv_cache row width does not match the head dim");
  auto out = torch::empty_like(query);
  const int64_t BS = kv_cache.size(2), KVH = kv_cache.size(3), MB = block_tables.size(1);
  const auto* kv = reinterpret_cast<const uint16_t*>(kv_cache.data_ptr<at::BFloat16>());
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t* starts = query_start.data_ptr<int64_t>();
  const float sc = static_cast<float>(scale);
  const float* qp = query.data_ptr<float>();
  float* op = out.data_ptr<float>();
  switch (D) {
    case 64: prefill_kernel_bf16<64>(qp, kv, tables, lens, starts, op, S, H, KVH, BS, MB, sc, window); break;
    case 128: prefill_kernel_bf16<128>(qp, kv, tables, lens, starts, op, S, H, KVH, BS, MB, sc, window); break;
    case 256: prefill_kernel_bf16<256>(qp, kv, tables, lens, starts, op, S, H, KVH, BS, MB, sc, window); break;
    default: TORCH_CHECK(false, "paged_prefill_bf16: head dim ", D, " is not compiled in (64, 128, 256)");
  }
  return out;
#else
  TORCH_CHECK(false, "paged_prefill_bf16: built without AVX512-BF16");
  return query;
#endif
}

bool has_bf16_dot() { return kBf16Dot; }

// kv_cache: float32/bf16/fp16 [NB,2,BS,KVH,D] (query is cast to it); int8 [NB,2,BS,KVH,D+4] with an fp32
// scale per row; fp8 e4m3/e5m2 [NB,2,BS,KVH,D] decoded through fp8_table (256 floats). Quantized caches
// keep the query's dtype for the query and the output.
torch::Tensor paged_decode(torch::Tensor query, torch::Tensor kv_cache, torch::Tensor block_tables,
                           torch::Tensor seq_lens, double scale, torch::Tensor fp8_table, int64_t window) {
  TORCH_CHECK(query.dim() == 3 && kv_cache.dim() == 5, "query [S,H,D], kv_cache [NB,2,BS,KVH,W]");
  const auto kv_type = kv_cache.scalar_type();
  const bool is_int8 = kv_type == at::ScalarType::Char;
  const bool is_fp8 = kv_type == at::ScalarType::Float8_e4m3fn || kv_type == at::ScalarType::Float8_e5m2;
  // A float32 query over a bf16/fp16 cache stays float32 (the CPU default under --dtype auto where bf16
  // is native): only K and V are rounded, as they were when stored.
  const bool float_query = query.scalar_type() == at::kFloat;
  query = (is_int8 || is_fp8 || float_query) ? query.contiguous() : query.contiguous().to(kv_type);
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
  } else if (float_query) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, kv_type, "paged_decode_f32q", [&] {
      decode_kernel<scalar_t, float>(query.data_ptr<float>(), kv_cache.data_ptr<scalar_t>(), tables, lens,
                                     out.data_ptr<float>(), S, H, KVH, D, BS, MB, sc, CastRow<scalar_t>{}, window);
    });
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, kv_type, "paged_decode", [&] {
      decode_kernel<scalar_t, scalar_t>(query.data_ptr<scalar_t>(), kv_cache.data_ptr<scalar_t>(), tables, lens,
                                        out.data_ptr<scalar_t>(), S, H, KVH, D, BS, MB, sc, CastRow<scalar_t>{}, window);
    });
  }
  return out;
}
