#include <algorithm>
#include <fstream>

#include "common/tiny_qwen4_checkpoint.h"
#include "core/dtype.h"
#include "core/error.h"
#include "model/registry.h"
#include "model/safetensors.h"

namespace metrale::testing {

TinySpec Qwen4Spec::default_base() {
  TinySpec base;
  base.model_type = "qwen4_exp";
  base.vocab_size = 61;
  base.hidden_size = 16;
  base.num_layers = 4;
  base.num_heads = 4;
  base.num_kv_heads = 2;
  base.head_dim = 8;
  base.partial_rotary_factor = 0.5;  // rotary 4 <= indexer_head_dim
  base.rope_theta = 10000.0;
  base.num_experts = 4;
  base.top_k = 2;
  base.moe_intermediate_size = 8;
  base.shared_expert_intermediate_size = 8;
  base.linear_num_key_heads = 2;
  base.linear_num_value_heads = 4;
  base.linear_key_head_dim = 4;
  base.linear_value_head_dim = 4;
  base.linear_conv_kernel_dim = 4;
  base.tie_word_embeddings = false;
  return base;
}

bool Qwen4Spec::layer_is_attention(int64_t layer) const {
  const std::string& type = layer_types.at(static_cast<size_t>(layer));
  return type == "qwen_sparse_attention" || type == "full_attention";
}

int64_t Qwen4Spec::ple_index(int64_t layer) const {
  std::vector<int64_t> sorted = ple_layer_ids;
  std::sort(sorted.begin(), sorted.end());
  sorted.erase(std::unique(sorted.begin(), sorted.end()), sorted.end());
  const auto it = std::find(sorted.begin(), sorted.end(), layer + 1);
  return it == sorted.end() ? -1 : it - sorted.begin();
}

namespace {

uint64_t mix64(uint64_t v) {
  uint64_t z = v + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

bool trial_division_prime(int64_t n) {
  if (n < 2) return false;
  for (int64_t d = 2; d * d <= n; ++d)
    if (n % d == 0) return false;
  return true;
}

}  // namespace

std::vector<int64_t> reference_multipliers(int64_t vocab_size, int64_t ngram_size, int64_t layer_index, int64_t seed) {
  const uint64_t max_i64 = (uint64_t{1} << 63) - 1;
  const uint64_t half = std::max<uint64_t>(1, (max_i64 / static_cast<uint64_t>(std::max<int64_t>(vocab_size, 1))) / 2);
  std::vector<int64_t> m;
  for (int64_t i = 0; i < ngram_size; ++i) {
    const uint64_t v = static_cast<uint64_t>(seed) + 10007ull * static_cast<uint64_t>(layer_index) +
                       0x9E3779B97F4A7C15ull * static_cast<uint64_t>(i + 1);
    m.push_back(static_cast<int64_t>(2 * (mix64(v) % half) + 1));
  }
  return m;
}

std::vector<int64_t> reference_head_sizes(int64_t base, int64_t heads, int64_t layer_index) {
  std::vector<int64_t> primes;
  for (int64_t n = base; static_cast<int64_t>(primes.size()) < (layer_index + 1) * heads; ++n)
    if (trial_division_prime(n)) primes.push_back(n);
  return {primes.end() - heads, primes.end()};
}

int64_t reference_padded_rows(const std::vector<int64_t>& sizes, int64_t pad_multiple) {
  int64_t total = 0;
  for (const int64_t s : sizes) total += s;
  return (total + pad_multiple - 1) / pad_multiple * pad_multiple;
}

Qwen4Weights make_qwen4_weights(const Qwen4Spec& spec, uint64_t seed) {
  const TinySpec& b = spec.base;
  TinyWeightMaker maker(seed);
  const int64_t h = b.hidden_size, d = b.head_dim, n = spec.hc_count, r = spec.hc_lowrank, width = n * h;
  const int64_t hk = b.linear_num_key_heads, hv = b.linear_num_value_heads;
  const int64_t key_dim = hk * b.linear_key_head_dim, value_dim = hv * b.linear_value_head_dim;
  const int64_t d_idx = spec.indexer_head_dim;
  Qwen4Weights result;
  maker.add("embed_tokens.weight", {b.vocab_size, h}, -1.0f, 1.0f);
  const auto connection = [&](const std::string& p, bool inject) {
    maker.add(p + "hc_norm.weight", {width}, -0.3f, 0.3f);
    maker.add(p + "input_mix_weight_down.weight", {r, width}, -0.4f, 0.4f);
    maker.add(p + "input_mix_weight_up.weight", {width, r}, -0.6f, 0.6f);
    if (inject) maker.add(p + "block_inject_weight.weight", {n, width}, -0.4f, 0.4f);
  };
  for (int64_t i = 0; i < b.num_layers; ++i) {
    const std::string p = "layers." + std::to_string(i) + ".";
    connection(p + "attn_hyper_connection.", true);
    connection(p + "mlp_hyper_connection.", true);
    if (spec.layer_is_attention(i)) {
      const std::string a = p + "self_attn.";
      maker.add(a + "q_proj.weight", {2 * b.num_heads * d, h}, -0.3f, 0.3f);
      maker.add(a + "k_proj.weight", {b.num_kv_heads * d, h}, -0.3f, 0.3f);
      maker.add(a + "v_proj.weight", {b.num_kv_heads * d, h}, -0.3f, 0.3f);
      maker.add(a + "o_proj.weight", {h, b.num_heads * d}, -0.25f, 0.25f);
      maker.add(a + "q_norm.weight", {d}, -0.3f, 0.3f);
      maker.add(a + "k_norm.weight", {d}, -0.3f, 0.3f);
      maker.add(a + "indexer.index_qk_proj.weight", {(spec.indexer_heads + 1) * d_idx, h}, -0.5f, 0.5f);
      maker.add(a + "indexer.q_layernorm.weight", {d_idx}, -0.3f, 0.3f);
      maker.add(a + "indexer.k_layernorm.weight", {d_idx}, -0.3f, 0.3f);
    } else {
      const std::string a = p + "linear_attn.";
      maker.add(a + "in_proj_qkv.weight", {2 * key_dim + value_dim, h}, -0.3f, 0.3f);
      maker.add(a + "in_proj_z.weight", {value_dim, h}, -0.3f, 0.3f);
      maker.add(a + "in_proj_b.weight", {hv, h}, -0.3f, 0.3f);
      maker.add(a + "in_proj_a.weight", {hv, h}, -0.3f, 0.3f);
      maker.add(a + "conv1d.weight", {2 * key_dim + value_dim, 1, b.linear_conv_kernel_dim}, -0.6f, 0.6f);
      maker.add(a + "dt_bias", {hv}, -0.5f, 0.5f);
      maker.add(a + "A_log", {hv}, -1.0f, 0.5f);
      maker.add(a + "norm.weight", {b.linear_value_head_dim}, 0.7f, 1.3f);
      maker.add(a + "out_proj.weight", {h, value_dim}, -0.25f, 0.25f);
    }
    const int64_t ple_index = spec.ple_index(i);
    if (ple_index >= 0) {
      const std::string e = p + "ple.";
      const int64_t heads = spec.ngram_heads();
      const std::vector<int64_t> sizes = reference_head_sizes(spec.ngram_vocab_size_base, heads, ple_index);
      std::vector<int64_t> offsets(sizes.size(), 0);
      for (size_t j = 1; j < sizes.size(); ++j) offsets[j] = offsets[j - 1] + sizes[j - 1];
      const int64_t rows = reference_padded_rows(sizes, spec.pad_multiple);
      maker.add(e + "ple_embedding.ngram_embedding.weight", {rows, spec.ple_embed_dim / heads}, -1.0f, 1.0f);
      result.buffers[e + "ple_embedding.layer_multipliers"] =
          reference_multipliers(b.vocab_size, spec.ngram_size, ple_index, spec.seed);
      result.buffers[e + "ple_embedding.ngram_heads_vocab_sizes"] = sizes;
      result.buffers[e + "ple_embedding.ngram_heads_offsets"] = offsets;
      maker.add(e + "key_proj.weight", {width, spec.ple_embed_dim}, -0.5f, 0.5f);
      maker.add(e + "value_proj.weight", {h, spec.ple_embed_dim}, -0.5f, 0.5f);
      maker.add(e + "norm_key.weight", {width}, -0.3f, 0.3f);
      maker.add(e + "norm_query.weight", {width}, -0.3f, 0.3f);
      maker.add(e + "norm_conv.weight", {width}, -0.3f, 0.3f);
      maker.add(e + "conv1d.weight", {width, 1, spec.ple_conv_kernel}, -0.6f, 0.6f);
    }
    const int64_t shared = b.shared_expert_intermediate_size;
    maker.add_routed_experts(b, p);
    maker.add(p + "mlp.shared_expert.gate_proj.weight", {shared, h}, -0.3f, 0.3f);
    maker.add(p + "mlp.shared_expert.up_proj.weight", {shared, h}, -0.3f, 0.3f);
    maker.add(p + "mlp.shared_expert.down_proj.weight", {h, shared}, -0.3f, 0.3f);
    maker.add(p + "mlp.shared_expert_gate.weight", {1, h}, -0.5f, 0.5f);
  }
  connection("hyper_connection_mixer.", false);
  if (!b.tie_word_embeddings) maker.add("lm_head.weight", {b.vocab_size, h}, -0.3f, 0.3f);
  result.floats = maker.take();
  return result;
}

nlohmann::json qwen4_config_json(const Qwen4Spec& spec) {
  const TinySpec& b = spec.base;
  nlohmann::json text = common_config_json(b);
  text["model_type"] = spec.composite_config ? "qwen4_exp_text" : "qwen4_exp";
  text["eos_token_id"] = nlohmann::json::array({spec.eos_token_id, 3});
  text["rope_parameters"] = {{"rope_type", "default"},
                             {"rope_theta", b.rope_theta},
                             {"partial_rotary_factor", b.partial_rotary_factor}};
  text["max_position_embeddings"] = 512;
  text["layer_types"] = spec.layer_types;
  text["linear_num_key_heads"] = b.linear_num_key_heads;
  text["linear_num_value_heads"] = b.linear_num_value_heads;
  text["linear_key_head_dim"] = b.linear_key_head_dim;
  text["linear_value_head_dim"] = b.linear_value_head_dim;
  text["linear_conv_kernel_dim"] = b.linear_conv_kernel_dim;
  text["num_experts"] = b.num_experts;
  text["num_experts_per_tok"] = b.top_k;
  text["moe_intermediate_size"] = b.moe_intermediate_size;
  text["shared_expert_intermediate_size"] = b.shared_expert_intermediate_size;
  text["norm_topk_prob"] = b.norm_topk_prob;
  text["hc_count"] = spec.hc_count;
  text["hc_lowrank"] = spec.hc_lowrank;
  text["ple_layer_ids"] = spec.ple_layer_ids;
  text["ple_embed_dim"] = spec.ple_embed_dim;
  text["ple_conv_kernel_size"] = spec.ple_conv_kernel;
  text["ngram_size"] = spec.ngram_size;
  text["heads_per_ngram"] = spec.heads_per_ngram;
  text["ngram_vocab_size_base"] = spec.ngram_vocab_size_base;
  text["make_ngram_vocab_size_divisible_by"] = spec.pad_multiple;
  text["split_ngram_parts"] = spec.split_ngram_parts;
  text["seed"] = spec.seed;
  text["indexer_n_heads"] = spec.indexer_heads;
  text["indexer_kv_heads"] = 1;
  text["indexer_head_dim"] = spec.indexer_head_dim;
  text["indexer_budget"] = spec.indexer_budget;
  text["indexer_compress_ratio"] = spec.compress_ratio;
  text["output_gate_type"] = spec.output_gate_type;
  if (!spec.composite_config) {
    text["tie_word_embeddings"] = b.tie_word_embeddings;
    text["architectures"] = {"Qwen4ExpForCausalLM"};
    return text;
  }
  return {{"model_type", "qwen4_exp"},
          {"architectures", {"Qwen4ExpForConditionalGeneration"}},
          {"text_config", text},
          {"vision_config", {{"depth", 1}}},
          {"tie_word_embeddings", b.tie_word_embeddings}};
}

void write_qwen4_checkpoint(const std::filesystem::path& dir, const Qwen4Spec& spec, const Qwen4Weights& weights,
                            const Qwen4Layout& layout) {
  std::ofstream(dir / "config.json") << qwen4_config_json(spec).dump(2);
  const std::string prefix = spec.composite_config ? "model.language_model." : "model.";
  std::vector<std::vector<uint16_t>> storage;  // bf16 data alive until written
  std::vector<std::vector<int64_t>> int_storage;
  storage.reserve(weights.floats.size() + 64);
  int_storage.reserve(weights.buffers.size());
  std::vector<std::pair<std::string, Tensor>> tensors;
  const auto add_bf16 = [&](const std::string& name, const std::vector<int64_t>& shape, const float* values,
                            size_t count) {
    storage.emplace_back(count);
    convert_from_f32(DType::kBF16, values, storage.back().data(), count);
    tensors.emplace_back(name, Tensor(storage.back().data(), DType::kBF16, Shape(std::span<const int64_t>(shape))));
  };
  for (const auto& [key, w] : weights.floats) {
    const std::string name = key == "lm_head.weight" ? key : prefix + key;
    const bool table = key.ends_with("ngram_embedding.weight");
    if (!table || !layout.shard_table) {
      add_bf16(name, w.shape, w.values.data(), w.values.size());
      continue;
    }
    // torch.chunk row shards: ceil(rows / parts) rows each, the last shorter.
    const int64_t rows = w.shape[0], cols = w.shape[1];
    const int64_t chunk = (rows + spec.split_ngram_parts - 1) / spec.split_ngram_parts;
    const std::string stem = name.substr(0, name.size() - std::string("weight").size());
    for (int64_t s = 0; s * chunk < rows; ++s) {
      const int64_t count = std::min(chunk, rows - s * chunk);
      add_bf16(stem + "shard_" + std::to_string(s) + ".weight", {count, cols},
               w.values.data() + s * chunk * cols, static_cast<size_t>(count * cols));
    }
  }
  if (layout.write_buffers) {
    for (const auto& [key, values] : weights.buffers) {
      int_storage.push_back(values);
      tensors.emplace_back(prefix + key, Tensor(int_storage.back().data(), DType::kI64,
                                                {static_cast<int64_t>(int_storage.back().size())}));
    }
  }
  // Hub files of the composite model also hold the MTP head and the vision tower.
  const float extra[3] = {1, 2, 3};
  if (spec.composite_config) add_bf16("model.visual.patch_embed.proj.weight", {3}, extra, 3);
  write_safetensors(dir / "model.safetensors", tensors);
}

std::unique_ptr<LoadedTinyModel> load_qwen4(const Qwen4Spec& spec, const Qwen4Weights& weights,
                                            const Qwen4Layout& layout) {
  auto loaded = std::make_unique<LoadedTinyModel>();
  write_qwen4_checkpoint(loaded->dir.path(), spec, weights, layout);
  loaded->model = load_model(loaded->dir.path(), Device::cpu());
  return loaded;
}

}  // namespace metrale::testing
