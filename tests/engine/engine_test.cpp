// Engine behaviour on tiny random models: continuous batching gives each request the tokens it
// would get alone, stop conditions, chunked prefill, preemption, aborts, and cache accounting.
#include "engine/engine.h"

#include <gtest/gtest.h>

#include <map>

#include "core/error.h"
#include "engine/request_helpers.h"
#include "engine/test_models_helpers.h"
#include "model/registry.h"

namespace metrale {
namespace {

using testing::make_request;
using testing::TinyQwen3Options;
using testing::write_tiny_qwen3;

std::unique_ptr<Engine> make_engine(const std::filesystem::path& dir, EngineConfig config = {}) {
  return std::make_unique<Engine>(load_model(dir, Device::cpu()), config);
}

// Runs the engine until every request is done; returns each request's generated tokens.
std::map<int64_t, std::vector<int32_t>> run_to_completion(Engine& engine) {
  return testing::tokens_of(testing::run_to_completion(engine, {}, {}, 10000));
}

void expect_cache_drained(const Engine& engine) {
  const BlockPool& pool = engine.cache().pool();
  EXPECT_EQ(pool.num_free(), pool.num_blocks());
  EXPECT_EQ(pool.num_free() + pool.num_used(), pool.num_blocks());
  EXPECT_EQ(engine.cache().num_sequences(), 0u);
  EXPECT_NO_THROW(engine.cache().check_integrity());
}

const std::vector<std::vector<int32_t>> kPrompts = {
    {5, 9, 17, 3, 44, 61, 2, 8, 90, 33, 12, 7, 70, 71, 72, 19, 21, 5, 6},  // 19 tokens: spans two blocks
    {11, 12},
    {80, 3, 3, 3, 3, 50, 40, 30, 20, 10},
    {7},
};

class EngineBatching : public ::testing::TestWithParam<int64_t> {};

TEST_P(EngineBatching, TogetherEqualsAlone) {
  TinyQwen3Options options;
  options.num_experts = GetParam();
  const auto dir = write_tiny_qwen3(options, "batching" + std::to_string(GetParam()));
  for (const float temperature : {0.0f, 0.9f}) {
    std::vector<std::vector<int32_t>> alone;
    for (size_t i = 0; i < kPrompts.size(); ++i) {
      auto engine = make_engine(dir);
      engine->add_request(make_request(kPrompts[i], 12, temperature, 100 + i));
      auto outputs = run_to_completion(*engine);
      ASSERT_EQ(outputs.size(), 1u);
      alone.push_back(outputs.begin()->second);
      EXPECT_EQ(alone.back().size(), 12u);
      expect_cache_drained(*engine);
    }
    // Together, staggered: two start at once, the others join while the first ones decode.
    auto engine = make_engine(dir);
    std::vector<int64_t> ids;
    ids.push_back(engine->add_request(make_request(kPrompts[0], 12, temperature, 100)));
    ids.push_back(engine->add_request(make_request(kPrompts[1], 12, temperature, 101)));
    std::map<int64_t, std::vector<int32_t>> together;
    for (int s = 0; s < 3; ++s)
      for (const auto& event : engine->step()) together[event.request_id].push_back(event.sampled.token);
    ids.push_back(engine->add_request(make_request(kPrompts[2], 12, temperature, 102)));
    ids.push_back(engine->add_request(make_request(kPrompts[3], 12, temperature, 103)));
    for (auto& [id, tokens] : run_to_completion(*engine))
      together[id].insert(together[id].end(), tokens.begin(), tokens.end());
    for (size_t i = 0; i < ids.size(); ++i) {
      EXPECT_EQ(together[ids[i]], alone[i]) << "prompt " << i << " temperature " << temperature;
    }
    expect_cache_drained(*engine);
  }
}

INSTANTIATE_TEST_SUITE_P(DenseAndMoe, EngineBatching, ::testing::Values(0, 4),
                         [](const auto& param_info) { return param_info.param == 0 ? "qwen3" : "qwen3_moe"; });

TEST(Engine, ChunkedPrefillAndSmallBudgetsGiveTheSameTokens) {
  const auto dir = write_tiny_qwen3({}, "chunked");
  auto reference_engine = make_engine(dir);
  for (const auto& prompt : kPrompts) reference_engine->add_request(make_request(prompt, 10));
  const auto reference = run_to_completion(*reference_engine);
  for (const int32_t budget : {1, 3, 7}) {
    EngineConfig config;
    config.scheduler.max_num_batched_tokens = budget;
    auto engine = make_engine(dir, config);
    for (const auto& prompt : kPrompts) engine->add_request(make_request(prompt, 10));
    EXPECT_EQ(run_to_completion(*engine), reference) << "budget " << budget;
    expect_cache_drained(*engine);
  }
}

TEST(Engine, BoundedMixedStepsGiveTheSameTokens) {
  // The prefill budget cuts prefill chunks by measured timings (engine/prefill_budget.h): whatever
  // it chooses, the tokens are those of unbounded steps.
  const auto dir = write_tiny_qwen3({}, "mixed_steps");
  auto reference_engine = make_engine(dir);
  for (const auto& prompt : kPrompts) reference_engine->add_request(make_request(prompt, 10));
  const auto reference = run_to_completion(*reference_engine);
  EngineConfig config;
  config.max_mixed_step_ratio = 1.5;
  config.scheduler.max_num_batched_tokens = 8;
  auto engine = make_engine(dir, config);
  for (const auto& prompt : kPrompts) engine->add_request(make_request(prompt, 10));
  EXPECT_EQ(run_to_completion(*engine), reference);
  expect_cache_drained(*engine);
  for (const double ratio : {0.5, 1.0, -2.0}) {
    EngineConfig invalid;
    invalid.max_mixed_step_ratio = ratio;
    try {
      make_engine(dir, invalid);
      ADD_FAILURE() << "accepted max_mixed_step_ratio " << ratio;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
    }
  }
}

TEST(Engine, PreemptionLosesAndRepeatsNothing) {
  const auto dir = write_tiny_qwen3({}, "preempt");
  auto reference_engine = make_engine(dir);
  for (const auto& prompt : kPrompts) reference_engine->add_request(make_request(prompt, 24, 0.8f, 5));
  const auto reference = run_to_completion(*reference_engine);
  // 4 blocks of 16 tokens: the longest request (19 + 24 tokens) needs 3 of them on its own, so the
  // four requests cannot all stay resident and the scheduler must preempt.
  EngineConfig config;
  config.num_kv_blocks = 4;
  auto engine = make_engine(dir, config);
  for (const auto& prompt : kPrompts) engine->add_request(make_request(prompt, 24, 0.8f, 5));
  const auto outputs = run_to_completion(*engine);
  EXPECT_EQ(outputs, reference);
  int32_t preemptions = 0;
  for (const auto& [id, tokens] : outputs) preemptions += engine->sequence(id).num_preemptions;
  EXPECT_GT(preemptions, 0) << "the scenario is meant to force preemption";
  expect_cache_drained(*engine);
}

// With a host tier, preempted sequences are swapped out (blocks and all) and back in instead of
// recomputed, and must not notice; a tier too small for every victim swaps some and recomputes the
// rest. Greedy and seeded sampling both give the tokens of a run without preemption.
TEST(Engine, SwapPreemptionGivesTheTokensOfRecomputeAndDrains) {
  const auto dir = write_tiny_qwen3({}, "swap");
  for (const float temperature : {0.0f, 0.8f}) {
    auto reference_engine = make_engine(dir);
    for (const auto& prompt : kPrompts) reference_engine->add_request(make_request(prompt, 24, temperature, 5));
    const auto reference = run_to_completion(*reference_engine);
    EXPECT_EQ(reference_engine->stats().num_preemptions, 0);
    for (const int32_t host_blocks : {64, 1}) {
      EngineConfig config;
      config.num_kv_blocks = 4;
      config.scheduler.preemption_mode = PreemptionMode::kSwap;  // the swaps this test counts, whatever they cost
      auto probe = make_engine(dir, config);
      config.swap_space_bytes = static_cast<uint64_t>(host_blocks) * paged_bytes_per_block(
          probe->cache().specs(), probe->plan().block_size, DType::kF32);
      auto engine = make_engine(dir, config);
      ASSERT_EQ(engine->plan().num_host_blocks, host_blocks);
      for (const auto& prompt : kPrompts) engine->add_request(make_request(prompt, 24, temperature, 5));
      const auto outputs = testing::tokens_of(testing::run_to_completion(*engine, testing::expect_cache_integrity));
      EXPECT_EQ(outputs, reference) << "temperature " << temperature << ", " << host_blocks << " host blocks";
      const EngineStats stats = engine->stats();
      EXPECT_GT(stats.swapped_out_sequences, 0) << "the scenario is meant to swap";
      EXPECT_EQ(stats.swapped_in_sequences, stats.swapped_out_sequences);
      EXPECT_EQ(stats.swapped_in_blocks, stats.swapped_out_blocks);
      EXPECT_GT(stats.swapped_out_blocks, 0);
      EXPECT_EQ(stats.swapped_out_slots, 0);  // a dense model keeps no state slots
      if (host_blocks == 1) {
        EXPECT_GT(stats.num_preemptions, stats.swapped_out_sequences) << "some recompute";
      }
      EXPECT_EQ(stats.host_blocks_used, 0);
      EXPECT_EQ(engine->cache().num_swapped(), 0u);
      expect_cache_drained(*engine);
    }
  }
}

// With a host tier, prefix blocks the device evicts are kept on the host, and the same prompt later
// hits them there: fewer prompt tokens computed, the same greedy tokens.
TEST(Engine, PrefixBlocksEvictedToTheHostTierStillHit) {
  const auto dir = write_tiny_qwen3({}, "host_prefix");
  std::vector<int32_t> first(40), second(50);
  for (size_t i = 0; i < first.size(); ++i) first[i] = static_cast<int32_t>(3 + (i * 7) % 90);
  for (size_t i = 0; i < second.size(); ++i) second[i] = static_cast<int32_t>(5 + (i * 11) % 80);
  for (const bool tier : {false, true}) {
    EngineConfig config;
    config.num_kv_blocks = 4;  // the second prompt takes every block, evicting the first's
    auto probe = make_engine(dir, config);
    if (tier) {
      config.swap_space_bytes =
          8 * paged_bytes_per_block(probe->cache().specs(), probe->plan().block_size, DType::kF32);
    }
    auto engine = make_engine(dir, config);
    const int64_t a = engine->add_request(make_request(first, 4));
    auto outputs = run_to_completion(*engine);
    engine->add_request(make_request(second, 4));
    run_to_completion(*engine);
    const EngineStats before = engine->stats();
    const int64_t again = engine->add_request(make_request(first, 4));
    const auto repeated = run_to_completion(*engine);
    EXPECT_EQ(repeated.at(again), outputs.at(a)) << "tier " << tier;
    const EngineStats after = engine->stats();
    EXPECT_EQ(after.prefix_cache_hits - before.prefix_cache_hits, tier ? 32 : 0) << "tier " << tier;
    EXPECT_EQ(after.prefix_blocks_from_host, tier ? 2 : 0);
    EXPECT_EQ(before.prefix_blocks_to_host > 0, tier);
    expect_cache_drained(*engine);
  }
}

TEST(Engine, StopsOnEosStopIdsAndLength) {
  TinyQwen3Options options;
  const auto dir = write_tiny_qwen3(options, "stops");
  // Find what greedy decoding produces, then make its third token the stop id.
  auto probe = make_engine(dir);
  const int64_t probe_id = probe->add_request(make_request({4, 5, 6}, 6));
  run_to_completion(*probe);
  const auto generated = probe->sequence(probe_id).output();
  ASSERT_EQ(generated.size(), 6u);
  const int32_t stop_token = generated[2];
  const size_t first_stop = static_cast<size_t>(std::find(generated.begin(), generated.end(), stop_token) - generated.begin());

  auto engine = make_engine(dir);
  Request with_stop = make_request({4, 5, 6}, 6);
  with_stop.stop_token_ids = {stop_token};
  const int64_t stop_id = engine->add_request(with_stop);
  const int64_t length_id = engine->add_request(make_request({4, 5, 6}, 2));
  run_to_completion(*engine);
  EXPECT_EQ(engine->sequence(stop_id).finish_reason, FinishReason::kStop);
  EXPECT_EQ(engine->sequence(stop_id).num_output(), static_cast<int64_t>(first_stop + 1));
  EXPECT_EQ(engine->sequence(length_id).finish_reason, FinishReason::kLength);
  EXPECT_EQ(engine->sequence(length_id).num_output(), 2);

  // The model's EOS id (from config.json) ends generation unless ignore_eos.
  TinyQwen3Options eos_options;
  eos_options.eos_token_id = stop_token;
  const auto eos_dir = write_tiny_qwen3(eos_options, "stops_eos");
  auto eos_engine = make_engine(eos_dir);
  Request honours = make_request({4, 5, 6}, 6);
  honours.ignore_eos = false;
  const int64_t honours_id = eos_engine->add_request(honours);
  const int64_t ignores_id = eos_engine->add_request(make_request({4, 5, 6}, 6));
  run_to_completion(*eos_engine);
  EXPECT_EQ(eos_engine->sequence(honours_id).finish_reason, FinishReason::kStop);
  EXPECT_EQ(eos_engine->sequence(honours_id).num_output(), static_cast<int64_t>(first_stop + 1));
  EXPECT_EQ(eos_engine->sequence(ignores_id).finish_reason, FinishReason::kLength);
  EXPECT_EQ(eos_engine->sequence(ignores_id).num_output(), 6);
  expect_cache_drained(*eos_engine);
}

TEST(Engine, AbortFreesBlocksAndOthersContinue) {
  const auto dir = write_tiny_qwen3({}, "abort");
  auto engine = make_engine(dir);
  const int64_t keep = engine->add_request(make_request(kPrompts[0], 8));
  const int64_t drop = engine->add_request(make_request(kPrompts[2], 8));
  engine->step();
  engine->abort_request(drop);
  EXPECT_EQ(engine->sequence(drop).finish_reason, FinishReason::kAbort);
  const auto outputs = run_to_completion(*engine);
  EXPECT_EQ(engine->sequence(keep).num_output(), 8);
  EXPECT_EQ(outputs.count(drop), 0u);
  expect_cache_drained(*engine);
}

TEST(Engine, RejectsInvalidRequests) {
  const auto dir = write_tiny_qwen3({}, "invalid");
  EngineConfig config;
  config.num_kv_blocks = 2;
  auto engine = make_engine(dir, config);
  const auto expect_invalid = [&](Request request) {
    try {
      engine->add_request(std::move(request));
      ADD_FAILURE() << "accepted an invalid request";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
    }
  };
  expect_invalid(make_request({}, 4));
  expect_invalid(make_request({1, 96}, 4));   // id == vocab size
  expect_invalid(make_request({1, -3}, 4));
  expect_invalid(make_request({1, 2}, 0));
  expect_invalid(make_request(std::vector<int32_t>(40, 3), 4));  // more than the 2 blocks hold
  Request bad_sampling = make_request({1, 2}, 4, 0.7f);
  bad_sampling.sampling.top_p = 0.0f;
  expect_invalid(bad_sampling);
  EXPECT_FALSE(engine->has_unfinished());
}

TEST(Engine, RejectsConfigurationsOutsideTheModelAndTheCacheSlots) {
  const auto dir = write_tiny_qwen3({}, "invalid_config");
  const auto expect_invalid = [&](EngineConfig config, const char* what) {
    try {
      make_engine(dir, config);
      ADD_FAILURE() << "accepted " << what;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << what << ": " << e.what();
    }
  };
  const int64_t positions = load_model_config(dir).max_position_embeddings;
  EngineConfig too_long;
  too_long.max_model_len = positions + 1;
  expect_invalid(too_long, "a max_model_len beyond the model's positions");
  EngineConfig too_many_blocks;
  too_many_blocks.num_kv_blocks = (1 << 30) + 1;  // x 16 tokens: past int32 cache slots
  expect_invalid(too_many_blocks, "KV blocks whose cache slots overflow int32");
  EngineConfig exact;
  exact.max_model_len = positions;
  exact.num_kv_blocks = 8;
  EXPECT_NO_THROW(make_engine(dir, exact));
}

TEST(Engine, PromptLogitsDoNotDependOnChunking) {
  const auto dir = write_tiny_qwen3({}, "prompt_logits");
  std::vector<float> reference;
  for (const int32_t chunk : {0, 1, 5}) {
    EngineConfig config;
    config.scheduler.max_prefill_chunk = chunk;
    auto engine = make_engine(dir, config);
    Request request = make_request(kPrompts[0], 0);
    request.return_prompt_logits = true;
    const int64_t id = engine->add_request(request);
    run_to_completion(*engine);
    const auto& logits = engine->sequence(id).prompt_logits;
    ASSERT_EQ(logits.size(), kPrompts[0].size() * 96);
    if (reference.empty()) {
      reference = logits;
      continue;
    }
    double diff = 0, norm = 0;
    for (size_t i = 0; i < logits.size(); ++i) {
      diff += (logits[i] - reference[i]) * (logits[i] - reference[i]);
      norm += reference[i] * reference[i];
    }
    EXPECT_LT(std::sqrt(diff / norm), 1e-5) << "chunk " << chunk;
    expect_cache_drained(*engine);
  }
}

}  // namespace
}  // namespace metrale
