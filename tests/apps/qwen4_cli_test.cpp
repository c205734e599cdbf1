// `metrale generate` on a tiny random qwen4_exp directory (tests/common/tiny_qwen4_checkpoint.h:
// composite config, PLE table in row shards, the hash buffers stored), end to end through the
// command: greedy ids from token ids, the same with n-gram speculation.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "apps/cli_helpers.h"
#include "common/tiny_qwen4_checkpoint.h"
#include "core/test_support.h"

namespace metrale {
namespace {

TEST(Qwen4Cli, GenerateRunsATinyCheckpoint) {
  const testing::Qwen4Spec spec;
  testing::TempDir dir;
  testing::write_qwen4_checkpoint(dir.path(), spec, testing::make_qwen4_weights(spec, 3));
  const std::string base = "generate --model " + dir.path().string() + " --device cpu" +
                           " --prompt-ids 5,6,7,2,9,10,11,5,6,7,5,6 --max-tokens 12 --temperature 0 --ignore-eos --json";
  const auto plain = testing::run_metrale(base);
  ASSERT_EQ(plain.exit_code, 0) << plain.err;
  const auto output = nlohmann::json::parse(plain.out);
  ASSERT_EQ(output.at("token_ids").size(), 12u);
  EXPECT_EQ(output.at("finish_reason"), "length");
  const auto speculative = testing::run_metrale(base + " --speculative-method ngram --num-drafts 3 --no-adaptive-speculation");
  ASSERT_EQ(speculative.exit_code, 0) << speculative.err;
  EXPECT_EQ(nlohmann::json::parse(speculative.out).at("token_ids"), output.at("token_ids"));
}

}  // namespace
}  // namespace metrale
