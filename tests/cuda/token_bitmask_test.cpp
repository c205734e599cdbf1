// kernels::apply_token_bitmask: the CUDA kernel against its CPU twin on random masks (mostly masked,
// mostly allowed and random words, bits past the vocabulary set), vocabularies of 151936 and odd
// sizes, padded row strides, unaligned rows (the scalar path), rows skipped (-1 entries, unlisted
// rows, out-of-range entries the kernel must ignore), more masks than one grid dimension holds, and
// a captured graph. Every float of the logits buffer, row padding included, must keep its bits or
// become -inf exactly as the CPU twin decides. A disabled benchmark times the kernel on the Qwen3
// vocabulary.
#include "kernels/token_bitmask.h"

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <vector>

#include "kernels/kernel_helpers.h"
#include "kernels/token_bitmask_cases.h"
#include "runtime/buffer.h"
#include "runtime/cuda/cuda_graph.h"
#include "runtime/device.h"
#include "runtime/stream.h"
#include "runtime/tensor.h"

namespace metrale {
namespace {

using testing::BitmaskCase;
using testing::Random;

// A case's buffers on the GPU. `offset` floats before the first row (1: rows not 16-byte aligned).
struct DeviceCase {
  Buffer logits, masks, rows;
  int64_t offset = 0;
  DeviceCase(const BitmaskCase& c, int64_t offset_floats) : offset(offset_floats) {
    const size_t logit_bytes = (c.logits.size() + static_cast<size_t>(offset)) * sizeof(float);
    logits = Buffer(Device::cuda(), logit_bytes);
    copy_bytes(static_cast<float*>(logits.data()) + offset, Device::cuda(), c.logits.data(), Device::cpu(),
               c.logits.size() * sizeof(float));
    masks = Buffer(Device::cuda(), std::max<size_t>(c.masks.size() * 4, 4));
    if (!c.masks.empty()) copy_bytes(masks.data(), Device::cuda(), c.masks.data(), Device::cpu(), c.masks.size() * 4);
    rows = Buffer(Device::cuda(), std::max<size_t>(c.rows.size() * 4, 4));
    if (!c.rows.empty()) copy_bytes(rows.data(), Device::cuda(), c.rows.data(), Device::cpu(), c.rows.size() * 4);
  }
  void run(const BitmaskCase& c) const {
    kernels::apply_token_bitmask(Tensor(static_cast<float*>(logits.data()) + offset, DType::kF32, {c.num_rows, c.vocab},
                                        {c.stride, 1}, Device::cuda()),
                                 Tensor(masks.data(), DType::kI32, {c.num_masks(), c.words}, Device::cuda()),
                                 Tensor(rows.data(), DType::kI32, {c.num_masks()}, Device::cuda()));
  }
  std::vector<float> read(const BitmaskCase& c) const {
    std::vector<float> out(c.logits.size());
    copy_bytes(out.data(), Device::cpu(), static_cast<const float*>(logits.data()) + offset, Device::cuda(),
               out.size() * sizeof(float));
    return out;
  }
};

std::vector<float> cpu_result(BitmaskCase c) {
  // The twin skips no entry the CUDA kernel applies; out-of-range entries (which the CPU refuses)
  // are dropped first, as the kernel ignores them.
  for (int32_t& row : c.rows) {
    if (row >= c.num_rows) row = -1;
  }
  kernels::apply_token_bitmask(
      Tensor(c.logits.data(), DType::kF32, {c.num_rows, c.vocab}, {c.stride, 1}, Device::cpu()),
      Tensor(c.masks.data(), DType::kI32, {c.num_masks(), c.words}, Device::cpu()),
      Tensor(c.rows.data(), DType::kI32, {c.num_masks()}, Device::cpu()));
  return c.logits;
}

void expect_matches_cpu(const BitmaskCase& c, int64_t offset) {
  const std::vector<float> expected = cpu_result(c);
  ASSERT_EQ(testing::first_bit_difference(expected, testing::expected_masked(c)), -1) << "the CPU twin";
  DeviceCase device(c, offset);
  device.run(c);
  const std::vector<float> actual = device.read(c);
  const int64_t diff = testing::first_bit_difference(actual, expected);
  EXPECT_EQ(diff, -1) << "first difference at row " << (diff < 0 ? 0 : diff / c.stride) << " token "
                      << (diff < 0 ? 0 : diff % c.stride);
}

TEST(CudaTokenBitmask, MatchesTheCpuTwinOnRandomMasks) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Random rng(9401);
  for (const int64_t vocab : {1, 3, 4, 31, 33, 1023, 1025, 4096, 151669, 151936, 151937}) {
    for (const int64_t pad : {0, 1, 4}) {
      for (const int64_t offset : {0, 1}) {
        SCOPED_TRACE(::testing::Message() << "vocab " << vocab << " stride pad " << pad << " offset " << offset);
        const int64_t num_rows = vocab > 10000 ? 24 : 9;
        // Fewer masks than rows (unlisted rows), some -1.
        const BitmaskCase c = testing::make_bitmask_case(rng, num_rows, vocab, num_rows - 3, pad, pad % 2);
        expect_matches_cpu(c, offset);
      }
    }
  }
}

TEST(CudaTokenBitmask, SkipsPaddingAndOutOfRangeEntries) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Random rng(9402);
  BitmaskCase c = testing::make_bitmask_case(rng, 5, 151936, 6);
  c.rows = {-1, 7, 2, -5, 1 << 30, 4};  // only rows 2 and 4 are masked
  expect_matches_cpu(c, 0);
  BitmaskCase none = testing::make_bitmask_case(rng, 3, 1000, 2);
  none.rows = {-1, -1};
  expect_matches_cpu(none, 0);
  BitmaskCase empty = testing::make_bitmask_case(rng, 3, 1000, 0);  // an unconstrained step
  expect_matches_cpu(empty, 0);
}

TEST(CudaTokenBitmask, MoreMasksThanOneGridDimension) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Random rng(9403);
  const BitmaskCase c = testing::make_bitmask_case(rng, 70000, 37, 70000, 3);
  expect_matches_cpu(c, 0);
}

TEST(CudaTokenBitmask, ReplaysInsideACudaGraph) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Random rng(9404);
  BitmaskCase c = testing::make_bitmask_case(rng, 8, 151936, 8);
  const std::vector<float> expected = cpu_result(c);
  DeviceCase device(c, 0);
  const auto stream = static_cast<cudaStream_t>(current_stream(Device::cuda()));
  CudaGraph graph;
  graph.begin_capture(stream);
  device.run(c);
  graph.end_capture(stream);
  graph.launch(stream);
  synchronize(Device::cuda());
  EXPECT_EQ(testing::first_bit_difference(device.read(c), expected), -1);
}

TEST(CudaTokenBitmaskBench, DISABLED_Qwen3Vocabulary) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Random rng(9405);
  const auto stream = static_cast<cudaStream_t>(current_stream(Device::cuda()));
  CudaEvent start, stop;
  std::printf("%-18s %5s %7s %10s %10s\n", "masks", "rows", "masked", "us/launch", "GB/s");
  for (const int64_t rows : {1, 16, 64, 256}) {
    for (const int64_t masked : {int64_t{1}, rows}) {
      if (masked > rows) continue;
      BitmaskCase c = testing::make_bitmask_case(rng, rows, 151936, masked);
      for (int64_t k = 0; k < masked; ++k) c.rows[static_cast<size_t>(k)] = static_cast<int32_t>(k);
      DeviceCase device(c, 0);
      device.run(c);
      constexpr int kIterations = 200;
      start.record(stream);
      for (int i = 0; i < kIterations; ++i) device.run(c);
      stop.record(stream);
      stop.synchronize();
      const double us = 1e3 * stop.elapsed_ms_since(start) / kIterations;
      // Traffic: the masks read and, at most, every logit of a masked row written.
      const double bytes = static_cast<double>(masked) * (static_cast<double>(c.words) * 4 + 151936.0 * 4);
      std::printf("%-18s %5lld %7lld %10.2f %10.1f\n", "random mix", static_cast<long long>(rows),
                  static_cast<long long>(masked), us, bytes / (us * 1e3));
    }
  }
}

}  // namespace
}  // namespace metrale
