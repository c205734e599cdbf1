// Every golden model with --quantization fp8 on the GPU against the same FP8 weights on the CPU:
// the CUDA FP8 paths end to end (the FP8 GEMV of every projection, the FP8 expert decode kernels
// and the grouped GEMM over FP8 experts), whole prefill and token by token. Both sides quantise the
// same bf16 weights with the same quantiser, so the only difference is the GPU's bf16 activations:
// the bound is that of the bf16 golden GPU test (relative L2 2e-2, or 1.5 times transformers' own
// bf16 error for MoE cases whose routing flips in bf16).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "engine/golden_cases.h"

namespace metrale {
namespace {

using testing::GoldenCase;

std::vector<float> fp8_prompt_logits(const GoldenCase& golden, Device device, int32_t chunk) {
  EngineConfig config;
  config.scheduler.max_prefill_chunk = chunk;
  config.scheduler.max_num_seqs = 4;
  config.scheduler.max_num_batched_tokens = 512;
  config.max_model_len = 512;
  config.gpu_memory_utilization = 0.5;
  config.graph_batch_sizes = {1, 2, 4};
  Engine engine(load_model(golden.dir / "model", device, LoadOptions{false, WeightQuantization::kFp8}), config);
  Request request;
  request.prompt = golden.input_ids;
  request.max_tokens = 0;
  request.return_prompt_logits = true;
  const int64_t id = engine.add_request(request);
  while (engine.has_unfinished()) engine.step();
  return engine.sequence(id).prompt_logits;
}

class Fp8GoldenGpu : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (!cuda_available()) GTEST_SKIP() << "no GPU";
  }
};

TEST_P(Fp8GoldenGpu, LogitsMatchTheCpuFp8Model) {
  const GoldenCase golden(GetParam());
  const double bound = std::max(2e-2, 1.5 * golden.info.value("transformers_bf16_rel_l2", 0.0));
  const std::vector<float> cpu = fp8_prompt_logits(golden, Device::cpu(), 0);
  for (const int32_t chunk : {0, 1}) {
    const std::vector<float> gpu = fp8_prompt_logits(golden, Device::cuda(0), chunk);
    ASSERT_EQ(gpu.size(), cpu.size());
    double diff = 0, norm = 0;
    for (size_t i = 0; i < cpu.size(); ++i) {
      diff += (static_cast<double>(gpu[i]) - cpu[i]) * (static_cast<double>(gpu[i]) - cpu[i]);
      norm += static_cast<double>(cpu[i]) * cpu[i];
    }
    const double relative = std::sqrt(diff / norm);
    EXPECT_LE(relative, bound) << "chunk " << chunk;
    RecordProperty("fp8_rel_l2_chunk_" + std::to_string(chunk), fmt::format("{:.3e}", relative));
    std::printf("[fp8-golden-gpu] %s chunk %d: rel L2 %.3e against the CPU FP8 model\n", GetParam().c_str(), chunk,
                relative);
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, Fp8GoldenGpu, ::testing::ValuesIn(testing::golden_cases()),
                         [](const auto& param_info) { return param_info.param; });
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(Fp8GoldenGpu);

}  // namespace
}  // namespace metrale
