// The NCCL group (runtime/cuda/nccl_group.h): one rank on GPU 0 (every GPU machine), and with two
// GPUs or more, the ranks' sums and gathers and the golden checkpoints at TP = 2 over NCCL against
// TP = 1 (relative L2 of the logits, fp32 activations).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <thread>

#include "common/step_runner.h"
#include "core/error.h"
#include "cuda_test_helpers.h"
#include "engine/engine.h"
#include "engine/tensor_parallel_model.h"
#include "kernels/kernel_helpers.h"
#include "model/registry.h"
#include "runtime/device_hooks.h"
#include "runtime/stream.h"

#if METRALE_WITH_NCCL
#include "runtime/cuda/nccl_group.h"
#endif

namespace metrale {
namespace {

using testing::fill;
using testing::to_device;
using testing::to_doubles;
using testing::to_host;

int gpu_count() {
  return cuda_hooks() == nullptr ? 0 : cuda_hooks()->device_count();
}

#if METRALE_WITH_NCCL

std::vector<float> host_floats(const Tensor& device) {
  const OwnedTensor host = to_host(device);
  const std::vector<double> values = to_doubles(*host);
  return {values.begin(), values.end()};
}

TEST(NcclGroup, OneRankReducesGathersAndAborts) {
  if (gpu_count() < 1) GTEST_SKIP() << "no GPU";
  NcclGroup group({0});
  Communicator& rank = group.communicator(0);
  EXPECT_EQ(rank.size(), 1);
  std::vector<float> values{1.5f, -2.0f, 3.25f, 0.0f};
  OwnedTensor host(DType::kF32, {2, 2});
  fill(*host, values);
  const OwnedTensor tensor = to_device(*host);
  rank.all_reduce_sum(*tensor);
  EXPECT_EQ(host_floats(*tensor), values);
  OwnedTensor gathered(DType::kF32, {2, 2}, Device::cuda());
  rank.all_gather(*tensor, *gathered);
  EXPECT_EQ(host_floats(*gathered), values);
  rank.barrier();
  // A host tensor is not the rank's device's.
  EXPECT_THROW(rank.all_reduce_sum(*host), Error);
  rank.abort("test");
  try {
    rank.all_reduce_sum(*tensor);
    ADD_FAILURE() << "a collective after abort returned";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kUnavailable);
    EXPECT_NE(std::string(error.what()).find("test"), std::string::npos) << error.what();
  }
}

TEST(NcclGroup, RanksSumAndGatherAcrossGpus) {
  if (gpu_count() < 2) GTEST_SKIP() << "needs two GPUs, this machine has " << gpu_count();
  const int size = gpu_count();
  std::vector<int> devices(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) devices[static_cast<size_t>(r)] = r;
  NcclGroup group(devices);
  std::vector<std::vector<float>> sums(static_cast<size_t>(size)), gathers(static_cast<size_t>(size));
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      const Device device = Device::cuda(r);
      set_current_device(device);
      OwnedTensor host(DType::kF32, {3});
      fill(*host, std::vector<float>{static_cast<float>(r), 1.0f, static_cast<float>(r * r)});
      OwnedTensor tensor(DType::kF32, {3}, device), gathered(DType::kF32, {3 * size}, device);
      copy_tensor(*tensor, *host);
      group.communicator(r).all_gather(*tensor, *gathered);
      group.communicator(r).all_reduce_sum(*tensor);
      synchronize(device);
      sums[static_cast<size_t>(r)] = host_floats(*tensor);
      gathers[static_cast<size_t>(r)] = host_floats(*gathered);
    });
  }
  for (std::thread& thread : threads) thread.join();
  float ranks = 0.0f, squares = 0.0f;
  std::vector<float> expected_gather;
  for (int r = 0; r < size; ++r) {
    ranks += static_cast<float>(r);
    squares += static_cast<float>(r * r);
    expected_gather.insert(expected_gather.end(), {static_cast<float>(r), 1.0f, static_cast<float>(r * r)});
  }
  for (int r = 0; r < size; ++r) {
    EXPECT_EQ(sums[static_cast<size_t>(r)], (std::vector<float>{ranks, static_cast<float>(size), squares}));
    EXPECT_EQ(gathers[static_cast<size_t>(r)], expected_gather);
  }
}

// --- Golden checkpoints at TP = 2 over NCCL ---------------------------------------------------------

const std::filesystem::path kGoldens = std::filesystem::path(METRALE_TEST_DATA_DIR) / "goldens";

using testing::relative_l2;
using testing::StepLogits;

StepLogits run_steps(Model& model, const std::vector<int32_t>& tokens) {
  return testing::run_two_sequence_steps(model, tokens, /*block_size=*/16, /*num_blocks=*/64);
}

TEST(TensorParallelGpu, GoldensAtTwoRanksGiveTheLogitsOfOne) {
  if (gpu_count() < 2) GTEST_SKIP() << "needs two GPUs, this machine has " << gpu_count();
  for (const char* name : {"qwen3_tied", "qwen3_moe", "qwen3_next", "qwen3_5", "qwen4_exp", "glm5_next"}) {
    SCOPED_TRACE(name);
    const std::filesystem::path dir = kGoldens / name / "model";
    ASSERT_TRUE(std::filesystem::exists(dir)) << dir;
    std::vector<int32_t> tokens;
    std::ifstream file(kGoldens / name / "input_ids.json");
    for (const auto& id : nlohmann::json::parse(file)) tokens.push_back(id.get<int32_t>());
    LoadOptions f32;
    f32.compute_dtype = DType::kF32;
    const StepLogits expected = [&] {
      set_current_device(Device::cuda(0));
      auto whole = load_model(dir, Device::cuda(0), f32);
      return run_steps(*whole, tokens);
    }();
    NcclGroup group({0, 1});
    std::vector<StepLogits> results(2);
    std::vector<std::string> failures(2);
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        try {
          set_current_device(Device::cuda(r));
          LoadOptions options = f32;
          options.tensor_parallel = {r, 2, &group.communicator(r)};
          auto model = load_model(dir, Device::cuda(r), options);
          results[static_cast<size_t>(r)] = run_steps(*model, tokens);
        } catch (const std::exception& e) {
          failures[static_cast<size_t>(r)] = e.what();
          group.communicator(r).abort(e.what());
        }
      });
    }
    for (std::thread& thread : threads) thread.join();
    ASSERT_EQ(failures[0], "");
    ASSERT_EQ(failures[1], "");
    EXPECT_LE(relative_l2(results[0], expected), 1e-5);
    EXPECT_LE(relative_l2(results[1], expected), 1e-5);
  }
}

// The engine over TensorParallelModel on the GPU: one rank (graphs on) and, with two GPUs, two
// ranks (eager) give the greedy tokens of the plain engine.
TEST(TensorParallelGpu, EngineOverRanksGivesThePlainTokens) {
  if (gpu_count() < 1) GTEST_SKIP() << "no GPU";
  for (const char* name : {"qwen3_tied", "qwen3_5", "qwen4_exp"}) {
    SCOPED_TRACE(name);
    const std::filesystem::path dir = kGoldens / name / "model";
    std::vector<int32_t> tokens;
    std::ifstream file(kGoldens / name / "input_ids.json");
    for (const auto& id : nlohmann::json::parse(file)) tokens.push_back(id.get<int32_t>());
    const auto run = [&](std::unique_ptr<Model> model) {
      EngineConfig config;
      config.max_model_len = 256;
      config.scheduler.max_num_seqs = 4;
      config.gpu_memory_utilization = 0.3;
      config.graph_batch_sizes = {1, 2, 4};
      Engine engine(std::move(model), config);
      for (size_t begin : {size_t{0}, size_t{9}}) {
        Request request;
        request.prompt.assign(tokens.begin() + static_cast<int64_t>(begin),
                              tokens.begin() + static_cast<int64_t>(begin + 20));
        request.max_tokens = 10;
        request.ignore_eos = true;
        request.sampling.temperature = 0.0f;
        engine.add_request(request);
      }
      std::map<int64_t, std::vector<int32_t>> out;
      while (engine.has_unfinished())
        for (const TokenEvent& event : engine.step())
          if (event.sampled.token >= 0) out[event.request_id].push_back(event.sampled.token);
      return out;
    };
    LoadOptions f32;
    f32.compute_dtype = DType::kF32;
    const auto expected = run(load_model(dir, Device::cuda(0), f32));
    EXPECT_EQ(run(TensorParallelModel::load(dir, {Device::cuda(0)}, f32)), expected);
    if (gpu_count() >= 2) {
      EXPECT_EQ(run(TensorParallelModel::load(dir, {Device::cuda(0), Device::cuda(1)}, f32)), expected);
    }
  }
}

#else

TEST(NcclGroup, BuiltWithoutNccl) {
  GTEST_SKIP() << "this CUDA build found no nccl.h";
}

#endif

}  // namespace
}  // namespace metrale
