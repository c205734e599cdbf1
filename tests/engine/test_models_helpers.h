// Tiny random checkpoints written in the Hugging Face layout, for engine tests that need a model
// but not reference numbers (those come from tests/goldens).
#pragma once

#include <cstdint>
#include <filesystem>

namespace metrale::testing {

struct TinyQwen3Options {
  int64_t vocab_size = 96;
  int64_t hidden_size = 32;
  int64_t num_layers = 2;
  int64_t num_heads = 4;
  int64_t num_kv_heads = 2;
  int64_t head_dim = 8;
  int64_t intermediate_size = 48;
  int64_t num_experts = 0;  // > 0: qwen3_moe with this many experts
  int64_t top_k = 2;
  int64_t eos_token_id = 1;
  uint64_t seed = 7;
};

// Writes config.json, generation_config.json and model.safetensors into a fresh directory under
// the system temp dir and returns it.
std::filesystem::path write_tiny_qwen3(const TinyQwen3Options& options, const std::string& name);

}  // namespace metrale::testing
