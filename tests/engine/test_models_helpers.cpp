#include "engine/test_models_helpers.h"

#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/dtype.h"
#include "core/error.h"
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

namespace metrale::testing {
namespace {

class FakeHybridModel : public Model {
 public:
  explicit FakeHybridModel(const FakeHybridOptions& options) : options_(options) {
    config_.model_type = "fake_hybrid";
    config_.vocab_size = options.vocab_size;
    config_.num_layers = options.recurrent ? 2 : 1;
    config_.max_position_embeddings = options.max_position_embeddings;
    config_.eos_token_ids = {0};
  }

  const ModelConfig& config() const override { return config_; }
  Device device() const override { return Device::cpu(); }

  // seams: at the merge, CacheSpecs (the attention layer's paged {k, v}; the recurrent layer's two
  // per-slot tensors), BlockCache views and ModelCaches in forward and commit_verified.
  std::vector<LayerCacheSpec> cache_specs() const override {
    std::vector<LayerCacheSpec> specs(1);
    specs[0].kind = LayerCacheKind::kPagedKv;
    specs[0].num_kv_heads = 1;
    specs[0].head_dim = 2;
    if (options_.recurrent) {
      LayerCacheSpec recurrent;
      recurrent.kind = LayerCacheKind::kRecurrent;
      recurrent.states = {StateTensorSpec{{2}, true}, StateTensorSpec{{options_.state_width}, false}};
      specs.push_back(recurrent);
    }
    return specs;
  }

  // Verify: (a, b) after every row, int64 each.
  size_t verify_scratch_bytes(int64_t num_tokens, int64_t) const override {
    return options_.recurrent ? static_cast<size_t>(num_tokens) * 2 * sizeof(int64_t) : 0;
  }

  void commit_verified(const ForwardBatch& batch, std::span<const int32_t> kept_rows, std::span<const LayerCache> caches,
                       Arena&) override {
    if (!options_.recurrent) return;
    if (!batch.verify) raise(ErrorCode::kInternal, "fake model: commit of a step that was not a verify");
    const auto* rows = batch.verify_scratch.data_as<const int64_t>();
    for (int64_t s = 0; s < batch.num_seqs; ++s) {
      const int64_t first = batch.host_cu_q[static_cast<size_t>(s)], last = batch.host_cu_q[static_cast<size_t>(s) + 1];
      const int64_t kept = kept_rows[static_cast<size_t>(s)];
      if (kept < 1 || kept > last - first) raise(ErrorCode::kInternal, "fake model: keeps {} of {} rows", kept, last - first);
      const int64_t row = first + kept - 1;
      const int64_t length = batch.host_kv_lens[static_cast<size_t>(s)] - (last - first) + kept;
      const int32_t slot = batch.host_state_slots[static_cast<size_t>(s)];
      float* state0 = caches[1].states[0].data_as<float>() + slot * 2;
      float* state1 = caches[1].states[1].data_as<float>() + slot * options_.state_width;
      state0[0] = static_cast<float>(rows[2 * row]);
      state0[1] = static_cast<float>(length);
      state1[0] = static_cast<float>(rows[2 * row + 1]);
      state1[1] = static_cast<float>(rows[2 * row]);
      state1[2] = static_cast<float>(length);
    }
  }

  void forward(const ForwardBatch& batch, std::span<const LayerCache> caches, const Tensor& logits, Arena&) override {
    constexpr int64_t kModA = 65521, kModB = 8191;
    const int64_t vocab = config_.vocab_size;
    const auto* token_ids = batch.token_ids.data_as<const int32_t>();
    const auto* slot_mapping = batch.slot_mapping.data_as<const int32_t>();
    const auto* tables = batch.block_tables.data_as<const int32_t>();
    const int64_t table_stride = batch.block_tables.size(1);
    const LayerCache& attention = caches[0];
    auto* keys = attention.k_cache.data_as<float>();    // [blocks, block_size, 1, 2]: (token, position)
    auto* values = attention.v_cache.data_as<float>();  // unused by the logits; written like a real layer
    const int64_t block_size = batch.block_size;
    if (options_.recurrent && batch.host_state_slots.size() != static_cast<size_t>(batch.num_seqs))
      raise(ErrorCode::kInternal, "fake model: {} state slots for {} sequences", batch.host_state_slots.size(), batch.num_seqs);
    if (!options_.recurrent && !batch.host_state_slots.empty())
      raise(ErrorCode::kInternal, "fake model: state slots given to a model without recurrent layers");

    std::vector<int64_t> targets(static_cast<size_t>(batch.num_tokens), 0);
    for (int64_t s = 0; s < batch.num_seqs; ++s) {
      const int64_t first = batch.host_cu_q[static_cast<size_t>(s)], last = batch.host_cu_q[static_cast<size_t>(s) + 1];
      const int64_t kv_len = batch.host_kv_lens[static_cast<size_t>(s)];
      const int64_t start = kv_len - (last - first);
      int64_t a = 0, b = 0;
      float* state0 = nullptr;  // [2] f32: a, tokens covered
      float* state1 = nullptr;  // [state_width]: b, a, tokens covered
      if (options_.recurrent) {
        const int32_t slot = batch.host_state_slots[static_cast<size_t>(s)];
        const LayerCache& recurrent = caches[1];
        if (slot < 0 || slot >= recurrent.states[0].size(0)) raise(ErrorCode::kInternal, "fake model: state slot {}", slot);
        state0 = recurrent.states[0].data_as<float>() + slot * 2;
        state1 = recurrent.states[1].data_as<float>() + slot * options_.state_width;
        if (start > 0) {
          if (state0[1] != static_cast<float>(start) || state1[2] != static_cast<float>(start) || state1[1] != state0[0])
            raise(ErrorCode::kInternal, "fake model: slot {} holds the state after {} tokens, the sequence has {} cached",
                  slot, state0[1], start);
          a = static_cast<int64_t>(state0[0]);
          b = static_cast<int64_t>(state1[0]);
        }
      }
      for (int64_t t = first; t < last; ++t) {
        const int64_t position = start + (t - first);
        const int64_t token = token_ids[t];
        if (slot_mapping[t] >= 0) {
          keys[slot_mapping[t] * 2] = static_cast<float>(token);
          keys[slot_mapping[t] * 2 + 1] = static_cast<float>(position);
          values[slot_mapping[t] * 2] = static_cast<float>(token);
          values[slot_mapping[t] * 2 + 1] = 1.0f;
        }
        a = (a * 31 + token + 1) % kModA;
        b = (b + token * (position + 1)) % kModB;
        int64_t key_sum = 0;
        // Padding rows (no slot) of graph and fixed-verify layouts read nothing; their output is ignored.
        for (int64_t j = 0; j <= position && slot_mapping[t] >= 0; ++j) {
          const int64_t block = tables[s * table_stride + j / block_size];
          const float* key = keys + (block * block_size + j % block_size) * 2;
          if (key[1] != static_cast<float>(j))
            raise(ErrorCode::kInternal, "fake model: key of position {} in block {} says position {}", j, block, key[1]);
          key_sum = (key_sum + static_cast<int64_t>(key[0]) * (j + 1)) % kModA;
        }
        targets[static_cast<size_t>(t)] = (a * 7 + b * 3 + key_sum) % vocab;
        if (options_.recurrent && batch.verify) {
          // Verify: the state after each row goes to the scratch; commit_verified picks the kept one.
          auto* rows = batch.verify_scratch.data_as<int64_t>();
          rows[2 * t] = a;
          rows[2 * t + 1] = b;
        }
      }
      if (options_.recurrent && !batch.verify) {
        state0[0] = static_cast<float>(a);
        state0[1] = static_cast<float>(kv_len);
        state1[0] = static_cast<float>(b);
        state1[1] = static_cast<float>(a);
        state1[2] = static_cast<float>(kv_len);
      }
    }
    auto* out = logits.data_as<float>();
    for (size_t r = 0; r < batch.host_logit_rows.size(); ++r) {
      const int64_t target = targets[static_cast<size_t>(batch.host_logit_rows[r])];
      for (int64_t v = 0; v < vocab; ++v)
        out[static_cast<int64_t>(r) * vocab + v] = -static_cast<float>(std::abs(v - target));
    }
  }

 private:
  FakeHybridOptions options_;
  ModelConfig config_;
};

}  // namespace

std::unique_ptr<Model> make_fake_hybrid_model(const FakeHybridOptions& options) {
  if (options.state_width < 3) raise(ErrorCode::kInvalidArgument, "fake model: state_width must be >= 3");
  return std::make_unique<FakeHybridModel>(options);
}

}  // namespace metrale::testing
