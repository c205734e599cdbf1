// The engine over tensor-parallel ranks (engine/tensor_parallel_model.h), ranks as threads on the
// CPU: continuous batching with chunked prefill, prefix caching (hybrid state checkpoints
// included), swapping preempted sequences to the host tier and speculative decoding give the
// tokens of one rank for every golden checkpoint; a failing rank fails the step with its error.
#include <gtest/gtest.h>

#include <filesystem>

#include "engine/engine.h"
#include "engine/golden_cases.h"
#include "engine/request_helpers.h"
#include "engine/tensor_parallel_model.h"

namespace metrale {
namespace {

using testing::GoldenCase;
using testing::make_request;

// Three prompts from the case's tokens; the third repeats the first's first 24 tokens (a prefix hit).
std::vector<std::vector<int32_t>> prompts_of(const std::vector<int32_t>& ids) {
  const auto piece = [&](size_t begin, size_t count) {
    std::vector<int32_t> tokens;
    for (size_t i = 0; i < count; ++i) tokens.push_back(ids[(begin + i) % ids.size()]);
    return tokens;
  };
  std::vector<int32_t> third = piece(0, 24);
  const std::vector<int32_t> tail = piece(40, 5);
  third.insert(third.end(), tail.begin(), tail.end());
  return {piece(0, 30), piece(11, 19), third};
}

EngineConfig engine_config(int32_t num_kv_blocks = 0) {
  EngineConfig config;
  config.block_size = 4;
  config.scheduler.max_prefill_chunk = 7;
  config.scheduler.max_num_seqs = 4;
  config.scheduler.max_num_batched_tokens = 64;
  config.max_model_len = 256;
  config.num_kv_blocks = num_kv_blocks;
  config.state_checkpoint_interval = 8;
  return config;
}

// Runs the prompts (the first two together, the third after they finish: its prefix is cached).
std::map<int64_t, std::vector<int32_t>> generate(Engine& engine, const std::vector<std::vector<int32_t>>& prompts) {
  std::map<int64_t, testing::Generated> outputs;
  for (size_t i = 0; i < 2; ++i) {
    Request request = make_request(prompts[i], 12);
    request.ignore_eos = true;
    engine.add_request(request);
  }
  outputs = testing::run_to_completion(engine, testing::expect_cache_integrity);
  Request third = make_request(prompts[2], 12);
  third.ignore_eos = true;
  engine.add_request(third);
  return testing::tokens_of(testing::run_to_completion(engine, testing::expect_cache_integrity, outputs));
}

class TensorParallelEngine : public ::testing::TestWithParam<std::string> {};

TEST_P(TensorParallelEngine, TwoRanksGiveTheTokensOfOne) {
  const GoldenCase golden(GetParam());
  const std::filesystem::path dir = golden.dir / "model";
  const std::vector<std::vector<int32_t>> prompts = prompts_of(golden.input_ids);
  Engine whole(load_model(dir, Device::cpu()), engine_config());
  const auto expected = generate(whole, prompts);
  ASSERT_EQ(expected.size(), 3u);
  auto model = TensorParallelModel::load(dir, {Device::cpu(), Device::cpu()});
  Engine engine(std::move(model), engine_config());
  EXPECT_EQ(engine.cache().num_ranks(), 2);
  EXPECT_EQ(generate(engine, prompts), expected);
  const EngineStats stats = engine.stats();
  EXPECT_GT(stats.prefix_cache_hits, 0) << "the third prompt's first blocks are cached";
}

INSTANTIATE_TEST_SUITE_P(Cases, TensorParallelEngine, ::testing::ValuesIn(testing::golden_cases()),
                         [](const auto& param_info) { return param_info.param; });
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(TensorParallelEngine);

// Preemption swaps every rank's blocks and state slot to the host tier and back.
TEST(TensorParallelEngineTiers, SwappedSequencesComeBackOnEveryRank) {
  for (const char* name : {"qwen3_tied", "qwen3_5"}) {
    SCOPED_TRACE(name);
    const GoldenCase golden(name);
    const std::filesystem::path dir = golden.dir / "model";
    const std::vector<std::vector<int32_t>> prompts = prompts_of(golden.input_ids);
    const auto run = [&](Engine& engine) {
      for (const auto& prompt : prompts) {
        Request request = make_request(prompt, 16);
        request.ignore_eos = true;
        engine.add_request(request);
      }
      return testing::tokens_of(testing::run_to_completion(engine, testing::expect_cache_integrity));
    };
    Engine whole(load_model(dir, Device::cpu()), engine_config());
    const auto expected = run(whole);
    EngineConfig config = engine_config(/*num_kv_blocks=*/14);  // three sequences of 46 tokens do not fit
    config.enable_prefix_caching = false;
    config.scheduler.preemption_mode = PreemptionMode::kSwap;
    config.swap_space_bytes = 64ull << 20;
    Engine engine(TensorParallelModel::load(dir, {Device::cpu(), Device::cpu()}), config);
    EXPECT_EQ(run(engine), expected);
    EXPECT_GT(engine.stats().swapped_out_sequences, 0) << "the scenario is meant to swap";
    EXPECT_EQ(engine.stats().swapped_in_sequences, engine.stats().swapped_out_sequences);
  }
}

TEST(TensorParallelEngineSpeculation, NgramDraftsGiveThePlainTokens) {
  const GoldenCase golden("qwen3_5");
  const std::filesystem::path dir = golden.dir / "model";
  const std::vector<std::vector<int32_t>> prompts = prompts_of(golden.input_ids);
  Engine whole(load_model(dir, Device::cpu()), engine_config());
  const auto expected = generate(whole, prompts);
  EngineConfig config = engine_config();
  config.speculative.method = SpeculativeMethod::kNgram;
  config.speculative.num_drafts = 3;
  Engine engine(TensorParallelModel::load(dir, {Device::cpu(), Device::cpu()}), config);
  EXPECT_EQ(generate(engine, prompts), expected);
}

TEST(TensorParallelEngineFailure, AFailingRankFailsTheCallWithItsError) {
  const GoldenCase golden("qwen3_tied");
  auto model = TensorParallelModel::load(golden.dir / "model", {Device::cpu(), Device::cpu()});
  // A logits tensor one column short: every rank's LM head check throws after the layers ran.
  std::vector<int32_t> ids{1}, positions{0}, cu_q{0, 1}, kv_lens{1}, slots{0}, rows{0}, tables{0};
  ForwardBatch batch;
  batch.num_tokens = 1;
  batch.num_seqs = 1;
  batch.block_size = 4;
  batch.max_q_len = 1;
  batch.max_kv_len = 1;
  batch.token_ids = Tensor(ids.data(), DType::kI32, {1});
  batch.positions = Tensor(positions.data(), DType::kI32, {1});
  batch.cu_q = Tensor(cu_q.data(), DType::kI32, {2});
  batch.kv_lens = Tensor(kv_lens.data(), DType::kI32, {1});
  batch.block_tables = Tensor(tables.data(), DType::kI32, {1, 1});
  batch.slot_mapping = Tensor(slots.data(), DType::kI32, {1});
  batch.logit_rows = Tensor(rows.data(), DType::kI32, {1});
  std::vector<OwnedTensor> storage;
  std::vector<BlockCache> caches;
  for (const CacheSpec& spec : model->cache_specs()) {
    BlockCache cache;
    for (const CacheTensorSpec& tensor : spec.tensors) {
      storage.emplace_back(tensor.dtype_or(DType::kF32), tensor.storage_shape(1, 4, 1));
      cache.tensors.push_back(*storage.back());
    }
    caches.push_back(cache);
  }
  OwnedTensor logits(DType::kF32, {1, model->config().vocab_size - 1});
  Arena workspace(Device::cpu(), 1 << 20);
  try {
    model->forward(batch, {caches, {}}, *logits, workspace);
    ADD_FAILURE() << "a forward into mis-shaped logits returned";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("logits"), std::string::npos) << error.what();
  }
  // The group is aborted: the next call fails at once instead of waiting for a collective.
  OwnedTensor good(DType::kF32, {1, model->config().vocab_size});
  EXPECT_THROW(model->forward(batch, {caches, {}}, *good, workspace), Error);
}

}  // namespace
}  // namespace metrale
