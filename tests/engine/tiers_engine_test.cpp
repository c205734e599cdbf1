// The host and disk tiers through the engine: preempted sequences that go on to disk and prefix
// blocks (and hybrid state checkpoints) evicted to disk give the tokens of a run without tiers;
// disk files deleted mid-run make the engine recompute, with a warning, never a wrong token.
#include <gtest/gtest.h>

#include <deque>
#include <filesystem>
#include <map>
#include <tuple>

#include "engine/engine.h"
#include "engine/golden_cases.h"
#include "engine/request_helpers.h"
#include "engine/scheduler.h"
#include "engine/test_models_helpers.h"
#include "model/registry.h"

namespace metrale {
namespace {

using testing::make_request;
using testing::write_tiny_qwen3;

// Eight prompts of 9 to 23 tokens: each grows by 24 into a third block of 16.
std::vector<std::vector<int32_t>> prompts() {
  std::vector<std::vector<int32_t>> result;
  for (int32_t i = 0; i < 8; ++i) {
    std::vector<int32_t> prompt(static_cast<size_t>(9 + 2 * i));
    for (size_t t = 0; t < prompt.size(); ++t) prompt[t] = static_cast<int32_t>(3 + (t * 13 + i * 29) % 90);
    result.push_back(prompt);
  }
  return result;
}

std::filesystem::path swap_dir(const std::string& name) {
  const auto dir = std::filesystem::temp_directory_path() / ("metrale_engine_tiers_" + name);
  std::filesystem::remove_all(dir);
  return dir;
}

uint64_t block_bytes(const Engine& engine) {
  return paged_bytes_per_block(engine.cache().specs(), engine.plan().block_size, DType::kF32);
}

size_t count_files(const std::filesystem::path& dir) {
  if (!std::filesystem::is_directory(dir)) return 0;
  size_t count = 0;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(dir)) count += entry.is_regular_file();
  return count;
}

// A prompt of `length` tokens: first + (i * step) % range.
std::vector<int32_t> arithmetic_prompt(size_t length, int32_t first, size_t step, size_t range) {
  std::vector<int32_t> prompt(length);
  for (size_t i = 0; i < length; ++i) prompt[i] = first + static_cast<int32_t>((i * step) % range);
  return prompt;
}

// An engine over `num_kv_blocks` device blocks, a one-block host tier and a 16-block disk tier in
// swap_dir(name).
std::unique_ptr<Engine> one_block_host_engine(const std::filesystem::path& model_dir, int32_t num_kv_blocks,
                                              const std::string& name) {
  EngineConfig config;
  config.num_kv_blocks = num_kv_blocks;
  auto probe = std::make_unique<Engine>(load_model(model_dir, Device::cpu()), config);
  config.swap_space_bytes = block_bytes(*probe);
  config.swap_disk_dir = swap_dir(name);
  config.swap_disk_bytes = 16 * block_bytes(*probe);
  return std::make_unique<Engine>(load_model(model_dir, Device::cpu()), config);
}

// A host tier of 3 blocks holds one preempted sequence at a time: the others go on to disk. With
// the disk's files deleted as soon as any exist, those come back lost and are recomputed.
TEST(TieredEngine, SwapsThroughDiskGiveTheTokensOfNoSwapEvenWhenFilesVanish) {
  const auto model_dir = write_tiny_qwen3({}, "tiers_swap");
  for (const float temperature : {0.0f, 0.8f}) {
    auto reference_engine = std::make_unique<Engine>(load_model(model_dir, Device::cpu()), EngineConfig{});
    const auto request_of = [&](const std::vector<int32_t>& prompt) {
      Request request = make_request(prompt, 24, temperature, 5);
      request.ignore_eos = true;  // every sequence grows to its full length: the preemptions are sure
      return request;
    };
    for (const auto& prompt : prompts()) reference_engine->add_request(request_of(prompt));
    const auto reference = testing::tokens_of(testing::run_to_completion(*reference_engine));
    for (const bool delete_files : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "temperature " << temperature << ", delete files " << delete_files);
      const auto dir = swap_dir("swap");
      EngineConfig config;
      config.num_kv_blocks = 4;
      config.enable_prefix_caching = false;
      config.scheduler.preemption_mode = PreemptionMode::kSwap;
      auto probe = std::make_unique<Engine>(load_model(model_dir, Device::cpu()), config);
      config.swap_space_bytes = 3 * block_bytes(*probe);
      config.swap_disk_dir = dir;
      config.swap_disk_bytes = 64 * block_bytes(*probe);
      // Deleted files must be read after they vanish: no reads queued ahead of the swap-in.
      if (delete_files) config.swap_prefetch = 0;
      Engine engine(load_model(model_dir, Device::cpu()), config);

      ASSERT_EQ(engine.plan().num_disk_blocks, 64);
      ASSERT_NE(engine.cache().disk_tier(), nullptr);
      const auto tier_dir = engine.cache().disk_tier()->directory();
      for (const auto& prompt : prompts()) engine.add_request(request_of(prompt));
      bool deleted = false;
      const auto after_step = [&](const Engine& e) {
        testing::expect_cache_integrity(e);
        if (!delete_files || deleted || !e.cache().disk_tier()) return;
        e.cache().disk_tier()->drain();
        if (count_files(tier_dir) == 0) return;
        for (const auto& entry : std::filesystem::directory_iterator(tier_dir)) std::filesystem::remove(entry.path());
        deleted = true;
      };
      const auto outputs = testing::tokens_of(testing::run_to_completion(engine, after_step));
      EXPECT_EQ(outputs, reference);
      const EngineStats stats = engine.stats();
      EXPECT_GT(stats.swapped_to_disk_sequences, 0) << "the scenario is meant to spill to disk";
      if (delete_files) {
        EXPECT_TRUE(deleted);
        EXPECT_GT(stats.tier_entries_lost, 0) << "a lost sequence is recomputed";
      } else {
        EXPECT_EQ(stats.tier_entries_lost, 0);
        EXPECT_EQ(stats.swapped_in_sequences, stats.swapped_out_sequences);
      }
      EXPECT_EQ(engine.cache().num_swapped(), 0u);
      EXPECT_EQ(engine.cache().num_sequences(), 0u);
      EXPECT_NO_THROW(engine.cache().check_integrity());
    }
  }
}

// Prefix blocks evicted from the device pass through a one-block host tier onto disk; the same
// prompt later hits them there, computing fewer tokens, with the tokens of a cold run.
TEST(TieredEngine, PrefixBlocksEvictedToDiskStillHit) {
  const auto model_dir = write_tiny_qwen3({}, "tiers_prefix");
  const auto first = arithmetic_prompt(40, 3, 7, 90), second = arithmetic_prompt(50, 5, 11, 80);
  // The second prompt takes every block, evicting the first's.
  const auto owned = one_block_host_engine(model_dir, 4, "prefix");
  Engine& engine = *owned;
  const int64_t a = engine.add_request(make_request(first, 4));
  const auto cold = testing::tokens_of(testing::run_to_completion(engine));
  engine.add_request(make_request(second, 4));
  testing::run_to_completion(engine);
  const EngineStats before = engine.stats();
  EXPECT_GT(before.prefix_blocks_to_disk, 0);
  const int64_t again = engine.add_request(make_request(first, 4));
  const auto repeated = testing::tokens_of(testing::run_to_completion(engine, testing::expect_cache_integrity));
  EXPECT_EQ(repeated.at(again), cold.at(a));
  const EngineStats after = engine.stats();
  EXPECT_EQ(after.prefix_cache_hits - before.prefix_cache_hits, 32);
  EXPECT_GT(after.prefix_blocks_from_disk, 0);
  EXPECT_EQ(after.tier_entries_lost, 0);
}

// A request whose prefix is on disk arrives while another runs: its disk hits are read ahead of
// its admission (which waits for them instead of holding the running step), and it gives the
// tokens of a cold run.
TEST(TieredEngine, PrefixReadAheadWhileAnotherRequestRunsGivesTheColdTokens) {
  const auto model_dir = write_tiny_qwen3({}, "tiers_read_ahead");
  // The second prompt takes all 6 blocks.
  const auto first = arithmetic_prompt(40, 3, 7, 90), second = arithmetic_prompt(88, 5, 11, 80);
  const auto busy = arithmetic_prompt(5, 60, 1, 5);
  const auto owned = one_block_host_engine(model_dir, 6, "read_ahead");
  Engine& engine = *owned;
  const int64_t a = engine.add_request(make_request(first, 4));
  const auto cold = testing::tokens_of(testing::run_to_completion(engine));
  engine.add_request(make_request(second, 4));  // evicts the first prompt's blocks, through the host to disk
  testing::run_to_completion(engine);
  const EngineStats before = engine.stats();
  ASSERT_GT(before.prefix_blocks_to_disk, 0);
  Request long_running = make_request(busy, 12);
  long_running.ignore_eos = true;
  engine.add_request(long_running);
  std::map<int64_t, testing::Generated> outputs;
  testing::record(engine.step(), outputs);  // the busy request is running
  const int64_t again = engine.add_request(make_request(first, 4));
  outputs = testing::run_to_completion(engine, testing::expect_cache_integrity, outputs);
  EXPECT_EQ(testing::tokens_of(outputs).at(again), cold.at(a));
  const EngineStats after = engine.stats();
  EXPECT_EQ(after.prefix_prefetches - before.prefix_prefetches, 1);
  EXPECT_GT(after.prefix_blocks_from_disk, before.prefix_blocks_from_disk);
  EXPECT_EQ(after.prefix_cache_hits - before.prefix_cache_hits, 32);
  EXPECT_EQ(after.tier_entries_lost, 0);
}

// A hybrid golden model (Gated DeltaNet + gated attention, from transformers 5.17.0): its prompt's
// blocks and state checkpoints are pushed off the device by another prompt, through a host tier
// of one state slot onto disk; the prompt again restores blocks and state from there and gives
// the greedy tokens (and log-probabilities) of a cold run without any cache.
TEST(TieredEngine, HybridGoldenPrefixHitAfterEvictionToDiskEqualsAColdRun) {
  for (const std::string name : {"qwen3_next", "qwen3_5"}) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(testing::fixture_exists(testing::golden_dir() / name / "case.json"));
    const testing::GoldenCase golden(name);
    const std::vector<int32_t> prompt = testing::read_ids(golden.info.at("greedy").at("prompt_ids"));
    // Two other prompts, which between them push every block of the first through the host tier.
    std::vector<std::vector<int32_t>> others(2, std::vector<int32_t>(prompt.size() + 20));
    for (size_t k = 0; k < others.size(); ++k)
      for (size_t i = 0; i < others[k].size(); ++i)
        others[k][i] = static_cast<int32_t>((prompt[i % prompt.size()] * (7 + k) + i) % 250);
    const auto request_of = [](const std::vector<int32_t>& tokens) {
      Request request = make_request(tokens, 16);
      request.ignore_eos = true;
      request.sampling.top_logprobs = 4;
      return request;
    };
    EngineConfig cold_config;
    cold_config.enable_prefix_caching = false;
    cold_config.max_model_len = 512;
    Engine cold_engine(load_model(golden.dir / "model", Device::cpu()), cold_config);
    const int64_t cold_id = cold_engine.add_request(request_of(prompt));
    const testing::Generated cold = testing::run_to_completion(cold_engine)[cold_id];
    ASSERT_EQ(cold.tokens.size(), 16u);

    EngineConfig config;
    config.max_model_len = 512;
    config.num_kv_blocks = 10;  // one sequence of up to 160 tokens
    config.state_checkpoint_interval = 32;
    config.state_checkpoint_slots = 1;  // the second prompt's checkpoints push the first's off the device
    config.scheduler.max_num_seqs = 2;
    Engine probe(load_model(golden.dir / "model", Device::cpu()), config);
    const uint64_t per_slot = slot_bytes_per_slot(probe.cache().specs(), DType::kF32);
    config.swap_space_bytes = 2 * per_slot;  // one host slot, the rest in host blocks
    config.swap_disk_dir = swap_dir("hybrid_" + name);
    config.swap_disk_bytes = 64ull << 20;
    Engine engine(load_model(golden.dir / "model", Device::cpu()), config);
    ASSERT_EQ(engine.plan().num_host_slots, 1);
    ASSERT_GT(engine.plan().num_disk_slots, 0);
    const int64_t first = engine.add_request(request_of(prompt));
    const testing::Generated warm = testing::run_to_completion(engine)[first];
    EXPECT_EQ(warm.tokens, cold.tokens);
    for (const auto& other : others) {
      engine.add_request(request_of(other));
      testing::run_to_completion(engine);
    }
    const EngineStats before = engine.stats();
    EXPECT_GT(before.checkpoints_to_host, 0);
    EXPECT_GT(before.prefix_blocks_to_disk, 0);
    const int64_t again = engine.add_request(request_of(prompt));
    const testing::Generated hit = testing::run_to_completion(engine, testing::expect_cache_integrity)[again];
    const EngineStats after = engine.stats();
    EXPECT_GT(after.prefix_cache_hits, before.prefix_cache_hits);
    EXPECT_EQ(after.hybrid_state_restores, before.hybrid_state_restores + 1);
    EXPECT_GT(after.checkpoints_restored_from_tiers, 0);
    EXPECT_GT(after.prefix_blocks_from_disk, 0);
    EXPECT_EQ(after.tier_entries_lost, 0);
    EXPECT_EQ(hit.tokens, cold.tokens);
    ASSERT_EQ(hit.logprobs.size(), cold.logprobs.size());
    for (size_t i = 0; i < hit.logprobs.size(); ++i) EXPECT_NEAR(hit.logprobs[i], cold.logprobs[i], 1e-4) << i;
  }
}

TEST(PreemptionCosts, SwapWhenMovingTheBytesOutAndBackBeatsRecomputing) {
  PreemptionCosts costs;
  EXPECT_TRUE(costs.prefers_swap(1ull << 40, 1)) << "unmeasured: swap";
  costs.copy_bytes_per_second = 1e9;
  EXPECT_TRUE(costs.prefers_swap(1ull << 40, 1)) << "no prefill cost measured yet: swap";
  costs.prefill_seconds_per_token = 1e-4;
  // 1 MB out and back at 1 GB/s: 2 ms, against 10 ms (100 tokens) or 1 ms (10 tokens) of prefill.
  EXPECT_TRUE(costs.prefers_swap(1000000, 100));
  EXPECT_FALSE(costs.prefers_swap(1000000, 10));
}

// The scheduler's choice, with the tier's room: by cost in auto mode, always with swap, never with
// recompute; a sequence recomputed has no cache left and starts over.
TEST(PreemptionCosts, TheSchedulerSwapsOrRecomputesAsTheModeAndCostsSay) {
  const std::vector<CacheSpec> specs = {CacheSpec{{CacheTensorSpec::per_token("k", {8}, DType::kF32)}}};
  for (const auto& [mode, bandwidth, swaps] :
       std::vector<std::tuple<PreemptionMode, double, bool>>{{PreemptionMode::kAuto, 1e12, true},
                                                             {PreemptionMode::kAuto, 1.0, false},
                                                             {PreemptionMode::kSwap, 1.0, true},
                                                             {PreemptionMode::kRecompute, 1e12, false}}) {
    SCOPED_TRACE(::testing::Message() << "mode " << static_cast<int>(mode) << ", bandwidth " << bandwidth);
    CacheConfig cache_config;
    cache_config.block_size = 4;
    cache_config.num_blocks = 4;
    cache_config.num_host_blocks = 8;
    CacheManager cache(specs, cache_config, Device::cpu());
    SchedulerConfig config;
    config.preemption_mode = mode;
    config.max_num_batched_tokens = 64;
    Scheduler scheduler(config);
    scheduler.set_preemption_costs({bandwidth, 1e-3});
    std::vector<std::unique_ptr<Sequence>> sequences;
    std::vector<Sequence*> running;
    std::deque<Sequence*> waiting;
    for (int64_t id = 1; id <= 2; ++id) {
      auto sequence = std::make_unique<Sequence>();
      sequence->id = id;
      sequence->arrival = id;
      sequence->tokens.assign(8, static_cast<int32_t>(id));
      sequence->num_prompt = 8;
      waiting.push_back(sequence.get());
      sequences.push_back(std::move(sequence));
    }
    SchedulePlan plan = scheduler.schedule(running, waiting, cache);
    ASSERT_EQ(plan.chunks.size(), 2u);  // 2 blocks each: the cache is full
    for (const ScheduledChunk& chunk : plan.chunks) chunk.sequence->num_computed += chunk.num_new;
    sequences[0]->tokens.push_back(3);  // the oldest grows into a third block: the newest is preempted
    plan = scheduler.schedule(running, waiting, cache);
    ASSERT_EQ(plan.preempted.size(), 1u);
    EXPECT_EQ(plan.preempted[0]->id, 2);
    EXPECT_EQ(cache.is_swapped(2), swaps);
    EXPECT_EQ(sequences[1]->num_computed, swaps ? 8 : 0);
    EXPECT_NO_THROW(cache.check_integrity());
  }
}

}  // namespace
}  // namespace metrale
