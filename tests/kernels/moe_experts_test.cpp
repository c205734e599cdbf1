// The routed-expert ops of kernels/moe.h against double references: moe_sort (stable counting
// sort), the decode path (moe_decode_gate_up, moe_decode_down), the grouped path
// (moe_grouped_gate_up, moe_grouped_down over sorted slots), moe_combine (weighted k-slot reduce
// with the optional sigmoid-gated shared expert), and MoeExpertWeights::from_fused.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "kernels/kernel_helpers.h"
#include "kernels/moe.h"

namespace metrale {
namespace {

using kernels::MoeExpertWeights;
using testing::Random;

// Per-expert weights in separate tensors (the per-expert checkpoint layout), kept alive here.
struct Experts {
  std::vector<OwnedTensor> owned;
  MoeExpertWeights weights;
  std::vector<std::vector<double>> gate, up, down;  // as doubles, row-major
};

Experts make_experts(int64_t e_count, int64_t hidden, int64_t inter, DType dtype, Random& rng) {
  Experts experts;
  experts.weights.num_experts = e_count;
  experts.weights.hidden_size = hidden;
  experts.weights.intermediate_size = inter;
  for (int64_t e = 0; e < e_count; ++e) {
    experts.owned.push_back(random_tensor(dtype, {inter, hidden}, rng, -0.5f, 0.5f));
    experts.weights.gate.push_back(experts.owned.back().tensor);
    experts.gate.push_back(testing::to_doubles(experts.owned.back().tensor));
    experts.owned.push_back(random_tensor(dtype, {inter, hidden}, rng, -0.5f, 0.5f));
    experts.weights.up.push_back(experts.owned.back().tensor);
    experts.up.push_back(testing::to_doubles(experts.owned.back().tensor));
    experts.owned.push_back(random_tensor(dtype, {hidden, inter}, rng, -0.5f, 0.5f));
    experts.weights.down.push_back(experts.owned.back().tensor);
    experts.down.push_back(testing::to_doubles(experts.owned.back().tensor));
  }
  return experts;
}

// topk ids [T, k]: k distinct experts per token; expert `unused` is never picked and expert 0 is
// picked by every token (a busy expert next to an idle one).
std::vector<int32_t> make_topk_ids(int64_t tokens, int k, int64_t e_count, int32_t unused, Random& rng) {
  std::vector<int32_t> ids;
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<int32_t> experts;
    for (int32_t e = 1; e < e_count; ++e)
      if (e != unused) experts.push_back(e);
    std::shuffle(experts.begin(), experts.end(), rng.engine());
    experts.insert(experts.begin() + static_cast<ptrdiff_t>(rng.integer(0, k - 1)), 0);
    ids.insert(ids.end(), experts.begin(), experts.begin() + k);
  }
  return ids;
}

double silu(double v) {
  return v / (1.0 + std::exp(-v));
}

// h = silu(x . gate^T) * (x . up^T) for one token row and one expert.
std::vector<double> reference_gate_up(const std::vector<double>& x_row, const Experts& experts, int32_t e) {
  const size_t inter = static_cast<size_t>(experts.weights.intermediate_size), hidden = x_row.size();
  std::vector<double> h(inter);
  for (size_t i = 0; i < inter; ++i) {
    double g = 0.0, u = 0.0;
    for (size_t c = 0; c < hidden; ++c) {
      g += x_row[c] * experts.gate[static_cast<size_t>(e)][i * hidden + c];
      u += x_row[c] * experts.up[static_cast<size_t>(e)][i * hidden + c];
    }
    h[i] = silu(g) * u;
  }
  return h;
}

std::vector<double> reference_down(const std::vector<double>& h_row, const Experts& experts, int32_t e) {
  const size_t hidden = static_cast<size_t>(experts.weights.hidden_size), inter = h_row.size();
  std::vector<double> y(hidden, 0.0);
  for (size_t c = 0; c < hidden; ++c)
    for (size_t i = 0; i < inter; ++i) y[c] += h_row[i] * experts.down[static_cast<size_t>(e)][c * inter + i];
  return y;
}

std::vector<double> row(const std::vector<double>& values, int64_t r, int64_t width) {
  return {values.begin() + r * width, values.begin() + (r + 1) * width};
}

struct SortResult {
  std::vector<int32_t> offsets, sorted;
};

SortResult run_sort(std::vector<int32_t>& ids, int64_t tokens, int k, int64_t e_count) {
  OwnedTensor offsets(DType::kI32, {e_count + 1}), sorted(DType::kI32, {tokens * k});
  OwnedTensor scratch(DType::kI32, {kernels::moe_sort_scratch_elements(tokens * k, e_count)});
  std::fill_n(offsets->data_as<int32_t>(), e_count + 1, -7);
  std::fill_n(sorted->data_as<int32_t>(), tokens * k, -7);
  kernels::moe_sort(Tensor(ids.data(), DType::kI32, {tokens, k}), *offsets, *sorted, *scratch);
  return {{offsets->data_as<int32_t>(), offsets->data_as<int32_t>() + e_count + 1},
          {sorted->data_as<int32_t>(), sorted->data_as<int32_t>() + tokens * k}};
}

TEST(MoeSort, StableCountingSortByExpert) {
  Random rng(1501);
  for (const int64_t tokens : {1, 5, 97, 300}) {  // 300 * 3 slots spans several 256-slot chunks
    const int k = 3;
    const int64_t e_count = 7;
    std::vector<int32_t> ids = make_topk_ids(tokens, k, e_count, 4, rng);
    const SortResult result = run_sort(ids, tokens, k, e_count);
    // Reference: expert e's slots, ascending, concatenated in expert order.
    std::vector<int32_t> expected_sorted, expected_offsets = {0};
    for (int32_t e = 0; e < e_count; ++e) {
      for (int32_t s = 0; s < static_cast<int32_t>(ids.size()); ++s)
        if (ids[static_cast<size_t>(s)] == e) expected_sorted.push_back(s);
      expected_offsets.push_back(static_cast<int32_t>(expected_sorted.size()));
    }
    EXPECT_EQ(result.offsets, expected_offsets) << tokens;
    EXPECT_EQ(result.sorted, expected_sorted) << tokens;
    EXPECT_EQ(result.offsets[4], result.offsets[5]) << "the unused expert has an empty segment";
  }
}

TEST(MoeSort, RejectsExpertIdsOutOfRangeAndSmallScratch) {
  std::vector<int32_t> ids = {0, 3, 1, 4};  // 4 is outside [0, 4)
  OwnedTensor offsets(DType::kI32, {5}), sorted(DType::kI32, {4});
  OwnedTensor scratch(DType::kI32, {kernels::moe_sort_scratch_elements(4, 4)});
  EXPECT_THROW(kernels::moe_sort(Tensor(ids.data(), DType::kI32, {2, 2}), *offsets, *sorted, *scratch), Error);
  ids[3] = 2;
  OwnedTensor tiny(DType::kI32, {1});
  EXPECT_THROW(kernels::moe_sort(Tensor(ids.data(), DType::kI32, {2, 2}), *offsets, *sorted, *tiny), Error);
  EXPECT_NO_THROW(kernels::moe_sort(Tensor(ids.data(), DType::kI32, {2, 2}), *offsets, *sorted, *scratch));
}

struct PathCase {
  DType weight_dtype, x_dtype;
};

class MoeExpertPaths : public ::testing::TestWithParam<PathCase> {};

// Both paths compute every slot's expert output; each is compared with the reference, and the two
// must agree with each other slot by slot.
TEST_P(MoeExpertPaths, DecodeAndGroupedMatchReference) {
  const PathCase c = GetParam();
  Random rng(1502);
  const int64_t tokens = 9, hidden = 20, inter = 13, e_count = 6;
  const int k = 2;
  const Experts experts = make_experts(e_count, hidden, inter, c.weight_dtype, rng);
  // x rows are strided: the view of a wider buffer.
  const OwnedTensor x_wide = random_tensor(c.x_dtype, {tokens, hidden + 3}, rng);
  const Tensor x = x_wide->slice(1, 0, hidden);
  const std::vector<double> x_values = testing::to_doubles(x);
  std::vector<int32_t> ids = make_topk_ids(tokens, k, e_count, 5, rng);
  const Tensor ids_tensor(ids.data(), DType::kI32, {tokens, k});
  const int64_t slots = tokens * k;

  // Decode path.
  OwnedTensor h_decode(DType::kF32, {slots, inter}), out_decode(DType::kF32, {slots, hidden});
  testing::poison(*h_decode);
  testing::poison(*out_decode);
  kernels::moe_decode_gate_up(x, ids_tensor, experts.weights, *h_decode);
  kernels::moe_decode_down(*h_decode, ids_tensor, experts.weights, *out_decode);
  std::vector<double> expected_h, expected_out_given_h;
  const std::vector<double> h_decode_values = testing::to_doubles(*h_decode);
  for (int64_t s = 0; s < slots; ++s) {
    const int32_t e = ids[static_cast<size_t>(s)];
    const auto h = reference_gate_up(row(x_values, s / k, hidden), experts, e);
    expected_h.insert(expected_h.end(), h.begin(), h.end());
    // down is checked on the kernel's own h, so that each op is measured alone.
    const auto y = reference_down(row(h_decode_values, s, inter), experts, e);
    expected_out_given_h.insert(expected_out_given_h.end(), y.begin(), y.end());
  }
  EXPECT_TRUE(testing::close_rel_l2(*h_decode, expected_h, testing::kF32Tolerance));
  EXPECT_TRUE(testing::close_rel_l2(*out_decode, expected_out_given_h, testing::kF32Tolerance));

  // Grouped path: h rows come in sorted order, slot_out rows in slot order.
  const SortResult sorted = run_sort(ids, tokens, k, e_count);
  std::vector<int32_t> sorted_slots = sorted.sorted, offsets = sorted.offsets;
  const Tensor sorted_tensor(sorted_slots.data(), DType::kI32, {slots});
  const Tensor offsets_tensor(offsets.data(), DType::kI32, {e_count + 1});
  OwnedTensor h_grouped(DType::kF32, {slots, inter}), out_grouped(DType::kF32, {slots, hidden});
  testing::poison(*h_grouped);
  testing::poison(*out_grouped);
  kernels::moe_grouped_gate_up(x, sorted_tensor, offsets_tensor, k, experts.weights, *h_grouped);
  std::vector<double> expected_sorted_h;
  for (int64_t p = 0; p < slots; ++p) {
    const auto h = row(expected_h, sorted_slots[static_cast<size_t>(p)], inter);
    expected_sorted_h.insert(expected_sorted_h.end(), h.begin(), h.end());
  }
  EXPECT_TRUE(testing::close_rel_l2(*h_grouped, expected_sorted_h, testing::kF32Tolerance));
  kernels::moe_grouped_down(*h_grouped, sorted_tensor, offsets_tensor, experts.weights, *out_grouped);
  const std::vector<double> h_grouped_values = testing::to_doubles(*h_grouped);
  std::vector<double> expected_grouped_out(static_cast<size_t>(slots * hidden));
  for (int64_t p = 0; p < slots; ++p) {
    const int32_t slot = sorted_slots[static_cast<size_t>(p)];
    const auto y = reference_down(row(h_grouped_values, p, inter), experts, ids[static_cast<size_t>(slot)]);
    std::copy(y.begin(), y.end(), expected_grouped_out.begin() + slot * hidden);
  }
  EXPECT_TRUE(testing::close_rel_l2(*out_grouped, expected_grouped_out, testing::kF32Tolerance));
  EXPECT_TRUE(testing::close_rel_l2(testing::to_doubles(*out_grouped), testing::to_doubles(*out_decode), 1e-6))
      << "the two paths disagree";
}

INSTANTIATE_TEST_SUITE_P(Dtypes, MoeExpertPaths,
                         ::testing::Values(PathCase{DType::kBF16, DType::kF32}, PathCase{DType::kF32, DType::kF32},
                                           PathCase{DType::kBF16, DType::kBF16}));

TEST(MoeExperts, FusedWeightsGiveTheSameViewsAndResults) {
  Random rng(1503);
  const int64_t e_count = 4, hidden = 12, inter = 7, tokens = 5;
  const int k = 2;
  const OwnedTensor gate_up = random_tensor(DType::kBF16, {e_count, 2 * inter, hidden}, rng, -0.5f, 0.5f);
  const OwnedTensor down = random_tensor(DType::kBF16, {e_count, hidden, inter}, rng, -0.5f, 0.5f);
  const MoeExpertWeights fused = MoeExpertWeights::from_fused(*gate_up, *down);
  EXPECT_EQ(fused.num_experts, e_count);
  EXPECT_EQ(fused.hidden_size, hidden);
  EXPECT_EQ(fused.intermediate_size, inter);
  EXPECT_TRUE(fused.has_fused());
  ASSERT_EQ(fused.gate.size(), static_cast<size_t>(e_count));
  const std::vector<double> gate_up_values = testing::to_doubles(*gate_up);
  for (int64_t e = 0; e < e_count; ++e) {
    // Gate rows first, then up rows.
    const std::vector<double> gate = testing::to_doubles(fused.gate[static_cast<size_t>(e)].weight);
    const std::vector<double> up = testing::to_doubles(fused.up[static_cast<size_t>(e)].weight);
    const auto expert_begin = gate_up_values.begin() + e * 2 * inter * hidden;
    EXPECT_TRUE(std::equal(gate.begin(), gate.end(), expert_begin));
    EXPECT_TRUE(std::equal(up.begin(), up.end(), expert_begin + inter * hidden));
    EXPECT_TRUE(fused.down[static_cast<size_t>(e)].weight.shape() == (Shape{hidden, inter}));
  }
  // Copies of the same weights as separate per-expert tensors give bit-identical outputs.
  Experts separate;
  separate.weights.num_experts = e_count;
  separate.weights.hidden_size = hidden;
  separate.weights.intermediate_size = inter;
  for (int64_t e = 0; e < e_count; ++e) {
    for (const Tensor* view : {&fused.gate[static_cast<size_t>(e)].weight, &fused.up[static_cast<size_t>(e)].weight,
                               &fused.down[static_cast<size_t>(e)].weight}) {
      separate.owned.emplace_back(DType::kBF16, view->shape());
      std::memcpy(separate.owned.back()->data(), view->data(), view->nbytes());
    }
    const size_t base = separate.owned.size() - 3;
    separate.weights.gate.push_back(separate.owned[base].tensor);
    separate.weights.up.push_back(separate.owned[base + 1].tensor);
    separate.weights.down.push_back(separate.owned[base + 2].tensor);
  }
  EXPECT_FALSE(separate.weights.has_fused());
  const OwnedTensor x = random_tensor(DType::kF32, {tokens, hidden}, rng);
  std::vector<int32_t> ids = make_topk_ids(tokens, k, e_count, 2, rng);
  const Tensor ids_tensor(ids.data(), DType::kI32, {tokens, k});
  OwnedTensor h1(DType::kF32, {tokens * k, inter}), h2(DType::kF32, {tokens * k, inter});
  OwnedTensor y1(DType::kF32, {tokens * k, hidden}), y2(DType::kF32, {tokens * k, hidden});
  kernels::moe_decode_gate_up(*x, ids_tensor, fused, *h1);
  kernels::moe_decode_gate_up(*x, ids_tensor, separate.weights, *h2);
  kernels::moe_decode_down(*h1, ids_tensor, fused, *y1);
  kernels::moe_decode_down(*h2, ids_tensor, separate.weights, *y2);
  EXPECT_EQ(testing::element_bytes(*y1), testing::element_bytes(*y2));
  EXPECT_THROW(MoeExpertWeights::from_fused(*gate_up, gate_up->slice(1, 0, hidden)), Error);
}

TEST(MoeExperts, RejectExpertIdsOutOfRange) {
  Random rng(1504);
  const Experts experts = make_experts(3, 8, 4, DType::kF32, rng);
  const OwnedTensor x = random_tensor(DType::kF32, {2, 8}, rng);
  std::vector<int32_t> ids = {0, 3};  // 3 is outside [0, 3)
  OwnedTensor h(DType::kF32, {2, 4});
  EXPECT_THROW(kernels::moe_decode_gate_up(*x, Tensor(ids.data(), DType::kI32, {2, 1}), experts.weights, *h), Error);
  ids[1] = -1;
  OwnedTensor y(DType::kF32, {2, 8});
  EXPECT_THROW(kernels::moe_decode_down(*h, Tensor(ids.data(), DType::kI32, {2, 1}), experts.weights, *y), Error);
}

// The fused decode ops: the shared expert as slot T * k + t of moe_decode_gate_up, and
// moe_decode_down_combine (every slot's down projection and the weighted sum in one op), without a
// shared expert, with a gated one and with an ungated one. The last of E + 1 experts plays the
// shared expert.
enum class SharedKind { kNone, kGated, kUngated };

class MoeDecodeFused : public ::testing::TestWithParam<SharedKind> {};

TEST_P(MoeDecodeFused, SharedSlotAndDownCombineMatchReference) {
  const SharedKind kind = GetParam();
  Random rng(1507);
  const int64_t tokens = 5, hidden = 24, inter = 16, e_count = 7;
  const int k = 3;
  Experts all = make_experts(e_count + 1, hidden, inter, DType::kBF16, rng);
  kernels::MoeSharedExpert shared;
  if (kind != SharedKind::kNone) {
    shared = kernels::MoeSharedExpert{all.weights.gate.back(), all.weights.up.back(), all.weights.down.back()};
  }
  MoeExpertWeights routed = all.weights;  // the first E experts
  routed.num_experts = e_count;
  routed.gate.pop_back();
  routed.up.pop_back();
  routed.down.pop_back();
  ASSERT_TRUE(kernels::moe_shared_expert_fits(routed, shared));
  const OwnedTensor x = random_tensor(DType::kF32, {tokens, hidden}, rng);
  const std::vector<double> x_values = testing::to_doubles(*x);
  std::vector<int32_t> ids = make_topk_ids(tokens, k, e_count, 4, rng);
  const Tensor ids_tensor(ids.data(), DType::kI32, {tokens, k});
  const OwnedTensor weights = random_tensor(DType::kF32, {tokens, k}, rng, 0.05f, 1.0f);
  const OwnedTensor gate_logits = random_tensor(DType::kF32, {tokens, 1}, rng, -3.0f, 3.0f);
  const int64_t slots = tokens * k, rows = slots + (shared.empty() ? 0 : tokens);

  OwnedTensor h(DType::kF32, {rows, inter}), out(DType::kF32, {tokens, hidden});
  testing::poison(*h);
  testing::poison(*out);
  kernels::moe_decode_gate_up(*x, ids_tensor, routed, *h, shared);
  std::vector<double> expected_h;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = r < slots ? r / k : r - slots;
    const auto values = reference_gate_up(row(x_values, t, hidden), all,
                                          r < slots ? ids[static_cast<size_t>(r)] : static_cast<int32_t>(e_count));
    expected_h.insert(expected_h.end(), values.begin(), values.end());
  }
  EXPECT_TRUE(testing::close_rel_l2(*h, expected_h, testing::kF32Tolerance));

  // The down projections and the combine, from the kernel's own h.
  kernels::moe_decode_down_combine(*h, ids_tensor, *weights, routed, shared,
                                   kind == SharedKind::kGated ? *gate_logits : Tensor(), *out);
  const std::vector<double> h_values = testing::to_doubles(*h), w = testing::to_doubles(*weights);
  const std::vector<double> g = testing::to_doubles(*gate_logits);
  std::vector<double> expected(static_cast<size_t>(tokens * hidden), 0.0);
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<double> sum(static_cast<size_t>(hidden), 0.0);
    for (int64_t j = 0; j < k; ++j) {
      const int64_t s = t * k + j;
      const auto y = reference_down(row(h_values, s, inter), all, ids[static_cast<size_t>(s)]);
      for (int64_t c = 0; c < hidden; ++c)
        sum[static_cast<size_t>(c)] += w[static_cast<size_t>(s)] * y[static_cast<size_t>(c)];
    }
    if (kind != SharedKind::kNone) {
      const auto y = reference_down(row(h_values, slots + t, inter), all, static_cast<int32_t>(e_count));
      const double gate = kind == SharedKind::kGated ? 1.0 / (1.0 + std::exp(-g[static_cast<size_t>(t)])) : 1.0;
      for (int64_t c = 0; c < hidden; ++c) sum[static_cast<size_t>(c)] += gate * y[static_cast<size_t>(c)];
    }
    std::copy(sum.begin(), sum.end(), expected.begin() + t * hidden);
  }
  EXPECT_TRUE(testing::close_rel_l2(*out, expected, testing::kF32Tolerance));
}

INSTANTIATE_TEST_SUITE_P(SharedExperts, MoeDecodeFused,
                         ::testing::Values(SharedKind::kNone, SharedKind::kGated, SharedKind::kUngated));

TEST(MoeDecodeFused, SharedExpertOfAnotherWidthOrFormatDoesNotFit) {
  Random rng(1508);
  const Experts routed = make_experts(3, 16, 8, DType::kBF16, rng);
  const Experts wider = make_experts(1, 16, 16, DType::kBF16, rng);
  const Experts f32 = make_experts(1, 16, 8, DType::kF32, rng);
  EXPECT_FALSE(kernels::moe_shared_expert_fits(routed.weights,
                                               {wider.weights.gate[0], wider.weights.up[0], wider.weights.down[0]}));
  EXPECT_FALSE(
      kernels::moe_shared_expert_fits(routed.weights, {f32.weights.gate[0], f32.weights.up[0], f32.weights.down[0]}));
  EXPECT_TRUE(kernels::moe_shared_expert_fits(routed.weights,
                                              {routed.weights.gate[1], routed.weights.up[1], routed.weights.down[1]}));
  EXPECT_TRUE(kernels::moe_shared_expert_fits(routed.weights, {}));
  // A misfit is an error in the ops, never a silent wrong read.
  const OwnedTensor x = random_tensor(DType::kF32, {1, 16}, rng);
  std::vector<int32_t> ids = {0};
  OwnedTensor h(DType::kF32, {2, 8});
  EXPECT_THROW(kernels::moe_decode_gate_up(*x, Tensor(ids.data(), DType::kI32, {1, 1}), routed.weights, *h,
                                           {wider.weights.gate[0], wider.weights.up[0], wider.weights.down[0]}),
               Error);
}

class MoeCombineTest : public ::testing::TestWithParam<std::tuple<bool, DType>> {};

TEST_P(MoeCombineTest, WeightedSumOfSlotsPlusGatedSharedExpert) {
  const auto [with_shared, out_dtype] = GetParam();
  Random rng(1505);
  const int64_t tokens = 11, hidden = 18;
  const int k = 3;
  const OwnedTensor slot_out = random_tensor(DType::kF32, {tokens * k, hidden}, rng, -2.0f, 2.0f);
  const OwnedTensor weights = random_tensor(DType::kF32, {tokens, k}, rng, 0.05f, 1.0f);
  const OwnedTensor shared = random_tensor(DType::kF32, {tokens, hidden}, rng, -2.0f, 2.0f);
  const OwnedTensor gate_logits = random_tensor(DType::kF32, {tokens, 1}, rng, -4.0f, 4.0f);
  OwnedTensor out(out_dtype, {tokens, hidden});
  testing::poison(*out);
  kernels::moe_combine(*slot_out, *weights, with_shared ? *shared : Tensor(), with_shared ? *gate_logits : Tensor(),
                       *out);
  const auto s = testing::to_doubles(*slot_out), w = testing::to_doubles(*weights);
  const auto sh = testing::to_doubles(*shared), g = testing::to_doubles(*gate_logits);
  std::vector<double> expected(static_cast<size_t>(tokens * hidden), 0.0);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t c = 0; c < hidden; ++c) {
      double sum = 0.0;
      for (int64_t j = 0; j < k; ++j)
        sum += w[static_cast<size_t>(t * k + j)] * s[static_cast<size_t>((t * k + j) * hidden + c)];
      if (with_shared)
        sum += 1.0 / (1.0 + std::exp(-g[static_cast<size_t>(t)])) * sh[static_cast<size_t>(t * hidden + c)];
      expected[static_cast<size_t>(t * hidden + c)] = sum;
    }
  }
  EXPECT_TRUE(testing::close_rel_l2(*out, expected,
                                    out_dtype == DType::kF32 ? testing::kF32Tolerance : testing::kBf16OutputTolerance));
}

INSTANTIATE_TEST_SUITE_P(Variants, MoeCombineTest,
                         ::testing::Values(std::tuple{false, DType::kF32}, std::tuple{true, DType::kF32},
                                           std::tuple{true, DType::kBF16}));

}  // namespace
}  // namespace metrale
