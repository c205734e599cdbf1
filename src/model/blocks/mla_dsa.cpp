#include "model/blocks/mla_dsa.h"

#include <cmath>
#include <optional>

#include "core/error.h"
#include "kernels/dsa.h"
#include "kernels/linear_weight.h"
#include "kernels/rms_norm.h"
#include "model/tensor_parallel.h"

namespace metrale {
namespace {

// The host values of a device or host tensor, in fp32.
std::vector<float> host_values(const Tensor& tensor) {
  std::vector<char> raw(tensor.nbytes());
  copy_bytes(raw.data(), Device::cpu(), tensor.data(), tensor.device(), raw.size());
  std::vector<float> values(static_cast<size_t>(tensor.numel()));
  convert_to_f32(tensor.dtype(), raw.data(), values.data(), values.size());
  return values;
}

}  // namespace

Tensor DsaMixer::load_as(Weights& weights, const std::string& key, const Shape& shape, DType dtype) {
  OwnedTensor placed(dtype, shape, weights.device());
  weights.load_into(key, *placed);
  const Tensor view = *placed;
  owned_.push_back(std::move(placed));
  return view;
}

DsaMixer::DsaMixer(const DsaConfig& config, Weights& weights, const std::string& prefix,
                   std::shared_ptr<DsaSelectionLink> shared_from, std::shared_ptr<DsaSelectionLink> publish_to)
    : config_(config), shared_from_(std::move(shared_from)), publish_to_(std::move(publish_to)) {
  const int64_t d = config.hidden_size, heads = config.num_heads, rq = config.q_lora_rank, r = config.kv_lora_rank;
  const int64_t dn = config.qk_nope_head_dim, dv = config.v_head_dim;
  if (config.index_kpool <= 0 || config.index_topk % config.index_kpool != 0 || heads <= 0 || r <= 0 || dn <= 0 ||
      dv <= 0) {
    raise(ErrorCode::kBadFormat,
          "{}: invalid DSA sizes (heads {}, kv_lora_rank {}, head dims {} / {}, index_topk {}, "
          "index_kpool {})",
          weights.source_name(), heads, r, dn, dv, config.index_topk, config.index_kpool);
  }
  // This rank's heads: all of them, or an even share under tensor parallelism (the latent, the
  // indexer and the selection are computed whole on every rank, alike).
  const std::optional<IndexRange> share = weights.tensor_parallel().split_share(heads);
  partial_ = share.has_value();
  const IndexRange local = share.value_or(IndexRange{0, heads});
  config_.num_heads = local.size();
  const int64_t local_heads = local.size();
  const TensorSlice q_rows = partial_ ? unit_slice(local, dn) : TensorSlice{};
  const TensorSlice out_columns = partial_ ? TensorSlice::of_columns(local.begin * dv, local.end * dv) : TensorSlice{};
  q_a_ = weights.get_linear(prefix + "q_a_proj.weight", {rq, d});
  q_a_norm_ = weights.get(prefix + "q_a_layernorm.weight", {rq});
  q_b_ = weights.get_linear(prefix + "q_b_proj.weight", {heads * dn, rq}, q_rows);
  kv_a_ = weights.get_linear(prefix + "kv_a_proj_with_mqa.weight", {r, d});
  kv_a_norm_ = weights.get(prefix + "kv_a_layernorm.weight", {r});
  // kv_b is absorbed into the attention (plain per-head matrices): an FP8 one is dequantised here.
  // A rank's heads are a run of whole [d_n + d_v, r] blocks.
  const Tensor kv_b = weights.get_dequantized(prefix + "kv_b_proj.weight", {heads * (dn + dv), r})
                          .slice(0, local.begin * (dn + dv), local.end * (dn + dv));
  // Per head: rows [0, d_n) are W_uk,h [d_n, r], rows [d_n, d_n + d_v) W_uv,h [d_v, r].
  value_absorb_ = kv_b.reshape({local_heads, dn + dv, r}).slice(1, dn, dn + dv);
  {
    const std::vector<float> rows = host_values(kv_b);
    std::vector<float> transposed(static_cast<size_t>(local_heads * r * dn));
    for (int64_t h = 0; h < local_heads; ++h) {
      for (int64_t i = 0; i < dn; ++i) {
        for (int64_t j = 0; j < r; ++j) {
          transposed[static_cast<size_t>((h * r + j) * dn + i)] =
              rows[static_cast<size_t>((h * (dn + dv) + i) * r + j)];
        }
      }
    }
    OwnedTensor key(kv_b.dtype(), {local_heads, r, dn}, weights.device());
    std::vector<char> converted(key->nbytes());
    convert_from_f32(kv_b.dtype(), transposed.data(), converted.data(), transposed.size());
    copy_bytes(key->data(), key->device(), converted.data(), Device::cpu(), converted.size());
    key_absorb_ = *key;
    owned_.push_back(std::move(key));
  }
  o_proj_ = weights.get_linear(prefix + "o_proj.weight", {d, heads * dv}, out_columns);
  if (has_indexer()) {
    const int64_t hi = config.index_n_heads, di = config.index_head_dim;
    const std::string p = prefix + "indexer.";
    index_q_ = weights.get_linear(p + "wq_b.weight", {hi * di, rq});
    index_k_ = weights.get_linear(p + "wk.weight", {di, d});
    index_ln_weight_ = weights.get(p + "k_norm.weight", {di});
    index_ln_bias_ = weights.get(p + "k_norm.bias", {di});
    index_weights_ = weights.get_linear(p + "weights_proj.weight", {hi, d});
    index_ape_ = weights.get(p + "index_kpool_compress_ape", {config.index_kpool, di});
    index_gate_ = weights.get_linear(p + "index_kpool_compress_gate", {di, d});
  }
}

CacheSpec DsaMixer::cache_spec() const {
  CacheSpec spec{{CacheTensorSpec::per_token("latent", {config_.kv_lora_rank})}};
  if (has_indexer()) {
    spec.tensors.push_back(CacheTensorSpec::per_token("index_keys", {2 * config_.index_head_dim}));
    spec.tensors.push_back(CacheTensorSpec::per_group("pool_keys", config_.index_kpool, {config_.index_head_dim}));
  }
  return spec;
}

size_t DsaMixer::step_output_bytes(int64_t num_tokens) const {
  return publish_to_ ? static_cast<size_t>(num_tokens * top_pools()) * sizeof(int32_t) : 0;
}

size_t DsaMixer::scratch_bytes(const ForwardBatch& batch, Device device) const {
  const int64_t tokens = batch.num_tokens;
  const int splits = kernels::dsa_attention_splits(device, tokens, config_.num_heads, top_pools());
  size_t bytes =
      kernels::dsa_attention_workspace_bytes(device, tokens, config_.num_heads, config_.kv_lora_rank, splits);
  if (has_indexer()) {
    const int64_t max_kv = batch.max_kv_len > 0 ? batch.max_kv_len : tokens;
    bytes = std::max(bytes, kernels::dsa_select_workspace_bytes(device, tokens, max_kv, config_.index_kpool));
  }
  return bytes;
}

Tensor DsaMixer::query_latent(const StepContext& step, const Tensor& x) const {
  const int64_t tokens = x.size(0);
  const Tensor raw = step.workspace.alloc(step.activation_dtype, {tokens, config_.q_lora_rank});
  const Tensor normed = step.workspace.alloc(step.activation_dtype, {tokens, config_.q_lora_rank});
  kernels::linear(x, q_a_, raw);
  kernels::rms_norm(raw, q_a_norm_, normed, {static_cast<float>(config_.rms_norm_eps), kernels::RmsNormKind::kPlain});
  return normed;
}

void DsaMixer::write_cache(const StepContext& step, const BlockCache& cache, const Tensor& x) const {
  const ForwardBatch& batch = step.batch;
  const int64_t tokens = x.size(0);
  Arena& ws = step.workspace;
  const DType act = step.activation_dtype;
  const Tensor raw = ws.alloc(act, {tokens, config_.kv_lora_rank});
  const Tensor latent = ws.alloc(act, {tokens, config_.kv_lora_rank});  // [T, r] c
  kernels::linear(x, kv_a_, raw);
  kernels::rms_norm(raw, kv_a_norm_, latent, {static_cast<float>(config_.rms_norm_eps), kernels::RmsNormKind::kPlain});
  kernels::dsa_latent_write(latent, batch.slot_mapping, cache.tensors[kLatent]);
  if (!has_indexer()) return;
  const int64_t di = config_.index_head_dim;
  const Tensor key_gate = ws.alloc(act, {tokens, 2 * di});  // [T, 2 d_I]: x.W_k^T, then gamma = x.G^T
  kernels::linear(x, index_k_, key_gate.slice(1, 0, di));
  kernels::linear(x, index_gate_, key_gate.slice(1, di, 2 * di));
  kernels::DsaIndexWriteParams params;
  params.kpool = config_.index_kpool;
  params.ln_eps = 1e-6f;
  kernels::dsa_index_write(key_gate.slice(1, 0, di), key_gate.slice(1, di, 2 * di), index_ln_weight_, index_ln_bias_,
                           index_ape_, batch.slot_mapping, cache.tensors[kIndexKeys], cache.tensors[kPoolKeys], params);
}

Tensor DsaMixer::selection(const StepContext& step, const BlockCache& cache, const Tensor& x, const Tensor& c_q) const {
  const ForwardBatch& batch = step.batch;
  const int64_t tokens = x.size(0), k = top_pools();
  if (!has_indexer()) {
    const Tensor& shared = shared_from_->selected;
    METRALE_CHECK(shared.ndim() == 2 && shared.size(0) == tokens && shared.size(1) == k,
                  "shared DSA layer: the previous layer's selection is {} for {} rows of {} pools", shared.describe(),
                  tokens, k);
    return shared;
  }
  Tensor selected;
  if (publish_to_) {
    const auto needed = static_cast<size_t>(tokens * k) * sizeof(int32_t);
    METRALE_CHECK(step.step_output.nbytes() >= needed, "DSA layer shared by the next: step output {} for {} bytes",
                  step.step_output.describe(), needed);
    selected = Tensor(step.step_output.data(), DType::kI32, {tokens, k}, x.device());
    publish_to_->selected = selected;
  } else {
    selected = step.workspace.alloc(DType::kI32, {tokens, k});
  }
  const int64_t hi = config_.index_n_heads, di = config_.index_head_dim;
  Arena& ws = step.workspace;
  const Tensor q_index = ws.alloc(step.activation_dtype, {tokens, hi, di});  // [T, H_I, d_I] q^I
  kernels::linear(c_q, index_q_, q_index.reshape({tokens, hi * di}));
  // [T, H_I] w: the reference runs weights_proj in its weight's dtype and upcasts the result, so
  // it is rounded to the activation dtype first.
  const Tensor head_weights = ws.alloc(step.activation_dtype, {tokens, hi});
  kernels::linear(x, index_weights_, head_weights);
  kernels::DsaSelectParams params;
  params.kpool = config_.index_kpool;
  params.top_pools = k;
  params.score_scale = 1.0f / std::sqrt(static_cast<float>(di));
  params.weight_scale = 1.0f / std::sqrt(static_cast<float>(hi));
  params.max_kv_len = batch.max_kv_len;
  if (!step.layer_scratch.empty()) params.workspace = step.layer_scratch;
  kernels::dsa_select(q_index, head_weights, cache.tensors[kPoolKeys], batch.cu_q, batch.kv_lens, batch.block_tables,
                      selected, params);
  return selected;
}

void DsaMixer::forward(const StepContext& step, const BlockCache& cache, const Tensor& x, const Tensor& out) {
  const ForwardBatch& batch = step.batch;
  const int64_t tokens = batch.num_tokens, heads = config_.num_heads, r = config_.kv_lora_rank;
  const int64_t dn = config_.qk_nope_head_dim, dv = config_.v_head_dim;
  METRALE_CHECK(cache.tensors.size() == (has_indexer() ? 3u : 1u), "DSA layer: {} cache tensors", cache.tensors.size());
  if (tokens == 0) return;
  Arena& ws = step.workspace;
  const DType act = step.activation_dtype;
  write_cache(step, cache, x);
  const Tensor c_q = query_latent(step, x);
  const Tensor selected = selection(step, cache, x, c_q);

  const Tensor q = ws.alloc(act, {tokens, heads, dn});  // [T, H, d_n]
  kernels::linear(c_q, q_b_, q.reshape({tokens, heads * dn}));
  const Tensor absorbed = ws.alloc(act, {tokens, heads, r});  // [T, H, r] q~, then o~
  kernels::mla_absorb(q, key_absorb_, absorbed);
  kernels::DsaAttentionParams params;
  params.scale = 1.0f / std::sqrt(static_cast<float>(dn));  // qk_head_dim = d_n (no rope part)
  params.kpool = config_.index_kpool;
  params.max_kv_len = batch.max_kv_len;
  if (!step.layer_scratch.empty()) params.workspace = step.layer_scratch;
  const Tensor latent_out = ws.alloc(act, {tokens, heads, r});
  kernels::dsa_attention(absorbed, cache.tensors[kLatent], selected, batch.cu_q, batch.kv_lens, batch.block_tables,
                         latent_out, params);
  const Tensor values = ws.alloc(act, {tokens, heads, dv});  // [T, H, d_v]
  kernels::mla_absorb(latent_out, value_absorb_, values);
  kernels::linear(values.reshape({tokens, heads * dv}), o_proj_, out);
}

void DsaMixer::write_keys(const StepContext& step, const BlockCache& cache, const Tensor& x) {
  if (step.batch.num_tokens == 0) return;
  write_cache(step, cache, x);
}

}  // namespace metrale
