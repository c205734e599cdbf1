// kernels::rejection_sample_rows: the CUDA kernel against its CPU twin given the same rows and
// uniforms, over random target and draft distributions (general and one-hot q, targets with zero
// tokens, q equal to p, a draft the target excludes, uniforms at the ends of [0, 1)) and
// vocabularies from 1 to 151936. Tokens and accept flags must agree exactly; the distribution itself
// is checked on the CPU (tests/kernels/rejection_sampling_test.cpp).
#include "kernels/rejection_sampling.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "cuda/cuda_test_helpers.h"
#include "runtime/device.h"
#include "runtime/stream.h"

namespace metrale {
namespace {

using testing::to_device;
using testing::to_host;

float uniform01(std::mt19937_64& rng) {
  return static_cast<float>(rng() >> 40) * 0x1p-24f;
}

// One row's distribution: `zeros` random tokens without mass, the rest random and normalised
// (softmax-like spreads: a few large entries, many tiny ones).
void random_distribution(std::mt19937_64& rng, std::span<float> out, int64_t zeros) {
  double total = 0.0;
  for (float& x : out) {
    const float u = uniform01(rng);
    x = u * u * u * u;
    total += x;
  }
  for (int64_t z = 0; z < zeros; ++z) {
    float& x = out[rng() % out.size()];
    total -= x;
    x = 0.0f;
  }
  if (!(total > 0.0)) {
    out[0] = 1.0f;
    total = 1.0;
  }
  for (float& x : out) x = static_cast<float>(x / total);
}

struct Case {
  int64_t rows = 0, vocab = 0;
  bool one_hot = false;
};

void expect_twins_agree(const Case& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const int64_t rows = c.rows, vocab = c.vocab;
  OwnedTensor target(DType::kF32, {rows, vocab}), draft_probs, drafts(DType::kI32, {rows}),
      accept_uniform(DType::kF32, {rows}), residual_uniform(DType::kF32, {rows});
  if (!c.one_hot) draft_probs = OwnedTensor(DType::kF32, {rows, vocab});
  for (int64_t r = 0; r < rows; ++r) {
    const std::span<float> p(target.tensor.data_as<float>() + r * vocab, static_cast<size_t>(vocab));
    random_distribution(rng, p, static_cast<int64_t>(rng() % static_cast<uint64_t>(vocab)) / 2);
    if (!c.one_hot) {
      const std::span<float> q(draft_probs.tensor.data_as<float>() + r * vocab, static_cast<size_t>(vocab));
      if (r % 7 == 3) {
        std::copy(p.begin(), p.end(), q.begin());  // q == p: always accepted
      } else {
        random_distribution(rng, q, static_cast<int64_t>(rng() % static_cast<uint64_t>(vocab)) / 2);
      }
    }
    drafts.tensor.data_as<int32_t>()[r] = static_cast<int32_t>(rng() % static_cast<uint64_t>(vocab));
    // Uniforms at the ends of [0, 1) now and then.
    const auto pick = [&]() { return r % 11 == 0 ? 0.0f : r % 13 == 0 ? 1.0f - 0x1p-24f : uniform01(rng); };
    accept_uniform.tensor.data_as<float>()[r] = pick();
    residual_uniform.tensor.data_as<float>()[r] = pick();
  }
  OwnedTensor cpu_tokens(DType::kI32, {rows}), cpu_accepted(DType::kI32, {rows});
  kernels::rejection_sample_rows({target.tensor, c.one_hot ? Tensor() : draft_probs.tensor, drafts.tensor,
                                  accept_uniform.tensor, residual_uniform.tensor},
                                 cpu_tokens.tensor, cpu_accepted.tensor);
  const OwnedTensor d_target = to_device(target.tensor), d_drafts = to_device(drafts.tensor),
                    d_accept = to_device(accept_uniform.tensor), d_residual = to_device(residual_uniform.tensor);
  OwnedTensor d_draft_probs;
  if (!c.one_hot) d_draft_probs = to_device(draft_probs.tensor);
  OwnedTensor gpu_tokens(DType::kI32, {rows}, Device::cuda()), gpu_accepted(DType::kI32, {rows}, Device::cuda());
  kernels::rejection_sample_rows({d_target.tensor, c.one_hot ? Tensor() : d_draft_probs.tensor, d_drafts.tensor,
                                  d_accept.tensor, d_residual.tensor},
                                 gpu_tokens.tensor, gpu_accepted.tensor);
  synchronize(Device::cuda());
  const OwnedTensor tokens = to_host(gpu_tokens.tensor), accepted = to_host(gpu_accepted.tensor);
  int64_t kept = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t expected = cpu_tokens.tensor.data_as<const int32_t>()[r];
    EXPECT_EQ(tokens.tensor.data_as<const int32_t>()[r], expected)
        << "vocab " << vocab << (c.one_hot ? " one-hot" : "") << " row " << r;
    EXPECT_EQ(accepted.tensor.data_as<const int32_t>()[r], cpu_accepted.tensor.data_as<const int32_t>()[r])
        << "vocab " << vocab << " row " << r;
    kept += cpu_accepted.tensor.data_as<const int32_t>()[r];
  }
  // Both outcomes occur (the comparison covers the residual draw, not only acceptance); with one
  // token in the vocabulary every draft is that token and is kept.
  if (vocab == 1) {
    EXPECT_EQ(kept, rows);
  } else if (rows >= 64) {
    EXPECT_GT(kept, 0) << "vocab " << vocab;
    EXPECT_LT(kept, rows) << "vocab " << vocab;
  }
}

TEST(RejectionSamplingKernel, CudaMatchesTheCpuTwin) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  uint64_t seed = 1;
  for (const int64_t vocab : {1, 2, 7, 255, 256, 257, 1000, 32000, 151936}) {
    for (const bool one_hot : {false, true}) {
      expect_twins_agree({vocab > 32000 ? 64 : 256, vocab, one_hot}, seed++);
    }
  }
}

}  // namespace
}  // namespace metrale
