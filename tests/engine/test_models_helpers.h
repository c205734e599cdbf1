// Tiny random checkpoints written in the Hugging Face layout, for engine tests that need a model
// but not reference numbers (those come from tests/goldens).
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>

#include "model/model.h"

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

// A CPU model with one paged-KV layer and one recurrent layer whose outputs are exact integers, for
// testing the engine's handling of recurrent state (slots, preemption, prefix checkpoints) before
// and besides real hybrid architectures.
// - Recurrent "mixer": per sequence a running state (a, b) over its tokens, kept in two state
//   tensors (one fp32, one in the activation dtype) together with the number of tokens it covers;
//   a sequence with cached tokens reads its slot, and the model throws kInternal when the slot
//   does not hold the state after exactly those tokens (a wrong restore cannot go unnoticed).
// - Attention "mixer": each row writes (token, position) into its KV slot and reads back every
//   cached key of its sequence through the block table, checking each key's position.
// - Logits: a peak at a vocabulary id that depends on the state and on the cached keys.
struct FakeHybridOptions {
  int64_t vocab_size = 61;
  int64_t max_position_embeddings = 512;
  bool recurrent = true;  // false: the attention layer only (a model without recurrent state)
  int64_t state_width = 3;  // elements of the second state tensor (>= 3); raises the bytes per slot
};
std::unique_ptr<Model> make_fake_hybrid_model(const FakeHybridOptions& options = {});

}  // namespace metrale::testing
