// Golden tests on the CPU: every case under tests/goldens/ (tiny random models made by
// transformers 5.17.0, see tools/goldens/) is run through the engine. The logits of every position
// must match transformers' full forward (relative L2 <= 1e-4) whether the sequence is fed whole, in
// chunks of 64 or 7, or one token at a time (the decode path); greedy generation must reproduce
// transformers' cached generation up to a near-tie (top-2 margin under 1e-3).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include "engine/golden_cases.h"

namespace metrale {
namespace {

using testing::GoldenCase;

TEST(Goldens, CasesExist) {
  // Without cases every parametrised test below would silently vanish.
  const auto names = testing::golden_cases();
  EXPECT_GE(names.size(), 9u) << "expected the golden cases under " << testing::golden_dir();
  for (const char* required : {"qwen3_tied", "qwen3_untied", "qwen3_long", "qwen3_moe", "qwen3_moe_fused",
                               "qwen3_next", "qwen3_5", "qwen3_5_moe"}) {
    EXPECT_NE(std::find(names.begin(), names.end(), required), names.end()) << "missing golden case " << required;
  }
}

class Golden : public ::testing::TestWithParam<std::string> {};

TEST_P(Golden, LogitsMatchTransformersForEveryChunking) {
  const GoldenCase golden(GetParam());
  // Whole, chunks of 64 (the GDN chunk: prefill chunks that end on and straddle its boundaries), 7, and
  // one token at a time. A case of at most 64 tokens skips 64, which would repeat the whole prefill.
  const int64_t rows = golden.logits.shape.at(0);
  for (const int32_t chunk : {0, 64, 7, 1}) {
    if (chunk == 64 && rows <= 64) continue;
    const double relative = testing::score_relative_l2(golden, Device::cpu(), chunk);
    EXPECT_LE(relative, 1e-4) << "chunk " << chunk;
    RecordProperty("rel_l2_chunk_" + std::to_string(chunk), fmt::format("{:.3e}", relative));
  }
}

TEST_P(Golden, GreedyGenerationMatchesTransformers) {
  testing::expect_greedy_matches(GoldenCase(GetParam()), Device::cpu(), 1e-3f);
}

INSTANTIATE_TEST_SUITE_P(Cases, Golden, ::testing::ValuesIn(testing::golden_cases()),
                         [](const auto& param_info) { return param_info.param; });
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(Golden);

}  // namespace
}  // namespace metrale
