// The CacheManager as a model's KV cache: a sequence run in chunks and decode steps, next to other
// sequences, after blocks were freed by a finished sequence and reused, must give the logits of
// the same sequence prefilled alone in one step. Models come from make_random_model, so no
// checkpoint is involved.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <random>

#include "cache/cache_manager.h"
#include "model/config.h"
#include "model/registry.h"

namespace metrale {
namespace {

ModelConfig tiny_config(const std::string& model_type) {
  nlohmann::json json = {
      {"model_type", model_type}, {"vocab_size", 53},           {"hidden_size", 32}, {"num_hidden_layers", 2},
      {"num_attention_heads", 4}, {"num_key_value_heads", 2},   {"head_dim", 8},     {"intermediate_size", 40},
      {"rms_norm_eps", 1e-6},     {"tie_word_embeddings", true}};
  if (model_type == "qwen3_moe") {
    json["num_experts"] = 4;
    json["num_experts_per_tok"] = 2;
    json["moe_intermediate_size"] = 16;
    json["norm_topk_prob"] = true;
  }
  return parse_model_config(json, "/virtual/config.json");
}

// Runs steps over a CacheManager the way the engine's runner does: reserve, block tables, slots.
class CacheRunner {
 public:
  CacheRunner(Model& model, int32_t block_size, int32_t num_blocks) : model_(model), arena_(Device::cpu(), 1 << 20) {
    const auto specs = model.cache_specs();
    cache_ = std::make_unique<CacheManager>(specs, CacheConfig{block_size, num_blocks, DType::kF32}, Device::cpu());
  }
  CacheManager& cache() { return *cache_; }

  struct Chunk {
    int64_t seq_id;
    std::vector<int32_t> tokens;
  };
  // Logits of every row of the step, [T][V].
  std::vector<std::vector<float>> step(const std::vector<Chunk>& chunks) {
    const int64_t block_size = cache_->block_size(), num_seqs = static_cast<int64_t>(chunks.size());
    std::vector<int32_t> ids, positions, slots, cu_q = {0}, kv_lens, rows;
    int64_t max_blocks = 1;
    for (const auto& chunk : chunks) {
      const int64_t total = cached_[chunk.seq_id] + static_cast<int64_t>(chunk.tokens.size());
      EXPECT_TRUE(cache_->reserve(chunk.seq_id, total)) << "cache too small for sequence " << chunk.seq_id;
      max_blocks = std::max<int64_t>(max_blocks, static_cast<int64_t>(cache_->block_table(chunk.seq_id).size()));
    }
    std::vector<int32_t> tables(static_cast<size_t>(num_seqs * max_blocks), 0);
    ForwardBatch batch;
    for (int64_t s = 0; s < num_seqs; ++s) {
      const Chunk& chunk = chunks[static_cast<size_t>(s)];
      const auto table = cache_->block_table(chunk.seq_id);
      std::copy(table.begin(), table.end(), tables.begin() + s * max_blocks);
      for (size_t i = 0; i < chunk.tokens.size(); ++i) {
        const int64_t p = cached_[chunk.seq_id] + static_cast<int64_t>(i);
        rows.push_back(static_cast<int32_t>(ids.size()));
        ids.push_back(chunk.tokens[i]);
        positions.push_back(static_cast<int32_t>(p));
        slots.push_back(table[static_cast<size_t>(p / block_size)] * static_cast<int32_t>(block_size) +
                        static_cast<int32_t>(p % block_size));
      }
      cached_[chunk.seq_id] += static_cast<int64_t>(chunk.tokens.size());
      cu_q.push_back(static_cast<int32_t>(ids.size()));
      kv_lens.push_back(static_cast<int32_t>(cached_[chunk.seq_id]));
      batch.max_q_len = std::max<int64_t>(batch.max_q_len, static_cast<int64_t>(chunk.tokens.size()));
      batch.max_kv_len = std::max<int64_t>(batch.max_kv_len, cached_[chunk.seq_id]);
    }
    const auto tokens = static_cast<int64_t>(ids.size());
    batch.num_tokens = tokens;
    batch.num_seqs = num_seqs;
    batch.block_size = block_size;
    batch.token_ids = Tensor(ids.data(), DType::kI32, {tokens});
    batch.positions = Tensor(positions.data(), DType::kI32, {tokens});
    batch.cu_q = Tensor(cu_q.data(), DType::kI32, {num_seqs + 1});
    batch.kv_lens = Tensor(kv_lens.data(), DType::kI32, {num_seqs});
    batch.block_tables = Tensor(tables.data(), DType::kI32, {num_seqs, max_blocks});
    batch.slot_mapping = Tensor(slots.data(), DType::kI32, {tokens});
    batch.logit_rows = Tensor(rows.data(), DType::kI32, {tokens});
    batch.host_cu_q = cu_q;
    batch.host_kv_lens = kv_lens;
    batch.host_logit_rows = rows;
    const int64_t vocab = model_.config().vocab_size;
    std::vector<float> logits(static_cast<size_t>(tokens * vocab), std::nanf(""));
    arena_.reset();
    model_.forward(batch, cache_->layer_caches(), Tensor(logits.data(), DType::kF32, {tokens, vocab}), arena_);
    std::vector<std::vector<float>> result;
    for (int64_t t = 0; t < tokens; ++t)
      result.emplace_back(logits.begin() + t * vocab, logits.begin() + (t + 1) * vocab);
    return result;
  }
  void finish(int64_t seq_id) {
    cache_->free_sequence(seq_id);
    cached_.erase(seq_id);
  }

 private:
  Model& model_;
  std::unique_ptr<CacheManager> cache_;
  Arena arena_;
  std::map<int64_t, int64_t> cached_;
};

double relative_l2(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  double diff = 0.0, norm = 0.0;
  for (size_t r = 0; r < b.size(); ++r)
    for (size_t c = 0; c < b[r].size(); ++c) {
      if (!std::isfinite(a[r][c])) return INFINITY;
      diff += (static_cast<double>(a[r][c]) - b[r][c]) * (static_cast<double>(a[r][c]) - b[r][c]);
      norm += static_cast<double>(b[r][c]) * b[r][c];
    }
  return std::sqrt(diff / norm);
}

class CacheForwardTest : public ::testing::TestWithParam<std::string> {};

TEST_P(CacheForwardTest, ChunkedDecodeOverReusedBlocksMatchesOneStepPrefill) {
  const ModelConfig config = tiny_config(GetParam());
  const auto model = make_random_model(config, Device::cpu(), 3);
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
  EXPECT_GT(relative_l2({changed.begin() + 1, changed.end()}, {expected.begin() + 1, expected.end()}), 1e-3);

  // Block size 3 and 9 blocks: the finished sequence's blocks must be reused by the others.
  CacheRunner runner(*model, 3, 9);
  runner.step({{7, b}});
  runner.finish(7);  // its 3 blocks go back to the pool holding b's keys and values
  EXPECT_EQ(runner.cache().pool().num_free(), 9);
  const auto slice = [](const std::vector<int32_t>& v, size_t begin, size_t end) {
    return std::vector<int32_t>(v.begin() + static_cast<ptrdiff_t>(begin), v.begin() + static_cast<ptrdiff_t>(end));
  };
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
  for (const int32_t block : runner.cache().block_table(0)) {
    const auto other = runner.cache().block_table(1);
    EXPECT_EQ(std::count(other.begin(), other.end(), block), 0);
  }
  runner.finish(0);
  runner.finish(1);
  EXPECT_EQ(runner.cache().pool().num_free(), 9);
}

INSTANTIATE_TEST_SUITE_P(Architectures, CacheForwardTest, ::testing::Values("qwen3", "qwen3_moe"));

}  // namespace
}  // namespace metrale
