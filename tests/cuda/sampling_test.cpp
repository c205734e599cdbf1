// kernels::sample_tokens: the CUDA kernel against its CPU twin, and the CPU twin against the engine's
// Sampler, over thousands of random rows and parameter settings (greedy, temperature only, top-k,
// top-p, min-p and their combinations; rows with ties, signed zeros, masked tokens, a dominant token,
// one value everywhere, huge spreads; vocabularies from 1 to 151936). Tokens must agree exactly,
// logprobs to 1e-5. Also: bad rows, CUDA graph
// replay, and a disabled benchmark. The CPU parts run without a GPU.
#include <cuda_runtime_api.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "core/random.h"
#include "engine/sampler.h"
#include "cuda/cuda_test_helpers.h"
#include "kernels/kernel_helpers.h"
#include "kernels/sampling.h"
#include "runtime/cuda/cuda_graph.h"
#include "runtime/device.h"
#include "runtime/stream.h"
#include "kernels/sampling_rows.h"

namespace metrale {
namespace {

using testing::to_device;

constexpr float kInf = std::numeric_limits<float>::infinity();

using testing::RowSettings;

// A batch of rows [R, V] with their settings, on the host.
struct Batch {
  int64_t vocab = 0;
  std::vector<float> logits;  // [R, V]
  std::vector<RowSettings> rows;
  int64_t num_rows() const { return static_cast<int64_t>(rows.size()); }
  std::vector<float> row(int64_t r) const {
    return {logits.begin() + r * vocab, logits.begin() + (r + 1) * vocab};
  }
};

struct Sampled {
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;
};

// The per-row parameter tensors of a batch, on the host.
struct HostParams {
  std::vector<float> temperature, top_p, min_p;
  std::vector<int32_t> top_k;
  std::vector<int64_t> seed, step;
  explicit HostParams(const std::vector<RowSettings>& rows) {
    for (const RowSettings& s : rows) {
      temperature.push_back(s.temperature);
      top_k.push_back(s.top_k);
      top_p.push_back(s.top_p);
      min_p.push_back(s.min_p);
      seed.push_back(static_cast<int64_t>(s.seed));
      step.push_back(static_cast<int64_t>(s.step));
    }
  }
  kernels::SamplingRowParams tensors() {
    const auto r = static_cast<int64_t>(temperature.size());
    return {Tensor(temperature.data(), DType::kF32, {r}), Tensor(top_k.data(), DType::kI32, {r}),
            Tensor(top_p.data(), DType::kF32, {r}),       Tensor(min_p.data(), DType::kF32, {r}),
            Tensor(seed.data(), DType::kI64, {r}),        Tensor(step.data(), DType::kI64, {r})};
  }
};

Sampled run_cpu(Batch& batch) {
  HostParams params(batch.rows);
  const int64_t r = batch.num_rows();
  Sampled out{std::vector<int32_t>(static_cast<size_t>(r), -5), std::vector<float>(static_cast<size_t>(r), std::nanf(""))};
  kernels::sample_tokens(Tensor(batch.logits.data(), DType::kF32, {r, batch.vocab}), params.tensors(),
                         Tensor(out.tokens.data(), DType::kI32, {r}), Tensor(out.logprobs.data(), DType::kF32, {r}));
  return out;
}

// The batch's tensors on the GPU, outputs poisoned.
struct DeviceBatch {
  OwnedTensor logits, temperature, top_k, top_p, min_p, seed, step, tokens, logprobs;
  explicit DeviceBatch(Batch& batch) {
    HostParams host_params(batch.rows);
    const kernels::SamplingRowParams host = host_params.tensors();
    const int64_t r = batch.num_rows();
    logits = to_device(Tensor(batch.logits.data(), DType::kF32, {r, batch.vocab}));
    temperature = to_device(host.temperature);
    top_k = to_device(host.top_k);
    top_p = to_device(host.top_p);
    min_p = to_device(host.min_p);
    seed = to_device(host.seed);
    step = to_device(host.step);
    std::vector<int32_t> minus(static_cast<size_t>(r), -5);
    std::vector<float> nans(static_cast<size_t>(r), std::nanf(""));
    tokens = to_device(Tensor(minus.data(), DType::kI32, {r}));
    logprobs = to_device(Tensor(nans.data(), DType::kF32, {r}));
  }
  kernels::SamplingRowParams params() const { return {*temperature, *top_k, *top_p, *min_p, *seed, *step}; }
  void run() const { kernels::sample_tokens(*logits, params(), *tokens, *logprobs); }
  Sampled read() const {
    const auto r = static_cast<size_t>(tokens->numel());
    Sampled out{std::vector<int32_t>(r), std::vector<float>(r)};
    copy_tensor(Tensor(out.tokens.data(), DType::kI32, {static_cast<int64_t>(r)}), *tokens);
    copy_tensor(Tensor(out.logprobs.data(), DType::kF32, {static_cast<int64_t>(r)}), *logprobs);
    return out;
  }
};

SampledToken run_engine(const std::vector<float>& row, const RowSettings& s) {
  Sampler sampler;
  std::vector<float> logits = row;
  SamplingParams params;
  params.temperature = s.temperature;
  params.top_k = s.top_k;
  params.top_p = s.top_p;
  params.min_p = s.min_p;
  return sampler.sample(logits, params, {}, {}, s.seed, s.step);
}

// Random rows of assorted shapes and random settings.
class RowFactory {
 public:
  explicit RowFactory(uint64_t seed) : rng_(seed) {}

  std::vector<float> logits(int64_t vocab) {
    const int kind = static_cast<int>(rng_() % 10);
    const double sigma = pick<double>({0.3, 1.0, 2.0, 5.0, 20.0});
    std::normal_distribution<double> normal(0.0, sigma);
    std::vector<float> row(static_cast<size_t>(vocab));
    for (auto& x : row) {
      double v = normal(rng_);
      switch (kind) {
        case 1: v = round_to_bf16(static_cast<float>(v)); break;     // bf16 logits: ties
        case 2: v = std::round(v); break;                             // many ties
        case 3: v = 1.5; break;                                       // one value everywhere
        case 4: if (rng_() % 4 != 0) v = -kInf; break;                // masked tokens
        case 6: v = (rng_() % 2) ? 0.0 : -0.0; if (rng_() % 3 == 0) v = -1.0; break;  // signed zeros
        case 7: v = std::round(v * 4) / 4 - 100.0; break;            // far from zero, ties
        case 8: v *= 1000.0; break;                                   // huge spread
        case 9: v = round_to_bf16(static_cast<float>(v * 0.5 - 2.0)); break;  // LLM-like, bf16 lm_head
        default: break;
      }
      x = static_cast<float>(v);
    }
    if (kind == 4) row[rng_() % static_cast<uint64_t>(vocab)] = 0.5f;  // at least one finite logit
    if (kind == 5 || kind == 9) row[rng_() % static_cast<uint64_t>(vocab)] = 12.0f;  // a dominant token
    return row;
  }

  RowSettings settings(int64_t vocab) {
    RowSettings s;
    const auto v = static_cast<int32_t>(std::min<int64_t>(vocab, 1 << 20));
    s.temperature = pick<float>({0.0f, 1e-6f, 1e-5f, 2e-5f, 0.1f, 0.3f, 0.7f, 1.0f, 1.0f, 1.3f, 3.0f, 100.0f, 1e6f});
    s.top_k = pick<int32_t>({0, 0, -1, 1, 2, 3, 20, 50, 1000, v - 1, v, v + 3,
                             static_cast<int32_t>(rng_() % static_cast<uint64_t>(v + 1))});
    s.top_p = pick<float>({1.0f, 1.0f, 0.95f, 0.9f, 0.5f, 0.1f, 1e-6f, 0.99999994f,
                           std::uniform_real_distribution<float>(0.01f, 1.0f)(rng_)});
    s.min_p = pick<float>({0.0f, 0.0f, 0.0f, 0.05f, 0.5f, 1.0f, 1e-30f, std::uniform_real_distribution<float>(0.0f, 1.0f)(rng_)});
    s.seed = rng_();
    s.step = rng_() % 100000;
    return s;
  }

  Batch batch(int64_t vocab, int64_t rows) {
    Batch b;
    b.vocab = vocab;
    for (int64_t r = 0; r < rows; ++r) {
      const std::vector<float> row = logits(vocab);
      b.logits.insert(b.logits.end(), row.begin(), row.end());
      b.rows.push_back(settings(vocab));
    }
    return b;
  }

  std::mt19937_64& engine() { return rng_; }

 private:
  template <typename T>
  T pick(std::initializer_list<T> values) {
    return *(values.begin() + static_cast<std::ptrdiff_t>(rng_() % values.size()));
  }
  std::mt19937_64 rng_;
};

std::string describe(const RowSettings& s) {
  return "T " + std::to_string(s.temperature) + " top_k " + std::to_string(s.top_k) + " top_p " +
         std::to_string(s.top_p) + " min_p " + std::to_string(s.min_p) + " seed " + std::to_string(s.seed) +
         " step " + std::to_string(s.step);
}

// ----------------------------------------------------------------------------------------------
// CPU: the twin against the engine (no GPU needed; both draw from core/random.h).

TEST(CudaSamplingCpu, TwinPicksTheEnginesTokens) {
  RowFactory factory(7002);
  int checked = 0;
  for (const int64_t vocab : {1, 2, 3, 5, 17, 100, 1000, 1025, 4097, 20000}) {
    const int64_t rows = vocab >= 4097 ? 150 : 400;
    Batch batch = factory.batch(vocab, rows);
    const Sampled twin = run_cpu(batch);
    for (int64_t r = 0; r < rows; ++r) {
      const SampledToken engine = run_engine(batch.row(r), batch.rows[static_cast<size_t>(r)]);
      ASSERT_EQ(twin.tokens[static_cast<size_t>(r)], engine.token)
          << "V " << vocab << " row " << r << " " << describe(batch.rows[static_cast<size_t>(r)]);
      ASSERT_NEAR(twin.logprobs[static_cast<size_t>(r)], engine.logprob, 1e-5);
      ++checked;
    }
  }
  EXPECT_GE(checked, 3000);
}

// ----------------------------------------------------------------------------------------------
// GPU against the twin.

void expect_same(const Sampled& gpu, const Sampled& cpu, const Batch& batch) {
  ASSERT_EQ(gpu.tokens.size(), cpu.tokens.size());
  int mismatches = 0;
  for (size_t r = 0; r < gpu.tokens.size(); ++r) {
    if (gpu.tokens[r] != cpu.tokens[r] && ++mismatches <= 10) {
      ADD_FAILURE() << "V " << batch.vocab << " row " << r << ": GPU token " << gpu.tokens[r] << ", CPU "
                    << cpu.tokens[r] << " (" << describe(batch.rows[r]) << ")";
    }
    EXPECT_NEAR(gpu.logprobs[r], cpu.logprobs[r], 1e-5) << "row " << r;
  }
  EXPECT_EQ(mismatches, 0);
}

TEST(CudaSampling, GpuPicksTheTwinsTokens) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  RowFactory factory(7101);
  int checked = 0;
  for (const int64_t vocab : {1, 2, 7, 100, 1000, 4097, 32000, 151936}) {
    const int64_t rows = vocab >= 32000 ? 96 : 500;  // 6 x 500 + 2 x 2 x 96 = 3384 rows
    for (int repeat = 0; repeat < (vocab >= 32000 ? 2 : 1); ++repeat) {
      Batch batch = factory.batch(vocab, rows);
      const DeviceBatch device(batch);
      device.run();
      const Sampled gpu = device.read();
      const Sampled cpu = run_cpu(batch);
      expect_same(gpu, cpu, batch);
      checked += static_cast<int>(rows);
    }
  }
  EXPECT_GE(checked, 3000);
}

TEST(CudaSampling, StridedLogitsAndRepeatedRunsAreDeterministic) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  RowFactory factory(7102);
  const int64_t vocab = 5000, rows = 64;
  Batch batch = factory.batch(vocab, rows);
  // Logits as the first V columns of rows padded to V + 13.
  std::vector<float> wide(static_cast<size_t>(rows * (vocab + 13)), -1.0f);
  for (int64_t r = 0; r < rows; ++r) {
    std::copy_n(batch.logits.begin() + r * vocab, vocab, wide.begin() + r * (vocab + 13));
  }
  const OwnedTensor wide_device = to_device(Tensor(wide.data(), DType::kF32, {rows, vocab + 13}));
  DeviceBatch device(batch);
  const Sampled cpu = run_cpu(batch);
  for (int run = 0; run < 3; ++run) {
    kernels::sample_tokens(wide_device->slice(1, 0, vocab), device.params(), *device.tokens, *device.logprobs);
    expect_same(device.read(), cpu, batch);
  }
}

TEST(CudaSampling, BadRowsGiveMinusOneAndLeaveOthersAlone) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Batch batch;
  batch.vocab = 4;
  batch.logits = {0.0f, std::nanf(""), 1.0f, 2.0f,  // NaN
                  0.0f, kInf, 1.0f, 2.0f,           // +inf
                  -kInf, -kInf, -kInf, -kInf,       // every token masked
                  0.0f, 3.0f, 1.0f, -kInf};         // fine
  for (int i = 0; i < 4; ++i) batch.rows.push_back(RowSettings{0.8f, 0, 0.9f, 0.0f, 17, static_cast<uint64_t>(i)});
  const DeviceBatch device(batch);
  device.run();
  const Sampled gpu = device.read();
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(gpu.tokens[static_cast<size_t>(r)], -1) << r;
    EXPECT_TRUE(std::isnan(gpu.logprobs[static_cast<size_t>(r)])) << r;
  }
  Batch good;
  good.vocab = 4;
  good.logits.assign(batch.logits.begin() + 12, batch.logits.end());
  good.rows = {batch.rows[3]};
  const Sampled cpu = run_cpu(good);
  EXPECT_EQ(gpu.tokens[3], cpu.tokens[0]);
  EXPECT_NEAR(gpu.logprobs[3], cpu.logprobs[0], 1e-6);
}

TEST(CudaSampling, ReplaysInsideCudaGraph) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  RowFactory factory(7103);
  Batch batch = factory.batch(32000, 16);
  for (auto& s : batch.rows) s.temperature = std::max(s.temperature, 0.5f);  // every row samples
  DeviceBatch device(batch);
  const auto stream = static_cast<cudaStream_t>(current_stream(Device::cuda()));
  CudaGraph graph;
  graph.begin_capture(stream);
  device.run();
  graph.end_capture(stream);
  // Replay with new steps written into the captured parameter array: the graph reads them at run time.
  for (uint64_t round = 0; round < 3; ++round) {
    for (auto& s : batch.rows) s.step = round * 1000 + s.step % 1000;
    HostParams params(batch.rows);
    copy_tensor(*device.step, Tensor(params.step.data(), DType::kI64, {batch.num_rows()}));
    graph.launch(stream);
    expect_same(device.read(), run_cpu(batch), batch);
  }
}

// Time per call for Qwen3's vocabulary (151936) at typical settings (T 0.7, top-k 20, top-p 0.95),
// temperature-only, and greedy. Run with --gtest_also_run_disabled_tests --gtest_filter='*SamplingBench*'.
TEST(CudaSamplingBench, DISABLED_Qwen3Vocabulary) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  RowFactory factory(7201);
  const auto stream = static_cast<cudaStream_t>(current_stream(Device::cuda()));
  struct Setting {
    const char* name;
    RowSettings settings;
  };
  const Setting settings[] = {{"greedy", {0.0f, 0, 1.0f, 0.0f}},
                              {"T=1", {1.0f, 0, 1.0f, 0.0f}},
                              {"T=0.7 k=20 p=0.95", {0.7f, 20, 0.95f, 0.0f}},
                              {"T=0.7 p=0.95", {0.7f, 0, 0.95f, 0.0f}},
                              {"T=1 min_p=0.05", {1.0f, 0, 1.0f, 0.05f}}};
  std::printf("%-20s %5s %10s\n", "setting", "rows", "us");
  for (const Setting& setting : settings) {
    for (const int64_t rows : {1, 16, 128, 256}) {
      Batch batch;
      batch.vocab = 151936;
      std::normal_distribution<float> normal(-2.0f, 2.5f);
      batch.logits.resize(static_cast<size_t>(rows * batch.vocab));
      for (auto& x : batch.logits) x = round_to_bf16(normal(factory.engine()));
      for (int64_t r = 0; r < rows; ++r) {
        RowSettings s = setting.settings;
        s.seed = static_cast<uint64_t>(r) * 7919;
        s.step = static_cast<uint64_t>(r);
        batch.rows.push_back(s);
        batch.logits[static_cast<size_t>(r * batch.vocab + r * 31 % batch.vocab)] = 14.0f;
      }
      const DeviceBatch device(batch);
      device.run();
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      const int iterations = 20;
      const auto start = std::chrono::steady_clock::now();
      for (int i = 0; i < iterations; ++i) device.run();
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      const double us =
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count() / iterations;
      std::printf("%-20s %5lld %10.1f\n", setting.name, static_cast<long long>(rows), us);
    }
  }
}

}  // namespace
}  // namespace metrale
