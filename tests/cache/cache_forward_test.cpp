// The CacheManager as a model's KV cache: a sequence run in chunks and decode steps, next to other
// sequences, after blocks were freed by a finished sequence and reused, must give the logits of
// the same sequence prefilled alone in one step. Models come from make_random_model (tiny specs of
// tests/common), so no checkpoint is involved; the steps run through the common mini-runner.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <random>

#include "cache/cache_manager.h"
#include "common/cache_manager_caches.h"
#include "common/step_runner.h"
#include "common/tiny_checkpoint.h"
#include "model/registry.h"

namespace metrale {
namespace {

using testing::CacheManagerCaches;
using testing::ForwardRunner;
using testing::relative_l2;
using testing::slice;

// A tiny model of `model_type` with random weights (no checkpoint).
std::unique_ptr<Model> tiny_random_model(const std::string& model_type) {
  testing::TinySpec spec;
  spec.model_type = model_type;
  spec.vocab_size = 53;
  spec.head_dim = 8;
  spec.num_experts = 4;
  spec.top_k = 2;
  spec.moe_intermediate_size = 16;
  return make_random_model(testing::tiny_model_config(spec), Device::cpu(), 3);
}

// A CacheManager of the model's caches and the common runner over it, the way the engine's runner
// uses one: reserve, block tables, slots.
struct CacheRunner {
  CacheRunner(Model& model, int32_t block_size, int32_t num_blocks)
      : cache(model.cache_specs(), CacheConfig{block_size, num_blocks, DType::kF32}, Device::cpu()),
        caches(cache, model.cache_specs().size()),
        runner(model, caches) {}
  std::vector<std::vector<float>> step(const std::vector<testing::SeqChunk>& chunks) { return runner.step(chunks); }
  void finish(int64_t seq_id) {
    cache.free_sequence(seq_id);
    runner.forget(seq_id);
  }

  CacheManager cache;
  CacheManagerCaches caches;
  ForwardRunner runner;
};

class CacheForwardTest : public ::testing::TestWithParam<std::string> {};

TEST_P(CacheForwardTest, ChunkedDecodeOverReusedBlocksMatchesOneStepPrefill) {
  const auto model = tiny_random_model(GetParam());
  const ModelConfig& config = model->config();
  std::mt19937_64 rng(1801);
  std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(config.vocab_size - 1));
  std::vector<int32_t> a(11), b(9), c(4);
  for (auto* seq : {&a, &b, &c})
    for (auto& t : *seq) t = token(rng);

  CacheRunner alone(*model, 4, 8);
  const auto expected = alone.step({{0, a}});
  // The comparison below has teeth only if a row depends on the cached context: changing the first
  // token must change the logits of every later row.
  std::vector<int32_t> other_start = a;
  other_start[0] = (a[0] + 1) % static_cast<int32_t>(config.vocab_size);
  const auto changed = alone.step({{5, other_start}});
  EXPECT_GT(relative_l2(slice(changed, 1, changed.size()), slice(expected, 1, expected.size())), 1e-3);

  // Block size 3 and 9 blocks: the finished sequence's blocks must be reused by the others.
  CacheRunner runner(*model, 3, 9);
  runner.step({{7, b}});
  runner.finish(7);  // its 3 blocks go back to the pool holding b's keys and values
  EXPECT_EQ(runner.cache.pool().num_free(), 9);
  std::vector<std::vector<float>> actual;
  auto logits = runner.step({{1, slice(c, 0, 3)}, {0, slice(a, 0, 5)}});
  actual.insert(actual.end(), logits.begin() + 3, logits.end());
  logits = runner.step({{0, slice(a, 5, 9)}, {1, slice(c, 3, 4)}});
  actual.insert(actual.end(), logits.begin(), logits.begin() + 4);
  logits = runner.step({{0, slice(a, 9, 10)}});
  actual.insert(actual.end(), logits.begin(), logits.end());
  logits = runner.step({{1, {token(rng)}}, {0, slice(a, 10, 11)}});
  actual.push_back(logits[1]);
  ASSERT_EQ(actual.size(), expected.size());
  EXPECT_LE(relative_l2(actual, expected), 1e-6);
  // The sequences own disjoint blocks, and finishing them returns every block.
  for (const int32_t block : runner.cache.block_table(0)) {
    const auto other = runner.cache.block_table(1);
    EXPECT_EQ(std::count(other.begin(), other.end(), block), 0);
  }
  runner.finish(0);
  runner.finish(1);
  EXPECT_EQ(runner.cache.pool().num_free(), 9);
}

INSTANTIATE_TEST_SUITE_P(Architectures, CacheForwardTest, ::testing::Values("qwen3", "qwen3_moe"));

}  // namespace
}  // namespace metrale
