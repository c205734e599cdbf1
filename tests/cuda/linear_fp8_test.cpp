// CUDA kernels::linear_fp8 (the FP8 GEMV) against its CPU twin on the same e4m3 codes, block scales
// and inputs: M across the 8-row passes, N and K not multiples of 128 (partial scale blocks) or of
// 16 (the unvectorised tail), bf16 and f32 inputs and outputs, accumulate, and untouched padding.
#include "kernels/linear_fp8.h"

#include <gtest/gtest.h>

#include <climits>

#include <vector>

#include "cuda/cuda_test_helpers.h"
#include "kernels/kernel_helpers.h"
#include "kernels/rms_norm.h"
#include "runtime/stream.h"
#include "runtime/device.h"

namespace metrale {
namespace {

using testing::Random;
using testing::to_device;
using testing::to_host;

OwnedTensor random_codes(int64_t n, int64_t k, Random& rng) {
  OwnedTensor codes(DType::kF8E4M3, {n, k});
  auto* bytes = static_cast<uint8_t*>(codes->data());
  for (int64_t i = 0; i < n * k; ++i) {
    uint8_t code;
    do {
      code = static_cast<uint8_t>(rng.integer(0, 255));
    } while ((code & 0x7fu) == 0x7fu);  // NaN
    bytes[i] = code;
  }
  return codes;
}

TEST(CudaLinearFp8, GemvMatchesCpuTwin) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  // The GEMV at every M here (the GEMM, on quantised activations, has its own test).
  struct GemvEverywhere {
    int saved = kernels::cuda::fp8_gemv_max_rows();
    GemvEverywhere() { kernels::cuda::set_fp8_gemv_max_rows(INT_MAX); }
    ~GemvEverywhere() { kernels::cuda::set_fp8_gemv_max_rows(saved); }
  } gemv_everywhere;
  Random rng(9101);
  const int64_t ms[] = {1, 2, 3, 8, 9, 17};
  const std::pair<int64_t, int64_t> nks[] = {{1, 16}, {5, 19}, {67, 136}, {130, 200}, {257, 1000}, {96, 4104}};
  constexpr int64_t kOutPad = 3;
  for (const int64_t m : ms) {
    for (const auto& [n, k] : nks) {
      for (const DType x_dtype : {DType::kBF16, DType::kF32}) {
        for (const DType out_dtype : {DType::kF32, DType::kBF16}) {
          for (const bool accumulate : {false, true}) {
            SCOPED_TRACE(::testing::Message() << "m " << m << " n " << n << " k " << k << " x " << dtype_name(x_dtype)
                                              << " out " << dtype_name(out_dtype) << " accumulate " << accumulate);
            const OwnedTensor x = testing::random_tensor(x_dtype, {m, k}, rng);
            const OwnedTensor codes = random_codes(n, k, rng);
            const OwnedTensor scales = testing::random_tensor(
                DType::kF32, {kernels::fp8_scale_blocks(n), kernels::fp8_scale_blocks(k)}, rng, 1e-3f, 4e-3f);
            const OwnedTensor out_wide = testing::random_tensor(out_dtype, {m, n + kOutPad}, rng, -2.0f, 2.0f);
            const Tensor out_cpu = out_wide->slice(1, 0, n);
            const OwnedTensor out_device = to_device(*out_wide);
            kernels::linear_fp8(*to_device(*x), *to_device(*codes), *to_device(*scales), out_device->slice(1, 0, n),
                                accumulate);
            kernels::linear_fp8(*x, *codes, *scales, out_cpu, accumulate);
            const OwnedTensor got = to_host(*out_device);
            const double tolerance = out_dtype == DType::kF32 ? 2e-5 : testing::kBf16OutputTolerance;
            EXPECT_TRUE(testing::close_rel_l2(got->slice(1, 0, n), testing::to_doubles(out_cpu), tolerance));
            EXPECT_EQ(testing::element_bytes(got->slice(1, n, n + kOutPad)),
                      testing::element_bytes(out_wide->slice(1, n, n + kOutPad)));
          }
        }
      }
    }
  }
}


// As CudaLinear.GemvReadsItsInputOnlyAfterAnOverlappedProducer, for the FP8 GEMV (pdl.cuh): a long
// RMSNorm that lets dependents launch at its start writes the GEMV's input row last; inputs alternate
// between two tensors, so a GEMV that read early would see the previous iteration's row.
TEST(CudaLinearFp8, GemvReadsItsInputOnlyAfterAnOverlappedProducer) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Random rng(9102);
  const int64_t rows = 16384, d = 4096, n = 4096;
  const OwnedTensor sources[2] = {to_device(*testing::random_tensor(DType::kBF16, {rows, d}, rng)),
                                  to_device(*testing::random_tensor(DType::kBF16, {rows, d}, rng))};
  const OwnedTensor norm_weight = to_device(*testing::random_tensor(DType::kBF16, {d}, rng));
  const OwnedTensor codes = to_device(*random_codes(n, d, rng));
  const OwnedTensor scales = to_device(*testing::random_tensor(
      DType::kF32, {kernels::fp8_scale_blocks(n), kernels::fp8_scale_blocks(d)}, rng, 1e-3f, 4e-3f));
  const OwnedTensor normed(DType::kBF16, {rows, d}, Device::cuda());
  const Tensor last_row = normed->slice(0, rows - 1, rows);
  const OwnedTensor out(DType::kF32, {1, n}, Device::cuda());
  std::vector<std::vector<uint8_t>> expected;
  for (int source = 0; source < 2; ++source) {
    kernels::rms_norm(*sources[source], *norm_weight, *normed, {});
    synchronize(Device::cuda());
    kernels::linear_fp8(last_row, *codes, *scales, *out, false);
    expected.push_back(testing::element_bytes(*to_host(*out)));
  }
  for (int i = 0; i < 16; ++i) {
    kernels::rms_norm(*sources[i % 2], *norm_weight, *normed, {});
    kernels::linear_fp8(last_row, *codes, *scales, *out, false);
    EXPECT_EQ(testing::element_bytes(*to_host(*out)), expected[i % 2]) << "iteration " << i;
  }
}

}  // namespace
}  // namespace metrale
