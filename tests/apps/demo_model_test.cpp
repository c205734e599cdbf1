// The bundled demo model (models/demo, made by tools/demo_model/train.py with transformers 5.17.0):
// `metrale score` reproduces the logits transformers computed for a held-out snippet, and the
// perplexity of the held-out file the training script printed; with an FP8 KV cache
// (--kv-cache-dtype fp8 --calculate-kv-scales) that perplexity stays within 1% of a bf16 KV cache's.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <iostream>
#include <string>

#include <nlohmann/json.hpp>

#include "apps/cli_helpers.h"
#include "core/npy.h"
#include "core/strings.h"

namespace metrale {
namespace {

using testing::join_ids;
using testing::run_metrale;

const std::filesystem::path kDemo = std::filesystem::path(METRALE_SOURCE_DIR) / "models" / "demo";

// The last line of `score`'s output is its JSON summary.
nlohmann::json summary_of(const std::string& out) {
  const size_t start = out.rfind('{');
  return nlohmann::json::parse(out.substr(start == std::string::npos ? 0 : start));
}

const nlohmann::json& train_log() {
  static const nlohmann::json log = nlohmann::json::parse(read_file(kDemo / "train_log.json"));
  return log;
}

TEST(DemoModel, ScoreReproducesTransformersLogits) {
  const auto reference = read_npy_f32(kDemo / "reference_logits.npy");
  const std::string ids = join_ids(train_log().at("reference").at("input_ids"));
  for (const char* chunk : {"0", "7", "1"}) {
    const auto out =
        std::filesystem::temp_directory_path() / ("metrale_demo_logits_" + std::to_string(::getpid()) + ".npy");
    const auto result = run_metrale("score --model " + kDemo.string() + " --tokens " + ids + " --out " + out.string() +
                                    " --chunk " + chunk + " --device cpu");
    ASSERT_EQ(result.exit_code, 0) << result.out << result.err;
    const auto logits = read_npy_f32(out);
    std::filesystem::remove(out);
    ASSERT_EQ(logits.shape, reference.shape);
    double diff = 0, norm = 0;
    for (size_t i = 0; i < logits.data.size(); ++i) {
      const double d = static_cast<double>(logits.data[i]) - reference.data[i];
      diff += d * d;
      norm += static_cast<double>(reference.data[i]) * reference.data[i];
    }
    EXPECT_LE(std::sqrt(diff / norm), 1e-4) << "chunk " << chunk;
  }
}

TEST(DemoModel, HeldOutPerplexityMatchesTrainingScript) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "4,763 tokens through an unoptimised sanitizer build take minutes; the Release run checks this";
#endif
  const auto& eval = train_log().at("heldout_eval");
  const double expected = eval.at("perplexity").get<double>();
  const auto result =
      run_metrale("score --model " + kDemo.string() + " --tokens " + join_ids(eval.at("input_ids")) + " --device cpu");
  ASSERT_EQ(result.exit_code, 0) << result.out << result.err;
  const double perplexity = summary_of(result.out).at("perplexity").get<double>();
  EXPECT_NEAR(perplexity, expected, 0.01 * expected);
}

TEST(DemoModel, HeldOutPerplexityWithFp8KvCacheWithinOnePercentOfBf16) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "4,763 tokens through an unoptimised sanitizer build take minutes; the Release run checks this";
#endif
  const std::string ids = join_ids(train_log().at("heldout_eval").at("input_ids"));
  const auto perplexity = [&](const std::string& flags) {
    const auto result = run_metrale("score --model " + kDemo.string() + " --tokens " + ids + " --device cpu " + flags);
    EXPECT_EQ(result.exit_code, 0) << result.out << result.err;
    return result.exit_code == 0 ? summary_of(result.out).at("perplexity").get<double>() : NAN;
  };
  const double bf16 = perplexity("--kv-cache-dtype bf16");
  const double fp8 = perplexity("--kv-cache-dtype fp8 --calculate-kv-scales");
  std::cout << "[ fp8 KV ] demo model held-out perplexity: bf16 KV " << bf16 << ", fp8 KV " << fp8 << " ("
            << 100.0 * (fp8 / bf16 - 1.0) << "%)\n";
  RecordProperty("perplexity_bf16_kv", std::to_string(bf16));
  RecordProperty("perplexity_fp8_kv", std::to_string(fp8));
  EXPECT_NEAR(fp8, bf16, 0.01 * bf16);
  EXPECT_NE(fp8, bf16) << "the FP8 cache must actually quantise";
}

}  // namespace
}  // namespace metrale
