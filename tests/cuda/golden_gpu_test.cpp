// Golden tests through the CUDA path: the same cases as tests/engine/golden_test.cpp, with bf16
// activations on the GPU against transformers' fp32 logits: relative L2 of the logits at most
// 2e-2 for whole, chunked and token-by-token feeding; greedy tokens equal up to a near-tie.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include "engine/golden_cases.h"

namespace metrale {
namespace {

using testing::GoldenCase;

class GoldenGpu : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (!cuda_available()) GTEST_SKIP() << "no GPU";
  }
};

TEST_P(GoldenGpu, LogitsMatchTransformers) {
  const GoldenCase golden(GetParam());
  for (const int32_t chunk : {0, 7, 1}) {
    const double relative = testing::score_relative_l2(golden, Device::cuda(0), chunk);
    EXPECT_LE(relative, 2e-2) << "chunk " << chunk;
    RecordProperty("rel_l2_chunk_" + std::to_string(chunk), fmt::format("{:.3e}", relative));
    std::printf("[golden-gpu] %s chunk %d: rel L2 %.3e\n", GetParam().c_str(), chunk, relative);
  }
}

TEST_P(GoldenGpu, GreedyGenerationMatchesTransformers) {
  // bf16 activations move logits by ~1e-2: a flip is a near-tie below that.
  testing::expect_greedy_matches(GoldenCase(GetParam()), Device::cuda(0), 5e-2f);
}

INSTANTIATE_TEST_SUITE_P(Cases, GoldenGpu, ::testing::ValuesIn(testing::golden_cases()),
                         [](const auto& param_info) { return param_info.param; });
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(GoldenGpu);

}  // namespace
}  // namespace metrale
