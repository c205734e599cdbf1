// CUDA hyper-connection pieces against their CPU twins on the same inputs (bf16 and f32
// activations, every hc_norm update mode, strided rows and the element-wise fallback). Both sides
// round at the same points, so they agree far below one bf16 ulp except for rare boundary flips.
#include "kernels/hyper_connection.h"

#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <vector>

#include "cuda/cuda_test_helpers.h"
#include "kernels/kernel_helpers.h"
#include "runtime/device.h"

namespace metrale {
namespace {

using kernels::HcParams;
using kernels::HcUpdate;
using testing::Random;
using testing::to_device;
using testing::to_host;

double tolerance_of(DType dtype) {
  return dtype == DType::kBF16 ? 1e-3 : 1e-5;
}

void check_norm(DType dtype, HcUpdate update, bool with_norm, int64_t hidden, int64_t offset, uint64_t seed) {
  SCOPED_TRACE(::testing::Message() << dtype_name(dtype) << " update " << static_cast<int>(update) << " hidden "
                                    << hidden << " offset " << offset);
  Random rng(seed);
  const int64_t tokens = 19, streams = 4, width = streams * hidden;
  // residual: a column slice (offset 0: vectorised; odd offsets: element-wise).
  const OwnedTensor wide = testing::random_tensor(dtype, {tokens, width + offset + 8}, rng, -2.0f, 2.0f);
  const int64_t a_width = update == HcUpdate::kAdd ? width : hidden;
  const OwnedTensor a = testing::random_tensor(dtype, {tokens, a_width}, rng, -1.5f, 1.5f);
  const OwnedTensor b = testing::random_tensor(DType::kF32, {tokens, streams}, rng, 0.0f, 2.0f);
  const OwnedTensor weight = testing::random_tensor(DType::kBF16, {width}, rng, -0.5f, 0.5f);
  OwnedTensor normed_cpu(dtype, {tokens, width});
  testing::poison(*normed_cpu);
  const OwnedTensor normed_dev = to_device(*normed_cpu);
  const OwnedTensor wide_dev = to_device(*wide);
  HcParams params;
  params.num_streams = static_cast<int>(streams);
  params.update = update;
  const bool uses_a = update != HcUpdate::kNone, uses_b = update == HcUpdate::kInject;
  const OwnedTensor a_dev = to_device(*a), b_dev = to_device(*b), weight_dev = to_device(*weight);
  kernels::hc_norm(wide->slice(1, offset, offset + width), uses_a ? *a : Tensor(), uses_b ? *b : Tensor(), *weight,
                   with_norm ? *normed_cpu : Tensor(), params);
  kernels::hc_norm(wide_dev->slice(1, offset, offset + width), uses_a ? *a_dev : Tensor(), uses_b ? *b_dev : Tensor(),
                   *weight_dev, with_norm ? *normed_dev : Tensor(), params);
  EXPECT_TRUE(testing::close_rel_l2(*to_host(*wide_dev), testing::to_doubles(*wide), tolerance_of(dtype)))
      << "residual (and the columns around it)";
  if (with_norm) {
    EXPECT_TRUE(testing::close_rel_l2(*to_host(*normed_dev), testing::to_doubles(*normed_cpu), tolerance_of(dtype)))
        << "normed";
  }
}

TEST(CudaHcNorm, MatchesCpuTwin) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  uint64_t seed = 1;
  for (DType dtype : {DType::kBF16, DType::kF32}) {
    for (HcUpdate update : {HcUpdate::kNone, HcUpdate::kAdd, HcUpdate::kInject, HcUpdate::kBroadcast}) {
      check_norm(dtype, update, true, 2560, 0, seed++);
      check_norm(dtype, update, true, 40, 3, seed++);
    }
    check_norm(dtype, HcUpdate::kInject, false, 2560, 0, seed++);
  }
}

TEST(CudaHcGates, MatchesCpuTwin) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  for (DType dtype : {DType::kBF16, DType::kF32}) {
    for (bool with_inject : {true, false}) {
      Random rng(with_inject ? 31 : 32);
      const int64_t tokens = 33, rank = 320, streams = 4;
      const OwnedTensor projected = testing::random_tensor(dtype, {tokens, rank + streams}, rng, -8.0f, 8.0f);
      OwnedTensor act_cpu(dtype, {tokens, rank}), beta_cpu(dtype, {tokens, streams});
      testing::poison(*act_cpu);
      testing::poison(*beta_cpu);
      const OwnedTensor act_dev = to_device(*act_cpu), beta_dev = to_device(*beta_cpu), p_dev = to_device(*projected);
      HcParams params;
      params.num_streams = static_cast<int>(streams);
      kernels::hc_gates(projected->slice(1, 0, rank),
                        with_inject ? projected->slice(1, rank, rank + streams) : Tensor(), *act_cpu,
                        with_inject ? *beta_cpu : Tensor(), params);
      kernels::hc_gates(p_dev->slice(1, 0, rank), with_inject ? p_dev->slice(1, rank, rank + streams) : Tensor(),
                        *act_dev, with_inject ? *beta_dev : Tensor(), params);
      EXPECT_TRUE(testing::close_rel_l2(*to_host(*act_dev), testing::to_doubles(*act_cpu), tolerance_of(dtype)));
      if (with_inject) {
        EXPECT_TRUE(testing::close_rel_l2(*to_host(*beta_dev), testing::to_doubles(*beta_cpu), tolerance_of(dtype)));
      }
    }
  }
}

TEST(CudaHcMix, MatchesCpuTwin) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  for (DType dtype : {DType::kBF16, DType::kF32}) {
    for (int64_t hidden : {int64_t{2560}, int64_t{44}}) {
      Random rng(static_cast<uint64_t>(hidden));
      const int64_t tokens = 17, streams = 4, width = streams * hidden;
      const OwnedTensor up = testing::random_tensor(dtype, {tokens, width}, rng, -4.0f, 4.0f);
      const OwnedTensor normed = testing::random_tensor(dtype, {tokens, width}, rng, -2.0f, 2.0f);
      OwnedTensor x_cpu(dtype, {tokens, hidden});
      testing::poison(*x_cpu);
      const OwnedTensor x_dev = to_device(*x_cpu);
      HcParams params;
      params.num_streams = static_cast<int>(streams);
      kernels::hc_mix(*up, *normed, *x_cpu, params);
      kernels::hc_mix(*to_device(*up), *to_device(*normed), *x_dev, params);
      EXPECT_TRUE(testing::close_rel_l2(*to_host(*x_dev), testing::to_doubles(*x_cpu), tolerance_of(dtype)))
          << dtype_name(dtype) << " hidden " << hidden;
    }
  }
}

// The gates, the W_up GEMM and the mix as one op: one kernel at decode-sized T with bf16, the three
// ops otherwise (f32, T above the kernel's limit); down and inject are column slices of one GEMM output.
TEST(CudaHcGatesUpMix, MatchesCpuTwin) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Random rng(61);
  const int64_t streams = 4;
  for (const DType dtype : {DType::kBF16, DType::kF32}) {
    for (const auto [tokens, hidden, rank] :
         std::vector<std::array<int64_t, 3>>{{1, 2560, 320}, {2, 2560, 320}, {4, 40, 24}, {7, 48, 16}, {1, 8, 8}}) {
      for (const bool injects : {true, false}) {
        SCOPED_TRACE(::testing::Message() << dtype_name(dtype) << " T " << tokens << " H " << hidden << " r " << rank
                                          << " inject " << injects);
        const int64_t width = streams * hidden;
        const OwnedTensor gemm = testing::random_tensor(dtype, {tokens, rank + streams}, rng, -6.0f, 6.0f);
        const OwnedTensor w_up = testing::random_tensor(dtype, {width, rank}, rng, -0.2f, 0.2f);
        const OwnedTensor normed = testing::random_tensor(dtype, {tokens, width}, rng, -2.0f, 2.0f);
        HcParams params;
        params.num_streams = static_cast<int>(streams);
        OwnedTensor act(dtype, {tokens, rank}), beta(dtype, {tokens, streams}), up(dtype, {tokens, width});
        OwnedTensor x(dtype, {tokens, hidden});
        testing::poison(*x);
        testing::poison(*beta);
        const auto down_of = [&](const Tensor& g) { return g.slice(1, 0, rank); };
        const auto inject_of = [&](const Tensor& g) { return injects ? g.slice(1, rank, rank + streams) : Tensor(); };
        kernels::hc_gates_up_mix(down_of(*gemm), inject_of(*gemm), *w_up, *normed, *act, injects ? *beta : Tensor(),
                                 *up, *x, params);

        const OwnedTensor gemm_dev = to_device(*gemm), w_dev = to_device(*w_up), normed_dev = to_device(*normed);
        const OwnedTensor act_dev = to_device(*act), up_dev = to_device(*up);
        const OwnedTensor beta_dev = to_device(*beta), x_dev = to_device(*x);  // poisoned
        kernels::hc_gates_up_mix(down_of(*gemm_dev), inject_of(*gemm_dev), *w_dev, *normed_dev, *act_dev,
                                 injects ? *beta_dev : Tensor(), *up_dev, *x_dev, params);
        EXPECT_TRUE(testing::close_rel_l2(*to_host(*x_dev), testing::to_doubles(*x), 2 * tolerance_of(dtype))) << "x";
        if (injects) {
          EXPECT_TRUE(testing::close_rel_l2(*to_host(*beta_dev), testing::to_doubles(*beta), tolerance_of(dtype)))
              << "beta";
        }
      }
    }
  }
}

}  // namespace
}  // namespace metrale
