#include "common/tiny_checkpoint.h"

#include <algorithm>
#include <fstream>
#include <numeric>

#include "core/dtype.h"
#include "core/error.h"
#include "model/registry.h"
#include "model/safetensors.h"

namespace metrale::testing {

bool TinySpec::layer_is_moe(int64_t layer) const {
  if (model_type == "qwen3_5_moe") return true;  // every layer, mlp_only_layers does not exist there
  return is_moe_model() && num_experts > 0 &&
         std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) == mlp_only_layers.end();
}

bool TinySpec::layer_is_linear(int64_t layer) const {
  if (!is_hybrid()) return false;
  if (!layer_types.empty()) {
    const std::string& type = layer_types[static_cast<size_t>(layer)];
    return type == "linear_attention" || type == "mamba" || type == "conv";  // with transformers' legacy names
  }
  return (layer + 1) % full_attention_interval != 0;
}

int64_t TinySpec::rotary_dim() const {
  if (!is_hybrid()) return head_dim;
  const double factor = partial_rotary_factor > 0 ? partial_rotary_factor : 0.25;
  return static_cast<int64_t>(static_cast<double>(head_dim) * factor);
}

int TinySpec::layer_window(int64_t layer) const {
  return sliding_window > 0 && layer >= max_window_layers ? sliding_window : 0;
}

// ---------------------------------------------------------------------------------------------
// Weights

void TinyWeightMaker::add(const std::string& key, std::vector<int64_t> shape, float lo, float hi) {
  std::uniform_real_distribution<float> dist(lo, hi);
  HostWeight w{std::move(shape), {}};
  const int64_t count = std::accumulate(w.shape.begin(), w.shape.end(), int64_t{1}, std::multiplies<>());
  w.values.resize(static_cast<size_t>(count));
  for (auto& v : w.values) {
    do v = round_to_bf16(dist(rng_));
    while (v == 0.0f);
  }
  weights_[key] = std::move(w);
}

void TinyWeightMaker::add_dense_mlp(const TinySpec& spec, const std::string& p) {
  const int64_t h = spec.hidden_size, inter = spec.intermediate_size;
  add(p + "mlp.gate_proj.weight", {inter, h}, -0.3f, 0.3f);
  add(p + "mlp.up_proj.weight", {inter, h}, -0.3f, 0.3f);
  add(p + "mlp.down_proj.weight", {h, inter}, -0.25f, 0.25f);
}

void TinyWeightMaker::add_routed_experts(const TinySpec& spec, const std::string& p) {
  const int64_t h = spec.hidden_size, inter = spec.moe_intermediate_size;
  add(p + "mlp.gate.weight", {spec.num_experts, h}, -0.5f, 0.5f);
  for (int64_t e = 0; e < spec.num_experts; ++e) {
    const std::string ep = p + "mlp.experts." + std::to_string(e) + ".";
    add(ep + "gate_proj.weight", {inter, h}, -0.3f, 0.3f);
    add(ep + "up_proj.weight", {inter, h}, -0.3f, 0.3f);
    add(ep + "down_proj.weight", {h, inter}, -0.3f, 0.3f);
  }
}

TinyWeights make_tiny_weights(const TinySpec& spec, uint64_t seed) {
  if (spec.is_hybrid()) return make_hybrid_weights(spec, seed);
  // Scales keep activations of order one.
  TinyWeightMaker maker(seed);
  const int64_t h = spec.hidden_size, d = spec.head_dim;
  maker.add("embed_tokens.weight", {spec.vocab_size, h}, -1.0f, 1.0f);
  for (int64_t i = 0; i < spec.num_layers; ++i) {
    const std::string p = "layers." + std::to_string(i) + ".";
    maker.add(p + "input_layernorm.weight", {h}, 0.7f, 1.3f);
    maker.add(p + "post_attention_layernorm.weight", {h}, 0.7f, 1.3f);
    maker.add(p + "self_attn.q_proj.weight", {spec.num_heads * d, h}, -0.3f, 0.3f);
    maker.add(p + "self_attn.k_proj.weight", {spec.num_kv_heads * d, h}, -0.3f, 0.3f);
    maker.add(p + "self_attn.v_proj.weight", {spec.num_kv_heads * d, h}, -0.3f, 0.3f);
    maker.add(p + "self_attn.o_proj.weight", {h, spec.num_heads * d}, -0.25f, 0.25f);
    maker.add(p + "self_attn.q_norm.weight", {d}, 0.7f, 1.3f);
    maker.add(p + "self_attn.k_norm.weight", {d}, 0.7f, 1.3f);
    if (spec.layer_is_moe(i)) {
      maker.add_routed_experts(spec, p);
    } else {
      maker.add_dense_mlp(spec, p);
    }
  }
  maker.add("norm.weight", {h}, 0.7f, 1.3f);
  if (!spec.tie_word_embeddings) maker.add("lm_head.weight", {spec.vocab_size, h}, -0.3f, 0.3f);
  return maker.take();
}

nlohmann::json common_config_json(const TinySpec& spec) {
  return {{"vocab_size", spec.vocab_size},
          {"hidden_size", spec.hidden_size},
          {"num_hidden_layers", spec.num_layers},
          {"num_attention_heads", spec.num_heads},
          {"num_key_value_heads", spec.num_kv_heads},
          {"head_dim", spec.head_dim},
          {"rms_norm_eps", spec.rms_norm_eps},
          {"hidden_act", "silu"},
          {"dtype", "bfloat16"},
          {"bos_token_id", 1},
          {"eos_token_id", 2}};
}

nlohmann::json tiny_config_json(const TinySpec& spec) {
  if (spec.is_hybrid()) return hybrid_config_json(spec);
  nlohmann::json config = common_config_json(spec);
  config["model_type"] = spec.model_type;
  config["architectures"] = nlohmann::json::array({spec.is_moe_model() ? "Qwen3MoeForCausalLM" : "Qwen3ForCausalLM"});
  config["intermediate_size"] = spec.intermediate_size;
  config["rope_theta"] = spec.rope_theta;
  config["max_position_embeddings"] = 256;
  config["tie_word_embeddings"] = spec.tie_word_embeddings;
  if (spec.sliding_window > 0) {
    config["use_sliding_window"] = true;
    config["sliding_window"] = spec.sliding_window;
    config["max_window_layers"] = spec.max_window_layers;
  }
  if (spec.is_moe_model()) {
    config["num_experts"] = spec.num_experts;
    config["num_experts_per_tok"] = spec.top_k;
    config["moe_intermediate_size"] = spec.moe_intermediate_size;
    config["norm_topk_prob"] = spec.norm_topk_prob;
    config["decoder_sparse_step"] = 1;
    config["mlp_only_layers"] = spec.mlp_only_layers;
  }
  return config;
}

namespace {

std::vector<NamedValues> checkpoint_tensors(const TinySpec& spec, const TinyWeights& weights,
                                            const CheckpointLayout& layout) {
  std::vector<NamedValues> tensors;
  for (const auto& [key, w] : weights) {
    const bool expert_key = key.find(".mlp.experts.") != std::string::npos;
    if (expert_key && layout.experts == ExpertLayout::kFused) continue;
    const std::string name = key == "lm_head.weight" ? key : layout.prefix + key;
    tensors.push_back({name, w.shape, w.values});
  }
  if (layout.experts == ExpertLayout::kFused) {
    const int64_t e_count = spec.num_experts, inter = spec.moe_intermediate_size, h = spec.hidden_size;
    for (int64_t i = 0; i < spec.num_layers; ++i) {
      if (!spec.layer_is_moe(i)) continue;
      const std::string p = "layers." + std::to_string(i) + ".mlp.experts.";
      // gate_up_proj [E, 2I, H]: per expert the gate rows, then the up rows. down_proj [E, H, I].
      NamedValues gate_up{layout.prefix + p + "gate_up_proj", {e_count, 2 * inter, h}, {}};
      NamedValues down{layout.prefix + p + "down_proj", {e_count, h, inter}, {}};
      for (int64_t e = 0; e < e_count; ++e) {
        const std::string ep = p + std::to_string(e) + ".";
        for (const char* part : {"gate_proj.weight", "up_proj.weight"}) {
          const auto& values = weights.at(ep + part).values;
          gate_up.values.insert(gate_up.values.end(), values.begin(), values.end());
        }
        const auto& down_values = weights.at(ep + "down_proj.weight").values;
        down.values.insert(down.values.end(), down_values.begin(), down_values.end());
      }
      tensors.push_back(std::move(gate_up));
      tensors.push_back(std::move(down));
    }
  }
  if (spec.model_type == "qwen3_next") group_gdn_projections(spec, layout.prefix, tensors);
  if (spec.composite_config) {
    // Hub files of the composite models also hold the MTP head and the vision tower; the text model
    // must not read them.
    tensors.push_back({"mtp.fc.weight", {2, 3}, {1, 2, 3, 4, 5, 6}});
    tensors.push_back({"model.visual.patch_embed.proj.weight", {3}, {1, 2, 3}});
  }
  return tensors;
}

}  // namespace

void write_tiny_checkpoint(const std::filesystem::path& dir, const TinySpec& spec, const TinyWeights& weights,
                           const CheckpointLayout& layout) {
  std::ofstream(dir / "config.json") << tiny_config_json(spec).dump(2);
  const std::vector<NamedValues> tensors = checkpoint_tensors(spec, weights, layout);
  METRALE_CHECK(layout.shards >= 1 && layout.storage != DType::kF8E4M3);
  std::vector<std::vector<std::pair<std::string, Tensor>>> per_shard(static_cast<size_t>(layout.shards));
  std::vector<std::vector<uint8_t>> storage;  // keeps converted data alive until written
  storage.reserve(tensors.size());
  nlohmann::json weight_map = nlohmann::json::object();
  const auto shard_name = [&](int s) {
    return layout.shards == 1 ? std::string("model.safetensors")
                              : fmt::format("model-{:05d}-of-{:05d}.safetensors", s + 1, layout.shards);
  };
  for (size_t i = 0; i < tensors.size(); ++i) {
    const NamedValues& t = tensors[i];
    storage.emplace_back(t.values.size() * dtype_size(layout.storage));
    convert_from_f32(layout.storage, t.values.data(), storage.back().data(), t.values.size());
    const int shard = static_cast<int>(i % static_cast<size_t>(layout.shards));
    per_shard[static_cast<size_t>(shard)].emplace_back(
        t.name, Tensor(storage.back().data(), layout.storage, Shape(std::span<const int64_t>(t.shape))));
    weight_map[t.name] = shard_name(shard);
  }
  for (int s = 0; s < layout.shards; ++s) write_safetensors(dir / shard_name(s), per_shard[static_cast<size_t>(s)]);
  if (layout.shards > 1) {
    std::ofstream(dir / "model.safetensors.index.json")
        << nlohmann::json{{"metadata", {{"total_size", 0}}}, {"weight_map", weight_map}}.dump(2);
  }
}

// ---------------------------------------------------------------------------------------------
// Loading

ModelConfig tiny_model_config(const TinySpec& spec) {
  return parse_model_config(tiny_config_json(spec), "/virtual/" + spec.model_type + "/config.json");
}

std::unique_ptr<LoadedTinyModel> load_tiny(const TinySpec& spec, const TinyWeights& weights,
                                           const CheckpointLayout& layout) {
  auto loaded = std::make_unique<LoadedTinyModel>();
  write_tiny_checkpoint(loaded->dir.path(), spec, weights, layout);
  loaded->model = load_model(loaded->dir.path(), Device::cpu());
  return loaded;
}

std::vector<int32_t> random_tokens(const TinySpec& spec, size_t count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> dist(0, static_cast<int32_t>(spec.vocab_size - 1));
  std::vector<int32_t> tokens(count);
  for (auto& t : tokens) t = dist(rng);
  return tokens;
}

}  // namespace metrale::testing
