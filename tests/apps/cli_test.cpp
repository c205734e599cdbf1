// The `metrale` command as a user runs it: exit codes (0 ok, 1 runtime error, 2 usage error), the
// one-line error message, `score` reproducing the golden logits, and `generate --json`.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <fstream>

#include <nlohmann/json.hpp>

#include "apps/cli_helpers.h"
#include "common/tiny_glm5_checkpoint.h"
#include "core/npy.h"
#include "core/strings.h"

namespace metrale {
namespace {

using testing::join_ids;
using testing::run_metrale;

const std::filesystem::path kGoldens = std::filesystem::path(METRALE_TEST_DATA_DIR) / "goldens";

std::string ids_arg(const std::filesystem::path& input_ids_json) {
  return join_ids(nlohmann::json::parse(read_file(input_ids_json)));
}

TEST(Cli, HelpAndVersionSucceed) {
  EXPECT_EQ(run_metrale("--help").exit_code, 0);
  EXPECT_EQ(run_metrale("--version").exit_code, 0);
  EXPECT_EQ(run_metrale("generate --help").exit_code, 0);
}

TEST(Cli, UsageErrorsExitTwo) {
  EXPECT_EQ(run_metrale("").exit_code, 2);
  EXPECT_EQ(run_metrale("no-such-command").exit_code, 2);
  EXPECT_EQ(run_metrale("generate --max-tokens banana").exit_code, 2);
  const auto both =
      run_metrale("generate --model " + (kGoldens / "qwen3_tied" / "model").string() + " --prompt hi --prompt-ids 1");
  EXPECT_EQ(both.exit_code, 2);
  EXPECT_NE(both.err.find("metrale: error:"), std::string::npos) << both.err;
  EXPECT_EQ(run_metrale("score --model " + (kGoldens / "qwen3_tied" / "model").string() + " --tokens 1,x,3").exit_code,
            2);
  EXPECT_EQ(run_metrale("score --model /nonexistent/model --tokens 1,2").exit_code, 2);
}

TEST(Cli, RuntimeErrorsExitOneWithOneLine) {
  const auto dir = std::filesystem::temp_directory_path() / ("metrale_cli_bad_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "config.json") << R"({"model_type": "not_a_model", "vocab_size": 8, "hidden_size": 8,
    "num_hidden_layers": 1, "num_attention_heads": 1})";
  const auto result = run_metrale("score --model " + dir.string() + " --tokens 1,2");
  EXPECT_EQ(result.exit_code, 1);
  EXPECT_NE(result.err.find("unknown model_type 'not_a_model'"), std::string::npos) << result.err;
  EXPECT_EQ(std::count(result.err.begin(), result.err.end(), '\n'), 1) << result.err;
  std::filesystem::remove_all(dir);
}

TEST(Cli, DtypeFlag) {
  const std::string model = (kGoldens / "qwen3_tied" / "model").string();
  // float32 is the CPU's own dtype; bfloat16 activations need a GPU; other names are usage errors.
  const auto f32 = run_metrale("score --device cpu --dtype float32 --model " + model + " --tokens 1,2,3");
  EXPECT_EQ(f32.exit_code, 0) << f32.err;
  const auto bf16 = run_metrale("score --device cpu --dtype bfloat16 --model " + model + " --tokens 1,2,3");
  EXPECT_EQ(bf16.exit_code, 1);
  EXPECT_NE(bf16.err.find("the CPU computes in float32"), std::string::npos) << bf16.err;
  EXPECT_EQ(run_metrale("score --device cpu --dtype f16 --model " + model + " --tokens 1,2,3").exit_code, 2);
}

TEST(Cli, ScoreReproducesGoldenLogits) {
  const auto case_dir = kGoldens / "qwen3_long";
  ASSERT_TRUE(std::filesystem::exists(case_dir / "logits.npy")) << case_dir;
  const auto reference = read_npy_f32(case_dir / "logits.npy");
  for (const char* chunk : {"0", "16", "1"}) {
    const auto out =
        std::filesystem::temp_directory_path() / ("metrale_cli_score_" + std::to_string(::getpid()) + ".npy");
    const auto result =
        run_metrale("score --model " + (case_dir / "model").string() + " --tokens " +
                    ids_arg(case_dir / "input_ids.json") + " --out " + out.string() + " --chunk " + chunk);
    ASSERT_EQ(result.exit_code, 0) << result.err;
    const auto summary = nlohmann::json::parse(result.out);
    EXPECT_TRUE(summary.at("perplexity").get<double>() > 1.0);
    const auto logits = read_npy_f32(out);
    ASSERT_EQ(logits.shape, reference.shape);
    double diff = 0, norm = 0;
    for (size_t i = 0; i < logits.data.size(); ++i) {
      diff += (logits.data[i] - reference.data[i]) * (logits.data[i] - reference.data[i]);
      norm += reference.data[i] * reference.data[i];
    }
    EXPECT_LE(std::sqrt(diff / norm), 1e-4) << "chunk " << chunk;
    std::filesystem::remove(out);
  }
}

TEST(Cli, GenerateJsonFromTokenIds) {
  const auto model = kGoldens / "qwen3_tied" / "model";
  const auto result = run_metrale("generate --model " + model.string() +
                                  " --prompt-ids 5,6,7 --max-tokens 5 --temperature 0 --ignore-eos --json");
  ASSERT_EQ(result.exit_code, 0) << result.err;
  const auto output = nlohmann::json::parse(result.out);
  EXPECT_EQ(output.at("token_ids").size(), 5u);
  EXPECT_EQ(output.at("finish_reason"), "length");
  EXPECT_TRUE(output.contains("text"));
  // Seeded sampling is reproducible run to run.
  const std::string sampled = "generate --model " + model.string() +
                              " --prompt-ids 5,6,7 --max-tokens 8 --temperature 1 --seed 3 --ignore-eos --json";
  EXPECT_EQ(nlohmann::json::parse(run_metrale(sampled).out).at("token_ids"),
            nlohmann::json::parse(run_metrale(sampled).out).at("token_ids"));
}

// A tiny random glm5_next directory (tests/common/tiny_glm5_checkpoint.h, hub layout, with its MTP
// layer) generates end to end, with the same greedy tokens with MTP and n-gram speculation.
TEST(Cli, GenerateGlm5NextWithAndWithoutSpeculation) {
  testing::TempDir dir;
  const testing::TinyGlm5Spec spec;
  testing::write_glm5_checkpoint(dir.path(), spec, testing::make_glm5_weights(spec, 61),
                                 {testing::Glm5Layout::kHub, "model.language_model.", DType::kBF16});
  const std::string base = "generate --model " + dir.path().string() +
                           " --prompt-ids 5,6,7,8,5,6,7,8,5,6,7,8,9,10,11,12 --max-tokens 24 --temperature 0 "
                           "--ignore-eos --json";
  const auto plain = run_metrale(base);
  ASSERT_EQ(plain.exit_code, 0) << plain.err;
  const auto tokens = nlohmann::json::parse(plain.out).at("token_ids");
  EXPECT_EQ(tokens.size(), 24u);
  for (const char* method : {"mtp", "ngram"}) {
    const auto speculative = run_metrale(base + " --speculative-method " + method + " --num-drafts 2");
    ASSERT_EQ(speculative.exit_code, 0) << method << ": " << speculative.err;
    EXPECT_EQ(nlohmann::json::parse(speculative.out).at("token_ids"), tokens) << method;
  }
}

}  // namespace
}  // namespace metrale
