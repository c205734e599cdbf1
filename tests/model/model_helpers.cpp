#include "model/model_helpers.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <numeric>
#include <random>

#include "core/dtype.h"
#include "core/error.h"
#include "model/reference_math_helpers.h"
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
// Reference forward (double precision, one sequence at positions 0..T-1)

std::vector<std::vector<double>> reference_logits(const TinySpec& spec, const TinyWeights& weights,
                                                  const std::vector<int32_t>& tokens) {
  using reference::Matrix, reference::matvec, reference::param, reference::rms_norm_in_place, reference::rope_in_place;
  if (spec.is_hybrid()) return hybrid_reference_logits(spec, weights, tokens);
  const size_t t_count = tokens.size(), h = static_cast<size_t>(spec.hidden_size),
               d = static_cast<size_t>(spec.head_dim);
  const size_t heads = static_cast<size_t>(spec.num_heads), kv_heads = static_cast<size_t>(spec.num_kv_heads);
  const double eps = spec.rms_norm_eps;
  constexpr double kPlainNorm = 0.0;  // qwen3's RMSNorms scale by w, not 1 + w

  Matrix hidden = reference::embed(spec, weights, tokens);
  for (int64_t layer = 0; layer < spec.num_layers; ++layer) {
    const std::string p = "layers." + std::to_string(layer) + ".";
    // Attention: q/k/v projections, per-head q/k RMSNorm, RoPE, causal GQA softmax attention, o_proj.
    Matrix q(t_count), k(t_count), v(t_count);
    for (size_t t = 0; t < t_count; ++t) {
      std::vector<double> x = hidden[t];
      rms_norm_in_place(x, 0, h, param(weights, p + "input_layernorm.weight"), eps, kPlainNorm);
      q[t] = matvec(param(weights, p + "self_attn.q_proj.weight"), x, static_cast<int64_t>(heads * d));
      k[t] = matvec(param(weights, p + "self_attn.k_proj.weight"), x, static_cast<int64_t>(kv_heads * d));
      v[t] = matvec(param(weights, p + "self_attn.v_proj.weight"), x, static_cast<int64_t>(kv_heads * d));
      for (size_t head = 0; head < heads; ++head) {
        rms_norm_in_place(q[t], head * d, d, param(weights, p + "self_attn.q_norm.weight"), eps, kPlainNorm);
        rope_in_place(q[t], head * d, d, static_cast<int64_t>(t), spec.rope_theta);
      }
      for (size_t head = 0; head < kv_heads; ++head) {
        rms_norm_in_place(k[t], head * d, d, param(weights, p + "self_attn.k_norm.weight"), eps, kPlainNorm);
        rope_in_place(k[t], head * d, d, static_cast<int64_t>(t), spec.rope_theta);
      }
    }
    for (size_t t = 0; t < t_count; ++t) {
      const std::vector<double> attn =
          reference::causal_attention(q, k, v, t, heads, kv_heads, d, spec.layer_window(layer));
      const std::vector<double> o =
          matvec(param(weights, p + "self_attn.o_proj.weight"), attn, static_cast<int64_t>(h));
      for (size_t c = 0; c < h; ++c) hidden[t][c] += o[c];
    }
    // FFN: SwiGLU MLP or MoE on the post-attention-normalised residual.
    for (size_t t = 0; t < t_count; ++t) {
      std::vector<double> x = hidden[t];
      rms_norm_in_place(x, 0, h, param(weights, p + "post_attention_layernorm.weight"), eps, kPlainNorm);
      const std::vector<double> y = spec.layer_is_moe(layer)
                                        ? reference::routed_experts(spec, weights, p, x, spec.norm_topk_prob)
                                        : reference::dense_mlp(spec, weights, p, x);
      for (size_t c = 0; c < h; ++c) hidden[t][c] += y[c];
    }
  }
  return reference::output_logits(spec, weights, hidden, kPlainNorm);
}

// ---------------------------------------------------------------------------------------------
// Runner

TestCache::TestCache(const std::vector<LayerCacheSpec>& specs, Device device, int32_t block_size, int32_t num_blocks,
                     int32_t num_state_slots, uint64_t seed)
    : block_size_(block_size) {
  layers_.resize(specs.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    if (specs[i].kind == LayerCacheKind::kRecurrent) {
      // [slots, ...per_slot] per state.
      for (const StateTensorSpec& state : specs[i].states) {
        std::vector<int64_t> dims{num_state_slots};
        dims.insert(dims.end(), state.per_slot_shape.begin(), state.per_slot_shape.end());
        const Shape shape{std::span<const int64_t>(dims)};
        storage_.emplace_back(DType::kF32, shape, device);
        std::fill_n(storage_.back()->data_as<float>(), shape.numel(), std::nanf(""));
        layers_[i].states.push_back(storage_.back().tensor);
      }
    } else if (specs[i].kind == LayerCacheKind::kPagedKv) {
      const Shape shape{num_blocks, block_size, specs[i].num_kv_heads, specs[i].head_dim};
      for (int kv = 0; kv < 2; ++kv) {
        storage_.emplace_back(DType::kF32, shape, device);
        std::fill_n(storage_.back()->data_as<float>(), shape.numel(), std::nanf(""));
      }
      layers_[i].k_cache = storage_[storage_.size() - 2].tensor;
      layers_[i].v_cache = storage_.back().tensor;
    }
  }
  free_blocks_.resize(static_cast<size_t>(num_blocks));
  std::iota(free_blocks_.begin(), free_blocks_.end(), 0);
  std::mt19937_64 rng(seed);
  std::shuffle(free_blocks_.begin(), free_blocks_.end(), rng);
  free_slots_.resize(static_cast<size_t>(num_state_slots));
  std::iota(free_slots_.begin(), free_slots_.end(), 0);
  std::shuffle(free_slots_.begin(), free_slots_.end(), rng);
}

int32_t TestCache::state_slot(int64_t seq_id) {
  const auto it = slots_.find(seq_id);
  if (it != slots_.end()) return it->second;
  if (free_slots_.empty()) raise(ErrorCode::kOutOfMemory, "test runner has no free state slot");
  const int32_t slot = free_slots_.back();
  free_slots_.pop_back();
  slots_[seq_id] = slot;
  return slot;
}

int32_t TestCache::take_block() {
  if (free_blocks_.empty()) raise(ErrorCode::kOutOfMemory, "test cache too small");
  const int32_t block = free_blocks_.back();
  free_blocks_.pop_back();
  return block;
}

void TestCache::copy_sequence(int64_t from, int64_t to) {
  const std::vector<int32_t> source = tables_[from];
  auto& table = tables_[to];
  table.clear();
  for (const int32_t block : source) {
    table.push_back(take_block());
    for (const LayerCache& layer : layers_) {
      for (const Tensor* cache : {&layer.k_cache, &layer.v_cache}) {
        if (cache->empty()) continue;
        copy_tensor(cache->select(0, table.back()), cache->select(0, block));
      }
    }
  }
  const int32_t from_slot = state_slot(from), to_slot = state_slot(to);
  for (const LayerCache& layer : layers_)
    for (const Tensor& state : layer.states) copy_tensor(state.select(0, to_slot), state.select(0, from_slot));
}

void TestCache::build(const std::vector<SeqChunk>& chunks, std::map<int64_t, int64_t>& lengths, bool last_rows_only,
                      HostBatch& host) {
  host = HostBatch{};
  const auto seqs = static_cast<int64_t>(chunks.size());
  for (const SeqChunk& chunk : chunks) {
    const int64_t total = lengths[chunk.seq_id] + static_cast<int64_t>(chunk.tokens.size());
    auto& table = tables_[chunk.seq_id];
    while (static_cast<int64_t>(table.size()) * block_size_ < total) table.push_back(take_block());
    host.max_blocks = std::max<int64_t>(host.max_blocks, static_cast<int64_t>(table.size()));
  }
  host.block_tables.assign(static_cast<size_t>(seqs * host.max_blocks), 0);
  for (int64_t s = 0; s < seqs; ++s) {
    const SeqChunk& chunk = chunks[static_cast<size_t>(s)];
    const auto& table = tables_[chunk.seq_id];
    std::copy(table.begin(), table.end(), host.block_tables.begin() + s * host.max_blocks);
    const int64_t begin = lengths[chunk.seq_id];
    for (size_t i = 0; i < chunk.tokens.size(); ++i) {
      const int64_t position = begin + static_cast<int64_t>(i);
      if (!last_rows_only || i + 1 == chunk.tokens.size())
        host.logit_rows.push_back(static_cast<int32_t>(host.token_ids.size()));
      host.token_ids.push_back(chunk.tokens[i]);
      host.positions.push_back(static_cast<int32_t>(position));
      host.slot_mapping.push_back(table[static_cast<size_t>(position / block_size_)] * block_size_ +
                                  static_cast<int32_t>(position % block_size_));
    }
    lengths[chunk.seq_id] = begin + static_cast<int64_t>(chunk.tokens.size());
    host.cu_q.push_back(static_cast<int32_t>(host.token_ids.size()));
    host.kv_lens.push_back(static_cast<int32_t>(lengths[chunk.seq_id]));
    host.state_slots.push_back(state_slot(chunk.seq_id));
    host.seq_ids.push_back(chunk.seq_id);
  }
  const auto tokens = static_cast<int64_t>(host.token_ids.size());
  const auto rows = static_cast<int64_t>(host.logit_rows.size());
  ForwardBatch& batch = host.batch;
  batch.num_tokens = tokens;
  batch.num_seqs = seqs;
  batch.block_size = block_size_;
  for (int64_t s = 0; s < seqs; ++s) {
    batch.max_q_len =
        std::max<int64_t>(batch.max_q_len, host.cu_q[static_cast<size_t>(s) + 1] - host.cu_q[static_cast<size_t>(s)]);
    batch.max_kv_len = std::max<int64_t>(batch.max_kv_len, host.kv_lens[static_cast<size_t>(s)]);
  }
  batch.token_ids = Tensor(host.token_ids.data(), DType::kI32, {tokens});
  batch.positions = Tensor(host.positions.data(), DType::kI32, {tokens});
  batch.cu_q = Tensor(host.cu_q.data(), DType::kI32, {seqs + 1});
  batch.kv_lens = Tensor(host.kv_lens.data(), DType::kI32, {seqs});
  batch.block_tables = Tensor(host.block_tables.data(), DType::kI32, {seqs, host.max_blocks});
  batch.slot_mapping = Tensor(host.slot_mapping.data(), DType::kI32, {tokens});
  batch.logit_rows = Tensor(host.logit_rows.data(), DType::kI32, {rows});
  batch.state_slots = Tensor(host.state_slots.data(), DType::kI32, {seqs});
  batch.host_cu_q = host.cu_q;
  batch.host_kv_lens = host.kv_lens;
  batch.host_logit_rows = host.logit_rows;
  batch.host_state_slots = host.state_slots;
}

ForwardRunner::ForwardRunner(Model& model, int32_t block_size, int32_t num_blocks, uint64_t seed,
                             int32_t num_state_slots)
    : model_(model),
      cache_(model.cache_specs(), model.device(), block_size, num_blocks, num_state_slots, seed),
      arena_(model.device(), 1 << 20) {}

void ForwardRunner::fork(int64_t from, int64_t to) {
  METRALE_CHECK(cached_.count(to) == 0 || cached_[to] == 0, "fork: sequence {} already has tokens", to);
  cache_.copy_sequence(from, to);
  cached_[to] = cached_[from];
}

std::vector<std::vector<float>> ForwardRunner::step(const std::vector<Chunk>& chunks, bool last_rows_only) {
  HostBatch host;
  cache_.build(chunks, cached_, last_rows_only, host);
  const auto rows = static_cast<int64_t>(host.logit_rows.size());
  const int64_t vocab = model_.config().vocab_size;
  std::vector<float> logits(static_cast<size_t>(rows * vocab), std::nanf(""));  // unwritten rows stay NaN
  arena_.reset();
  model_.forward(host.batch, cache_.layers(), Tensor(logits.data(), DType::kF32, {rows, vocab}), arena_);
  return split_rows(logits, rows, vocab);
}

std::vector<std::vector<float>> split_rows(const std::vector<float>& values, int64_t rows, int64_t width) {
  std::vector<std::vector<float>> result(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r)
    result[static_cast<size_t>(r)].assign(values.begin() + r * width, values.begin() + (r + 1) * width);
  return result;
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

double relative_l2(const std::vector<std::vector<float>>& actual, const std::vector<std::vector<double>>& expected) {
  METRALE_CHECK(actual.size() == expected.size(), "{} rows vs {}", actual.size(), expected.size());
  double diff = 0.0, norm = 0.0;
  for (size_t r = 0; r < actual.size(); ++r) {
    METRALE_CHECK(actual[r].size() == expected[r].size());
    for (size_t c = 0; c < actual[r].size(); ++c) {
      if (!std::isfinite(actual[r][c])) return INFINITY;
      diff += (actual[r][c] - expected[r][c]) * (actual[r][c] - expected[r][c]);
      norm += expected[r][c] * expected[r][c];
    }
  }
  return std::sqrt(diff / norm);
}

}  // namespace metrale::testing
