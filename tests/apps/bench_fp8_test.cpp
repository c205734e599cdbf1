// `metrale bench --random-weights --quantization fp8` on tiny presets (the golden configs of the
// GDN + MoE, KDA + MLA/DSA + MoE and QSA + MoE architectures) on the CPU: the random weights are
// generated in FP8, the decode and prefill rows run, and the roofline counts FP8 weight bytes.
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "apps/cli_helpers.h"
#include "common/fixtures.h"

namespace metrale {
namespace {

const std::filesystem::path kGoldens = std::filesystem::path(METRALE_TEST_DATA_DIR) / "goldens";

nlohmann::json bench(const std::filesystem::path& config, const std::string& quantization) {
  const auto result =
      testing::run_metrale("bench --config " + config.string() + " --random-weights --quantization " + quantization +
                           " --device cpu --batch 1,2 --prefill 8 --context 4 --iters 1 --warmup 0 "
                           "--json");
  EXPECT_EQ(result.exit_code, 0) << result.err;
  if (result.exit_code != 0) return nlohmann::json::object();
  return nlohmann::json::parse(result.out);
}

TEST(BenchFp8, RandomFp8WeightsRunOnTinyPresets) {
  for (const char* name : {"qwen3_next", "glm5_next", "qwen4_exp"}) {
    SCOPED_TRACE(name);
    const std::filesystem::path config = kGoldens / name / "model" / "config.json";
    ASSERT_TRUE(testing::fixtures_present({config}));
    const nlohmann::json fp8 = bench(config, "fp8");
    ASSERT_TRUE(fp8.contains("results"));
    EXPECT_NE(fp8.at("model").get<std::string>().find("random FP8 weights"), std::string::npos);
    int decode = 0, prefill = 0;
    for (const auto& row : fp8.at("results")) {
      EXPECT_GT(row.at("step_ms").get<double>(), 0.0);
      decode += row.at("phase") == "decode" ? 1 : 0;
      prefill += row.at("phase") == "prefill" ? 1 : 0;
    }
    EXPECT_EQ(decode, 2);
    EXPECT_EQ(prefill, 1);
  }
}

TEST(BenchFp8, RooflineCountsFp8WeightBytes) {
  const std::filesystem::path config = kGoldens / "qwen3_next" / "model" / "config.json";
  ASSERT_TRUE(testing::fixtures_present({config}));
  const nlohmann::json fp8 = bench(config, "fp8"), bf16 = bench(config, "none");
  ASSERT_TRUE(fp8.contains("weight_bytes") && bf16.contains("weight_bytes"));
  // The mixer and FFN weights take one byte instead of two; the embedding and LM head stay bf16.
  EXPECT_LT(fp8.at("weight_bytes").get<double>(), 0.9 * bf16.at("weight_bytes").get<double>());
  EXPECT_GT(fp8.at("weight_bytes").get<double>(), 0.5 * bf16.at("weight_bytes").get<double>());
}

}  // namespace
}  // namespace metrale
