// qwen4_exp through the engine (tiny random weights, CPU): its PLE rows come through the prestage
// hook from each sequence's history, its per-slot state (GDN conv and recurrence, the PLE conv
// window) is checkpointed for prefix hits and rolled back after rejected drafts, its QSA index and
// block keys are paged with the KV blocks. Greedy tokens must not depend on batching, preemption,
// n-gram speculation or a prefix hit.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <random>

#include "engine/engine.h"
#include "engine/speculator.h"
#include "engine/request_helpers.h"
#include "model/config.h"
#include "model/registry.h"

namespace metrale {
namespace {

constexpr int64_t kVocab = 67;

// Two GDN layers (the first with PLE) and two QSA layers; c 2 and budget 8, so that most positions
// of the 30-60 token sequences select sparsely.
std::unique_ptr<Model> tiny_qwen4() {
  const nlohmann::json config = {
      {"model_type", "qwen4_exp_text"},
      {"vocab_size", kVocab},
      {"hidden_size", 16},
      {"num_hidden_layers", 4},
      {"num_attention_heads", 4},
      {"num_key_value_heads", 2},
      {"head_dim", 8},
      {"rms_norm_eps", 1e-6},
      {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 10000.0}, {"partial_rotary_factor", 0.5}}},
      {"max_position_embeddings", 512},
      {"hidden_act", "silu"},
      {"layer_types", {"linear_attention", "qwen_sparse_attention", "linear_attention", "qwen_sparse_attention"}},
      {"linear_num_key_heads", 2},
      {"linear_num_value_heads", 4},
      {"linear_key_head_dim", 4},
      {"linear_value_head_dim", 4},
      {"linear_conv_kernel_dim", 4},
      {"num_experts", 4},
      {"num_experts_per_tok", 2},
      {"moe_intermediate_size", 8},
      {"shared_expert_intermediate_size", 8},
      {"hc_count", 4},
      {"hc_lowrank", 6},
      {"ple_layer_ids", {1}},
      {"ple_embed_dim", 16},
      {"ngram_size", 3},
      {"heads_per_ngram", 2},
      {"ple_conv_kernel_size", 3},
      {"ngram_vocab_size_base", 101},
      {"make_ngram_vocab_size_divisible_by", 8},
      {"indexer_n_heads", 8},
      {"indexer_kv_heads", 1},
      {"indexer_head_dim", 8},
      {"indexer_budget", 8},
      {"indexer_compress_ratio", 2},
      {"output_gate_type", "sigmoid"},
      {"tie_word_embeddings", false},
      {"eos_token_id", 2}};
  return make_random_model(parse_model_config(config, "/virtual/qwen4_exp/config.json"), Device::cpu(), 9);
}

Request greedy(std::vector<int32_t> prompt, int32_t max_tokens) {
  Request request = testing::make_request(std::move(prompt), max_tokens);
  request.sampling.top_logprobs = 4;
  return request;
}

std::vector<int32_t> random_tokens(size_t count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> tokens(count);
  for (auto& token : tokens) token = static_cast<int32_t>(3 + rng() % (kVocab - 3));
  return tokens;
}

// Prompts with repeats (n-gram drafts), one EOS (the PLE history restarts after it).
std::vector<std::vector<int32_t>> prompts() {
  const std::vector<int32_t> phrase = random_tokens(5, 1);
  std::vector<std::vector<int32_t>> out;
  for (uint64_t i = 0; i < 3; ++i) {
    std::vector<int32_t> prompt = random_tokens(4 + 3 * i, 10 + i);
    for (int r = 0; r < 4; ++r) prompt.insert(prompt.end(), phrase.begin(), phrase.end());
    prompt[3] = 2;
    out.push_back(prompt);
  }
  return out;
}

void expect_same(const std::map<int64_t, testing::Generated>& actual,
                 const std::map<int64_t, testing::Generated>& expected, const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  for (const auto& [id, generated] : expected) {
    const testing::Generated& other = actual.at(id);
    EXPECT_EQ(other.tokens, generated.tokens) << what << ", request " << id;
    ASSERT_EQ(other.logprobs.size(), generated.logprobs.size()) << what;
    for (size_t i = 0; i < generated.logprobs.size(); ++i)
      EXPECT_NEAR(other.logprobs[i], generated.logprobs[i], 1e-4) << what << ", request " << id << " logprob " << i;
  }
}

std::map<int64_t, testing::Generated> generate(EngineConfig config, EngineStats* stats = nullptr) {
  Engine engine(tiny_qwen4(), config);
  std::map<int64_t, int64_t> index;
  int64_t i = 0;
  for (const auto& prompt : prompts()) index[engine.add_request(greedy(prompt, 16))] = i++;
  auto outputs = testing::run_to_completion(engine, testing::expect_cache_integrity);
  EXPECT_EQ(engine.cache().pool().num_used(), 0);
  if (stats) *stats = engine.stats();
  std::map<int64_t, testing::Generated> by_index;
  for (const auto& [id, generated] : outputs) by_index[index.at(id)] = generated;
  return by_index;
}

EngineConfig base_config() {
  EngineConfig config;
  config.block_size = 4;
  config.max_model_len = 256;
  config.enable_prefix_caching = false;
  return config;
}

TEST(Qwen4Engine, DeclaresPrestageAndSlots) {
  Engine engine(tiny_qwen4(), base_config());
  EXPECT_TRUE(engine.cache().has_recurrent_state());
  EXPECT_GT(engine.plan().state_bytes_per_slot, 0u);
}

TEST(Qwen4Engine, NgramSpeculationAndPreemptionGiveThePlainTokens) {
  const auto plain = generate(base_config());
  ASSERT_EQ(plain.size(), 3u);
  for (const int32_t drafts : {1, 3}) {
    EngineConfig config = base_config();
    config.speculative.method = SpeculativeMethod::kNgram;
    config.speculative.num_drafts = drafts;
    config.speculative.ngram_min = 1;
    config.speculative.ngram_max = 3;
    EngineStats stats;
    expect_same(generate(config, &stats), plain, "ngram k=" + std::to_string(drafts));
    EXPECT_GT(stats.verify_steps, 0);
    EXPECT_GT(stats.drafted_tokens, stats.accepted_tokens);  // some drafts were rejected
  }
  EngineConfig tight = base_config();
  tight.num_kv_blocks = 14;
  tight.scheduler.max_num_batched_tokens = 12;
  EngineStats stats;
  const auto preempted = generate(tight, &stats);
  for (const auto& [i, generated] : plain) EXPECT_EQ(preempted.at(i).tokens, generated.tokens) << "request " << i;
  EXPECT_GT(stats.num_preemptions, 0);
}

TEST(Qwen4Engine, PrefixHitRestoresTheStateAndGivesColdTokens) {
  std::vector<int32_t> first = random_tokens(45, 7);
  first[9] = 2;  // an EOS inside the shared prefix
  std::vector<int32_t> second(first.begin(), first.begin() + 37);
  const auto tail = random_tokens(6, 8);
  second.insert(second.end(), tail.begin(), tail.end());
  EngineConfig config;  // the default block size and checkpoint interval
  config.max_model_len = 256;
  Engine cold(tiny_qwen4(), config);
  const int64_t cold_id = cold.add_request(greedy(second, 12));
  const auto cold_out = testing::run_to_completion(cold).at(cold_id);
  Engine warm(tiny_qwen4(), config);
  warm.add_request(greedy(first, 12));
  (void)testing::run_to_completion(warm);
  const EngineStats before = warm.stats();
  const int64_t warm_id = warm.add_request(greedy(second, 12));
  const auto warm_out = testing::run_to_completion(warm, testing::expect_cache_integrity).at(warm_id);
  EXPECT_GT(warm.stats().prefix_cache_hits - before.prefix_cache_hits, 0);
  EXPECT_EQ(warm.stats().hybrid_state_restores - before.hybrid_state_restores, 1);
  EXPECT_EQ(warm_out.tokens, cold_out.tokens);
  ASSERT_EQ(warm_out.logprobs.size(), cold_out.logprobs.size());
  for (size_t i = 0; i < cold_out.logprobs.size(); ++i) EXPECT_NEAR(warm_out.logprobs[i], cold_out.logprobs[i], 1e-4);
}

}  // namespace
}  // namespace metrale
