// The DeepSeek-V3 routing and the clamped SwiGLU of glm5_next (glm_deepseek.md §1, §2.7) on the CPU:
// moe_route with sigmoid scores, e_score_correction_bias for the choice only, group limiting,
// renormalisation with its 1e-20 and routed_scaling_factor; silu_mul and the routed-expert ops with
// swiglu_limit; moe_combine with an ungated shared expert added after the routed sum is rounded.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "kernels/activation.h"
#include "kernels/kernel_helpers.h"
#include "kernels/moe.h"

namespace metrale {
namespace {

using testing::Random;

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

struct Route {
  std::vector<int32_t> ids;  // sorted ascending (the order of the op's ids is by choice score)
  std::vector<double> weight_of;
};

// The reference router of §1 for one token, in double.
Route reference_route(const std::vector<double>& logits, const std::vector<double>& bias, int k, int n_group,
                      int topk_group, bool normalize, double scaling) {
  const auto E = static_cast<int64_t>(logits.size());
  std::vector<double> s(logits.size()), choice(logits.size());
  for (size_t e = 0; e < logits.size(); ++e) {
    s[e] = sigmoid(logits[e]);
    choice[e] = s[e] + bias[e];
  }
  const int64_t per = E / n_group;
  std::vector<double> group(static_cast<size_t>(n_group));
  for (int g = 0; g < n_group; ++g) {
    std::vector<double> members(choice.begin() + g * per, choice.begin() + (g + 1) * per);
    std::sort(members.rbegin(), members.rend());
    group[static_cast<size_t>(g)] = members[0] + members[1];
  }
  std::vector<int> groups(static_cast<size_t>(n_group));
  std::iota(groups.begin(), groups.end(), 0);
  std::stable_sort(groups.begin(), groups.end(), [&](int a, int b) { return group[static_cast<size_t>(a)] > group[static_cast<size_t>(b)]; });
  for (size_t rank = static_cast<size_t>(topk_group); rank < groups.size(); ++rank)
    for (int64_t e = groups[rank] * per; e < (groups[rank] + 1) * per; ++e) choice[static_cast<size_t>(e)] = -1e300;
  std::vector<int32_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return choice[static_cast<size_t>(a)] > choice[static_cast<size_t>(b)]; });
  Route route;
  route.ids.assign(order.begin(), order.begin() + k);
  double sum = 0.0;
  for (const int32_t e : route.ids) sum += s[static_cast<size_t>(e)];
  route.weight_of.assign(logits.size(), 0.0);
  for (const int32_t e : route.ids) {
    route.weight_of[static_cast<size_t>(e)] = (normalize ? s[static_cast<size_t>(e)] / (sum + 1e-20) : s[static_cast<size_t>(e)]) * scaling;
  }
  std::sort(route.ids.begin(), route.ids.end());
  return route;
}

TEST(MoeSigmoidRouter, MatchesReferenceWithBiasGroupsAndScaling) {
  Random rng(71);
  const int64_t tokens = 33, experts = 32;
  const OwnedTensor logits = testing::random_tensor(DType::kF32, {tokens, experts}, rng, -3.0f, 3.0f);
  // A bias large enough to change the choice: the weights must still be the unbiased scores.
  const OwnedTensor bias = testing::random_tensor(DType::kF32, {experts}, rng, -0.3f, 0.3f);
  struct Case {
    int k, n_group, topk_group;
    bool normalize;
    float scaling;
  };
  for (const Case c : {Case{6, 1, 1, true, 2.5f}, Case{4, 4, 2, true, 1.5f}, Case{3, 8, 3, false, 1.0f}}) {
    kernels::MoeRouteParams params;
    params.top_k = c.k;
    params.normalize = c.normalize;
    params.scoring = kernels::MoeScoring::kSigmoid;
    params.correction_bias = *bias;
    params.n_group = c.n_group;
    params.topk_group = c.topk_group;
    params.routed_scaling_factor = c.scaling;
    OwnedTensor ids(DType::kI32, {tokens, c.k}), weights(DType::kF32, {tokens, c.k});
    kernels::moe_route(*logits, *ids, *weights, params);
    const std::vector<double> ls = testing::to_doubles(*logits), bs = testing::to_doubles(*bias);
    int changed_by_bias = 0;
    for (int64_t t = 0; t < tokens; ++t) {
      const std::vector<double> row(ls.begin() + t * experts, ls.begin() + (t + 1) * experts);
      const Route expected = reference_route(row, bs, c.k, c.n_group, c.topk_group, c.normalize, c.scaling);
      std::vector<int32_t> got(ids->data_as<const int32_t>() + t * c.k, ids->data_as<const int32_t>() + (t + 1) * c.k);
      const std::vector<int32_t> got_in_order = got;
      std::sort(got.begin(), got.end());
      ASSERT_EQ(got, expected.ids) << "token " << t << " k " << c.k;
      for (int j = 0; j < c.k; ++j) {
        const int32_t e = got_in_order[static_cast<size_t>(j)];
        EXPECT_NEAR(weights->data_as<const float>()[t * c.k + j], expected.weight_of[static_cast<size_t>(e)], 1e-6);
      }
      const Route unbiased = reference_route(row, std::vector<double>(bs.size(), 0.0), c.k, c.n_group, c.topk_group,
                                             c.normalize, c.scaling);
      changed_by_bias += unbiased.ids != expected.ids;
    }
    EXPECT_GT(changed_by_bias, 0) << "the bias must matter for the test to mean something";
  }
}

TEST(ClampedSwiglu, SiluMulClampsGateAboveAndUpBothWays) {
  Random rng(72);
  const int64_t rows = 4, width = 64;
  const float limit = 3.0f;
  const OwnedTensor gate = testing::random_tensor(DType::kF32, {rows, width}, rng, -8.0f, 8.0f);
  const OwnedTensor up = testing::random_tensor(DType::kF32, {rows, width}, rng, -8.0f, 8.0f);
  OwnedTensor out(DType::kF32, {rows, width}), plain(DType::kF32, {rows, width});
  kernels::silu_mul(*gate, *up, *out, limit);
  kernels::silu_mul(*gate, *up, *plain);
  const std::vector<double> g = testing::to_doubles(*gate), u = testing::to_doubles(*up);
  std::vector<double> expected, unclamped;
  for (size_t i = 0; i < g.size(); ++i) {
    const double gc = std::min(g[i], static_cast<double>(limit)), uc = std::clamp(u[i], -3.0, 3.0);
    expected.push_back(gc * sigmoid(gc) * uc);
    unclamped.push_back(g[i] * sigmoid(g[i]) * u[i]);
  }
  EXPECT_TRUE(testing::close_rel_l2(*out, expected, testing::kF32Tolerance));
  EXPECT_TRUE(testing::close_rel_l2(*plain, unclamped, testing::kF32Tolerance));
}

TEST(ClampedSwiglu, RoutedExpertsClampBothPaths) {
  Random rng(73);
  const int64_t tokens = 3, hidden = 32, inter = 16, E = 4;
  const int k = 2;
  const OwnedTensor x = testing::random_tensor(DType::kF32, {tokens, hidden}, rng, -2.0f, 2.0f);
  const OwnedTensor gate_up = testing::random_tensor(DType::kF32, {E, 2 * inter, hidden}, rng, -1.0f, 1.0f);
  const OwnedTensor down = testing::random_tensor(DType::kF32, {E, hidden, inter}, rng);
  kernels::MoeExpertWeights experts = kernels::MoeExpertWeights::from_fused(*gate_up, *down);
  experts.swiglu_limit = 1.5f;
  std::vector<int32_t> id_values = {0, 3, 2, 0, 1, 3};
  const Tensor ids(id_values.data(), DType::kI32, {tokens, k});
  OwnedTensor h(DType::kF32, {tokens * k, inter});
  kernels::moe_decode_gate_up(*x, ids, experts, *h);
  const std::vector<double> xs = testing::to_doubles(*x), w = testing::to_doubles(*gate_up);
  std::vector<double> expected;
  for (int64_t s = 0; s < tokens * k; ++s) {
    const int64_t e = id_values[static_cast<size_t>(s)], t = s / k;
    for (int64_t i = 0; i < inter; ++i) {
      double g = 0.0, u = 0.0;
      for (int64_t c = 0; c < hidden; ++c) {
        g += xs[static_cast<size_t>(t * hidden + c)] * w[static_cast<size_t>((e * 2 * inter + i) * hidden + c)];
        u += xs[static_cast<size_t>(t * hidden + c)] * w[static_cast<size_t>((e * 2 * inter + inter + i) * hidden + c)];
      }
      g = std::min(g, 1.5);
      u = std::clamp(u, -1.5, 1.5);
      expected.push_back(g * sigmoid(g) * u);
    }
  }
  EXPECT_TRUE(testing::close_rel_l2(*h, expected, 1e-6));
  // The grouped path over expert-sorted slots gives the same rows (in sorted order).
  std::vector<int32_t> offsets(static_cast<size_t>(E + 1)), sorted(static_cast<size_t>(tokens * k));
  OwnedTensor scratch(DType::kI32, {kernels::moe_sort_scratch_elements(tokens * k, E)});
  const Tensor offsets_t(offsets.data(), DType::kI32, {E + 1}), sorted_t(sorted.data(), DType::kI32, {tokens * k});
  kernels::moe_sort(ids, offsets_t, sorted_t, *scratch);
  OwnedTensor hg(DType::kF32, {tokens * k, inter});
  kernels::moe_grouped_gate_up(*x, sorted_t, offsets_t, k, experts, *hg);
  const std::vector<double> grouped = testing::to_doubles(*hg);
  for (int64_t p = 0; p < tokens * k; ++p) {
    const std::vector<double> row(grouped.begin() + p * inter, grouped.begin() + (p + 1) * inter);
    const std::vector<double> want(expected.begin() + sorted[static_cast<size_t>(p)] * inter,
                                   expected.begin() + (sorted[static_cast<size_t>(p)] + 1) * inter);
    EXPECT_TRUE(testing::close_rel_l2(row, want, 1e-6)) << "sorted row " << p;
  }
}

TEST(MoeCombine, UngatedSharedExpertIsAddedAfterRounding) {
  Random rng(74);
  const int64_t tokens = 3, hidden = 24;
  const int k = 2;
  const OwnedTensor slot_out = testing::random_tensor(DType::kF32, {tokens * k, hidden}, rng, -2.0f, 2.0f);
  const OwnedTensor weights = testing::random_tensor(DType::kF32, {tokens, k}, rng, 0.1f, 2.0f);
  const OwnedTensor shared = testing::random_tensor(DType::kF32, {tokens, hidden}, rng, -2.0f, 2.0f);
  for (const DType dtype : {DType::kF32, DType::kBF16}) {
    OwnedTensor out(dtype, {tokens, hidden});
    kernels::moe_combine(*slot_out, *weights, *shared, Tensor(), *out);
    const std::vector<double> so = testing::to_doubles(*slot_out), w = testing::to_doubles(*weights);
    const std::vector<double> sh = testing::to_doubles(*shared);
    const auto r = [&](double v) { return dtype == DType::kBF16 ? static_cast<double>(round_to_bf16(static_cast<float>(v))) : v; };
    std::vector<double> expected;
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t c = 0; c < hidden; ++c) {
        double routed = 0.0;
        for (int j = 0; j < k; ++j) routed += w[static_cast<size_t>(t * k + j)] * so[static_cast<size_t>((t * k + j) * hidden + c)];
        expected.push_back(r(r(routed) + r(sh[static_cast<size_t>(t * hidden + c)])));
      }
    }
    EXPECT_TRUE(testing::close_rel_l2(*out, expected, dtype == DType::kF32 ? 1e-6 : 3e-3)) << dtype_name(dtype);
  }
}

}  // namespace
}  // namespace metrale
