// The prefix cache and the recurrent-state pool through the engine. Each scenario runs on a tiny
// random Qwen3 (attention only) and on the fake hybrid model of test_models_helpers (attention plus
// a recurrent layer that throws when its slot does not hold the state it expects), and checks:
// - a request sharing a prefix with an earlier one computes fewer prompt tokens
//   (EngineStats.computed_prompt_tokens) and gives exactly the tokens of a cold engine;
// - eviction under pressure drops the least recently used prefixes and still gives cold tokens;
// - preemption with shared blocks loses and repeats nothing;
// - hybrid models restore state checkpoints (hybrid_state_restores) at block-aligned points where
//   the scheduler ended prefill chunks;
// - the memory planner splits one budget between state slots and KV blocks, lowering
//   max_num_seqs rather than failing;
// and after every step: free + cached + used = total, reference counts equal the tables holding
// each block, state slots owned once (CacheManager::check_integrity).
#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <random>

#include "core/error.h"
#include "engine/engine.h"
#include "engine/request_helpers.h"
#include "engine/test_models_helpers.h"
#include "model/registry.h"

namespace metrale {
namespace {

using testing::FakeHybridOptions;
using testing::make_fake_hybrid_model;
using testing::make_request;
using testing::write_tiny_qwen3;

struct ModelKind {
  std::string name;
  bool hybrid = false;
  int64_t vocab = 0;
};

void PrintTo(const ModelKind& kind, std::ostream* out) { *out << kind.name; }

const ModelKind kQwen3{"qwen3", false, 96};
const ModelKind kFakeHybrid{"fake_hybrid", true, 61};

std::unique_ptr<Model> make_model(const ModelKind& kind) {
  if (kind.hybrid) return make_fake_hybrid_model();
  static const auto dir = write_tiny_qwen3({}, "prefix_engine");
  return load_model(dir, Device::cpu());
}

std::unique_ptr<Engine> make_engine(const ModelKind& kind, EngineConfig config = {}) {
  return std::make_unique<Engine>(make_model(kind), config);
}

EngineConfig cold_config() {
  EngineConfig config;
  config.enable_prefix_caching = false;
  return config;
}

std::vector<int32_t> random_tokens(size_t count, int64_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> tokens(count);
  for (auto& token : tokens) token = static_cast<int32_t>(1 + rng() % static_cast<uint64_t>(vocab - 1));
  return tokens;
}

void expect_books_balance(const Engine& engine) {
  EXPECT_NO_THROW(engine.cache().check_integrity());
  const EngineStats stats = engine.stats();
  const BlockPool& pool = engine.cache().pool();
  EXPECT_EQ(stats.kv_blocks_total, pool.num_blocks());
  EXPECT_EQ(pool.num_empty() + stats.kv_blocks_cached + stats.kv_blocks_used, stats.kv_blocks_total);
}

// Runs until every request is done, checking the cache's books after every step; returns each
// request's generated tokens.
std::map<int64_t, std::vector<int32_t>> run_to_completion(Engine& engine) {
  const auto after_step = [](const Engine& stepped) {
    EXPECT_LE(static_cast<int64_t>(stepped.num_running()), stepped.plan().max_num_seqs);
    expect_books_balance(stepped);
  };
  const auto outputs = testing::run_to_completion(engine, after_step, {}, 10000);
  const BlockPool& pool = engine.cache().pool();
  EXPECT_EQ(pool.num_used(), 0) << "finished requests still hold blocks";
  EXPECT_EQ(engine.cache().num_sequences(), 0u);
  EXPECT_EQ(engine.stats().state_slots_used, engine.cache().num_checkpoints()) << "only checkpoints stay";
  return testing::tokens_of(outputs);
}

std::vector<int32_t> run_alone(Engine& engine, Request request) {
  const int64_t id = engine.add_request(std::move(request));
  auto outputs = run_to_completion(engine);
  return outputs[id];
}

class PrefixEngine : public ::testing::TestWithParam<ModelKind> {};

TEST_P(PrefixEngine, SharedPrefixComputesFewerTokensAndGivesColdTokens) {
  const ModelKind& kind = GetParam();
  const std::vector<int32_t> first = random_tokens(45, kind.vocab, 11);
  std::vector<int32_t> second(first.begin(), first.begin() + 37);
  const std::vector<int32_t> tail = random_tokens(6, kind.vocab, 12);
  second.insert(second.end(), tail.begin(), tail.end());

  auto cold = make_engine(kind, cold_config());
  const auto cold_first = run_alone(*cold, make_request(first, 8));
  const auto cold_second = run_alone(*cold, make_request(second, 8));
  EXPECT_EQ(cold->stats().computed_prompt_tokens, 45 + 43);
  EXPECT_EQ(cold->stats().prefix_cache_queries, 0);

  auto engine = make_engine(kind);
  EXPECT_EQ(run_alone(*engine, make_request(first, 8)), cold_first);
  const EngineStats after_first = engine->stats();
  EXPECT_EQ(after_first.computed_prompt_tokens, 45);
  EXPECT_EQ(after_first.prefix_cache_queries, 45);
  EXPECT_EQ(after_first.prefix_cache_hits, 0);
  EXPECT_GT(after_first.kv_blocks_cached, 0);
  EXPECT_EQ(run_alone(*engine, make_request(second, 8)), cold_second);
  const EngineStats after_second = engine->stats();
  // 37 shared tokens = two whole blocks of 16 (a hybrid model has its checkpoint at 32, the last
  // block boundary before the end of the first prompt).
  EXPECT_EQ(after_second.computed_prompt_tokens - after_first.computed_prompt_tokens, 43 - 32);
  EXPECT_EQ(after_second.prefix_cache_hits, 32);
  EXPECT_EQ(after_second.prefix_cache_queries, 45 + 43);
  EXPECT_EQ(after_second.hybrid_state_restores, kind.hybrid ? 1 : 0);
  EXPECT_EQ(after_second.prompt_tokens, 45 + 43);
  EXPECT_EQ(after_second.generated_tokens, 16);
  EXPECT_GT(after_second.num_steps, 2 * 8 - 2);

  // The same prompt again reuses all but its last (partial) block, and gives the same tokens.
  EXPECT_EQ(run_alone(*engine, make_request(first, 8)), cold_first);
  EXPECT_EQ(engine->stats().computed_prompt_tokens - after_second.computed_prompt_tokens, 45 - 32);
  // A prompt of exactly two blocks is never taken whole: its last block is computed again. (A
  // hybrid model has no checkpoint at 16, so it computes the whole prompt.)
  const std::vector<int32_t> two_blocks(first.begin(), first.begin() + 32);
  const EngineStats before = engine->stats();
  auto cold_two = make_engine(kind, cold_config());
  EXPECT_EQ(run_alone(*engine, make_request(two_blocks, 5)), run_alone(*cold_two, make_request(two_blocks, 5)));
  EXPECT_EQ(engine->stats().computed_prompt_tokens - before.computed_prompt_tokens, kind.hybrid ? 32 : 16);
}

TEST_P(PrefixEngine, RequestsAdmittedTogetherShareOnlyWhatIsCached) {
  const ModelKind& kind = GetParam();
  const std::vector<int32_t> stem = random_tokens(40, kind.vocab, 21);
  std::vector<std::vector<int32_t>> prompts;
  for (uint64_t i = 0; i < 4; ++i) {
    prompts.push_back(stem);
    const auto tail = random_tokens(3 + i, kind.vocab, 30 + i);
    prompts.back().insert(prompts.back().end(), tail.begin(), tail.end());
  }
  std::vector<std::vector<int32_t>> cold_outputs;
  for (const auto& prompt : prompts) {
    auto cold = make_engine(kind, cold_config());
    cold_outputs.push_back(run_alone(*cold, make_request(prompt, 6)));
  }
  auto engine = make_engine(kind);
  std::vector<int64_t> ids;
  for (size_t i = 0; i < 2; ++i) ids.push_back(engine->add_request(make_request(prompts[i], 6)));
  auto outputs = run_to_completion(*engine);  // both miss: nothing was cached when they arrived
  EXPECT_EQ(engine->stats().prefix_cache_hits, 0);
  for (size_t i = 2; i < 4; ++i) ids.push_back(engine->add_request(make_request(prompts[i], 6)));
  for (auto& [id, tokens] : run_to_completion(*engine)) outputs[id] = tokens;
  EXPECT_EQ(engine->stats().prefix_cache_hits, 2 * 32);
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(outputs[ids[i]], cold_outputs[i]) << "prompt " << i;
}

TEST_P(PrefixEngine, EvictionUnderPressureDropsTheLeastRecentlyUsedPrefixes) {
  const ModelKind& kind = GetParam();
  // 8 blocks of 16 tokens. Each request (40 prompt + 4 generated tokens) takes 3 blocks and leaves
  // its 2 full prompt blocks cached: the fourth and fifth requests must evict earlier prefixes.
  EngineConfig config;
  config.num_kv_blocks = 8;
  auto engine = make_engine(kind, config);
  auto cold = make_engine(kind, cold_config());
  std::vector<std::vector<int32_t>> prompts;
  for (uint64_t i = 0; i < 5; ++i) prompts.push_back(random_tokens(40, kind.vocab, 100 + i));
  for (const auto& prompt : prompts) {
    EXPECT_EQ(run_alone(*engine, make_request(prompt, 4)), run_alone(*cold, make_request(prompt, 4)));
  }
  EXPECT_EQ(engine->stats().prefix_cache_hits, 0);
  EXPECT_EQ(engine->stats().kv_blocks_cached, 7);
  // The most recent prefix is still there; the oldest was evicted, tail block first.
  const auto hits_of = [&](const std::vector<int32_t>& prompt) {
    const int64_t before = engine->stats().prefix_cache_hits;
    EXPECT_EQ(run_alone(*engine, make_request(prompt, 4)), run_alone(*cold, make_request(prompt, 4)));
    return engine->stats().prefix_cache_hits - before;
  };
  // The second prompt kept its first block; a hybrid model has no checkpoint there (its checkpoint
  // was at 32, on the evicted block), so only the attention model reuses it.
  EXPECT_EQ(hits_of(prompts[1]), kind.hybrid ? 0 : 16);
  EXPECT_EQ(hits_of(prompts[4]), 32);
  EXPECT_EQ(hits_of(prompts[0]), 0);
}

TEST_P(PrefixEngine, PreemptionWithSharedBlocksLosesAndRepeatsNothing) {
  const ModelKind& kind = GetParam();
  const std::vector<int32_t> stem = random_tokens(20, kind.vocab, 41);
  std::vector<Request> requests;
  for (uint64_t i = 0; i < 5; ++i) {
    std::vector<int32_t> prompt = stem;
    const auto tail = random_tokens(3 + 4 * i, kind.vocab, 50 + i);
    prompt.insert(prompt.end(), tail.begin(), tail.end());
    requests.push_back(make_request(prompt, 24, 0.8f, 7 + i));
  }
  auto reference_engine = make_engine(kind, cold_config());
  for (const auto& request : requests) reference_engine->add_request(request);
  const auto reference = run_to_completion(*reference_engine);
  // 6 blocks: the longest request (39 + 24 tokens) needs 4 on its own.
  EngineConfig config;
  config.num_kv_blocks = 6;
  config.state_checkpoint_interval = 16;
  auto engine = make_engine(kind, config);
  std::vector<int64_t> ids;
  for (const auto& request : requests) ids.push_back(engine->add_request(request));
  // A second wave sharing the stem arrives while the first is decoding.
  for (int s = 0; s < 6; ++s) engine->step();
  for (const auto& request : requests) ids.push_back(engine->add_request(request));
  auto outputs = run_to_completion(*engine);
  const auto reference_ids = [&](size_t i) { return static_cast<int64_t>(i % requests.size()) + 1; };
  for (size_t i = 0; i < ids.size(); ++i) {
    // Already-delivered tokens of the first six steps are not in `outputs`: compare the whole sequence.
    const auto generated = engine->sequence(ids[i]).output();
    EXPECT_EQ(std::vector<int32_t>(generated.begin(), generated.end()), reference.at(reference_ids(i))) << "request " << i;
  }
  EXPECT_GT(engine->stats().num_preemptions, 0) << "the scenario is meant to force preemption";
  EXPECT_GT(engine->stats().prefix_cache_hits, 0);
  if (kind.hybrid) {
    EXPECT_GT(engine->stats().hybrid_state_restores, 0);
  }
}

TEST_P(PrefixEngine, ScoringRequestsSkipTheLookup) {
  const ModelKind& kind = GetParam();
  const std::vector<int32_t> prompt = random_tokens(40, kind.vocab, 61);
  auto engine = make_engine(kind);
  run_alone(*engine, make_request(prompt, 2));
  const EngineStats before = engine->stats();
  Request scoring = make_request(prompt, 0);
  scoring.return_prompt_logits = true;
  const int64_t id = engine->add_request(scoring);
  run_to_completion(*engine);
  EXPECT_EQ(engine->stats().prefix_cache_queries, before.prefix_cache_queries);
  EXPECT_EQ(engine->stats().computed_prompt_tokens - before.computed_prompt_tokens, 40);
  auto cold = make_engine(kind, cold_config());
  const int64_t cold_id = cold->add_request(scoring);
  run_to_completion(*cold);
  EXPECT_EQ(engine->sequence(id).prompt_logits, cold->sequence(cold_id).prompt_logits);
}

INSTANTIATE_TEST_SUITE_P(Models, PrefixEngine, ::testing::Values(kQwen3, kFakeHybrid),
                         [](const auto& param_info) { return param_info.param.name; });

// Hybrid: prefill chunks end at checkpoint points, so that a later request sharing a prefix
// restores the state of the longest checkpointed prefix, whatever the budget and chunking were.
TEST(HybridPrefix, CheckpointsAtIntervalsAndPromptEndsForAnyChunking) {
  const ModelKind kind = kFakeHybrid;
  const std::vector<int32_t> base = random_tokens(30, kind.vocab, 71);
  const auto extend = [&](size_t shared, uint64_t seed) {
    std::vector<int32_t> prompt(base.begin(), base.begin() + static_cast<long>(shared));
    const auto tail = random_tokens(5, kind.vocab, seed);
    prompt.insert(prompt.end(), tail.begin(), tail.end());
    return prompt;
  };
  // Block 4, checkpoints every 8 tokens: base has them at 8, 16, 24 and 28.
  const std::vector<std::pair<std::vector<int32_t>, int64_t>> followers = {
      {extend(19, 81), 16}, {extend(27, 82), 24}, {extend(30, 83), 28}, {extend(7, 84), 0}, {base, 28}};
  EngineConfig cold_cfg = cold_config();
  cold_cfg.block_size = 4;
  auto cold = make_engine(kind, cold_cfg);
  const auto cold_base = run_alone(*cold, make_request(base, 6));
  std::vector<std::vector<int32_t>> cold_followers;
  for (const auto& [prompt, hit] : followers) cold_followers.push_back(run_alone(*cold, make_request(prompt, 6)));

  for (const int32_t budget : {1, 3, 7, 2048}) {
    for (const int32_t chunk : {0, 5}) {
      EngineConfig config;
      config.block_size = 4;
      config.state_checkpoint_interval = 8;
      config.scheduler.max_num_batched_tokens = budget;
      config.scheduler.max_prefill_chunk = chunk;
      auto engine = make_engine(kind, config);
      EXPECT_EQ(run_alone(*engine, make_request(base, 6)), cold_base) << "budget " << budget << " chunk " << chunk;
      EXPECT_EQ(engine->cache().num_checkpoints(), 4) << "budget " << budget << " chunk " << chunk;
      for (size_t i = 0; i < followers.size(); ++i) {
        const EngineStats before = engine->stats();
        EXPECT_EQ(run_alone(*engine, make_request(followers[i].first, 6)), cold_followers[i]) << "follower " << i;
        const EngineStats after = engine->stats();
        EXPECT_EQ(after.prefix_cache_hits - before.prefix_cache_hits, followers[i].second)
            << "follower " << i << " budget " << budget << " chunk " << chunk;
        EXPECT_EQ(after.hybrid_state_restores - before.hybrid_state_restores, followers[i].second > 0 ? 1 : 0);
      }
    }
  }
}

TEST(HybridPrefix, StateSlotsFollowRunningSequences) {
  auto engine = make_engine(kFakeHybrid);
  const EngineStats idle = engine->stats();
  EXPECT_EQ(idle.state_slots_total, engine->plan().num_state_slots + engine->plan().num_checkpoint_slots);
  EXPECT_EQ(idle.state_slots_used, 0);
  for (uint64_t i = 0; i < 3; ++i) engine->add_request(make_request(random_tokens(10, 61, 90 + i), 4));
  engine->step();
  EXPECT_EQ(engine->stats().state_slots_used, 3);
  run_to_completion(*engine);
  EXPECT_EQ(engine->stats().state_slots_used, 0) << "prompts shorter than a block leave no checkpoint";
}

// ---- Memory planner

int64_t slot_bytes(const FakeHybridOptions& options) {
  return static_cast<int64_t>(slot_bytes_per_slot(make_fake_hybrid_model(options)->cache_specs(), DType::kF32));
}

TEST(StatePlanner, LowersMaxNumSeqsWhenTheBudgetCannotHoldEverySlot) {
  FakeHybridOptions options;
  options.state_width = 1 << 16;  // 256 KiB per slot
  const int64_t per_slot = slot_bytes(options);
  const int64_t per_block = 2 * 16 * 2 * 4;
  const int64_t one_sequence = 512 / 16 * per_block;  // max_model_len 512
  EngineConfig config;
  config.kv_cache_bytes = 4ull << 20;
  config.scheduler.max_num_seqs = 64;
  Engine engine(make_fake_hybrid_model(options), config);
  const EnginePlan& plan = engine.plan();
  EXPECT_LT(plan.max_num_seqs, 64);
  EXPECT_GE(plan.max_num_seqs, 1);
  EXPECT_EQ(plan.num_state_slots, plan.max_num_seqs);
  EXPECT_EQ(plan.num_checkpoint_slots, 0) << "checkpoints give way before sequences";
  EXPECT_EQ(plan.state_bytes_per_slot, static_cast<uint64_t>(per_slot));
  // Every slot (and the padding slot) plus one full-length sequence of KV fits; one more slot would not.
  EXPECT_LE((plan.max_num_seqs + 1) * per_slot + one_sequence, static_cast<int64_t>(config.kv_cache_bytes));
  EXPECT_GT((plan.max_num_seqs + 2) * per_slot + one_sequence, static_cast<int64_t>(config.kv_cache_bytes));
  EXPECT_GE(static_cast<int64_t>(plan.num_kv_blocks) * 16, 512);
  EXPECT_LE(plan.state_bytes + plan.kv_cache_bytes, config.kv_cache_bytes + 16 * Buffer::kAlignment);
  EXPECT_NE(plan.describe().find("recurrent state"), std::string::npos) << plan.describe();
  // The lowered limit holds while more requests than it wait.
  for (uint64_t i = 0; i < 20; ++i) engine.add_request(make_request(random_tokens(12, 61, 200 + i), 3));
  const auto outputs = run_to_completion(engine);
  EXPECT_EQ(outputs.size(), 20u);
}

TEST(StatePlanner, CheckpointSlotsShareTheBudget) {
  FakeHybridOptions options;
  options.state_width = 1024;
  const int64_t per_slot = slot_bytes(options);
  const int64_t one_sequence = 512 / 16 * (2 * 16 * 2 * 4);
  EngineConfig config;
  config.scheduler.max_num_seqs = 8;
  // Room for 8 sequence slots, the padding slot, 5 checkpoints and one sequence of KV.
  config.kv_cache_bytes = static_cast<uint64_t>((8 + 1 + 5) * per_slot + one_sequence + per_slot / 2);
  Engine engine(make_fake_hybrid_model(options), config);
  EXPECT_EQ(engine.plan().max_num_seqs, 8);
  EXPECT_EQ(engine.plan().num_checkpoint_slots, 5);
  // Enough memory: one checkpoint slot per sequence by default, or as configured.
  config.kv_cache_bytes = 64ull << 20;
  EXPECT_EQ(Engine(make_fake_hybrid_model(options), config).plan().num_checkpoint_slots, 8);
  config.state_checkpoint_slots = 3;
  EXPECT_EQ(Engine(make_fake_hybrid_model(options), config).plan().num_checkpoint_slots, 3);
  config.enable_prefix_caching = false;
  EXPECT_EQ(Engine(make_fake_hybrid_model(options), config).plan().num_checkpoint_slots, 0);
  // A budget that cannot hold one sequence's state is an out-of-memory error at start-up.
  config.kv_cache_bytes = static_cast<uint64_t>(per_slot);
  try {
    Engine tiny(make_fake_hybrid_model(options), config);
    ADD_FAILURE() << "a budget below one state slot was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kOutOfMemory) << e.what();
  }
}

TEST(StatePlanner, ModelsWithoutRecurrentLayersCostNothing) {
  FakeHybridOptions options;
  options.recurrent = false;
  EngineConfig config;
  config.kv_cache_bytes = 1ull << 20;
  Engine engine(make_fake_hybrid_model(options), config);
  EXPECT_EQ(engine.plan().state_bytes, 0u);
  EXPECT_EQ(engine.plan().num_state_slots, 0);
  EXPECT_EQ(engine.plan().max_num_seqs, config.scheduler.max_num_seqs);
  EXPECT_EQ(engine.stats().state_slots_total, 0);
  EXPECT_EQ(engine.plan().describe().find("recurrent state"), std::string::npos);
  EXPECT_FALSE(engine.cache().has_recurrent_state());
  engine.add_request(make_request(random_tokens(20, 61, 300), 3));
  EXPECT_EQ(run_to_completion(engine).size(), 1u);
}

}  // namespace
}  // namespace metrale
