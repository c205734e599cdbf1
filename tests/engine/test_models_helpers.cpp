#include "engine/test_models_helpers.h"

#include <unistd.h>

#include <fstream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/dtype.h"
#include "model/safetensors.h"

namespace metrale::testing {

std::filesystem::path write_tiny_qwen3(const TinyQwen3Options& o, const std::string& name) {
  const auto dir = std::filesystem::temp_directory_path() / ("metrale_test_" + name + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  std::mt19937_64 rng(o.seed);
  std::vector<std::vector<uint16_t>> storage;
  std::vector<std::pair<std::string, Tensor>> tensors;
  // Weights large enough that the logits are far from uniform (clear argmax margins).
  auto add = [&](const std::string& key, Shape shape, float mean, float stddev) {
    std::normal_distribution<float> dist(mean, stddev);
    storage.emplace_back(static_cast<size_t>(shape.numel()));
    for (auto& value : storage.back()) value = f32_to_bf16_bits(dist(rng));
    tensors.emplace_back(key, Tensor(storage.back().data(), DType::kBF16, shape));
  };
  const int64_t h = o.hidden_size, d = o.head_dim;
  add("model.embed_tokens.weight", {o.vocab_size, h}, 0.0f, 1.0f);
  for (int64_t i = 0; i < o.num_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    add(p + "input_layernorm.weight", {h}, 1.0f, 0.1f);
    add(p + "post_attention_layernorm.weight", {h}, 1.0f, 0.1f);
    add(p + "self_attn.q_proj.weight", {o.num_heads * d, h}, 0.0f, 0.2f);
    add(p + "self_attn.k_proj.weight", {o.num_kv_heads * d, h}, 0.0f, 0.2f);
    add(p + "self_attn.v_proj.weight", {o.num_kv_heads * d, h}, 0.0f, 0.2f);
    add(p + "self_attn.o_proj.weight", {h, o.num_heads * d}, 0.0f, 0.2f);
    add(p + "self_attn.q_norm.weight", {d}, 1.0f, 0.1f);
    add(p + "self_attn.k_norm.weight", {d}, 1.0f, 0.1f);
    if (o.num_experts > 0) {
      add(p + "mlp.gate.weight", {o.num_experts, h}, 0.0f, 0.3f);
      for (int64_t e = 0; e < o.num_experts; ++e) {
        const std::string ep = p + "mlp.experts." + std::to_string(e) + ".";
        add(ep + "gate_proj.weight", {o.intermediate_size, h}, 0.0f, 0.2f);
        add(ep + "up_proj.weight", {o.intermediate_size, h}, 0.0f, 0.2f);
        add(ep + "down_proj.weight", {h, o.intermediate_size}, 0.0f, 0.2f);
      }
    } else {
      add(p + "mlp.gate_proj.weight", {o.intermediate_size, h}, 0.0f, 0.2f);
      add(p + "mlp.up_proj.weight", {o.intermediate_size, h}, 0.0f, 0.2f);
      add(p + "mlp.down_proj.weight", {h, o.intermediate_size}, 0.0f, 0.2f);
    }
  }
  add("model.norm.weight", {h}, 1.0f, 0.1f);
  write_safetensors(dir / "model.safetensors", tensors);

  nlohmann::json config = {{"model_type", o.num_experts > 0 ? "qwen3_moe" : "qwen3"},
                           {"vocab_size", o.vocab_size},
                           {"hidden_size", h},
                           {"num_hidden_layers", o.num_layers},
                           {"num_attention_heads", o.num_heads},
                           {"num_key_value_heads", o.num_kv_heads},
                           {"head_dim", d},
                           {"intermediate_size", o.intermediate_size},
                           {"rms_norm_eps", 1e-6},
                           {"rope_theta", 10000.0},
                           {"max_position_embeddings", 512},
                           {"tie_word_embeddings", true},
                           {"eos_token_id", o.eos_token_id}};
  if (o.num_experts > 0) {
    config["num_experts"] = o.num_experts;
    config["num_experts_per_tok"] = o.top_k;
    config["moe_intermediate_size"] = o.intermediate_size;
    config["norm_topk_prob"] = true;
  }
  std::ofstream(dir / "config.json") << config.dump(2);
  return dir;
}

}  // namespace metrale::testing
