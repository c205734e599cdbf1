// CUDA PLE kernels against their CPU twins on the same inputs: n-gram ids with the history slots
// (ragged batches, fresh and continuing sequences, q_len 0, slot -1, verify steps that only read),
// the row gather from a device table and from pinned host memory (zero-copy), and the fused gating.
// Ids, histories and gathered rows are exact copies: compared bit for bit. Outputs start as NaN / -1.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "cuda/cuda_test_helpers.h"
#include "kernels/causal_conv1d.h"
#include "kernels/kernel_helpers.h"
#include "kernels/ple_gate.h"
#include "kernels/ple_gather.h"
#include "kernels/ple_ngram.h"
#include "runtime/buffer.h"
#include "runtime/device.h"

namespace metrale {
namespace {

using testing::Random;
using testing::to_device;
using testing::to_host;

template <typename T>
OwnedTensor host_tensor(const std::vector<T>& values, DType dtype, Shape shape) {
  OwnedTensor t(dtype, shape);
  if (!values.empty()) std::memcpy(t->data(), values.data(), values.size() * sizeof(T));
  return t;
}

template <typename T>
std::vector<T> values_of(const Tensor& host) {
  std::vector<T> values(static_cast<size_t>(host.numel()));
  if (!values.empty()) std::memcpy(values.data(), host.data(), values.size() * sizeof(T));
  return values;
}

// ---- ple_ngram_ids ----

struct IdCase {
  int n_max, hpn;
  std::vector<std::pair<int32_t, int32_t>> seqs;  // (q_len, ctx)
  int no_slot_every = 0;                          // > 0: every n-th sequence has slot -1
  bool write = true;
};

void check_ids(const IdCase& c, uint64_t seed) {
  SCOPED_TRACE(::testing::Message() << "n_max " << c.n_max << " sequences " << c.seqs.size() << " write " << c.write);
  Random rng(seed);
  const int64_t vocab = 5000, eos = 17, context = c.n_max - 1;
  const int64_t heads = static_cast<int64_t>(c.n_max - 1) * c.hpn;
  std::vector<int32_t> cu{0}, lens, slots, tokens;
  const auto num_slots = static_cast<int32_t>(c.seqs.size() + 3);
  std::vector<int32_t> order(static_cast<size_t>(num_slots));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937_64(seed));
  for (size_t s = 0; s < c.seqs.size(); ++s) {
    const auto [q_len, ctx] = c.seqs[s];
    for (int32_t i = 0; i < q_len; ++i)
      tokens.push_back(static_cast<int32_t>(rng.integer(0, 6) == 0 ? eos : rng.integer(0, vocab - 1)));
    cu.push_back(static_cast<int32_t>(tokens.size()));
    lens.push_back(ctx + q_len);
    const bool no_slot = c.no_slot_every > 0 && static_cast<int>(s) % c.no_slot_every == c.no_slot_every - 1;
    slots.push_back(no_slot ? -1 : order[s]);
  }
  std::vector<int64_t> history(static_cast<size_t>(num_slots * context));
  for (auto& h : history) h = rng.integer(0, 3) == 0 ? eos : rng.integer(0, vocab - 1);
  const std::vector<int64_t> multipliers = kernels::ple_layer_multipliers(vocab, c.n_max, 2, 99);
  const kernels::PleHeadTable table = kernels::ple_head_table(20000000, heads, 2, 128);
  const auto T = static_cast<int64_t>(tokens.size()), S = static_cast<int64_t>(lens.size());

  const OwnedTensor tok = host_tensor(tokens, DType::kI32, {T}), cu_t = host_tensor(cu, DType::kI32, {S + 1}),
                    lens_t = host_tensor(lens, DType::kI32, {S}), slots_t = host_tensor(slots, DType::kI32, {S}),
                    mult_t = host_tensor(multipliers, DType::kI64, {c.n_max}),
                    sizes_t = host_tensor(table.sizes, DType::kI64, {heads}),
                    offsets_t = host_tensor(table.offsets, DType::kI64, {heads});
  const OwnedTensor hist_cpu = host_tensor(history, DType::kI64, {num_slots, context});
  const OwnedTensor ids_cpu =
      host_tensor(std::vector<int64_t>(static_cast<size_t>(T * heads), -1), DType::kI64, {T, heads});
  const OwnedTensor hist_dev = to_device(*hist_cpu), ids_dev = to_device(*ids_cpu);
  kernels::PleNgramParams params;
  params.eos_token_id = eos;
  params.ngram_size = c.n_max;
  params.heads_per_ngram = c.hpn;
  params.write_history = c.write;
  kernels::ple_ngram_ids(*to_device(*tok), *hist_dev, *to_device(*cu_t), *to_device(*lens_t), *to_device(*slots_t),
                         *to_device(*mult_t), *to_device(*sizes_t), *to_device(*offsets_t), *ids_dev, params);
  kernels::ple_ngram_ids(*tok, *hist_cpu, *cu_t, *lens_t, *slots_t, *mult_t, *sizes_t, *offsets_t, *ids_cpu, params);
  const std::vector<int64_t> ids_gpu = values_of<int64_t>(*to_host(*ids_dev)), ids_ref = values_of<int64_t>(*ids_cpu);
  EXPECT_EQ(ids_gpu, ids_ref) << "ids";
  EXPECT_TRUE(std::none_of(ids_ref.begin(), ids_ref.end(), [](int64_t v) { return v < 0; }));
  EXPECT_EQ(values_of<int64_t>(*to_host(*hist_dev)), values_of<int64_t>(*hist_cpu)) << "histories";
  if (!c.write) {
    EXPECT_EQ(values_of<int64_t>(*hist_cpu), history);
  }
}

TEST(CudaPleNgramIds, MatchesCpuTwin) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  const std::vector<std::pair<int32_t, int32_t>> mixed = {{37, 0}, {1, 5}, {2, 3},  {1, 0}, {130, 10},
                                                          {0, 6},  {2, 0}, {70, 2}, {1, 1}};
  check_ids({3, 8, mixed}, 1);
  check_ids({2, 3, mixed}, 2);
  check_ids({5, 2, mixed}, 3);
  check_ids({8, 1, mixed}, 4);
  check_ids({3, 8, mixed, 0, false}, 5);  // verify: histories read, never written
  check_ids({3, 8, mixed, 2}, 6);         // rows without a slot
  std::vector<std::pair<int32_t, int32_t>> decode;
  for (int i = 0; i < 128; ++i) decode.push_back({1, i % 9 == 0 ? 0 : 3 + i});
  check_ids({3, 8, decode}, 7);
}

// ---- ple_gather ----

void check_gather(DType table_dtype, DType out_dtype, bool zero_copy, int64_t width, uint64_t seed) {
  SCOPED_TRACE(::testing::Message() << "table " << dtype_name(table_dtype) << " out " << dtype_name(out_dtype)
                                    << " zero-copy " << zero_copy << " width " << width);
  Random rng(seed);
  const int64_t rows = 4099, tokens = 37, heads = 16;
  const OwnedTensor table = testing::random_tensor(table_dtype, {rows, width}, rng);
  std::vector<int64_t> ids(static_cast<size_t>(tokens * heads));
  for (auto& id : ids) id = rng.integer(0, rows - 1);
  ids[3] = 0;
  ids[5] = rows - 1;
  const OwnedTensor ids_host = host_tensor(ids, DType::kI64, {tokens, heads});
  // The output is a column slice of a wider buffer; the columns around it must stay NaN.
  OwnedTensor out_wide(out_dtype, {tokens, heads * width + 16});
  testing::poison(*out_wide);
  const OwnedTensor out_dev = to_device(*out_wide);
  const Tensor out_view = out_dev->slice(1, 8, 8 + heads * width);
  OwnedTensor expected_wide(out_dtype, {tokens, heads * width + 16});
  testing::poison(*expected_wide);
  kernels::ple_gather(*table, *ids_host, expected_wide->slice(1, 8, 8 + heads * width));
  if (zero_copy) {
    // The table stays in pinned host memory; the kernel reads it through unified addressing.
    PinnedBuffer pinned(table->nbytes());
    std::memcpy(pinned.data(), table->data(), table->nbytes());
    const Tensor host_table(pinned.data(), table_dtype, {rows, width});
    kernels::ple_gather(host_table, *to_device(*ids_host), out_view);
    EXPECT_EQ(testing::element_bytes(*to_host(*out_dev)), testing::element_bytes(*expected_wide));
  } else {
    kernels::ple_gather(*to_device(*table), *to_device(*ids_host), out_view);
    EXPECT_EQ(testing::element_bytes(*to_host(*out_dev)), testing::element_bytes(*expected_wide));
  }
}

TEST(CudaPleGather, MatchesCpuTwinFromDeviceAndPinnedHostTables) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  check_gather(DType::kBF16, DType::kBF16, false, 160, 11);  // 16-byte chunks
  check_gather(DType::kBF16, DType::kBF16, true, 160, 12);   // zero-copy
  check_gather(DType::kBF16, DType::kF32, false, 160, 13);   // converting, element-wise
  check_gather(DType::kF32, DType::kF32, true, 20, 14);
  check_gather(DType::kBF16, DType::kBF16, false, 6, 15);  // rows not a 16-byte multiple
}

// ---- ple_gate ----

void check_gate(DType dtype, int64_t tokens, int64_t streams, int64_t hidden, uint64_t seed) {
  SCOPED_TRACE(::testing::Message() << dtype_name(dtype) << " tokens " << tokens << " hidden " << hidden);
  Random rng(seed);
  const int64_t width = streams * hidden;
  // key and residual are column slices of wider rows, as GEMM outputs into fused buffers can be.
  const OwnedTensor key_wide = testing::random_tensor(dtype, {tokens, width + 8}, rng, -2.0f, 2.0f);
  const OwnedTensor value = testing::random_tensor(dtype, {tokens, hidden}, rng, -2.0f, 2.0f);
  const OwnedTensor residual = testing::random_tensor(dtype, {tokens, width}, rng, -3.0f, 3.0f);
  const OwnedTensor wk = testing::random_tensor(DType::kBF16, {width}, rng, -0.5f, 0.5f);
  const OwnedTensor wq = testing::random_tensor(DType::kF32, {width}, rng, -0.5f, 0.5f);
  const OwnedTensor wc = testing::random_tensor(DType::kBF16, {width}, rng, -0.5f, 0.5f);
  const Tensor key = key_wide->slice(1, 8, 8 + width);
  OwnedTensor g_cpu(dtype, {tokens, width}), gn_cpu(dtype, {tokens, width});
  testing::poison(*g_cpu);
  testing::poison(*gn_cpu);
  const OwnedTensor g_dev = to_device(*g_cpu), gn_dev = to_device(*gn_cpu);
  kernels::PleGateParams params;
  params.num_streams = static_cast<int>(streams);
  kernels::ple_gate(key, *value, *residual, *wk, *wq, *wc, *g_cpu, *gn_cpu, params);
  const OwnedTensor key_dev = to_device(*key_wide);
  kernels::ple_gate(key_dev->slice(1, 8, 8 + width), *to_device(*value), *to_device(*residual), *to_device(*wk),
                    *to_device(*wq), *to_device(*wc), *g_dev, *gn_dev, params);
  // Same rounding points on both sides: only fp32 summation order differs (a rare flip at a bf16
  // rounding boundary, which for s moves a whole stream's gate by one ulp).
  const double tolerance = dtype == DType::kBF16 ? 2e-3 : 1e-5;
  EXPECT_TRUE(testing::close_rel_l2(*to_host(*g_dev), testing::to_doubles(*g_cpu), tolerance)) << "G";
  EXPECT_TRUE(testing::close_rel_l2(*to_host(*gn_dev), testing::to_doubles(*gn_cpu), tolerance)) << "G^";
}

TEST(CudaPleGate, MatchesCpuTwin) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  check_gate(DType::kBF16, 37, 4, 2560, 21);  // the released shape
  check_gate(DType::kBF16, 1, 4, 2560, 22);   // decode
  check_gate(DType::kF32, 9, 3, 200, 23);
  check_gate(DType::kBF16, 5, 2, 48, 24);
}

// ---- the dilated conv with a residual (PLE's short conv) ----

struct DilatedConvCase {
  std::vector<std::pair<int32_t, int32_t>> seqs;  // (q_len, ctx)
  int64_t channels;
  int kernel, dilation;
  int64_t offset;  // x, residual and out are column slices at this offset (odd: element-wise path)
  bool write = true;
  int no_slot_every = 0;
  bool decode = false;  // every q_len <= 1, passed as max_q_len 1
};

void check_dilated_conv(const DilatedConvCase& c, uint64_t seed) {
  SCOPED_TRACE(::testing::Message() << "channels " << c.channels << " K " << c.kernel << " d " << c.dilation
                                    << " offset " << c.offset << " write " << c.write);
  Random rng(seed);
  const int64_t history = static_cast<int64_t>(c.kernel - 1) * c.dilation;
  std::vector<int32_t> cu{0}, lens, slots;
  const auto num_slots = static_cast<int32_t>(c.seqs.size() + 2);
  std::vector<int32_t> order(static_cast<size_t>(num_slots));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937_64(seed));
  for (size_t s = 0; s < c.seqs.size(); ++s) {
    cu.push_back(cu.back() + c.seqs[s].first);
    lens.push_back(c.seqs[s].first + c.seqs[s].second);
    const bool no_slot = c.no_slot_every > 0 && static_cast<int>(s) % c.no_slot_every == c.no_slot_every - 1;
    slots.push_back(no_slot ? -1 : order[s]);
  }
  const int64_t tokens = cu.back(), S = static_cast<int64_t>(lens.size()), width = c.channels + c.offset + 8;
  const OwnedTensor x = testing::random_tensor(DType::kBF16, {tokens, width}, rng);
  const OwnedTensor res = testing::random_tensor(DType::kBF16, {tokens, width}, rng);
  const OwnedTensor weight = testing::random_tensor(DType::kBF16, {c.channels, c.kernel}, rng, -0.6f, 0.6f);
  const OwnedTensor state = testing::random_tensor(DType::kBF16, {num_slots, history, c.channels}, rng);
  OwnedTensor out(DType::kBF16, {tokens, width});
  testing::poison(*out);
  const OwnedTensor x_dev = to_device(*x), res_dev = to_device(*res), w_dev = to_device(*weight),
                    state_dev = to_device(*state), out_dev = to_device(*out);
  const OwnedTensor cu_t = host_tensor(cu, DType::kI32, {S + 1}), lens_t = host_tensor(lens, DType::kI32, {S}),
                    slots_t = host_tensor(slots, DType::kI32, {S});
  const auto cols = [&](const Tensor& t) { return t.slice(1, c.offset, c.offset + c.channels); };
  kernels::CausalConv1dParams params;
  params.dilation = c.dilation;
  params.write_state = c.write;
  params.max_q_len = c.decode ? 1 : 0;  // 1: the one-launch decode kernel
  params.residual = cols(*res_dev);
  kernels::causal_conv1d(cols(*x_dev), *w_dev, *state_dev, *to_device(*cu_t), *to_device(*lens_t), *to_device(*slots_t),
                         cols(*out_dev), params);
  params.residual = cols(*res);
  kernels::causal_conv1d(cols(*x), *weight, *state, *cu_t, *lens_t, *slots_t, cols(*out), params);
  const OwnedTensor got = to_host(*out_dev);
  EXPECT_TRUE(testing::close_rel_l2(cols(*got), testing::to_doubles(cols(*out)), 1e-3)) << "output";
  // The columns around the slice stay NaN.
  const std::vector<double> all = testing::to_doubles(*got);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t col = 0; col < width; ++col) {
      if (col >= c.offset && col < c.offset + c.channels) continue;
      ASSERT_TRUE(std::isnan(all[static_cast<size_t>(t * width + col)])) << "row " << t << " column " << col;
    }
  }
  EXPECT_EQ(testing::element_bytes(*to_host(*state_dev)), testing::element_bytes(*state)) << "conv states";
}

TEST(CudaPleConv, DilatedConvWithResidualMatchesCpuTwin) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  const std::vector<std::pair<int32_t, int32_t>> mixed = {{37, 0}, {1, 5}, {3, 2},  {1, 0}, {130, 10},
                                                          {0, 6},  {2, 0}, {70, 2}, {8, 20}};
  check_dilated_conv({mixed, 10240, 4, 3, 0}, 31);  // the released PLE shape: N*H channels, Kp 4, n_max 3
  check_dilated_conv({mixed, 1024, 4, 3, 0, false}, 32);
  check_dilated_conv({mixed, 1024, 4, 3, 0, true, 3}, 33);
  check_dilated_conv({mixed, 100, 3, 2, 3}, 34);  // element-wise path
  check_dilated_conv({mixed, 512, 2, 4, 0}, 35);
  check_dilated_conv({mixed, 512, 4, 1, 0}, 36);  // dilation 1 with a residual
  std::vector<std::pair<int32_t, int32_t>> decode;
  for (int i = 0; i < 128; ++i) decode.push_back({1, i % 7 == 0 ? 0 : 3 + i});
  check_dilated_conv({decode, 10240, 4, 3, 0}, 37);
  // The decode kernel: one launch for the row and the slot's shift, a sequence without a row, no
  // slot, slots only read, the element-wise path.
  decode.push_back({0, 9});
  check_dilated_conv({decode, 10240, 4, 3, 0, true, 0, true}, 38);
  check_dilated_conv({decode, 1024, 4, 3, 0, true, 5, true}, 39);
  check_dilated_conv({decode, 1024, 4, 3, 0, false, 0, true}, 40);
  check_dilated_conv({decode, 100, 3, 2, 3, true, 4, true}, 41);
}

}  // namespace
}  // namespace metrale
