// The CPU MoE expert ops (moe_sort, the decode and grouped expert paths, moe_combine) against
// naive double-precision references, on awkward sizes, with some experts left empty.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "kernels/kernel_helpers.h"
#include "kernels/moe.h"

namespace metrale {
namespace {

using testing::Random;

// Distinct random experts per token, drawn from the first `used_experts` ids (the rest stay empty).
std::vector<int32_t> random_routes(int64_t tokens, int64_t k, int64_t used_experts, Random& rng) {
  std::vector<int32_t> ids;
  std::vector<int32_t> pool(static_cast<size_t>(used_experts));
  for (int64_t t = 0; t < tokens; ++t) {
    std::iota(pool.begin(), pool.end(), 0);
    std::shuffle(pool.begin(), pool.end(), rng.engine());
    ids.insert(ids.end(), pool.begin(), pool.begin() + k);
  }
  return ids;
}

struct ExpertSet {
  OwnedTensor gate_up;  // [E, 2I, H]
  OwnedTensor down;     // [E, H, I]
  kernels::MoeExpertWeights weights;
};

ExpertSet random_experts(DType dtype, int64_t experts, int64_t hidden, int64_t inter, Random& rng) {
  ExpertSet set{testing::random_tensor(dtype, {experts, 2 * inter, hidden}, rng),
                testing::random_tensor(dtype, {experts, hidden, inter}, rng),
                {}};
  set.weights = kernels::MoeExpertWeights::from_fused(*set.gate_up, *set.down);
  return set;
}

double silu(double g) { return g / (1.0 + std::exp(-g)); }

// h[s] = silu(x[token(s)] . gate[e]) * (x[token(s)] . up[e]) for the listed (token, expert) rows.
std::vector<double> reference_gate_up(const std::vector<double>& x, const std::vector<double>& gate_up,
                                      const std::vector<int64_t>& tokens, const std::vector<int32_t>& experts,
                                      int64_t hidden, int64_t inter) {
  std::vector<double> h;
  for (size_t r = 0; r < tokens.size(); ++r) {
    const double* xr = x.data() + tokens[r] * hidden;
    const double* w = gate_up.data() + static_cast<int64_t>(experts[r]) * 2 * inter * hidden;
    for (int64_t i = 0; i < inter; ++i) {
      double g = 0.0, u = 0.0;
      for (int64_t c = 0; c < hidden; ++c) {
        g += xr[c] * w[i * hidden + c];
        u += xr[c] * w[(inter + i) * hidden + c];
      }
      h.push_back(silu(g) * u);
    }
  }
  return h;
}

// y[r] = h[r] . down[e]^T.
std::vector<double> reference_down(const std::vector<double>& h, const std::vector<double>& down,
                                   const std::vector<int32_t>& experts, int64_t hidden, int64_t inter) {
  std::vector<double> y;
  for (size_t r = 0; r < experts.size(); ++r) {
    const double* hr = h.data() + static_cast<int64_t>(r) * inter;
    const double* w = down.data() + static_cast<int64_t>(experts[r]) * hidden * inter;
    for (int64_t c = 0; c < hidden; ++c) {
      double sum = 0.0;
      for (int64_t i = 0; i < inter; ++i) sum += hr[i] * w[c * inter + i];
      y.push_back(sum);
    }
  }
  return y;
}

TEST(MoeOpsSort, StableCountingSortByExpert) {
  Random rng(811);
  for (const auto [tokens, k, experts, used] : std::vector<std::array<int64_t, 4>>{
           {1, 1, 1, 1}, {1, 2, 4, 4}, {37, 2, 8, 5}, {300, 8, 128, 100}, {70, 4, 6, 6}}) {
    SCOPED_TRACE(::testing::Message() << "T " << tokens << " k " << k << " E " << experts);
    std::vector<int32_t> ids = random_routes(tokens, k, used, rng);
    // Shuffle expert ids so that empty experts are not only the last ones.
    std::vector<int32_t> relabel(static_cast<size_t>(experts));
    std::iota(relabel.begin(), relabel.end(), 0);
    std::shuffle(relabel.begin(), relabel.end(), rng.engine());
    for (auto& id : ids) id = relabel[static_cast<size_t>(id)];
    const int64_t slots = tokens * k;
    OwnedTensor offsets(DType::kI32, {experts + 1}), sorted(DType::kI32, {slots});
    OwnedTensor scratch(DType::kI32, {std::max<int64_t>(1, kernels::moe_sort_scratch_elements(slots, experts))});
    std::fill_n(offsets->data_as<int32_t>(), experts + 1, -7);
    std::fill_n(sorted->data_as<int32_t>(), slots, -7);
    kernels::moe_sort(Tensor(ids.data(), DType::kI32, {tokens, k}), *offsets, *sorted, *scratch);

    std::vector<int32_t> expected_sorted, expected_offsets;
    for (int32_t e = 0; e < experts; ++e) {
      expected_offsets.push_back(static_cast<int32_t>(expected_sorted.size()));
      for (int64_t s = 0; s < slots; ++s) {
        if (ids[static_cast<size_t>(s)] == e) expected_sorted.push_back(static_cast<int32_t>(s));
      }
    }
    expected_offsets.push_back(static_cast<int32_t>(slots));
    EXPECT_EQ(std::vector<int32_t>(offsets->data_as<int32_t>(), offsets->data_as<int32_t>() + experts + 1),
              expected_offsets);
    EXPECT_EQ(std::vector<int32_t>(sorted->data_as<int32_t>(), sorted->data_as<int32_t>() + slots), expected_sorted);
  }
}

TEST(MoeOpsSort, RejectsExpertOutOfRange) {
  std::vector<int32_t> ids = {0, 3};
  OwnedTensor offsets(DType::kI32, {4}), sorted(DType::kI32, {2}), scratch(DType::kI32, {3});
  EXPECT_THROW(kernels::moe_sort(Tensor(ids.data(), DType::kI32, {1, 2}), *offsets, *sorted, *scratch), Error);
}

struct ExpertCase {
  int64_t tokens, k, experts, hidden, inter;
  DType weight_dtype;
};

const ExpertCase kExpertCases[] = {
    {1, 1, 1, 8, 8, DType::kF32},     {1, 2, 4, 24, 16, DType::kBF16},  {3, 2, 5, 40, 24, DType::kBF16},
    {37, 4, 9, 33, 17, DType::kF32},  {9, 3, 3, 16, 40, DType::kF16},
};

TEST(MoeOpsDecode, MatchesReference) {
  Random rng(823);
  for (const ExpertCase& c : kExpertCases) {
    SCOPED_TRACE(::testing::Message() << "T " << c.tokens << " k " << c.k << " E " << c.experts << " H " << c.hidden
                                      << " I " << c.inter);
    const ExpertSet experts = random_experts(c.weight_dtype, c.experts, c.hidden, c.inter, rng);
    const OwnedTensor x = testing::random_tensor(DType::kF32, {c.tokens, c.hidden}, rng);
    std::vector<int32_t> ids = random_routes(c.tokens, c.k, c.experts, rng);
    const Tensor ids_tensor(ids.data(), DType::kI32, {c.tokens, c.k});
    const int64_t slots = c.tokens * c.k;
    OwnedTensor h(DType::kF32, {slots, c.inter}), y(DType::kF32, {slots, c.hidden});
    testing::poison(*h);
    testing::poison(*y);
    kernels::moe_decode_gate_up(*x, ids_tensor, experts.weights, *h);
    kernels::moe_decode_down(*h, ids_tensor, experts.weights, *y);

    std::vector<int64_t> token_of;
    for (int64_t s = 0; s < slots; ++s) token_of.push_back(s / c.k);
    const auto expected_h = reference_gate_up(testing::to_doubles(*x), testing::to_doubles(*experts.gate_up), token_of,
                                              ids, c.hidden, c.inter);
    EXPECT_TRUE(testing::close_rel_l2(*h, expected_h, 1e-5));
    const auto expected_y =
        reference_down(testing::to_doubles(*h), testing::to_doubles(*experts.down), ids, c.hidden, c.inter);
    EXPECT_TRUE(testing::close_rel_l2(*y, expected_y, 1e-5));
  }
}

TEST(MoeOpsGrouped, MatchesReferenceAndDecodePath) {
  Random rng(829);
  for (const ExpertCase& c : kExpertCases) {
    for (const DType h_dtype : {DType::kF32, DType::kBF16}) {
      SCOPED_TRACE(::testing::Message() << "T " << c.tokens << " k " << c.k << " E " << c.experts << " h "
                                        << dtype_name(h_dtype));
      const ExpertSet experts = random_experts(c.weight_dtype, c.experts, c.hidden, c.inter, rng);
      const OwnedTensor x = testing::random_tensor(DType::kBF16, {c.tokens, c.hidden}, rng);
      // Route to the first experts only when there are several, so that some stay empty.
      std::vector<int32_t> ids = random_routes(c.tokens, c.k, std::max<int64_t>(c.k, c.experts - 1), rng);
      const Tensor ids_tensor(ids.data(), DType::kI32, {c.tokens, c.k});
      const int64_t slots = c.tokens * c.k;
      OwnedTensor offsets(DType::kI32, {c.experts + 1}), sorted(DType::kI32, {slots});
      OwnedTensor scratch(DType::kI32, {kernels::moe_sort_scratch_elements(slots, c.experts)});
      kernels::moe_sort(ids_tensor, *offsets, *sorted, *scratch);
      OwnedTensor h(h_dtype, {slots, c.inter}), y(DType::kF32, {slots, c.hidden});
      testing::poison(*h);
      testing::poison(*y);
      kernels::moe_grouped_gate_up(*x, *sorted, *offsets, static_cast<int>(c.k), experts.weights, *h);
      kernels::moe_grouped_down(*h, *sorted, *offsets, experts.weights, *y);

      // h rows are in sorted order; y rows in slot order.
      std::vector<int64_t> token_of;
      std::vector<int32_t> expert_of_sorted;
      for (int64_t p = 0; p < slots; ++p) {
        const int32_t slot = sorted->data_as<int32_t>()[p];
        token_of.push_back(slot / c.k);
        expert_of_sorted.push_back(ids[static_cast<size_t>(slot)]);
      }
      const auto expected_h = reference_gate_up(testing::to_doubles(*x), testing::to_doubles(*experts.gate_up),
                                                token_of, expert_of_sorted, c.hidden, c.inter);
      EXPECT_TRUE(testing::close_rel_l2(*h, expected_h, h_dtype == DType::kF32 ? 1e-5 : testing::kBf16OutputTolerance));
      const auto y_sorted = reference_down(testing::to_doubles(*h), testing::to_doubles(*experts.down),
                                           expert_of_sorted, c.hidden, c.inter);
      std::vector<double> expected_y(y_sorted.size());
      for (int64_t p = 0; p < slots; ++p) {
        const int32_t slot = sorted->data_as<int32_t>()[p];
        std::copy_n(y_sorted.begin() + p * c.hidden, c.hidden, expected_y.begin() + slot * c.hidden);
      }
      EXPECT_TRUE(testing::close_rel_l2(*y, expected_y, 1e-5));

      if (h_dtype == DType::kF32) {
        // The decode path computes the same function.
        OwnedTensor h_decode(DType::kF32, {slots, c.inter}), y_decode(DType::kF32, {slots, c.hidden});
        kernels::moe_decode_gate_up(*x, ids_tensor, experts.weights, *h_decode);
        kernels::moe_decode_down(*h_decode, ids_tensor, experts.weights, *y_decode);
        EXPECT_TRUE(testing::close_rel_l2(*y_decode, testing::to_doubles(*y), 1e-6));
      }
    }
  }
}

TEST(MoeOpsGrouped, PerExpertViewsMatchFusedLayout) {
  Random rng(839);
  const int64_t tokens = 11, k = 2, experts = 4, hidden = 24, inter = 16, slots = tokens * k;
  const ExpertSet fused = random_experts(DType::kBF16, experts, hidden, inter, rng);
  // The same values as separate per-expert tensors (as a per-expert checkpoint stores them).
  std::vector<OwnedTensor> separate;
  kernels::MoeExpertWeights views;
  views.num_experts = experts;
  views.hidden_size = hidden;
  views.intermediate_size = inter;
  for (int64_t e = 0; e < experts; ++e) {
    for (const Tensor& src :
         {fused.weights.gate[static_cast<size_t>(e)].weight, fused.weights.up[static_cast<size_t>(e)].weight,
          fused.weights.down[static_cast<size_t>(e)].weight}) {
      separate.emplace_back(src.dtype(), src.shape());
      copy_tensor(*separate.back(), src);
    }
    views.gate.push_back(*separate[separate.size() - 3]);
    views.up.push_back(*separate[separate.size() - 2]);
    views.down.push_back(*separate[separate.size() - 1]);
  }
  const OwnedTensor x = testing::random_tensor(DType::kF32, {tokens, hidden}, rng);
  std::vector<int32_t> ids = random_routes(tokens, k, experts, rng);
  const Tensor ids_tensor(ids.data(), DType::kI32, {tokens, k});
  OwnedTensor offsets(DType::kI32, {experts + 1}), sorted(DType::kI32, {slots});
  OwnedTensor scratch(DType::kI32, {kernels::moe_sort_scratch_elements(slots, experts)});
  kernels::moe_sort(ids_tensor, *offsets, *sorted, *scratch);
  OwnedTensor h_fused(DType::kF32, {slots, inter}), h_views(DType::kF32, {slots, inter});
  OwnedTensor y_fused(DType::kF32, {slots, hidden}), y_views(DType::kF32, {slots, hidden});
  kernels::moe_grouped_gate_up(*x, *sorted, *offsets, static_cast<int>(k), fused.weights, *h_fused);
  kernels::moe_grouped_gate_up(*x, *sorted, *offsets, static_cast<int>(k), views, *h_views);
  kernels::moe_grouped_down(*h_fused, *sorted, *offsets, fused.weights, *y_fused);
  kernels::moe_grouped_down(*h_views, *sorted, *offsets, views, *y_views);
  EXPECT_EQ(testing::element_bytes(*h_fused), testing::element_bytes(*h_views));
  EXPECT_EQ(testing::element_bytes(*y_fused), testing::element_bytes(*y_views));
}

TEST(MoeOpsCombine, MatchesReference) {
  Random rng(853);
  for (const auto [tokens, k, hidden] : std::vector<std::array<int64_t, 3>>{{1, 1, 8}, {3, 2, 33}, {17, 8, 64}}) {
    for (const bool shared : {false, true}) {
      for (const DType out_dtype : {DType::kF32, DType::kBF16}) {
        SCOPED_TRACE(::testing::Message() << "T " << tokens << " k " << k << " H " << hidden << " shared " << shared
                                          << " out " << dtype_name(out_dtype));
        const OwnedTensor slot_out = testing::random_tensor(DType::kF32, {tokens * k, hidden}, rng, -2.0f, 2.0f);
        const OwnedTensor weights = testing::random_tensor(DType::kF32, {tokens, k}, rng, 0.0f, 1.0f);
        OwnedTensor shared_out, gate;
        if (shared) {
          shared_out = testing::random_tensor(DType::kF32, {tokens, hidden}, rng);
          gate = testing::random_tensor(DType::kF32, {tokens, 1}, rng, -3.0f, 3.0f);
        }
        OwnedTensor out(out_dtype, {tokens, hidden});
        testing::poison(*out);
        kernels::moe_combine(*slot_out, *weights, *shared_out, *gate, *out);
        const auto s = testing::to_doubles(*slot_out), w = testing::to_doubles(*weights);
        const auto so = shared ? testing::to_doubles(*shared_out) : std::vector<double>();
        const auto g = shared ? testing::to_doubles(*gate) : std::vector<double>();
        std::vector<double> expected;
        for (int64_t t = 0; t < tokens; ++t) {
          for (int64_t c = 0; c < hidden; ++c) {
            double sum = 0.0;
            for (int64_t j = 0; j < k; ++j) sum += w[static_cast<size_t>(t * k + j)] * s[static_cast<size_t>((t * k + j) * hidden + c)];
            if (shared) {
              sum += so[static_cast<size_t>(t * hidden + c)] / (1.0 + std::exp(-g[static_cast<size_t>(t)]));
            }
            expected.push_back(sum);
          }
        }
        EXPECT_TRUE(testing::close_rel_l2(
            *out, expected, out_dtype == DType::kF32 ? testing::kF32Tolerance : testing::kBf16OutputTolerance));
      }
    }
  }
}

}  // namespace
}  // namespace metrale
