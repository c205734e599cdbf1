// The FP8 KV cache (--kv-cache-dtype fp8) through the engine: the memory planner gives twice the
// KV blocks of bf16 for the same bytes, and the trained demo model (models/demo, a qwen3_5 hybrid:
// its two gated-attention layers get e4m3 caches, its Gated DeltaNet state stays fp32) agrees with
// its bf16-cache self on the greedy token of almost every held-out position, with scales calibrated
// on the first step (--calculate-kv-scales) or left at 1.0. The numbers are printed.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <iostream>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/strings.h"
#include "engine/engine.h"
#include "engine/request_helpers.h"
#include "model/registry.h"

namespace metrale {
namespace {

const std::filesystem::path kModels = std::filesystem::path(METRALE_SOURCE_DIR) / "models";

LoadOptions kv_options(std::optional<DType> dtype, bool calibrate = false) {
  LoadOptions options;
  options.kv_cache = {dtype, calibrate};
  return options;
}

TEST(Fp8KvEngine, PlannerGivesTwiceTheBlocksForTheSameBytes) {
  const auto dir = kModels / "default";  // qwen3: attention layers only
  ASSERT_TRUE(testing::fixture_exists(dir / "model.safetensors"));
  EngineConfig config;
  config.kv_cache_bytes = 2ull << 20;
  config.max_model_len = 4096;
  Engine bf16(load_model(dir, Device::cpu(), kv_options(DType::kBF16)), config);
  Engine fp8(load_model(dir, Device::cpu(), kv_options(DType::kF8E4M3)), config);
  EXPECT_EQ(fp8.plan().num_kv_blocks, 2 * bf16.plan().num_kv_blocks);
  EXPECT_EQ(fp8.plan().kv_cache_bytes, bf16.plan().kv_cache_bytes);
  for (const BlockCache& cache : fp8.cache().block_caches())
    for (const Tensor& tensor : cache.tensors) EXPECT_EQ(tensor.dtype(), DType::kF8E4M3);
  // The model runs on it.
  fp8.add_request(testing::make_request({1, 2, 3, 4, 5}, 8));
  const auto outputs = testing::run_to_completion(fp8, testing::expect_cache_integrity);
  ASSERT_EQ(outputs.size(), 1u);
  EXPECT_EQ(outputs.begin()->second.tokens.size(), 8u);
}

// Teacher-forced logits of `ids` (every position's next-token distribution).
struct Scored {
  std::vector<float> logits;  // [T, vocab]
  int64_t vocab = 0;
};

Scored score(std::unique_ptr<Model> model, const std::vector<int32_t>& ids) {
  EngineConfig config;
  config.kv_cache_bytes = 64ull << 20;
  config.max_model_len = 2048;
  config.scheduler.max_num_seqs = 1;
  Engine engine(std::move(model), config);
  Request request;
  request.prompt = ids;
  request.max_tokens = 0;
  request.return_prompt_logits = true;
  const int64_t id = engine.add_request(std::move(request));
  while (engine.has_unfinished()) engine.step();
  return {engine.sequence(id).prompt_logits, engine.model().config().vocab_size};
}

struct Comparison {
  double argmax_agreement = 0.0;  // share of positions with the same greedy token
  double logits_rel_l2 = 0.0;
  double perplexity = 0.0, reference_perplexity = 0.0;
};

Comparison compare(const Scored& got, const Scored& reference, const std::vector<int32_t>& ids) {
  Comparison c;
  const int64_t positions = static_cast<int64_t>(ids.size()) - 1, vocab = reference.vocab;
  int64_t agree = 0;
  double diff = 0.0, norm = 0.0, nll = 0.0, reference_nll = 0.0;
  for (int64_t t = 0; t < positions; ++t) {
    const float* a = got.logits.data() + t * vocab;
    const float* b = reference.logits.data() + t * vocab;
    int64_t best_a = 0, best_b = 0;
    for (int64_t v = 0; v < vocab; ++v) {
      best_a = a[v] > a[best_a] ? v : best_a;
      best_b = b[v] > b[best_b] ? v : best_b;
      diff += (static_cast<double>(a[v]) - b[v]) * (static_cast<double>(a[v]) - b[v]);
      norm += static_cast<double>(b[v]) * b[v];
    }
    agree += best_a == best_b;
    const auto nll_of = [&](const float* row, int64_t best) {
      double sum = 0.0;
      for (int64_t v = 0; v < vocab; ++v) sum += std::exp(static_cast<double>(row[v]) - row[best]);
      return row[best] + std::log(sum) - row[ids[static_cast<size_t>(t + 1)]];
    };
    nll += nll_of(a, best_a);
    reference_nll += nll_of(b, best_b);
  }
  c.argmax_agreement = static_cast<double>(agree) / static_cast<double>(positions);
  c.logits_rel_l2 = std::sqrt(diff / norm);
  c.perplexity = std::exp(nll / static_cast<double>(positions));
  c.reference_perplexity = std::exp(reference_nll / static_cast<double>(positions));
  return c;
}

TEST(Fp8KvEngine, DemoModelAgreesWithBf16KvGreedily) {
  const auto dir = kModels / "demo";
  ASSERT_TRUE(testing::fixture_exists(dir / "train_log.json"));
  const nlohmann::json log = nlohmann::json::parse(read_file(dir / "train_log.json"));
  std::vector<int32_t> ids = log.at("heldout_eval").at("input_ids").get<std::vector<int32_t>>();
  ids.resize(1024);  // the full held-out file is the perplexity test's (tests/apps/demo_model_test.cpp)
  const Scored bf16 = score(load_model(dir, Device::cpu(), kv_options(DType::kBF16)), ids);
  for (const bool calibrate : {true, false}) {
    const Scored fp8 = score(load_model(dir, Device::cpu(), kv_options(DType::kF8E4M3, calibrate)), ids);
    const Comparison c = compare(fp8, bf16, ids);
    std::cout << "[ fp8 KV ] demo model, " << ids.size() << " held-out tokens, scales "
              << (calibrate ? "calibrated" : "1.0") << ": greedy agreement " << c.argmax_agreement
              << ", logits relative L2 " << c.logits_rel_l2 << ", perplexity " << c.perplexity << " (bf16 KV "
              << c.reference_perplexity << ")\n";
    EXPECT_GE(c.argmax_agreement, 0.95);
    EXPECT_LT(c.logits_rel_l2, 0.05);
    EXPECT_NEAR(c.perplexity, c.reference_perplexity, 0.01 * c.reference_perplexity);
    EXPECT_GT(c.logits_rel_l2, 0.0) << "the FP8 cache must actually quantise";
  }
}

}  // namespace
}  // namespace metrale
