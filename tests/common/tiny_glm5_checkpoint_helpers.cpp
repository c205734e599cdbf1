#include "common/tiny_glm5_checkpoint.h"

#include <fstream>

#include "core/dtype.h"
#include "core/error.h"
#include "model/registry.h"
#include "model/safetensors.h"

namespace metrale::testing {
namespace {

void add_dsa(TinyWeightMaker& make, const TinyGlm5Spec& spec, const std::string& p, bool indexer) {
  const int64_t d = spec.hidden_size, rq = spec.q_lora_rank, r = spec.kv_lora_rank, h = spec.num_heads;
  make.add(p + "q_a_proj.weight", {rq, d}, -0.3f, 0.3f);
  make.add(p + "q_a_layernorm.weight", {rq}, 0.8f, 1.2f);
  make.add(p + "q_b_proj.weight", {h * spec.qk_nope_head_dim, rq}, -0.4f, 0.4f);
  make.add(p + "kv_a_proj_with_mqa.weight", {r, d}, -0.3f, 0.3f);
  make.add(p + "kv_a_layernorm.weight", {r}, 0.8f, 1.2f);
  make.add(p + "kv_b_proj.weight", {h * (spec.qk_nope_head_dim + spec.v_head_dim), r}, -0.4f, 0.4f);
  make.add(p + "o_proj.weight", {d, h * spec.v_head_dim}, -0.3f, 0.3f);
  if (!indexer) return;
  const int64_t hi = spec.index_n_heads, di = spec.index_head_dim;
  make.add(p + "indexer.wq_b.weight", {hi * di, rq}, -0.5f, 0.5f);
  make.add(p + "indexer.wk.weight", {di, d}, -0.5f, 0.5f);
  make.add(p + "indexer.k_norm.weight", {di}, 0.8f, 1.2f);
  make.add(p + "indexer.k_norm.bias", {di}, -0.2f, 0.2f);
  make.add(p + "indexer.weights_proj.weight", {hi, d}, -0.5f, 0.5f);
  make.add(p + "indexer.index_kpool_compress_ape", {spec.index_kpool, di}, -0.5f, 0.5f);
  make.add(p + "indexer.index_kpool_compress_gate", {di, d}, -0.5f, 0.5f);
}

void add_kda(TinyWeightMaker& make, const TinyGlm5Spec& spec, const std::string& p) {
  const int64_t d = spec.hidden_size, pd = spec.linear_dim(), hd = spec.linear_head_dim;
  make.add(p + "q_proj.weight", {pd, d}, -0.4f, 0.4f);
  make.add(p + "k_proj.weight", {pd, d}, -0.4f, 0.4f);
  make.add(p + "v_proj.weight", {pd, d}, -0.4f, 0.4f);
  make.add(p + "conv1d.weight", {3 * pd, 1, spec.linear_conv_kernel}, -0.6f, 0.6f);
  make.add(p + "forget_gate.f_a_proj.weight", {hd, d}, -0.4f, 0.4f);
  make.add(p + "forget_gate.f_b_proj.weight", {pd, hd}, -0.4f, 0.4f);
  make.add(p + "forget_gate.dt_bias", {pd}, -0.5f, 0.5f);
  make.add(p + "forget_gate.A_log", {spec.linear_num_heads}, -0.5f, 0.5f);
  make.add(p + "b_proj.weight", {spec.linear_num_heads, d}, -0.5f, 0.5f);
  make.add(p + "g_a_proj.weight", {hd, d}, -0.4f, 0.4f);
  make.add(p + "g_b_proj.weight", {pd, hd}, -0.4f, 0.4f);
  make.add(p + "o_norm.weight", {hd}, 0.8f, 1.2f);
  make.add(p + "o_proj.weight", {d, pd}, -0.3f, 0.3f);
}

void add_ffn(TinyWeightMaker& make, const TinyGlm5Spec& spec, const std::string& p, bool moe) {
  const int64_t d = spec.hidden_size;
  if (!moe) {
    make.add(p + "mlp.gate_proj.weight", {spec.intermediate_size, d}, -0.3f, 0.3f);
    make.add(p + "mlp.up_proj.weight", {spec.intermediate_size, d}, -0.3f, 0.3f);
    make.add(p + "mlp.down_proj.weight", {d, spec.intermediate_size}, -0.25f, 0.25f);
    return;
  }
  const int64_t i = spec.moe_intermediate_size, shared = i * spec.n_shared_experts;
  make.add(p + "mlp.gate.weight", {spec.num_experts, d}, -0.5f, 0.5f);
  make.add(p + "mlp.gate.e_score_correction_bias", {spec.num_experts}, -0.2f, 0.2f);
  for (int64_t e = 0; e < spec.num_experts; ++e) {
    const std::string key = p + "mlp.experts." + std::to_string(e) + ".";
    make.add(key + "gate_proj.weight", {i, d}, -0.3f, 0.3f);
    make.add(key + "up_proj.weight", {i, d}, -0.3f, 0.3f);
    make.add(key + "down_proj.weight", {d, i}, -0.3f, 0.3f);
  }
  make.add(p + "mlp.shared_experts.gate_proj.weight", {shared, d}, -0.3f, 0.3f);
  make.add(p + "mlp.shared_experts.up_proj.weight", {shared, d}, -0.3f, 0.3f);
  make.add(p + "mlp.shared_experts.down_proj.weight", {d, shared}, -0.3f, 0.3f);
}

void add_hc(TinyWeightMaker& make, const TinyGlm5Spec& spec, const std::string& p) {
  const int64_t n = spec.hc_mult, mix = (2 + n) * n;
  make.add(p + "fn", {mix, n * spec.hidden_size}, -0.15f, 0.15f);
  make.add(p + "base", {mix}, -0.5f, 0.5f);
  make.add(p + "scale", {3}, 0.5f, 1.5f);
}

// The hub spelling of an HF-layout key (experts and conv weights are handled by the writer).
std::string hub_name(const std::string& key) {
  static const std::pair<std::string, std::string> kRenames[] = {
      {"attn_hc.", "hc_attn_"}, {"ffn_hc.", "hc_ffn_"}, {"self_attn.forget_gate.", "self_attn."}};
  std::string name = key;
  for (const auto& [hf, hub] : kRenames) {
    const size_t at = name.find(hf);
    if (at != std::string::npos) name = name.substr(0, at) + hub + name.substr(at + hf.size());
  }
  return name;
}

}  // namespace

TinyWeights make_glm5_weights(const TinyGlm5Spec& spec, uint64_t seed) {
  TinyWeightMaker make(seed);
  const int64_t d = spec.hidden_size;
  make.add("embed_tokens.weight", {spec.vocab_size, d}, -1.0f, 1.0f);
  for (int64_t l = 0; l < spec.num_layers(); ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    make.add(p + "input_layernorm.weight", {d}, 0.8f, 1.2f);
    make.add(p + "post_attention_layernorm.weight", {d}, 0.8f, 1.2f);
    add_hc(make, spec, p + "attn_hc.");
    add_hc(make, spec, p + "ffn_hc.");
    if (spec.is_dsa(l)) {
      add_dsa(make, spec, p + "self_attn.", !spec.shared_indexer(l));
    } else {
      add_kda(make, spec, p + "self_attn.");
    }
    add_ffn(make, spec, p, spec.is_moe(l));
  }
  make.add("norm.weight", {d}, 0.8f, 1.2f);
  make.add("lm_head.weight", {spec.vocab_size, d}, -0.5f, 0.5f);
  if (spec.with_mtp) {
    const std::string p = "layers." + std::to_string(spec.num_layers()) + ".";
    make.add(p + "eh_proj.weight", {d, 2 * d}, -0.3f, 0.3f);
    make.add(p + "enorm.weight", {d}, 0.8f, 1.2f);
    make.add(p + "hnorm.weight", {d}, 0.8f, 1.2f);
    make.add(p + "shared_head.norm.weight", {d}, 0.8f, 1.2f);
    make.add(p + "input_layernorm.weight", {d}, 0.8f, 1.2f);
    make.add(p + "post_attention_layernorm.weight", {d}, 0.8f, 1.2f);
    add_dsa(make, spec, p + "self_attn.", true);
    add_ffn(make, spec, p, true);
  }
  return make.take();
}

nlohmann::json glm5_config_json(const TinyGlm5Spec& spec) {
  nlohmann::json text = {
      {"model_type", "glm5_next_text"},
      {"vocab_size", spec.vocab_size},
      {"hidden_size", spec.hidden_size},
      {"num_hidden_layers", spec.num_layers()},
      {"num_attention_heads", spec.num_heads},
      {"num_key_value_heads", spec.num_heads},
      {"head_dim", 0},
      {"q_lora_rank", spec.q_lora_rank},
      {"kv_lora_rank", spec.kv_lora_rank},
      {"qk_nope_head_dim", spec.qk_nope_head_dim},
      {"qk_rope_head_dim", 0},
      {"v_head_dim", spec.v_head_dim},
      {"index_n_heads", spec.index_n_heads},
      {"index_head_dim", spec.index_head_dim},
      {"index_topk", spec.index_topk},
      {"index_kpool", spec.index_kpool},
      {"linear_num_heads", spec.linear_num_heads},
      {"linear_head_dim", spec.linear_head_dim},
      {"linear_conv_kernel_dim", spec.linear_conv_kernel},
      {"linear_lower_bound", spec.linear_lower_bound ? nlohmann::json(*spec.linear_lower_bound) : nlohmann::json()},
      {"hc_mult", spec.hc_mult},
      {"hc_sinkhorn_iters", spec.hc_sinkhorn_iters},
      {"hc_eps", spec.hc_eps},
      {"intermediate_size", spec.intermediate_size},
      {"moe_intermediate_size", spec.moe_intermediate_size},
      {"n_routed_experts", spec.num_experts},
      {"num_experts_per_tok", spec.top_k},
      {"n_shared_experts", spec.n_shared_experts},
      {"n_group", spec.n_group},
      {"topk_group", spec.topk_group},
      {"routed_scaling_factor", spec.routed_scaling_factor},
      {"norm_topk_prob", spec.norm_topk_prob},
      {"swiglu_limit", spec.swiglu_limit},
      {"rms_norm_eps", spec.rms_norm_eps},
      {"hidden_act", "silu"},
      {"max_position_embeddings", 4096},
      {"layer_types", spec.layer_types},
      {"mlp_layer_types", spec.mlp_layer_types},
      {"num_nextn_predict_layers", spec.with_mtp ? 1 : 0},
      {"tie_word_embeddings", false},
      {"eos_token_id", spec.vocab_size - 1},
  };
  if (!spec.index_topk_pattern.empty()) text["index_topk_pattern"] = spec.index_topk_pattern;
  if (!spec.composite_config) return text;
  return {{"model_type", "glm5_next"}, {"text_config", text}, {"tie_word_embeddings", false}};
}

void write_glm5_checkpoint(const std::filesystem::path& dir, const TinyGlm5Spec& spec, const TinyWeights& weights,
                           const Glm5CheckpointLayout& layout) {
  std::ofstream(dir / "config.json") << glm5_config_json(spec).dump(2);
  std::vector<NamedValues> tensors;
  const bool hub = layout.layout == Glm5Layout::kHub;
  const auto full = [&](const std::string& key) { return key == "lm_head.weight" ? key : layout.prefix + key; };
  for (const auto& [key, w] : weights) {
    if (key.find(".mlp.experts.") != std::string::npos && !hub) continue;  // fused below
    if (hub && key.ends_with("self_attn.conv1d.weight")) {
      // q, k, v conv weights [P, 1, K] each.
      const std::string base = key.substr(0, key.size() - std::string("conv1d.weight").size());
      const int64_t p = w.shape[0] / 3;
      const auto part = static_cast<size_t>(p * w.shape[2]);
      const char* names[] = {"q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight"};
      for (size_t i = 0; i < 3; ++i) {
        tensors.push_back({full(base + names[i]), {p, 1, w.shape[2]},
                           {w.values.begin() + static_cast<ptrdiff_t>(i * part),
                            w.values.begin() + static_cast<ptrdiff_t>((i + 1) * part)}});
      }
      continue;
    }
    tensors.push_back({full(hub ? hub_name(key) : key), w.shape, w.values});
  }
  if (!hub) {
    // HF layout: experts.gate_up_proj [E, 2I, D] (gate rows first) and experts.down_proj [E, D, I].
    for (int64_t l = 0; l <= spec.num_layers(); ++l) {
      const std::string p = "layers." + std::to_string(l) + ".mlp.";
      if (!weights.count(p + "experts.0.gate_proj.weight")) continue;
      const int64_t i = spec.moe_intermediate_size, d = spec.hidden_size, e_count = spec.num_experts;
      NamedValues gate_up{full(p + "experts.gate_up_proj"), {e_count, 2 * i, d}, {}};
      NamedValues down{full(p + "experts.down_proj"), {e_count, d, i}, {}};
      for (int64_t e = 0; e < e_count; ++e) {
        const std::string key = p + "experts." + std::to_string(e) + ".";
        for (const char* part : {"gate_proj.weight", "up_proj.weight"}) {
          const auto& v = weights.at(key + part).values;
          gate_up.values.insert(gate_up.values.end(), v.begin(), v.end());
        }
        const auto& v = weights.at(key + "down_proj.weight").values;
        down.values.insert(down.values.end(), v.begin(), v.end());
      }
      tensors.push_back(std::move(gate_up));
      tensors.push_back(std::move(down));
    }
  }
  std::vector<std::vector<uint8_t>> storage;
  storage.reserve(tensors.size());
  std::vector<std::pair<std::string, Tensor>> entries;
  for (const NamedValues& t : tensors) {
    storage.emplace_back(t.values.size() * dtype_size(layout.storage));
    convert_from_f32(layout.storage, t.values.data(), storage.back().data(), t.values.size());
    entries.emplace_back(t.name, Tensor(storage.back().data(), layout.storage, Shape(std::span<const int64_t>(t.shape))));
  }
  write_safetensors(dir / "model.safetensors", entries);
}

std::unique_ptr<LoadedTinyModel> load_glm5(const TinyGlm5Spec& spec, const TinyWeights& weights,
                                           const Glm5CheckpointLayout& layout) {
  auto loaded = std::make_unique<LoadedTinyModel>();
  write_glm5_checkpoint(loaded->dir.path(), spec, weights, layout);
  loaded->model = load_model(loaded->dir.path(), Device::cpu());
  return loaded;
}

}  // namespace metrale::testing
