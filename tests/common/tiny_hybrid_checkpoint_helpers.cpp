// Tiny Qwen hybrid checkpoints (qwen3_next, qwen3_5, qwen3_5_moe): weights in Qwen3.5's split GDN
// layout, config.json (plain or composite), and qwen3_next's grouped projections (qwen.md §4.4-§4.5,
// §6.1).
#include <algorithm>

#include "common/tiny_checkpoint.h"
#include "core/error.h"

namespace metrale::testing {

TinyWeights make_hybrid_weights(const TinySpec& spec, uint64_t seed) {
  TinyWeightMaker maker(seed);
  const int64_t h = spec.hidden_size, d = spec.head_dim;
  const int64_t hk = spec.linear_num_key_heads, hv = spec.linear_num_value_heads;
  const int64_t key_dim = hk * spec.linear_key_head_dim, value_dim = hv * spec.linear_value_head_dim;
  // Zero-centred norms hold weights near 0 (the scale is 1 + w).
  maker.add("embed_tokens.weight", {spec.vocab_size, h}, -1.0f, 1.0f);
  for (int64_t i = 0; i < spec.num_layers; ++i) {
    const std::string p = "layers." + std::to_string(i) + ".";
    maker.add(p + "input_layernorm.weight", {h}, -0.3f, 0.3f);
    maker.add(p + "post_attention_layernorm.weight", {h}, -0.3f, 0.3f);
    if (spec.layer_is_linear(i)) {
      const std::string a = p + "linear_attn.";
      maker.add(a + "in_proj_qkv.weight", {2 * key_dim + value_dim, h}, -0.3f, 0.3f);
      maker.add(a + "in_proj_z.weight", {value_dim, h}, -0.3f, 0.3f);
      maker.add(a + "in_proj_b.weight", {hv, h}, -0.3f, 0.3f);
      maker.add(a + "in_proj_a.weight", {hv, h}, -0.3f, 0.3f);
      maker.add(a + "conv1d.weight", {2 * key_dim + value_dim, 1, spec.linear_conv_kernel_dim}, -0.6f, 0.6f);
      maker.add(a + "dt_bias", {hv}, -0.5f, 0.5f);
      maker.add(a + "A_log", {hv}, -1.0f, 0.5f);
      maker.add(a + "norm.weight", {spec.linear_value_head_dim}, 0.7f, 1.3f);
      maker.add(a + "out_proj.weight", {h, value_dim}, -0.25f, 0.25f);
    } else {
      maker.add(p + "self_attn.q_proj.weight", {2 * spec.num_heads * d, h}, -0.3f, 0.3f);
      maker.add(p + "self_attn.k_proj.weight", {spec.num_kv_heads * d, h}, -0.3f, 0.3f);
      maker.add(p + "self_attn.v_proj.weight", {spec.num_kv_heads * d, h}, -0.3f, 0.3f);
      maker.add(p + "self_attn.o_proj.weight", {h, spec.num_heads * d}, -0.25f, 0.25f);
      maker.add(p + "self_attn.q_norm.weight", {d}, -0.3f, 0.3f);
      maker.add(p + "self_attn.k_norm.weight", {d}, -0.3f, 0.3f);
    }
    if (spec.layer_is_moe(i)) {
      const int64_t shared = spec.shared_expert_intermediate_size;
      maker.add_routed_experts(spec, p);
      maker.add(p + "mlp.shared_expert.gate_proj.weight", {shared, h}, -0.3f, 0.3f);
      maker.add(p + "mlp.shared_expert.up_proj.weight", {shared, h}, -0.3f, 0.3f);
      maker.add(p + "mlp.shared_expert.down_proj.weight", {h, shared}, -0.3f, 0.3f);
      maker.add(p + "mlp.shared_expert_gate.weight", {1, h}, -0.5f, 0.5f);
    } else {
      maker.add_dense_mlp(spec, p);
    }
  }
  maker.add("norm.weight", {h}, -0.3f, 0.3f);
  if (!spec.tie_word_embeddings) maker.add("lm_head.weight", {spec.vocab_size, h}, -0.3f, 0.3f);
  return maker.take();
}

nlohmann::json hybrid_config_json(const TinySpec& spec) {
  const bool composite = spec.composite_config && spec.model_type != "qwen3_next";
  nlohmann::json text = common_config_json(spec);
  text["model_type"] = composite ? spec.model_type + "_text" : spec.model_type;
  text["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", spec.rope_theta}};
  text["max_position_embeddings"] = 512;
  text["linear_num_key_heads"] = spec.linear_num_key_heads;
  text["linear_num_value_heads"] = spec.linear_num_value_heads;
  text["linear_key_head_dim"] = spec.linear_key_head_dim;
  text["linear_value_head_dim"] = spec.linear_value_head_dim;
  text["linear_conv_kernel_dim"] = spec.linear_conv_kernel_dim;
  if (spec.layer_types.empty()) {
    text["full_attention_interval"] = spec.full_attention_interval;
  } else {
    text["layer_types"] = spec.layer_types;
  }
  if (spec.partial_rotary_factor > 0) text["rope_parameters"]["partial_rotary_factor"] = spec.partial_rotary_factor;
  if (spec.model_type == "qwen3_5_moe") {
    text["mrope_section"] = {1, 1, 0};  // ignored for text (equal position rows)
  }
  if (spec.model_type != "qwen3_5_moe") text["intermediate_size"] = spec.intermediate_size;
  if (spec.model_type != "qwen3_5") {
    text["num_experts"] = spec.num_experts;
    text["num_experts_per_tok"] = spec.top_k;
    text["moe_intermediate_size"] = spec.moe_intermediate_size;
    text["shared_expert_intermediate_size"] = spec.shared_expert_intermediate_size;
  }
  if (spec.model_type == "qwen3_next") {
    text["norm_topk_prob"] = spec.norm_topk_prob;
    text["decoder_sparse_step"] = 1;
    text["mlp_only_layers"] = spec.mlp_only_layers;
  }
  if (spec.model_type == "qwen3_5_moe") text["norm_topk_prob"] = false;  // not a qwen3_5_moe field: ignored
  if (!composite) {
    text["tie_word_embeddings"] = spec.tie_word_embeddings;
    return text;
  }
  return {{"model_type", spec.model_type},
          {"architectures",
           {spec.model_type == "qwen3_5" ? "Qwen3_5ForConditionalGeneration" : "Qwen3_5MoeForConditionalGeneration"}},
          {"text_config", text},
          {"vision_config", {{"depth", 1}}},
          {"tie_word_embeddings", spec.tie_word_embeddings}};
}

void group_gdn_projections(const TinySpec& spec, const std::string& prefix, std::vector<NamedValues>& tensors) {
  const int64_t hk = spec.linear_num_key_heads, hv = spec.linear_num_value_heads, dk = spec.linear_key_head_dim,
                dv = spec.linear_value_head_dim, ratio = hv / hk, key_dim = hk * dk;
  const int64_t h = spec.hidden_size;
  const auto take = [&](const std::string& name) {
    const auto it = std::find_if(tensors.begin(), tensors.end(), [&](const NamedValues& t) { return t.name == name; });
    METRALE_CHECK(it != tensors.end(), "no tensor {}", name);
    NamedValues taken = std::move(*it);
    tensors.erase(it);
    return taken;
  };
  const auto rows = [&](const NamedValues& t, int64_t begin, int64_t count, std::vector<float>& out) {
    out.insert(out.end(), t.values.begin() + begin * h, t.values.begin() + (begin + count) * h);
  };
  for (int64_t i = 0; i < spec.num_layers; ++i) {
    if (!spec.layer_is_linear(i)) continue;
    const std::string a = prefix + "layers." + std::to_string(i) + ".linear_attn.";
    const NamedValues qkv = take(a + "in_proj_qkv.weight"), z = take(a + "in_proj_z.weight");
    const NamedValues b = take(a + "in_proj_b.weight"), alpha = take(a + "in_proj_a.weight");
    // Per key head g: [q_g (dk) | k_g (dk) | v_g (r dv) | z_g (r dv)] and [b_g (r) | a_g (r)] (qwen.md §6.1).
    NamedValues qkvz{a + "in_proj_qkvz.weight", {2 * key_dim + 2 * hv * dv, h}, {}};
    NamedValues ba{a + "in_proj_ba.weight", {2 * hv, h}, {}};
    for (int64_t g = 0; g < hk; ++g) {
      rows(qkv, g * dk, dk, qkvz.values);
      rows(qkv, key_dim + g * dk, dk, qkvz.values);
      rows(qkv, 2 * key_dim + g * ratio * dv, ratio * dv, qkvz.values);
      rows(z, g * ratio * dv, ratio * dv, qkvz.values);
      rows(b, g * ratio, ratio, ba.values);
      rows(alpha, g * ratio, ratio, ba.values);
    }
    tensors.push_back(std::move(qkvz));
    tensors.push_back(std::move(ba));
  }
}

}  // namespace metrale::testing
