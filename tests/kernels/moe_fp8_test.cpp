// The CPU MoE expert ops with FP8 experts (e4m3 codes, 128x128 block scales, fused layout and
// per-expert views) against the same ops on the dequantised f32 weights: the CPU dequantises a
// weight row to f32 and shares the plain linear's loop, so both give the same bits. Sizes leave
// partial scale blocks (H 136, I 200: gate and up rows in scale blocks of their own).
#include <gtest/gtest.h>

#include "kernels/fp8_expert_helpers.h"
#include "kernels/kernel_helpers.h"
#include "kernels/moe.h"

namespace metrale {
namespace {

using testing::Random;

std::vector<int32_t> routes(int64_t tokens, int64_t k, int64_t experts, Random& rng) {
  std::vector<int32_t> ids;
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<int32_t> pool(static_cast<size_t>(experts));
    for (int64_t e = 0; e < experts; ++e) pool[static_cast<size_t>(e)] = static_cast<int32_t>(e);
    std::shuffle(pool.begin(), pool.end(), rng.engine());
    ids.insert(ids.end(), pool.begin(), pool.begin() + k);
  }
  return ids;
}

std::vector<float> floats(const Tensor& t) {
  return std::vector<float>(t.data_as<const float>(), t.data_as<const float>() + t.numel());
}

struct Case {
  int64_t tokens, k, experts, hidden, inter;
};

TEST(MoeFp8, DecodePathEqualsDequantisedWeights) {
  Random rng(1301);
  for (const Case c : {Case{3, 2, 5, 136, 200}, Case{1, 4, 6, 64, 32}, Case{2, 1, 3, 260, 130}}) {
    SCOPED_TRACE(::testing::Message() << "E " << c.experts << " H " << c.hidden << " I " << c.inter);
    const auto experts = testing::random_fp8_experts(c.experts, c.hidden, c.inter, rng);
    ASSERT_TRUE(experts->fp8.is_fp8());
    ASSERT_FALSE(experts->plain.is_fp8());
    for (const DType x_dtype : {DType::kF32, DType::kBF16}) {
      const OwnedTensor x = testing::random_tensor(x_dtype, {c.tokens, c.hidden}, rng);
      std::vector<int32_t> ids = routes(c.tokens, c.k, c.experts, rng);
      const Tensor ids_tensor(ids.data(), DType::kI32, {c.tokens, c.k});
      const int64_t slots = c.tokens * c.k;
      OwnedTensor h_fp8(DType::kF32, {slots, c.inter}), h_plain(DType::kF32, {slots, c.inter});
      OwnedTensor y_fp8(DType::kF32, {slots, c.hidden}), y_plain(DType::kF32, {slots, c.hidden});
      testing::poison(*h_fp8);
      testing::poison(*y_fp8);
      kernels::moe_decode_gate_up(*x, ids_tensor, experts->fp8, *h_fp8);
      kernels::moe_decode_gate_up(*x, ids_tensor, experts->plain, *h_plain);
      EXPECT_EQ(floats(*h_fp8), floats(*h_plain));
      kernels::moe_decode_down(*h_plain, ids_tensor, experts->fp8, *y_fp8);
      kernels::moe_decode_down(*h_plain, ids_tensor, experts->plain, *y_plain);
      EXPECT_EQ(floats(*y_fp8), floats(*y_plain));
    }
  }
}

TEST(MoeFp8, GroupedPathEqualsDequantisedWeightsAndPerExpertViews) {
  Random rng(1303);
  for (const Case c : {Case{40, 2, 5, 136, 200}, Case{70, 3, 4, 64, 32}}) {
    SCOPED_TRACE(::testing::Message() << "E " << c.experts << " H " << c.hidden << " I " << c.inter);
    const auto experts = testing::random_fp8_experts(c.experts, c.hidden, c.inter, rng);
    // The same codes and scales as separate per-expert tensors (the per-expert checkpoint layout).
    std::vector<OwnedTensor> owned;
    kernels::MoeExpertWeights separate;
    separate.num_experts = c.experts;
    separate.hidden_size = c.hidden;
    separate.intermediate_size = c.inter;
    const auto copy_of = [&](const kernels::LinearWeight& view) {
      owned.emplace_back(view.weight.dtype(), view.weight.shape());
      copy_tensor(*owned.back(), view.weight);
      const Tensor weight = *owned.back();
      owned.emplace_back(DType::kF32, view.scale_inv.shape());
      copy_tensor(*owned.back(), view.scale_inv);
      return kernels::LinearWeight(weight, *owned.back());
    };
    for (int64_t e = 0; e < c.experts; ++e) {
      const auto index = static_cast<size_t>(e);
      separate.gate.push_back(copy_of(experts->fp8.gate[index]));
      separate.up.push_back(copy_of(experts->fp8.up[index]));
      separate.down.push_back(copy_of(experts->fp8.down[index]));
    }
    const OwnedTensor x = testing::random_tensor(DType::kF32, {c.tokens, c.hidden}, rng);
    std::vector<int32_t> ids = routes(c.tokens, c.k, c.experts - 1, rng);  // the last expert stays empty
    const Tensor ids_tensor(ids.data(), DType::kI32, {c.tokens, c.k});
    const int64_t slots = c.tokens * c.k;
    OwnedTensor offsets(DType::kI32, {c.experts + 1}), sorted(DType::kI32, {slots});
    OwnedTensor scratch(DType::kI32, {kernels::moe_sort_scratch_elements(slots, c.experts)});
    kernels::moe_sort(ids_tensor, *offsets, *sorted, *scratch);
    std::vector<std::vector<float>> hs, ys;
    for (const kernels::MoeExpertWeights* weights : {&experts->fp8, &separate, &experts->plain}) {
      OwnedTensor h(DType::kF32, {slots, c.inter}), y(DType::kF32, {slots, c.hidden});
      testing::poison(*h);
      testing::poison(*y);
      kernels::moe_grouped_gate_up(*x, *sorted, *offsets, static_cast<int>(c.k), *weights, *h);
      kernels::moe_grouped_down(*h, *sorted, *offsets, *weights, *y);
      hs.push_back(floats(*h));
      ys.push_back(floats(*y));
    }
    EXPECT_EQ(hs[0], hs[2]);
    EXPECT_EQ(ys[0], ys[2]);
    EXPECT_EQ(hs[1], hs[2]);
    EXPECT_EQ(ys[1], ys[2]);
  }
}

TEST(MoeFp8, FusedFp8ScalesOfTheWrongShapeAreRejected) {
  Random rng(1307);
  const auto experts = testing::random_fp8_experts(2, 64, 32, rng);
  // A [E, ceil(2I/128), ceil(H/128)] scale (one block row shared by gate and up) is not the layout.
  OwnedTensor shared_rows(DType::kF32, {2, 1, 1});
  EXPECT_THROW(
      kernels::MoeExpertWeights::from_fused_fp8(*experts->gate_up, *shared_rows, *experts->down, *experts->down_scale),
      Error);
}

}  // namespace
}  // namespace metrale
