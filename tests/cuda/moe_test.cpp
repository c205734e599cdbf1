// CUDA MoE ops against their CPU twins on the same inputs: routing (exact ids, weights to 1e-6),
// the counting sort (exact), the decode and grouped expert paths, the weighted combine, gather /
// scatter rows, and the whole Moe block on GPU vs CPU from the same random checkpoint in both
// expert layouts. A disabled benchmark (--gtest_also_run_disabled_tests --gtest_filter='*Bench*')
// times the expert paths on Qwen3-30B-A3B shapes.
#include "kernels/moe.h"

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "core/test_support.h"
#include "cuda/cuda_test_helpers.h"
#include "kernels/kernel_helpers.h"
#include "model/blocks/moe.h"
#include "model/safetensors.h"
#include "model/weight_store.h"
#include "runtime/cuda/cuda_graph.h"
#include "runtime/device.h"
#include "runtime/stream.h"

namespace metrale {
namespace {

using testing::to_device;
using testing::to_host;

using testing::Random;

OwnedTensor poisoned_device(DType dtype, Shape shape) {
  OwnedTensor host(dtype, shape);
  if (dtype == DType::kI32) {
    std::fill_n(host->data_as<int32_t>(), host->numel(), -777);
  } else {
    testing::poison(*host);
  }
  return to_device(*host);
}

std::vector<int32_t> ints(const Tensor& host) {
  return std::vector<int32_t>(host.data_as<const int32_t>(), host.data_as<const int32_t>() + host.numel());
}

// Distinct random experts per token from the first `used` ids.
std::vector<int32_t> random_routes(int64_t tokens, int64_t k, int64_t used, Random& rng) {
  std::vector<int32_t> ids, pool(static_cast<size_t>(used));
  for (int64_t t = 0; t < tokens; ++t) {
    std::iota(pool.begin(), pool.end(), 0);
    std::shuffle(pool.begin(), pool.end(), rng.engine());
    ids.insert(ids.end(), pool.begin(), pool.begin() + k);
  }
  return ids;
}

// ------------------------------------------------------------------------------------------------
// moe_route

// Logits with no near-ties: each row is a permutation of distinct multiples of 1/64 (exact in
// bf16), except that every third row repeats one value so that exact ties (broken towards the
// lower id on both sides) are exercised too.
OwnedTensor route_logits(DType dtype, int64_t tokens, int64_t experts, Random& rng) {
  std::vector<float> values;
  std::vector<int64_t> order(static_cast<size_t>(experts));
  for (int64_t t = 0; t < tokens; ++t) {
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng.engine());
    std::vector<float> row(static_cast<size_t>(experts));
    for (int64_t e = 0; e < experts; ++e) {
      row[static_cast<size_t>(e)] = static_cast<float>(order[static_cast<size_t>(e)] - experts / 2) / 64.0f;
    }
    if (t % 3 == 0 && experts > 2) row[1] = row[static_cast<size_t>(experts - 1)];
    values.insert(values.end(), row.begin(), row.end());
  }
  OwnedTensor logits(dtype, {tokens, experts});
  testing::fill(*logits, values);
  return logits;
}

TEST(CudaMoeRoute, MatchesCpuTwin) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Random rng(7001);
  for (const int64_t experts : {3, 8, 60, 128, 200, 512}) {
    for (const int k : {1, 2, 8}) {
      if (k > experts) continue;
      for (const bool normalize : {false, true}) {
        for (const DType dtype : {DType::kF32, DType::kBF16}) {
          for (const int64_t tokens : {1, 37, 300}) {
            SCOPED_TRACE(::testing::Message() << "E " << experts << " k " << k << " normalize " << normalize << " "
                                              << dtype_name(dtype) << " T " << tokens);
            const OwnedTensor logits = route_logits(dtype, tokens, experts, rng);
            OwnedTensor ids(DType::kI32, {tokens, k}), weights(DType::kF32, {tokens, k});
            kernels::moe_route(*logits, *ids, *weights, {k, normalize});
            const OwnedTensor logits_device = to_device(*logits);
            const OwnedTensor ids_device = poisoned_device(DType::kI32, {tokens, k});
            const OwnedTensor weights_device = poisoned_device(DType::kF32, {tokens, k});
            kernels::moe_route(*logits_device, *ids_device, *weights_device, {k, normalize});
            EXPECT_EQ(ints(*to_host(*ids_device)), ints(*ids));
            const std::vector<double> got = testing::to_doubles(*to_host(*weights_device));
            const std::vector<double> expected = testing::to_doubles(*weights);
            double worst = 0.0;
            for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::fabs(got[i] - expected[i]));
            EXPECT_LE(worst, 1e-6);
            EXPECT_TRUE(testing::close_rel_l2(got, expected, 1e-6));
          }
        }
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// moe_sort

TEST(CudaMoeSort, MatchesCpuTwinExactly) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Random rng(7002);
  struct Case {
    int64_t tokens, k, experts, used;
  };
  for (const Case c : {Case{1, 1, 1, 1}, Case{1, 8, 128, 128}, Case{5, 2, 4, 3}, Case{300, 8, 128, 100},
                       Case{1000, 8, 512, 512}, Case{777, 4, 1000, 900}, Case{8192, 8, 128, 128}}) {
    SCOPED_TRACE(::testing::Message() << "T " << c.tokens << " k " << c.k << " E " << c.experts);
    std::vector<int32_t> ids = random_routes(c.tokens, c.k, c.used, rng);
    std::vector<int32_t> relabel(static_cast<size_t>(c.experts));
    std::iota(relabel.begin(), relabel.end(), 0);
    std::shuffle(relabel.begin(), relabel.end(), rng.engine());
    for (auto& id : ids) id = relabel[static_cast<size_t>(id)];
    const int64_t slots = c.tokens * c.k;
    const Tensor ids_host(ids.data(), DType::kI32, {c.tokens, c.k});
    OwnedTensor offsets(DType::kI32, {c.experts + 1}), sorted(DType::kI32, {slots});
    OwnedTensor scratch(DType::kI32, {kernels::moe_sort_scratch_elements(slots, c.experts)});
    kernels::moe_sort(ids_host, *offsets, *sorted, *scratch);
    const OwnedTensor ids_device = to_device(ids_host);
    const OwnedTensor offsets_device = poisoned_device(DType::kI32, {c.experts + 1});
    const OwnedTensor sorted_device = poisoned_device(DType::kI32, {slots});
    const OwnedTensor scratch_device =
        poisoned_device(DType::kI32, {kernels::moe_sort_scratch_elements(slots, c.experts)});
    kernels::moe_sort(*ids_device, *offsets_device, *sorted_device, *scratch_device);
    EXPECT_EQ(ints(*to_host(*offsets_device)), ints(*offsets));
    EXPECT_EQ(ints(*to_host(*sorted_device)), ints(*sorted));
  }
}

// ------------------------------------------------------------------------------------------------
// Expert paths

struct Experts {
  OwnedTensor gate_up_host, down_host;  // [E, 2I, H], [E, H, I] bf16 (or f32)
  OwnedTensor gate_up_device, down_device;
  kernels::MoeExpertWeights host, device;
};

std::unique_ptr<Experts> random_experts(int64_t experts, int64_t hidden, int64_t inter, Random& rng,
                                        DType dtype = DType::kBF16) {
  auto set = std::make_unique<Experts>();
  // Scaled so that the activations stay O(1) through SiLU and the down projection.
  set->gate_up_host = testing::random_tensor(dtype, {experts, 2 * inter, hidden}, rng, -0.1f, 0.1f);
  set->down_host = testing::random_tensor(dtype, {experts, hidden, inter}, rng, -0.1f, 0.1f);
  set->gate_up_device = to_device(*set->gate_up_host);
  set->down_device = to_device(*set->down_host);
  set->host = kernels::MoeExpertWeights::from_fused(*set->gate_up_host, *set->down_host);
  set->device = kernels::MoeExpertWeights::from_fused(*set->gate_up_device, *set->down_device);
  return set;
}

struct ExpertCase {
  int64_t tokens, k, experts, hidden, inter;
};

TEST(CudaMoeDecode, MatchesCpuTwin) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Random rng(7003);
  for (const ExpertCase c : {ExpertCase{1, 8, 128, 2048, 768}, ExpertCase{3, 2, 5, 40, 24},
                             ExpertCase{2, 4, 9, 136, 40}, ExpertCase{8, 8, 16, 264, 72}, ExpertCase{1, 1, 1, 8, 8}}) {
    for (const DType x_dtype : {DType::kBF16, DType::kF32}) {
      SCOPED_TRACE(::testing::Message() << "T " << c.tokens << " k " << c.k << " E " << c.experts << " H " << c.hidden
                                        << " I " << c.inter << " x " << dtype_name(x_dtype));
      const auto experts = random_experts(c.experts, c.hidden, c.inter, rng);
      // x rows strided (16-byte aligned padding) to exercise the row stride.
      const OwnedTensor x_wide = testing::random_tensor(x_dtype, {c.tokens, c.hidden + 8}, rng);
      const Tensor x = x_wide->slice(1, 0, c.hidden);
      std::vector<int32_t> ids = random_routes(c.tokens, c.k, c.experts, rng);
      const Tensor ids_host(ids.data(), DType::kI32, {c.tokens, c.k});
      const int64_t slots = c.tokens * c.k;
      OwnedTensor h(DType::kF32, {slots, c.inter}), y(DType::kF32, {slots, c.hidden});
      kernels::moe_decode_gate_up(x, ids_host, experts->host, *h);
      kernels::moe_decode_down(*h, ids_host, experts->host, *y);

      const OwnedTensor x_device = to_device(*x_wide), ids_device = to_device(ids_host);
      const OwnedTensor h_device = poisoned_device(DType::kF32, {slots, c.inter});
      const OwnedTensor y_device = poisoned_device(DType::kF32, {slots, c.hidden});
      kernels::moe_decode_gate_up(x_device->slice(1, 0, c.hidden), *ids_device, experts->device, *h_device);
      EXPECT_TRUE(testing::close_rel_l2(*to_host(*h_device), testing::to_doubles(*h), 1e-5));
      // The down projection from the same h on both sides.
      copy_tensor(*h_device, *h);
      kernels::moe_decode_down(*h_device, *ids_device, experts->device, *y_device);
      EXPECT_TRUE(testing::close_rel_l2(*to_host(*y_device), testing::to_doubles(*y), 1e-5));
    }
  }
}

// The fused decode ops (the shared expert as one more slot per token, moe_decode_down_combine)
// against their CPU twins: bf16 and f32 experts, no / gated / ungated shared expert, up to
// kMoeDecodeCombineMaxSlots slots per token, f32 and bf16 outputs. The last of E + 1 experts plays
// the shared expert, so its weights are views of the same tensors on both sides.
TEST(CudaMoeDecodeFused, MatchesCpuTwin) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Random rng(7011);
  enum class Shared { kNone, kGated, kUngated };
  for (const ExpertCase c : {ExpertCase{1, 10, 16, 2048, 512}, ExpertCase{3, 8, 12, 256, 136},
                             ExpertCase{6, 4, 9, 136, 40}, ExpertCase{2, 15, 20, 64, 24}, ExpertCase{1, 1, 1, 8, 8}}) {
    for (const DType weight_dtype : {DType::kBF16, DType::kF32}) {
      for (const Shared kind : {Shared::kNone, Shared::kGated, Shared::kUngated}) {
        for (const DType out_dtype : {DType::kF32, DType::kBF16}) {
          SCOPED_TRACE(::testing::Message()
                       << "T " << c.tokens << " k " << c.k << " E " << c.experts << " H " << c.hidden << " I "
                       << c.inter << " " << dtype_name(weight_dtype) << " shared " << static_cast<int>(kind) << " out "
                       << dtype_name(out_dtype));
          const auto all = random_experts(c.experts + 1, c.hidden, c.inter, rng, weight_dtype);
          const auto routed_of = [&](const Tensor& gate_up, const Tensor& down) {
            kernels::MoeExpertWeights w =
                kernels::MoeExpertWeights::from_fused(gate_up.slice(0, 0, c.experts), down.slice(0, 0, c.experts));
            return w;
          };
          const kernels::MoeExpertWeights routed_host = routed_of(*all->gate_up_host, *all->down_host);
          const kernels::MoeExpertWeights routed_device = routed_of(*all->gate_up_device, *all->down_device);
          const auto shared_of = [&](const kernels::MoeExpertWeights& w) {
            const auto e = static_cast<size_t>(c.experts);
            return kind == Shared::kNone ? kernels::MoeSharedExpert{}
                                         : kernels::MoeSharedExpert{w.gate[e], w.up[e], w.down[e]};
          };
          const kernels::MoeSharedExpert shared_host = shared_of(all->host), shared_device = shared_of(all->device);
          const DType x_dtype = weight_dtype == DType::kF32 ? DType::kF32 : DType::kBF16;
          const OwnedTensor x_wide = testing::random_tensor(x_dtype, {c.tokens, c.hidden + 8}, rng);
          const Tensor x = x_wide->slice(1, 0, c.hidden);
          std::vector<int32_t> ids = random_routes(c.tokens, c.k, c.experts, rng);
          const Tensor ids_host(ids.data(), DType::kI32, {c.tokens, c.k});
          const OwnedTensor weights = testing::random_tensor(DType::kF32, {c.tokens, c.k}, rng, 0.0f, 1.0f);
          const OwnedTensor gate_wide = testing::random_tensor(DType::kF32, {c.tokens, 3}, rng, -3.0f, 3.0f);
          const Tensor gate = kind == Shared::kGated ? gate_wide->slice(1, 1, 2) : Tensor();  // strided rows
          const int64_t rows = c.tokens * c.k + (kind == Shared::kNone ? 0 : c.tokens);
          OwnedTensor h(DType::kF32, {rows, c.inter}), out(out_dtype, {c.tokens, c.hidden});
          kernels::moe_decode_gate_up(x, ids_host, routed_host, *h, shared_host);

          const OwnedTensor x_device = to_device(*x_wide), ids_device = to_device(ids_host);
          const OwnedTensor weights_device = to_device(*weights), gate_device = to_device(*gate_wide);
          const OwnedTensor h_device = poisoned_device(DType::kF32, {rows, c.inter});
          kernels::moe_decode_gate_up(x_device->slice(1, 0, c.hidden), *ids_device, routed_device, *h_device,
                                      shared_device);
          EXPECT_TRUE(testing::close_rel_l2(*to_host(*h_device), testing::to_doubles(*h), 1e-5));
          copy_tensor(*h_device, *h);  // the down projections and the combine from the same h on both sides
          kernels::moe_decode_down_combine(*h, ids_host, *weights, routed_host, shared_host, gate, *out);
          const OwnedTensor out_device = poisoned_device(out_dtype, {c.tokens, c.hidden});
          kernels::moe_decode_down_combine(*h_device, *ids_device, *weights_device, routed_device, shared_device,
                                           kind == Shared::kGated ? gate_device->slice(1, 1, 2) : Tensor(),
                                           *out_device);
          EXPECT_TRUE(testing::close_rel_l2(*to_host(*out_device), testing::to_doubles(*out),
                                            out_dtype == DType::kF32 ? 1e-5 : testing::kBf16OutputTolerance));
        }
      }
    }
  }
}

TEST(CudaMoeDecodeFused, RejectsTooManySlotsPerToken) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Random rng(7012);
  const auto all = random_experts(20, 16, 8, rng);
  const kernels::MoeExpertWeights routed =
      kernels::MoeExpertWeights::from_fused(all->gate_up_device->slice(0, 0, 19), all->down_device->slice(0, 0, 19));
  const kernels::MoeSharedExpert shared{all->device.gate[19], all->device.up[19], all->device.down[19]};
  std::vector<int32_t> ids = random_routes(1, 16, 19, rng);
  const OwnedTensor ids_device = to_device(Tensor(ids.data(), DType::kI32, {1, 16}));
  const OwnedTensor weights = to_device(*testing::random_tensor(DType::kF32, {1, 16}, rng));
  const OwnedTensor h = poisoned_device(DType::kF32, {17, 8}), out = poisoned_device(DType::kF32, {1, 16});
  EXPECT_THROW(kernels::moe_decode_down_combine(*h, *ids_device, *weights, routed, shared, Tensor(), *out), Error);
}

TEST(CudaMoeGrouped, MatchesCpuTwin) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Random rng(7004);
  // Awkward shapes: I not a multiple of the 64-column tile, H not a multiple of the 32-deep K step,
  // single rows, one expert, experts left empty, segments longer than one 128-row tile.
  for (const ExpertCase c :
       {ExpertCase{100, 8, 128, 2048, 768}, ExpertCase{37, 2, 6, 136, 40}, ExpertCase{1, 1, 1, 8, 8},
        ExpertCase{1, 4, 9, 72, 24}, ExpertCase{300, 2, 3, 256, 200}, ExpertCase{64, 2, 8, 520, 136}}) {
    SCOPED_TRACE(::testing::Message() << "T " << c.tokens << " k " << c.k << " E " << c.experts << " H " << c.hidden
                                      << " I " << c.inter);
    const auto experts = random_experts(c.experts, c.hidden, c.inter, rng);
    const OwnedTensor x_wide = testing::random_tensor(DType::kBF16, {c.tokens, c.hidden + 16}, rng);
    const Tensor x = x_wide->slice(1, 0, c.hidden);
    const int64_t used = c.experts > c.k ? c.experts - 1 : c.experts;  // leave one expert empty when possible
    std::vector<int32_t> ids = random_routes(c.tokens, c.k, used, rng);
    const Tensor ids_host(ids.data(), DType::kI32, {c.tokens, c.k});
    const int64_t slots = c.tokens * c.k;
    OwnedTensor offsets(DType::kI32, {c.experts + 1}), sorted(DType::kI32, {slots});
    OwnedTensor scratch(DType::kI32, {kernels::moe_sort_scratch_elements(slots, c.experts)});
    kernels::moe_sort(ids_host, *offsets, *sorted, *scratch);
    OwnedTensor h(DType::kBF16, {slots, c.inter}), y(DType::kF32, {slots, c.hidden});
    kernels::moe_grouped_gate_up(x, *sorted, *offsets, static_cast<int>(c.k), experts->host, *h);
    kernels::moe_grouped_down(*h, *sorted, *offsets, experts->host, *y);

    const OwnedTensor x_device = to_device(*x_wide);
    const OwnedTensor offsets_device = to_device(*offsets), sorted_device = to_device(*sorted);
    const OwnedTensor h_device = poisoned_device(DType::kBF16, {slots, c.inter});
    const OwnedTensor y_device = poisoned_device(DType::kF32, {slots, c.hidden});
    kernels::moe_grouped_gate_up(x_device->slice(1, 0, c.hidden), *sorted_device, *offsets_device,
                                 static_cast<int>(c.k), experts->device, *h_device);
    EXPECT_TRUE(testing::close_rel_l2(*to_host(*h_device), testing::to_doubles(*h), 1e-2));
    copy_tensor(*h_device, *h);  // the down GEMM from the same h on both sides
    kernels::moe_grouped_down(*h_device, *sorted_device, *offsets_device, experts->device, *y_device);
    EXPECT_TRUE(testing::close_rel_l2(*to_host(*y_device), testing::to_doubles(*y), 1e-5));
  }
}

// f32 expert weights and activations (f32 runs): both paths on CUDA cores, fp32 throughout, so both
// must agree with the CPU twin up to summation order. Sizes off every tile and vector width.
TEST(CudaMoeF32, DecodeAndGroupedMatchCpuTwin) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Random rng(7010);
  for (const ExpertCase c : {ExpertCase{3, 2, 5, 40, 24}, ExpertCase{37, 2, 6, 60, 36}, ExpertCase{1, 1, 1, 7, 5},
                             ExpertCase{50, 4, 9, 72, 20}}) {
    SCOPED_TRACE(::testing::Message() << "T " << c.tokens << " k " << c.k << " E " << c.experts << " H " << c.hidden
                                      << " I " << c.inter);
    const auto experts = random_experts(c.experts, c.hidden, c.inter, rng, DType::kF32);
    const OwnedTensor x_wide = testing::random_tensor(DType::kF32, {c.tokens, c.hidden + 4}, rng);
    const Tensor x = x_wide->slice(1, 0, c.hidden);
    std::vector<int32_t> ids = random_routes(c.tokens, c.k, c.experts, rng);
    const Tensor ids_host(ids.data(), DType::kI32, {c.tokens, c.k});
    const int64_t slots = c.tokens * c.k;
    const OwnedTensor x_device = to_device(*x_wide), ids_device = to_device(ids_host);
    const Tensor x_view = x_device->slice(1, 0, c.hidden);

    // Decode path.
    OwnedTensor h(DType::kF32, {slots, c.inter}), y(DType::kF32, {slots, c.hidden});
    kernels::moe_decode_gate_up(x, ids_host, experts->host, *h);
    kernels::moe_decode_down(*h, ids_host, experts->host, *y);
    const OwnedTensor h_device = poisoned_device(DType::kF32, {slots, c.inter});
    const OwnedTensor y_device = poisoned_device(DType::kF32, {slots, c.hidden});
    if (slots <= 65535) {
      kernels::moe_decode_gate_up(x_view, *ids_device, experts->device, *h_device);
      EXPECT_TRUE(testing::close_rel_l2(*to_host(*h_device), testing::to_doubles(*h), 1e-5));
      kernels::moe_decode_down(*h_device, *ids_device, experts->device, *y_device);
      EXPECT_TRUE(testing::close_rel_l2(*to_host(*y_device), testing::to_doubles(*y), 1e-5));
    }

    // Grouped path.
    OwnedTensor offsets(DType::kI32, {c.experts + 1}), sorted(DType::kI32, {slots});
    OwnedTensor scratch(DType::kI32, {kernels::moe_sort_scratch_elements(slots, c.experts)});
    kernels::moe_sort(ids_host, *offsets, *sorted, *scratch);
    OwnedTensor hg(DType::kF32, {slots, c.inter}), yg(DType::kF32, {slots, c.hidden});
    kernels::moe_grouped_gate_up(x, *sorted, *offsets, static_cast<int>(c.k), experts->host, *hg);
    kernels::moe_grouped_down(*hg, *sorted, *offsets, experts->host, *yg);
    const OwnedTensor offsets_device = to_device(*offsets), sorted_device = to_device(*sorted);
    const OwnedTensor hg_device = poisoned_device(DType::kF32, {slots, c.inter});
    const OwnedTensor yg_device = poisoned_device(DType::kF32, {slots, c.hidden});
    kernels::moe_grouped_gate_up(x_view, *sorted_device, *offsets_device, static_cast<int>(c.k), experts->device,
                                 *hg_device);
    EXPECT_TRUE(testing::close_rel_l2(*to_host(*hg_device), testing::to_doubles(*hg), 1e-5));
    kernels::moe_grouped_down(*hg_device, *sorted_device, *offsets_device, experts->device, *yg_device);
    EXPECT_TRUE(testing::close_rel_l2(*to_host(*yg_device), testing::to_doubles(*yg), 1e-5));
  }
}

TEST(CudaMoeCombine, MatchesCpuTwin) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Random rng(7005);
  for (const auto [tokens, k, hidden] :
       std::vector<std::array<int64_t, 3>>{{1, 1, 8}, {1, 8, 2048}, {3, 2, 33}, {300, 8, 520}}) {
    for (const bool shared : {false, true}) {
      for (const DType out_dtype : {DType::kF32, DType::kBF16}) {
        SCOPED_TRACE(::testing::Message() << "T " << tokens << " k " << k << " H " << hidden << " shared " << shared
                                          << " " << dtype_name(out_dtype));
        const OwnedTensor slot_out = testing::random_tensor(DType::kF32, {tokens * k, hidden}, rng, -2.0f, 2.0f);
        const OwnedTensor weights = testing::random_tensor(DType::kF32, {tokens, k}, rng, 0.0f, 1.0f);
        OwnedTensor shared_out, gate, shared_out_device, gate_device;
        if (shared) {
          shared_out = testing::random_tensor(DType::kF32, {tokens, hidden}, rng);
          gate = testing::random_tensor(DType::kF32, {tokens, 1}, rng, -3.0f, 3.0f);
          shared_out_device = to_device(*shared_out);
          gate_device = to_device(*gate);
        }
        OwnedTensor out(out_dtype, {tokens, hidden});
        kernels::moe_combine(*slot_out, *weights, *shared_out, *gate, *out);
        const OwnedTensor out_device = poisoned_device(out_dtype, {tokens, hidden});
        kernels::moe_combine(*to_device(*slot_out), *to_device(*weights), *shared_out_device, *gate_device,
                             *out_device);
        EXPECT_TRUE(testing::close_rel_l2(*to_host(*out_device), testing::to_doubles(*out),
                                          out_dtype == DType::kF32 ? 1e-6 : testing::kBf16OutputTolerance));
      }
    }
  }
}

TEST(CudaMoeRows, GatherAndScatterMatchCpuTwin) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Random rng(7006);
  for (const DType dtype : {DType::kF32, DType::kBF16}) {
    for (const int64_t width : {8, 13, 2048}) {
      SCOPED_TRACE(::testing::Message() << dtype_name(dtype) << " width " << width);
      const OwnedTensor src = testing::random_tensor(dtype, {9, width}, rng);
      std::vector<int32_t> index = {4, 0, 8, 4, 2, 2, 7};  // duplicates on purpose
      const Tensor index_host(index.data(), DType::kI32, {static_cast<int64_t>(index.size())});
      OwnedTensor gathered(dtype, {7, width});
      kernels::gather_rows(*src, index_host, *gathered);
      const OwnedTensor gathered_device = poisoned_device(dtype, {7, width});
      const OwnedTensor index_device = to_device(index_host);
      kernels::gather_rows(*to_device(*src), *index_device, *gathered_device);
      EXPECT_EQ(testing::element_bytes(*to_host(*gathered_device)), testing::element_bytes(*gathered));

      const OwnedTensor rows = testing::random_tensor(dtype, {7, width}, rng);
      const OwnedTensor weight = testing::random_tensor(DType::kF32, {7}, rng);
      OwnedTensor dst = testing::random_tensor(DType::kF32, {9, width}, rng);
      const OwnedTensor dst_device = to_device(*dst);
      kernels::scatter_add_rows(*dst, *rows, index_host, *weight);
      kernels::scatter_add_rows(*dst_device, *to_device(*rows), *index_device, *to_device(*weight));
      EXPECT_TRUE(testing::close_rel_l2(*to_host(*dst_device), testing::to_doubles(*dst), 1e-6));
    }
  }
}

// ------------------------------------------------------------------------------------------------
// The whole Moe block, GPU vs CPU, from one random checkpoint.

struct BlockCase {
  int64_t experts, top_k, hidden, inter, shared_inter;
  bool normalize, fused;
  DType storage;
};

// Writes model.safetensors with random weights of layer 0's MoE block under "model.layers.0.mlp.".
// Values are bf16-representable whatever the storage dtype, so that the GPU block (which converts
// to bf16) and the CPU block see the same weights and route every token identically.
void write_block_checkpoint(const std::filesystem::path& dir, const BlockCase& c, Random& rng) {
  std::vector<OwnedTensor> owned;
  std::vector<std::pair<std::string, Tensor>> tensors;
  const auto add = [&](const std::string& key, Shape shape, float scale) {
    const OwnedTensor values = testing::random_tensor(DType::kBF16, shape, rng, -scale, scale);
    owned.emplace_back(c.storage, shape);
    const std::vector<double> doubles = testing::to_doubles(*values);
    testing::fill(*owned.back(), std::vector<float>(doubles.begin(), doubles.end()));
    tensors.emplace_back("model.layers.0.mlp." + key, *owned.back());
  };
  const int64_t e = c.experts, h = c.hidden, i = c.inter;
  add("gate.weight", {e, h}, 0.5f);
  if (c.fused) {
    add("experts.gate_up_proj", {e, 2 * i, h}, 0.1f);
    add("experts.down_proj", {e, h, i}, 0.1f);
  } else {
    for (int64_t x = 0; x < e; ++x) {
      const std::string key = "experts." + std::to_string(x) + ".";
      add(key + "gate_proj.weight", {i, h}, 0.1f);
      add(key + "up_proj.weight", {i, h}, 0.1f);
      add(key + "down_proj.weight", {h, i}, 0.1f);
    }
  }
  if (c.shared_inter > 0) {
    add("shared_expert.gate_proj.weight", {c.shared_inter, h}, 0.1f);
    add("shared_expert.up_proj.weight", {c.shared_inter, h}, 0.1f);
    add("shared_expert.down_proj.weight", {h, c.shared_inter}, 0.1f);
    add("shared_expert_gate.weight", {1, h}, 0.5f);
  }
  write_safetensors(dir / "model.safetensors", tensors);
}

TEST(CudaMoeBlock, MatchesCpuBlock) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Random rng(7007);
  const BlockCase cases[] = {
      {8, 2, 64, 32, 0, true, false, DType::kBF16},
      {8, 2, 64, 32, 0, true, true, DType::kBF16},
      {16, 4, 136, 40, 48, false, true, DType::kBF16},
      {16, 4, 136, 40, 48, false, false, DType::kF32},
      {128, 8, 256, 96, 0, true, true, DType::kBF16},
      // A shared expert of the routed width: the fused decode path (one more slot, the combine in the down op).
      {16, 4, 136, 40, 40, false, true, DType::kBF16},
      {16, 4, 136, 40, 40, true, false, DType::kF32},
  };
  for (const BlockCase& c : cases) {
    const testing::TempDir dir;
    write_block_checkpoint(dir.path(), c, rng);
    const auto store = std::make_shared<const WeightStore>(dir.path());
    Weights cpu_weights(store, Device::cpu(), "model.");
    Weights gpu_weights(store, Device::cuda(), "model.");
    MoeConfig config;
    config.hidden_size = c.hidden;
    config.num_experts = c.experts;
    config.top_k = c.top_k;
    config.expert_intermediate_size = c.inter;
    config.normalize_top_k = c.normalize;
    config.shared_expert_intermediate_size = c.shared_inter;
    Moe cpu_block(config, cpu_weights, "layers.0.mlp.");
    Moe gpu_block(config, gpu_weights, "layers.0.mlp.");
    const std::vector<Buffer> gpu_buffers = gpu_weights.take_device_buffers();  // keep any Weights copies alive
    // T * k <= kMoeDecodeMaxSlots takes the decode path; larger T the grouped path.
    for (const int64_t tokens : {int64_t{1}, int64_t{3}, int64_t{100}, int64_t{333}}) {
      SCOPED_TRACE(::testing::Message() << "E " << c.experts << " k " << c.top_k << " H " << c.hidden << " I "
                                        << c.inter << " shared " << c.shared_inter << " fused " << c.fused << " "
                                        << dtype_name(c.storage) << " T " << tokens);
      const OwnedTensor x_bf16 = testing::random_tensor(DType::kBF16, {tokens, c.hidden}, rng);
      OwnedTensor x_f32(DType::kF32, {tokens, c.hidden});
      const std::vector<double> x_values = testing::to_doubles(*x_bf16);
      testing::fill(*x_f32, std::vector<float>(x_values.begin(), x_values.end()));
      ForwardBatch batch;
      batch.num_tokens = tokens;
      Arena cpu_arena(Device::cpu(), 1 << 20);
      Arena gpu_arena(Device::cuda(), 64 << 20, /*growable=*/false);
      OwnedTensor out_cpu(DType::kF32, {tokens, c.hidden});
      testing::poison(*out_cpu);
      cpu_block.forward(StepContext{batch, cpu_arena, DType::kF32, Tensor(), Tensor()}, *x_f32, *out_cpu);
      const OwnedTensor x_device = to_device(*x_bf16);
      const OwnedTensor out_device = poisoned_device(DType::kBF16, {tokens, c.hidden});
      gpu_block.forward(StepContext{batch, gpu_arena, DType::kBF16, Tensor(), Tensor()}, *x_device, *out_device);
      EXPECT_TRUE(testing::close_rel_l2(*to_host(*out_device), testing::to_doubles(*out_cpu), 2e-2));
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Qwen3-30B-A3B expert shapes (E 128, k 8, H 2048, I 768): decode at T = 1..8 (bytes of the selected
// experts over time) and the grouped path at T = 512..8192 (TFLOP/s).
TEST(CudaMoeBench, DISABLED_Qwen3_30B_A3B) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  const int64_t experts = 128, k = 8, hidden = 2048, inter = 768;
  const auto stream = static_cast<cudaStream_t>(current_stream(Device::cuda()));
  OwnedTensor gate_up(DType::kBF16, {experts, 2 * inter, hidden}, Device::cuda());
  OwnedTensor down(DType::kBF16, {experts, hidden, inter}, Device::cuda());
  ASSERT_EQ(cudaMemsetAsync(gate_up->data(), 0x3c, gate_up->nbytes(), stream), cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(down->data(), 0x3c, down->nbytes(), stream), cudaSuccess);
  const auto weights = kernels::MoeExpertWeights::from_fused(*gate_up, *down);
  Random rng(7008);
  const auto time_us = [&](const std::function<void()>& body) {
    for (int i = 0; i < 3; ++i) body();
    std::vector<float> times;
    for (int rep = 0; rep < 7; ++rep) {
      CudaEvent start, stop;
      constexpr int kIterations = 10;
      start.record(stream);
      for (int i = 0; i < kIterations; ++i) body();
      stop.record(stream);
      stop.synchronize();
      times.push_back(stop.elapsed_ms_since(start) * 1000.0f / kIterations);
    }
    std::sort(times.begin(), times.end());
    return static_cast<double>(times[times.size() / 2]);
  };
  const double expert_bytes = 3.0 * hidden * inter * 2;
  std::printf("decode: %6s %10s %10s %10s\n", "T", "us", "experts", "GB/s");
  for (const int64_t tokens : {1, 2, 4, 8}) {
    std::vector<int32_t> ids = random_routes(tokens, k, experts, rng);
    const OwnedTensor ids_device = to_device(Tensor(ids.data(), DType::kI32, {tokens, k}));
    OwnedTensor x(DType::kBF16, {tokens, hidden}, Device::cuda());
    ASSERT_EQ(cudaMemsetAsync(x->data(), 0x3f, x->nbytes(), stream), cudaSuccess);
    OwnedTensor h(DType::kF32, {tokens * k, inter}, Device::cuda());
    OwnedTensor y(DType::kF32, {tokens * k, hidden}, Device::cuda());
    const double us = time_us([&] {
      kernels::moe_decode_gate_up(*x, *ids_device, weights, *h);
      kernels::moe_decode_down(*h, *ids_device, weights, *y);
    });
    std::vector<int32_t> distinct = ids;
    std::sort(distinct.begin(), distinct.end());
    distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
    std::printf("decode: %6lld %10.1f %10zu %10.0f\n", static_cast<long long>(tokens), us, distinct.size(),
                static_cast<double>(distinct.size()) * expert_bytes / us / 1e3);
  }
  std::printf("grouped: %6s %10s %10s %10s\n", "T", "sort us", "gemm us", "TFLOP/s");
  for (const int64_t tokens : {512, 2048, 8192}) {
    const int64_t slots = tokens * k;
    std::vector<int32_t> ids = random_routes(tokens, k, experts, rng);
    const OwnedTensor ids_device = to_device(Tensor(ids.data(), DType::kI32, {tokens, k}));
    OwnedTensor x(DType::kBF16, {tokens, hidden}, Device::cuda());
    ASSERT_EQ(cudaMemsetAsync(x->data(), 0x3f, x->nbytes(), stream), cudaSuccess);
    OwnedTensor offsets(DType::kI32, {experts + 1}, Device::cuda());
    OwnedTensor sorted(DType::kI32, {slots}, Device::cuda());
    OwnedTensor scratch(DType::kI32, {kernels::moe_sort_scratch_elements(slots, experts)}, Device::cuda());
    OwnedTensor h(DType::kBF16, {slots, inter}, Device::cuda());
    OwnedTensor y(DType::kF32, {slots, hidden}, Device::cuda());
    const double sort_us = time_us([&] { kernels::moe_sort(*ids_device, *offsets, *sorted, *scratch); });
    const double gemm_us = time_us([&] {
      kernels::moe_grouped_gate_up(*x, *sorted, *offsets, static_cast<int>(k), weights, *h);
      kernels::moe_grouped_down(*h, *sorted, *offsets, weights, *y);
    });
    const double flops = 2.0 * static_cast<double>(slots) * 3.0 * hidden * inter;
    std::printf("grouped: %6lld %10.1f %10.1f %10.1f\n", static_cast<long long>(tokens), sort_us, gemm_us,
                flops / gemm_us / 1e6);
  }
}

}  // namespace
}  // namespace metrale
