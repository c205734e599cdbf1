// Tiny random Qwen3 / Qwen3-MoE / Qwen hybrid (qwen3_next, qwen3_5, qwen3_5_moe) checkpoints in the
// Hugging Face layout, shared by the tests of every floor from the model up: a spec of the sizes, its
// bf16-exact random weights, config.json, the safetensors files in several layouts (prefixes, fused
// experts, shards, storage dtype), and the model loaded from them. (The double-precision reference
// forwards of these models live in tests/model/model_helpers.h.)
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "core/test_support.h"
#include "model/config.h"
#include "model/model.h"

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

// Draws the parameters of make_tiny_weights and make_hybrid_weights: uniform values in [lo, hi)
// rounded to bf16, never zero, from one generator in call order, so that a spec and a seed always
// give the same weights.
class TinyWeightMaker {
 public:
  explicit TinyWeightMaker(uint64_t seed) : rng_(seed) {}
  void add(const std::string& key, std::vector<int64_t> shape, float lo, float hi);
  // The dense SwiGLU MLP of the layer with key prefix `p` (p + "mlp.gate_proj.weight", ...).
  void add_dense_mlp(const TinySpec& spec, const std::string& p);
  // The router and the per-expert SwiGLU weights of an MoE layer (p + "mlp.gate.weight",
  // p + "mlp.experts.<e>.gate_proj.weight", ...).
  void add_routed_experts(const TinySpec& spec, const std::string& p);
  TinyWeights take() { return std::move(weights_); }

 private:
  std::mt19937_64 rng_;
  TinyWeights weights_;
};

TinyWeights make_tiny_weights(const TinySpec& spec, uint64_t seed);
// Hybrid models (tiny_hybrid_checkpoint_helpers.cpp). Weights are kept in Qwen3.5's split GDN layout
// (linear_attn.in_proj_{qkv,z,b,a}.weight); qwen3_next checkpoints are written grouped by key head.
TinyWeights make_hybrid_weights(const TinySpec& spec, uint64_t seed);
nlohmann::json hybrid_config_json(const TinySpec& spec);
// The keys that the config.json (or text_config) of every tiny model holds, qwen3 and hybrid alike.
nlohmann::json common_config_json(const TinySpec& spec);
// A tensor to write: its full name, shape and values (converted to the storage dtype when written).
struct NamedValues {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> values;
};
// Replaces the split GDN projections of `tensors` (full names under `prefix`) by qwen3_next's
// in_proj_qkvz / in_proj_ba.
void group_gdn_projections(const TinySpec& spec, const std::string& prefix, std::vector<NamedValues>& tensors);

enum class ExpertLayout { kPerExpert, kFused };

struct CheckpointLayout {
  std::string prefix = "model.";
  ExpertLayout experts = ExpertLayout::kPerExpert;
  int shards = 1;                // > 1: model-0000i-of-0000n.safetensors plus model.safetensors.index.json
  DType storage = DType::kBF16;  // kBF16 or kF32 (both hold the values exactly)
};

nlohmann::json tiny_config_json(const TinySpec& spec);
// The parsed config of the spec (for make_random_model, no files).
ModelConfig tiny_model_config(const TinySpec& spec);
// Writes config.json and the checkpoint into `dir` (which must exist).
void write_tiny_checkpoint(const std::filesystem::path& dir, const TinySpec& spec, const TinyWeights& weights,
                           const CheckpointLayout& layout = {});

// A checkpoint written into a temporary directory and the model loaded from it (on the CPU); the
// directory lives as long as the model.
struct LoadedTinyModel {
  TempDir dir;
  std::unique_ptr<Model> model;
};
std::unique_ptr<LoadedTinyModel> load_tiny(const TinySpec& spec, const TinyWeights& weights,
                                           const CheckpointLayout& layout = {});

// `count` token ids drawn uniformly from the whole vocabulary.
std::vector<int32_t> random_tokens(const TinySpec& spec, size_t count, uint64_t seed);

}  // namespace metrale::testing
