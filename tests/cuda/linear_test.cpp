// CUDA kernels::linear (GEMV for small M, cuBLASLt above, a simple kernel for the rest) against the
// CPU twin on the same bf16 inputs: M from 1 to 300, awkward N and K, strided and misaligned input
// rows, strided output rows, bf16 and f32 outputs, accumulate, and replay inside a CUDA graph.
// A disabled benchmark (--gtest_also_run_disabled_tests --gtest_filter='*Bench*') prints the GEMV's
// weight bandwidth on Qwen3-8B shapes.
#include <cuda_runtime_api.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "cuda/cuda_test_helpers.h"
#include "kernels/kernel_helpers.h"
#include "kernels/linear.h"
#include "kernels/rms_norm.h"
#include "runtime/cuda/cuda_graph.h"
#include "runtime/device.h"
#include "runtime/stream.h"

namespace metrale {
namespace {

using testing::to_device;
using testing::to_host;

using testing::Random;

double tolerance_for(DType out) { return out == DType::kF32 ? 2e-5 : testing::kBf16OutputTolerance; }

// Restores the GEMV crossover after a test that changes it.
class GemvRowsGuard {
 public:
  GemvRowsGuard() : saved_(kernels::cuda::gemv_max_rows()) {}
  ~GemvRowsGuard() { kernels::cuda::set_gemv_max_rows(saved_); }
  GemvRowsGuard(const GemvRowsGuard&) = delete;
  GemvRowsGuard& operator=(const GemvRowsGuard&) = delete;

 private:
  int saved_;
};

struct Problem {
  int64_t m, n, k;
  DType x_dtype = DType::kBF16, weight_dtype = DType::kBF16, out_dtype = DType::kF32;
  bool accumulate = false;
  int64_t x_column_offset = 0;  // > 0: x starts inside a wider row (misaligned for odd offsets)
};

// Runs the problem on the GPU and with the CPU twin on the same inputs and compares; the padding
// columns of the output rows must stay untouched.
void check_problem(const Problem& p, Random& rng) {
  SCOPED_TRACE(::testing::Message() << "m " << p.m << " n " << p.n << " k " << p.k << " x " << dtype_name(p.x_dtype)
                                    << " w " << dtype_name(p.weight_dtype) << " out " << dtype_name(p.out_dtype)
                                    << " accumulate " << p.accumulate << " x offset " << p.x_column_offset
                                    << " gemv rows " << kernels::cuda::gemv_max_rows());
  constexpr int64_t kXPad = 8, kOutPad = 3;
  const OwnedTensor x_wide = testing::random_tensor(p.x_dtype, {p.m, p.k + kXPad + p.x_column_offset}, rng);
  const OwnedTensor w = testing::random_tensor(p.weight_dtype, {p.n, p.k}, rng);
  const OwnedTensor out_wide = testing::random_tensor(p.out_dtype, {p.m, p.n + kOutPad}, rng, -2.0f, 2.0f);
  const Tensor out_cpu = out_wide->slice(1, 0, p.n);
  if (!p.accumulate) testing::poison(out_cpu);
  const OwnedTensor x_device = to_device(*x_wide);
  const OwnedTensor w_device = to_device(*w);
  const OwnedTensor out_device = to_device(*out_wide);

  kernels::linear(x_device->slice(1, p.x_column_offset, p.x_column_offset + p.k), *w_device,
                  out_device->slice(1, 0, p.n), p.accumulate);
  kernels::linear(x_wide->slice(1, p.x_column_offset, p.x_column_offset + p.k), *w, out_cpu, p.accumulate);

  const OwnedTensor got = to_host(*out_device);
  EXPECT_TRUE(testing::close_rel_l2(got->slice(1, 0, p.n), testing::to_doubles(out_cpu), tolerance_for(p.out_dtype)));
  EXPECT_EQ(testing::element_bytes(got->slice(1, p.n, p.n + kOutPad)),
            testing::element_bytes(out_wide->slice(1, p.n, p.n + kOutPad)));
}

TEST(CudaLinear, GemvAndCublasLtMatchCpuTwin) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  const GemvRowsGuard guard;
  Random rng(9001);
  const int64_t ms[] = {1, 2, 3, 7, 8, 16, 64, 300};
  const std::pair<int64_t, int64_t> nks[] = {{1, 8}, {67, 136}, {257, 1000}, {1029, 256}, {96, 4104}};
  // 0: every M through cuBLASLt; 8: the default crossover; 16: the GEMV up to its limit.
  for (const int gemv_rows : {0, 8, 16}) {
    kernels::cuda::set_gemv_max_rows(gemv_rows);
    for (const int64_t m : ms) {
      if (gemv_rows == 0 && m > 8) continue;                // same as the default
      if (gemv_rows == 16 && (m <= 8 || m > 16)) continue;  // same as the default
      for (const auto& [n, k] : nks) {
        for (const DType out_dtype : {DType::kF32, DType::kBF16}) {
          for (const bool accumulate : {false, true}) {
            check_problem({m, n, k, DType::kBF16, DType::kBF16, out_dtype, accumulate, 0}, rng);
          }
        }
      }
    }
  }
}

// Every M of a bucket (33-64, 65-128) shares one heuristic query: later shapes take the bucket's
// algorithm after a check, and still match the CPU twin.
TEST(CudaLinear, MBucketsShareOneHeuristicQuery) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Random rng(4242);
  const kernels::cuda::LinearPlanStats before = kernels::cuda::linear_plan_stats(0);
  const int64_t ms[] = {33, 40, 47, 57, 64, 65, 90, 127, 128};
  for (const int64_t m : ms) check_problem({m, 2053, 776, DType::kBF16, DType::kBF16, DType::kBF16, false, 0}, rng);
  const kernels::cuda::LinearPlanStats after = kernels::cuda::linear_plan_stats(0);
  EXPECT_EQ(after.plans - before.plans, 9);
  // Two buckets: two representative queries, plus one for each shape whose check failed.
  const int64_t taken = after.bucket_algorithms_taken - before.bucket_algorithms_taken;
  EXPECT_GE(taken, 5);
  EXPECT_EQ(after.heuristic_queries - before.heuristic_queries, 2 + (9 - taken));
}

TEST(CudaLinear, StridedAndMisalignedInputRows) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Random rng(9002);
  for (const int64_t m : {1, 5, 40}) {
    // Offset 8: aligned strided rows (fast paths); offset 1: 2-byte aligned rows (fallbacks).
    for (const int64_t offset : {8, 1}) {
      for (const DType out_dtype : {DType::kF32, DType::kBF16}) {
        check_problem({m, 77, 264, DType::kBF16, DType::kBF16, out_dtype, m == 5, offset}, rng);
      }
    }
  }
}

TEST(CudaLinear, SimplePathForOtherShapesAndDtypes) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Random rng(9003);
  // K not a multiple of 8.
  for (const int64_t m : {1, 3, 20}) check_problem({m, 33, 100, DType::kBF16, DType::kBF16, DType::kF32, false, 0}, rng);
  // Non-bf16 operands: f32 activations, f32 / f16 weights.
  for (const DType x_dtype : {DType::kF32, DType::kBF16}) {
    for (const DType w_dtype : {DType::kF32, DType::kF16}) {
      for (const bool accumulate : {false, true}) {
        check_problem({4, 19, 40, x_dtype, w_dtype, DType::kF32, accumulate, 0}, rng);
        check_problem({12, 21, 24, x_dtype, w_dtype, DType::kBF16, accumulate, 0}, rng);
      }
    }
  }
}

TEST(CudaLinear, F32OperandsMatchCpuTwinAtEveryRowCount) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Random rng(9004);
  // f32 x, weight and out (f32 runs): cuBLASLt with CUBLAS_COMPUTE_32F (no TF32) at every M, the
  // simple kernel where cuBLASLt has no algorithm (odd offsets).
  for (const int64_t m : {1, 2, 7, 64, 300}) {
    for (const auto& [n, k] : {std::pair<int64_t, int64_t>{67, 136}, {257, 1000}, {33, 100}}) {
      for (const bool accumulate : {false, true}) {
        check_problem({m, n, k, DType::kF32, DType::kF32, DType::kF32, accumulate, 0}, rng);
      }
    }
    check_problem({m, 77, 264, DType::kF32, DType::kF32, DType::kF32, false, 1}, rng);
  }
}

TEST(CudaLinear, EmptyAndMismatchedShapes) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  const OwnedTensor w(DType::kBF16, {3, 8}, Device::cuda());
  const OwnedTensor x_empty(DType::kBF16, {0, 8}, Device::cuda());
  const OwnedTensor out_empty(DType::kF32, {0, 3}, Device::cuda());
  EXPECT_NO_THROW(kernels::linear(*x_empty, *w, *out_empty));
  const OwnedTensor x(DType::kBF16, {2, 16}, Device::cuda());
  const OwnedTensor out(DType::kF32, {2, 3}, Device::cuda());
  EXPECT_THROW(kernels::linear(*x, *w, *out), Error);
}

TEST(CudaLinear, ReplaysInsideCudaGraph) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  kernels::linear_prepare(Device::cuda());
  Random rng(9004);
  const auto stream = static_cast<cudaStream_t>(current_stream(Device::cuda()));
  for (const int64_t m : {1, 6, 48}) {  // GEMV, GEMV, cuBLASLt
    SCOPED_TRACE(::testing::Message() << "m " << m);
    const int64_t n = 300, k = 512;
    const OwnedTensor x = testing::random_tensor(DType::kBF16, {m, k}, rng);
    const OwnedTensor w = testing::random_tensor(DType::kBF16, {n, k}, rng);
    OwnedTensor expected(DType::kF32, {m, n});
    kernels::linear(*x, *w, *expected);
    const OwnedTensor x_device = to_device(*x), w_device = to_device(*w);
    const OwnedTensor out_device(DType::kF32, {m, n}, Device::cuda());
    kernels::linear(*x_device, *w_device, *out_device);  // eager first: plans exist before the capture
    CudaGraph graph;
    graph.begin_capture(stream);
    kernels::linear(*x_device, *w_device, *out_device);
    graph.end_capture(stream);
    OwnedTensor nan_host(DType::kF32, {m, n});
    testing::poison(*nan_host);
    copy_tensor(*out_device, *nan_host);
    graph.launch(stream);
    const OwnedTensor got = to_host(*out_device);
    EXPECT_TRUE(testing::close_rel_l2(*got, testing::to_doubles(*expected), 2e-5));
  }
}

// The GEMV is launched to overlap its producer (pdl.cuh): it stages weights before the producer has
// finished and must read its input only after. A long RMSNorm that lets dependents launch at its
// start writes the GEMV's input row last; inputs alternate between two tensors, so a GEMV that read
// early would see the previous iteration's row. Eagerly and replayed in a CUDA graph.
TEST(CudaLinear, GemvReadsItsInputOnlyAfterAnOverlappedProducer) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  kernels::linear_prepare(Device::cuda());
  Random rng(9005);
  const auto stream = static_cast<cudaStream_t>(current_stream(Device::cuda()));
  const int64_t rows = 16384, d = 4096, n = 4096;
  const OwnedTensor sources[2] = {to_device(*testing::random_tensor(DType::kBF16, {rows, d}, rng)),
                                  to_device(*testing::random_tensor(DType::kBF16, {rows, d}, rng))};
  const OwnedTensor norm_weight = to_device(*testing::random_tensor(DType::kBF16, {d}, rng));
  const OwnedTensor w = to_device(*testing::random_tensor(DType::kBF16, {n, d}, rng));
  const OwnedTensor normed(DType::kBF16, {rows, d}, Device::cuda());
  const Tensor last_row = normed->slice(0, rows - 1, rows);
  const OwnedTensor out(DType::kF32, {1, n}, Device::cuda());
  const auto step = [&](int source) {
    kernels::rms_norm(*sources[source], *norm_weight, *normed, {});
    kernels::linear(last_row, *w, *out);
  };
  std::vector<std::vector<uint8_t>> expected;
  for (int source = 0; source < 2; ++source) {
    kernels::rms_norm(*sources[source], *norm_weight, *normed, {});
    synchronize(Device::cuda());
    kernels::linear(last_row, *w, *out);
    expected.push_back(testing::element_bytes(*to_host(*out)));
  }
  for (int i = 0; i < 16; ++i) {
    step(i % 2);
    EXPECT_EQ(testing::element_bytes(*to_host(*out)), expected[i % 2]) << "eager iteration " << i;
  }
  CudaGraph graphs[2];
  for (int source = 0; source < 2; ++source) {
    graphs[source].begin_capture(stream);
    step(source);
    graphs[source].end_capture(stream);
  }
  for (int i = 0; i < 16; ++i) {
    graphs[i % 2].launch(stream);
    EXPECT_EQ(testing::element_bytes(*to_host(*out)), expected[i % 2]) << "graph replay " << i;
  }
}

// Weight bandwidth of the GEMV (and cuBLASLt at M = 16) on Qwen3-8B shapes. The weights rotate
// over enough copies to exceed the 50 MB L2.
TEST(CudaLinearBench, DISABLED_Qwen3Shapes) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  kernels::linear_prepare(Device::cuda());
  const auto stream = static_cast<cudaStream_t>(current_stream(Device::cuda()));
  struct Shape3 {
    int64_t n, k;
    DType out;
    const char* what;
  };
  const Shape3 shapes[] = {{4096, 4096, DType::kBF16, "o_proj 4096x4096"},
                           {6144, 4096, DType::kBF16, "qkv 6144x4096"},
                           {24576, 4096, DType::kBF16, "gate_up 24576x4096"},
                           {12288, 4096, DType::kBF16, "gate 12288x4096"},
                           {4096, 12288, DType::kBF16, "down 4096x12288"},
                           {151936, 4096, DType::kF32, "lm_head 151936x4096"}};
  std::printf("%-22s %4s %10s %10s\n", "shape", "M", "us", "GB/s");
  for (const Shape3& s : shapes) {
    const size_t weight_bytes = static_cast<size_t>(s.n * s.k) * 2;
    const int copies = static_cast<int>(std::max<size_t>(1, (size_t{256} << 20) / weight_bytes + 1));
    std::vector<OwnedTensor> weights;
    for (int c = 0; c < copies; ++c) {
      weights.emplace_back(DType::kBF16, metrale::Shape{s.n, s.k}, Device::cuda());
      ASSERT_EQ(cudaMemsetAsync(weights.back()->data(), 0x3c, weight_bytes, stream), cudaSuccess);  // 0.0115, not zero
    }
    for (const int64_t m : {1, 2, 4, 8, 16}) {
      OwnedTensor x(DType::kBF16, {m, s.k}, Device::cuda());
      ASSERT_EQ(cudaMemsetAsync(x->data(), 0x3f, x->nbytes(), stream), cudaSuccess);
      OwnedTensor out(s.out, {m, s.n}, Device::cuda());
      for (int i = 0; i < 3; ++i) kernels::linear(*x, *weights[static_cast<size_t>(i % copies)], *out);
      std::vector<float> times;
      for (int rep = 0; rep < 7; ++rep) {
        CudaEvent start, stop;
        constexpr int kIterations = 20;
        start.record(stream);
        for (int i = 0; i < kIterations; ++i) kernels::linear(*x, *weights[static_cast<size_t>(i % copies)], *out);
        stop.record(stream);
        stop.synchronize();
        times.push_back(stop.elapsed_ms_since(start) * 1000.0f / kIterations);
      }
      std::sort(times.begin(), times.end());
      const double us = times[times.size() / 2];
      std::printf("%-22s %4lld %10.1f %10.0f\n", s.what, static_cast<long long>(m), us, weight_bytes / us / 1e3);
    }
  }
}

}  // namespace
}  // namespace metrale
