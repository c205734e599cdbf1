// The golden cases under tests/goldens (made by tools/goldens/make_goldens.py with transformers
// 5.17.0) and the checks both the CPU and the GPU golden tests run on them.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/npy.h"
#include "core/strings.h"
#include "engine/engine.h"
#include "model/registry.h"

namespace metrale::testing {

inline const std::filesystem::path& golden_dir() {
  static const std::filesystem::path dir = std::filesystem::path(METRALE_TEST_DATA_DIR) / "goldens";
  return dir;
}

inline std::vector<std::string> golden_cases() {
  std::vector<std::string> names;
  if (std::filesystem::is_directory(golden_dir())) {
    for (const auto& entry : std::filesystem::directory_iterator(golden_dir()))
      if (std::filesystem::exists(entry.path() / "case.json")) names.push_back(entry.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

inline std::vector<int32_t> read_ids(const nlohmann::json& value) {
  std::vector<int32_t> ids;
  for (const auto& id : value) ids.push_back(id.get<int32_t>());
  return ids;
}

struct GoldenCase {
  std::filesystem::path dir;
  nlohmann::json info;
  std::vector<int32_t> input_ids;
  NpyArray logits;

  explicit GoldenCase(const std::string& name) : dir(golden_dir() / name) {
    info = nlohmann::json::parse(read_file(dir / "case.json"));
    input_ids = read_ids(nlohmann::json::parse(read_file(dir / "input_ids.json")));
    logits = read_npy_f32(dir / "logits.npy");
  }

  // `load`: e.g. LoadOptions::compute_dtype for the GPU's f32 runs.
  std::unique_ptr<Engine> make_engine(Device device, int32_t max_prefill_chunk, const LoadOptions& load = {}) const {
    EngineConfig config;
    config.scheduler.max_prefill_chunk = max_prefill_chunk;
    config.scheduler.max_num_seqs = 4;
    config.scheduler.max_num_batched_tokens = 512;
    config.max_model_len = 512;
    config.gpu_memory_utilization = 0.5;
    config.graph_batch_sizes = {1, 2, 4};
    return std::make_unique<Engine>(load_model(dir / "model", device, load), config);
  }
};

// Relative L2 error of the logits of every position against transformers' full forward.
inline double score_relative_l2(const GoldenCase& golden, Device device, int32_t chunk, const LoadOptions& load = {}) {
  auto engine = golden.make_engine(device, chunk, load);
  Request request;
  request.prompt = golden.input_ids;
  request.max_tokens = 0;
  request.return_prompt_logits = true;
  const int64_t id = engine->add_request(request);
  while (engine->has_unfinished()) engine->step();
  const auto& logits = engine->sequence(id).prompt_logits;
  EXPECT_EQ(logits.size(), golden.logits.data.size());
  if (logits.size() != golden.logits.data.size()) return 1.0;
  const size_t vocab = static_cast<size_t>(golden.logits.shape.at(1));
  double diff = 0, norm = 0, worst = 0;
  size_t worst_row = 0;
  for (size_t row = 0; row * vocab < logits.size(); ++row) {
    double row_diff = 0, row_norm = 0;
    for (size_t i = row * vocab; i < (row + 1) * vocab; ++i) {
      const double a = logits[i], b = golden.logits.data[i];
      row_diff += (a - b) * (a - b);
      row_norm += b * b;
    }
    diff += row_diff;
    norm += row_norm;
    if (std::sqrt(row_diff / row_norm) > worst) {
      worst = std::sqrt(row_diff / row_norm);
      worst_row = row;
    }
  }
  const double relative = std::sqrt(diff / norm);
  if (relative > 1e-3) {
    std::printf("[golden] %s on %s chunk %d: rel L2 %.3e, worst row %zu at %.3e\n", golden.dir.filename().c_str(),
                device.to_string().c_str(), chunk, relative, worst_row, worst);
  }
  return relative;
}

// Greedy generation against transformers' cached generation. A mismatch is accepted only at a
// near-tie (top-2 margin under `near_tie` on either side), after which the sequences diverge.
inline void expect_greedy_matches(const GoldenCase& golden, Device device, float near_tie,
                                  const LoadOptions& load = {}) {
  const auto& greedy = golden.info.at("greedy");
  const std::vector<int32_t> prompt = read_ids(greedy.at("prompt_ids"));
  const std::vector<int32_t> expected = read_ids(greedy.at("output_ids"));
  std::vector<float> reference_margins;
  for (const char* key : {"greedy_margins"}) {
    const nlohmann::json* source = greedy.contains(key) ? &greedy[key] : golden.info.contains(key) ? &golden.info[key] : nullptr;
    if (source != nullptr)
      for (const auto& m : *source) reference_margins.push_back(m.get<float>());
  }
  auto engine = golden.make_engine(device, 0, load);
  Request request;
  request.prompt = prompt;
  request.max_tokens = static_cast<int32_t>(expected.size());
  request.ignore_eos = true;
  request.sampling.temperature = 0.0f;
  request.sampling.top_logprobs = 2;
  const int64_t id = engine->add_request(request);
  std::vector<TokenEvent> events;
  while (engine->has_unfinished())
    for (auto& event : engine->step()) events.push_back(std::move(event));
  ASSERT_EQ(events.size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    if (events[i].sampled.token == expected[i]) continue;
    const auto& top = events[i].sampled.top_logprobs;
    const float our_margin = top.size() >= 2 ? top[0].second - top[1].second : 1.0f;
    const float their_margin = i < reference_margins.size() ? reference_margins[i] : 1.0f;
    EXPECT_TRUE(our_margin < near_tie || their_margin < near_tie)
        << "step " << i << ": metrale chose " << events[i].sampled.token << ", transformers " << expected[i]
        << " (top-2 margins " << our_margin << " / " << their_margin << ")";
    break;
  }
  EXPECT_EQ(engine->sequence(id).finish_reason, FinishReason::kLength);
}

}  // namespace metrale::testing
