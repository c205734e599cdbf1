// A real hybrid architecture through the engine: a tiny random qwen3_5 (Gated DeltaNet and gated
// attention layers) keeps its recurrent state in the engine's state slots. Continuous batching,
// preemption and prefix hits that restore a state checkpoint give the tokens of a cold run.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <random>

#include "engine/engine.h"
#include "engine/request_helpers.h"
#include "model/config.h"
#include "model/registry.h"
#include "runtime/buffer.h"
#include "runtime/device.h"
#include "runtime/stream.h"

namespace metrale {
namespace {

constexpr int64_t kVocab = 67;

// The CUDA chunked delta rule takes dk 64 or 128 and dv a multiple of 16: the GPU model uses those.
std::unique_ptr<Model> tiny_qwen3_5(Device device = Device::cpu()) {
  const bool gpu = device.is_cuda();
  const nlohmann::json config = {{"model_type", "qwen3_5"},
                                 {"vocab_size", kVocab},
                                 {"hidden_size", 32},
                                 {"num_hidden_layers", 4},
                                 {"num_attention_heads", 4},
                                 {"num_key_value_heads", 2},
                                 {"head_dim", 16},
                                 {"intermediate_size", 40},
                                 {"rms_norm_eps", 1e-6},
                                 {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 10000.0}}},
                                 {"max_position_embeddings", 512},
                                 {"hidden_act", "silu"},
                                 {"full_attention_interval", 2},
                                 {"linear_num_key_heads", 2},
                                 {"linear_num_value_heads", 4},
                                 {"linear_key_head_dim", gpu ? 64 : 8},
                                 {"linear_value_head_dim", gpu ? 16 : 6},
                                 {"linear_conv_kernel_dim", 4},
                                 {"tie_word_embeddings", true},
                                 {"eos_token_id", 2}};
  return make_random_model(parse_model_config(config, "/virtual/qwen3_5/config.json"), device, 5);
}

void expect_close(const std::vector<float>& actual, const std::vector<float>& expected, float tolerance) {
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t i = 0; i < actual.size(); ++i) EXPECT_NEAR(actual[i], expected[i], tolerance) << "logprob " << i;
}

Request greedy(std::vector<int32_t> prompt, int32_t max_tokens) {
  Request request = testing::make_request(std::move(prompt), max_tokens);
  request.sampling.top_logprobs = 8;
  return request;
}

std::vector<int32_t> random_tokens(size_t count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> tokens(count);
  for (auto& token : tokens) token = static_cast<int32_t>(3 + rng() % (kVocab - 3));
  return tokens;
}

// Each request's generated tokens and the log-probabilities of every step (the token's and all
// 8 top tokens'), which show any difference in the logits, not only one that flips a greedy choice.
using testing::Generated;

// Runs until every request is done, checking the cache's books after every step.
std::map<int64_t, Generated> run(Engine& engine) {
  auto outputs = testing::run_to_completion(engine, testing::expect_cache_integrity);
  EXPECT_FALSE(engine.has_unfinished());
  EXPECT_EQ(engine.cache().pool().num_used(), 0);
  return outputs;
}

Generated run_alone(Engine& engine, Request request) {
  const int64_t id = engine.add_request(std::move(request));
  return run(engine)[id];
}

TEST(Qwen3_5Engine, PlansStateSlots) {
  Engine engine(tiny_qwen3_5(), {});
  ASSERT_TRUE(engine.cache().has_recurrent_state());
  EXPECT_GT(engine.plan().state_bytes_per_slot, 0u);
  EXPECT_EQ(engine.plan().num_state_slots, engine.plan().max_num_seqs);
  // Two GDN layers: conv state [K-1, conv_dim] and recurrent state [Hv, dk, dv] fp32 each.
  const int64_t conv_dim = 2 * 2 * 8 + 4 * 6;
  EXPECT_EQ(engine.plan().state_bytes_per_slot, static_cast<uint64_t>(2 * (3 * conv_dim + 4 * 8 * 6) * 4));
}

// The host tier of a hybrid model with prefix caching keeps a checkpoint slot for every checkpoint
// interval of its blocks (a cached prefix is usable only up to its last checkpoint); without prefix
// caching its slots are only for preempted sequences.
TEST(Qwen3_5Engine, HostTierSplitsItsSpaceIntoBlocksWithTheirCheckpoints) {
  for (const bool prefix_caching : {true, false}) {
    EngineConfig config;
    config.enable_prefix_caching = prefix_caching;
    config.state_checkpoint_interval = 64;  // 4 blocks of 16
    config.scheduler.max_num_seqs = 4;
    config.swap_space_bytes = 64ull << 20;
    Engine engine(tiny_qwen3_5(), config);
    const EnginePlan& plan = engine.plan();
    SCOPED_TRACE(::testing::Message() << "prefix caching " << prefix_caching << ": " << plan.num_host_blocks
                                      << " host blocks, " << plan.num_host_slots << " host slots");
    ASSERT_GT(plan.num_host_blocks, 0);
    if (prefix_caching) {
      EXPECT_GE(plan.num_host_slots, plan.num_host_blocks / 4);
      EXPECT_LE(plan.num_host_slots, plan.num_host_blocks / 4 + 4 + 1);
    } else {
      EXPECT_LE(plan.num_host_slots, 4);
    }
  }
}

TEST(Qwen3_5Engine, BatchingAndPreemptionGiveTheTokensOfRunningAlone) {
  std::vector<Request> requests;
  for (uint64_t i = 0; i < 4; ++i) requests.push_back(greedy(random_tokens(9 + 7 * i, 40 + i), 10));
  std::vector<Generated> alone;
  for (const auto& request : requests) {
    EngineConfig config;
    config.enable_prefix_caching = false;
    Engine engine(tiny_qwen3_5(), config);
    alone.push_back(run_alone(engine, request));
    ASSERT_EQ(alone.back().tokens.size(), 10u);
  }
  // Few blocks: sequences are preempted, recomputed from zero state, and must not notice.
  EngineConfig config;
  config.enable_prefix_caching = false;
  config.num_kv_blocks = 4;
  config.scheduler.max_num_batched_tokens = 8;
  Engine engine(tiny_qwen3_5(), config);
  std::vector<int64_t> ids;
  for (const auto& request : requests) ids.push_back(engine.add_request(request));
  auto outputs = run(engine);
  // Different chunkings round differently: the tokens must agree, the log-probabilities closely.
  for (size_t i = 0; i < ids.size(); ++i) {
    EXPECT_EQ(outputs[ids[i]].tokens, alone[i].tokens) << "request " << i;
    expect_close(outputs[ids[i]].logprobs, alone[i].logprobs, 1e-4);
  }
  EXPECT_GT(engine.stats().num_preemptions, 0);
}

// A host tier: preempted sequences leave with their KV blocks and their state slot and come back
// to both; the tokens are those of recompute-free runs, and the tier drains.
TEST(Qwen3_5Engine, SwapPreemptionKeepsBlocksAndStateSlot) {
  std::vector<Request> requests;
  for (uint64_t i = 0; i < 4; ++i) requests.push_back(greedy(random_tokens(9 + 7 * i, 40 + i), 10));
  std::vector<Generated> alone;
  for (const auto& request : requests) {
    EngineConfig config;
    config.enable_prefix_caching = false;
    config.scheduler.max_num_batched_tokens = 8;
    Engine engine(tiny_qwen3_5(), config);
    alone.push_back(run_alone(engine, request));
  }
  for (const bool prefix_caching : {false, true}) {
    EngineConfig config;
    config.enable_prefix_caching = prefix_caching;
    config.state_checkpoint_interval = 16;
    config.num_kv_blocks = 4;
    config.scheduler.max_num_batched_tokens = 8;
    config.swap_space_bytes = 64ull << 20;
    config.scheduler.preemption_mode = PreemptionMode::kSwap;  // every preemption swaps, whatever it costs
    Engine engine(tiny_qwen3_5(), config);
    ASSERT_GT(engine.plan().num_host_slots, 0);
    std::vector<int64_t> ids;
    for (const auto& request : requests) ids.push_back(engine.add_request(request));
    auto outputs = run(engine);
    for (size_t i = 0; i < ids.size(); ++i) {
      EXPECT_EQ(outputs[ids[i]].tokens, alone[i].tokens) << "request " << i << ", prefix caching " << prefix_caching;
      expect_close(outputs[ids[i]].logprobs, alone[i].logprobs, 1e-4);
    }
    const EngineStats stats = engine.stats();
    EXPECT_GT(stats.swapped_out_sequences, 0);
    EXPECT_EQ(stats.swapped_out_sequences, stats.num_preemptions);  // room for all: nothing recomputed
    EXPECT_EQ(stats.swapped_in_sequences, stats.swapped_out_sequences);
    EXPECT_EQ(stats.swapped_out_slots, stats.swapped_out_sequences);
    EXPECT_EQ(stats.swapped_in_slots, stats.swapped_out_slots);
    EXPECT_EQ(stats.host_blocks_used, 0);
    EXPECT_EQ(stats.host_slots_used, 0);
    EXPECT_EQ(engine.cache().num_sequences() + engine.cache().num_swapped(), 0u);
    EXPECT_NO_THROW(engine.cache().check_integrity());
  }
}

TEST(Qwen3_5Engine, PrefixHitRestoresTheStateAndGivesColdTokens) {
  const std::vector<int32_t> first = random_tokens(45, 7);
  std::vector<int32_t> second(first.begin(), first.begin() + 37);
  const auto tail = random_tokens(6, 8);
  second.insert(second.end(), tail.begin(), tail.end());

  // Cold with the prefix cache on: the same chunk boundaries (checkpoint points) as the warm run,
  // so the warm run must be bitwise the same computation.
  Engine cold(tiny_qwen3_5(), {});
  const auto cold_second = run_alone(cold, greedy(second, 12));
  EXPECT_EQ(cold.stats().prefix_cache_hits, 0);
  // Cold without the prefix cache: the prompt in one chunk.
  EngineConfig off;
  off.enable_prefix_caching = false;
  Engine uncached(tiny_qwen3_5(), off);
  const auto uncached_second = run_alone(uncached, greedy(second, 12));
  EXPECT_EQ(uncached_second.tokens, cold_second.tokens);
  expect_close(uncached_second.logprobs, cold_second.logprobs, 1e-4);

  Engine warm(tiny_qwen3_5(), {});
  run_alone(warm, greedy(first, 12));
  const EngineStats before = warm.stats();
  EXPECT_EQ(run_alone(warm, greedy(second, 12)), cold_second);
  const EngineStats after = warm.stats();
  EXPECT_EQ(after.prefix_cache_hits - before.prefix_cache_hits, 32);
  EXPECT_EQ(after.hybrid_state_restores - before.hybrid_state_restores, 1);
  EXPECT_EQ(after.computed_prompt_tokens - before.computed_prompt_tokens, 43 - 32);
}

// ---- The same on the GPU (skipped without one): state slots through the decode graphs, padding
// rows writing the padding slot, checkpoint copies on the device.

EngineConfig gpu_config() {
  EngineConfig config;
  config.scheduler.max_num_seqs = 8;
  config.scheduler.max_num_batched_tokens = 256;
  config.max_model_len = 256;
  config.gpu_memory_utilization = 0.3;
  config.graph_batch_sizes = {1, 2, 4, 8};
  return config;
}

// The fp32 recurrent state [Hv, dk, dv] of the first GDN layer in a sequence's slot, on the host.
std::vector<float> recurrent_state(const Engine& engine, int64_t seq_id) {
  const int32_t slot = engine.cache().state_slot(seq_id);
  EXPECT_GE(slot, 0);
  const auto caches = engine.cache().block_caches();
  for (size_t i = 0; i < caches.size(); ++i) {
    const auto& tensors = engine.cache().specs()[i].tensors;
    if (tensors.size() < 2 || tensors[1].name != "recurrent") continue;
    const Tensor& state = caches[i].tensors[1];
    const int64_t per_slot = state.numel() / state.size(0);
    std::vector<float> host(static_cast<size_t>(per_slot));
    synchronize(state.device());
    copy_bytes(host.data(), Device::cpu(), state.data_as<const float>() + slot * per_slot, state.device(),
               host.size() * sizeof(float));
    return host;
  }
  ADD_FAILURE() << "no recurrent layer";
  return {};
}

double relative_distance(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    norm += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(diff / std::max(norm, 1e-30));
}

TEST(Qwen3_5EngineGpu, DecodeGraphsReadAndWriteEachSequencesSlot) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  // The logits of this random model barely depend on the recurrent state, so the test reads the
  // state itself: after a prefill step and six decode steps (through the graph of 8, three padding
  // rows), each sequence's slot must hold what it holds when the sequence runs alone, to bf16
  // precision; the states of different sequences are far apart.
  constexpr int kSteps = 7;
  std::vector<Request> requests;
  for (uint64_t i = 0; i < 5; ++i) requests.push_back(greedy(random_tokens(5 + 9 * i, 60 + i), 20));
  std::vector<std::vector<float>> alone;
  std::vector<Generated> alone_tokens;
  for (const auto& request : requests) {
    Engine engine(tiny_qwen3_5(Device::cuda(0)), gpu_config());
    const int64_t id = engine.add_request(request);
    Generated generated;
    for (int step = 0; step < kSteps; ++step)
      for (const TokenEvent& event : engine.step()) generated.tokens.push_back(event.sampled.token);
    alone.push_back(recurrent_state(engine, id));
    alone_tokens.push_back(generated);
  }
  Engine engine(tiny_qwen3_5(Device::cuda(0)), gpu_config());
  ASSERT_FALSE(engine.plan().graph_batch_sizes.empty());
  std::vector<int64_t> ids;
  for (const auto& request : requests) ids.push_back(engine.add_request(request));
  std::map<int64_t, Generated> together;
  for (int step = 0; step < kSteps; ++step)
    for (const TokenEvent& event : engine.step()) together[event.request_id].tokens.push_back(event.sampled.token);
  int compared = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (together[ids[i]].tokens != alone_tokens[i].tokens) continue;  // a bf16 near-tie went the other way
    ++compared;
    const auto state = recurrent_state(engine, ids[i]);
    EXPECT_LT(relative_distance(state, alone[i]), 3e-2) << "request " << i;
    for (size_t j = 0; j < ids.size(); ++j) {
      if (j != i) {
        EXPECT_GT(relative_distance(state, alone[j]), 0.2) << "requests " << i << " and " << j;
      }
    }
  }
  EXPECT_GE(compared, 3) << "most sequences should generate the tokens they generate alone";
}

TEST(Qwen3_5EngineGpu, PrefixHitRestoresTheStateOnTheDevice) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  const std::vector<int32_t> first = random_tokens(45, 17);
  std::vector<int32_t> second(first.begin(), first.begin() + 37);
  const auto tail = random_tokens(6, 18);
  second.insert(second.end(), tail.begin(), tail.end());
  Engine cold(tiny_qwen3_5(Device::cuda(0)), gpu_config());
  const auto cold_second = run_alone(cold, greedy(second, 12));
  Engine warm(tiny_qwen3_5(Device::cuda(0)), gpu_config());
  run_alone(warm, greedy(first, 12));
  const auto warm_second = run_alone(warm, greedy(second, 12));
  EXPECT_EQ(warm.stats().hybrid_state_restores, 1);
  EXPECT_EQ(warm.stats().prefix_cache_hits, 32);
  // The same chunks from the same state and keys: the same computation.
  EXPECT_EQ(warm_second.tokens, cold_second.tokens);
  expect_close(warm_second.logprobs, cold_second.logprobs, 1e-3);
}

}  // namespace
}  // namespace metrale
