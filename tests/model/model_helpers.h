// Tiny random Qwen3 / Qwen3-MoE / Qwen hybrid (qwen3_next, qwen3_5, qwen3_5_moe) checkpoints in the
// Hugging Face layout, a double-precision reference forward of the same architecture written from
// the spec (shared/arch/qwen.md §3, §5, §6), and a runner that feeds a Model hand-built
// ForwardBatches (no engine floor involved). The model tests link floors 1-4 only, so the runner owns
// a minimal paged KV cache and recurrent-state slots of its own (the CacheManager of floor 5 is tested
// in tests/cache); it hands out blocks and slots in shuffled order so that every sequence's blocks are
// scattered and out of order. The hybrid parts live in hybrid_helpers.cpp.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "model/model.h"
#include "runtime/arena.h"

namespace metrale::testing {

struct TinySpec {
  std::string model_type = "qwen3";  // or "qwen3_moe", "qwen3_next", "qwen3_5", "qwen3_5_moe"
  int64_t vocab_size = 61;
  int64_t hidden_size = 32;
  int64_t num_layers = 2;
  int64_t num_heads = 4;
  int64_t num_kv_heads = 2;
  int64_t head_dim = 12;  // deliberately not hidden_size / num_heads
  int64_t intermediate_size = 40;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  bool tie_word_embeddings = true;
  // qwen3 sliding window: layers >= max_window_layers see the last `sliding_window` keys (0: off).
  int sliding_window = 0;
  int64_t max_window_layers = 0;
  // qwen3_moe
  int64_t num_experts = 4;
  int64_t top_k = 2;
  int64_t moe_intermediate_size = 24;
  bool norm_topk_prob = true;
  std::vector<int64_t> mlp_only_layers;
  // Hybrid models: layer pattern (layer_types when given, else every full_attention_interval-th layer
  // is full attention), the Gated DeltaNet sizes, the shared expert and the rotary fraction.
  std::vector<std::string> layer_types;
  int64_t full_attention_interval = 2;
  int64_t linear_num_key_heads = 2;
  int64_t linear_num_value_heads = 4;
  int64_t linear_key_head_dim = 8;
  int64_t linear_value_head_dim = 6;
  int64_t linear_conv_kernel_dim = 4;
  int64_t shared_expert_intermediate_size = 20;
  double partial_rotary_factor = 0.0;  // 0: not written (the model's default 0.25 applies)
  // qwen3_5*: write the composite config {model_type: qwen3_5, text_config: {model_type: qwen3_5_text}}.
  bool composite_config = false;

  bool is_hybrid() const {
    return model_type == "qwen3_next" || model_type == "qwen3_5" || model_type == "qwen3_5_moe";
  }
  bool is_moe_model() const {
    return model_type == "qwen3_moe" || model_type == "qwen3_next" || model_type == "qwen3_5_moe";
  }
  bool layer_is_moe(int64_t layer) const;
  bool layer_is_linear(int64_t layer) const;  // a Gated DeltaNet layer of a hybrid model
  int64_t rotary_dim() const;
  int layer_window(int64_t layer) const;
};

// One parameter: its shape and values, all exactly representable in bf16.
struct HostWeight {
  std::vector<int64_t> shape;
  std::vector<float> values;
};
// Keys relative to the text model's prefix ("layers.0.self_attn.q_proj.weight"), plus the root key
// "lm_head.weight" when the head is untied. MoE experts are per expert here; the fused layout is
// produced when writing.
using TinyWeights = std::map<std::string, HostWeight>;

TinyWeights make_tiny_weights(const TinySpec& spec, uint64_t seed);
// Hybrid models (hybrid_helpers.cpp). Weights are kept in Qwen3.5's split GDN layout
// (linear_attn.in_proj_{qkv,z,b,a}.weight); qwen3_next checkpoints are written grouped by key head.
TinyWeights make_hybrid_weights(const TinySpec& spec, uint64_t seed);
nlohmann::json hybrid_config_json(const TinySpec& spec);
// A tensor to write: its full name, shape and values (converted to the storage dtype when written).
struct NamedValues {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> values;
};
// Replaces the split GDN projections of `tensors` (full names under `prefix`) by qwen3_next's
// in_proj_qkvz / in_proj_ba.
void group_gdn_projections(const TinySpec& spec, const std::string& prefix, std::vector<NamedValues>& tensors);
std::vector<std::vector<double>> hybrid_reference_logits(const TinySpec& spec, const TinyWeights& weights,
                                                         const std::vector<int32_t>& tokens);

enum class ExpertLayout { kPerExpert, kFused };

struct CheckpointLayout {
  std::string prefix = "model.";
  ExpertLayout experts = ExpertLayout::kPerExpert;
  int shards = 1;                // > 1: model-0000i-of-0000n.safetensors plus model.safetensors.index.json
  DType storage = DType::kBF16;  // kBF16 or kF32 (both hold the values exactly)
};

nlohmann::json tiny_config_json(const TinySpec& spec);
// Writes config.json and the checkpoint into `dir` (which must exist).
void write_tiny_checkpoint(const std::filesystem::path& dir, const TinySpec& spec, const TinyWeights& weights,
                           const CheckpointLayout& layout = {});

// Reference logits [T][V] of one sequence whose tokens sit at positions 0..T-1.
std::vector<std::vector<double>> reference_logits(const TinySpec& spec, const TinyWeights& weights,
                                                  const std::vector<int32_t>& tokens);

// Drives Model::forward with hand-built ragged batches over a paged KV cache, tracking how many
// tokens each sequence has in the cache.
class ForwardRunner {
 public:
  explicit ForwardRunner(Model& model, int32_t block_size = 4, int32_t num_blocks = 64, uint64_t seed = 5,
                         int32_t num_state_slots = 8);

  struct Chunk {
    int64_t seq_id;
    std::vector<int32_t> tokens;  // this step's new tokens of the sequence
  };
  // Runs one step over the chunks (in batch order) and returns the logits of every row, [T][V], or
  // with `last_rows_only` of each chunk's last row, [S][V] (what a generating engine asks for).
  std::vector<std::vector<float>> step(const std::vector<Chunk>& chunks, bool last_rows_only = false);
  const std::vector<int32_t>& block_table(int64_t seq_id) { return tables_[seq_id]; }
  // A new sequence `to` with a copy of everything `from` has cached: its KV blocks (copied into blocks
  // of its own) and its recurrent state slot. `to` then continues exactly as `from` would.
  void fork(int64_t from, int64_t to);

 private:
  int32_t state_slot(int64_t seq_id);  // assigned on first use

  Model& model_;
  int32_t block_size_;
  std::vector<OwnedTensor> storage_;  // K and V of every paged layer, the states of every recurrent layer
  std::vector<LayerCache> layers_;    // one per layer
  std::vector<int32_t> free_blocks_;  // shuffled; taken from the back
  std::vector<int32_t> free_slots_;   // shuffled; taken from the back
  std::map<int64_t, std::vector<int32_t>> tables_;
  std::map<int64_t, int32_t> slots_;
  std::map<int64_t, int64_t> cached_;  // tokens each sequence has in the cache
  Arena arena_;
};

// Relative L2 distance of two logit matrices.
double relative_l2(const std::vector<std::vector<float>>& actual, const std::vector<std::vector<double>>& expected);

}  // namespace metrale::testing
