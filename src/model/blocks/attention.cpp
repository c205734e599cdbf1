#include "model/blocks/attention.h"

#include <cmath>

#include "kernels/attention.h"
#include "kernels/linear_weight.h"
#include "kernels/qk_norm_rope.h"
#include "kernels/sigmoid_gate.h"
#include "model/tensor_parallel.h"

namespace metrale {

// This rank's heads of the layer: the whole layer unless tensor parallelism splits its heads.
struct Attention::Share {
  AttentionConfig local;
  std::optional<TensorParallel::GroupedHeads> heads;  // nullopt: whole
};

Attention::Share Attention::share_of(const AttentionConfig& config, const TensorParallel& tensor_parallel) {
  Share share{config, std::nullopt};
  if (!tensor_parallel.active()) return share;
  share.heads = tensor_parallel.grouped_heads(config.num_heads, config.num_kv_heads);
  if (share.heads) {
    share.local.num_heads = share.heads->heads.size();
    share.local.num_kv_heads = share.heads->groups.size();
  }
  return share;
}

Attention::Attention(const AttentionConfig& config, Weights& weights, const std::string& prefix,
                     std::shared_ptr<const RotaryEmbedding> rope)
    : Attention(share_of(config, weights.tensor_parallel()), config, weights, prefix, std::move(rope)) {}

Attention::Attention(const Share& share, const AttentionConfig& full, Weights& weights, const std::string& prefix,
                     std::shared_ptr<const RotaryEmbedding> rope)
    : config_(share.local),
      partial_(share.heads.has_value()),
      rope_(std::move(rope)),
      scale_(1.0f / std::sqrt(static_cast<float>(full.head_dim))),
      kv_scales_(weights, prefix, full.num_kv_heads,
                 share.heads ? share.heads->groups : IndexRange{0, full.num_kv_heads}) {
  const int64_t h = full.hidden_size, d = full.head_dim;
  const int64_t q_head_rows = d * (full.output_gate ? 2 : 1);
  const int64_t q_rows = config_.num_heads * q_head_rows, kv_rows = config_.num_kv_heads * d;
  const int64_t full_rows[] = {full.num_heads * q_head_rows, full.num_kv_heads * d, full.num_kv_heads * d};
  // The rows of this rank's heads (query and gate rows interleave per head, so a run of heads is a
  // run of rows) and the o_proj columns they feed.
  TensorSlice q_slice, kv_slice, o_slice;
  if (share.heads) {
    append_rows(q_slice.rows, unit_rows(0, share.heads->heads.begin, config_.num_heads, q_head_rows));
    append_rows(kv_slice.rows, unit_rows(0, share.heads->groups.begin, config_.num_kv_heads, d));
    o_slice = TensorSlice::of_columns(share.heads->heads.begin * d, share.heads->heads.end * d);
  }
  const std::string keys[] = {prefix + "q_proj.weight", prefix + "k_proj.weight", prefix + "v_proj.weight"};
  const int64_t rows[] = {q_rows, kv_rows, kv_rows};
  const TensorSlice slices[] = {q_slice, kv_slice, kv_slice};
  qkv_proj_ = weights.get_fused_linear(keys, rows, h, slices, full_rows);
  if (qkv_proj_.empty()) {
    q_proj_ = weights.get_linear(keys[0], {full_rows[0], h}, q_slice);
    k_proj_ = weights.get_linear(keys[1], {full_rows[1], h}, kv_slice);
    v_proj_ = weights.get_linear(keys[2], {full_rows[2], h}, kv_slice);
  }
  o_proj_ = weights.get_linear(prefix + "o_proj.weight", {h, full.num_heads * d}, o_slice);
  if (config_.qk_norm) {
    q_norm_ = RmsNorm::load(weights, prefix + "q_norm.weight", d, config_.rms_norm_eps, config_.norm_kind);
    k_norm_ = RmsNorm::load(weights, prefix + "k_norm.weight", d, config_.rms_norm_eps, config_.norm_kind);
  }
}

size_t Attention::scratch_bytes(const ForwardBatch& batch, Device device) const {
  if (!device.is_cuda()) return 0;  // only the CUDA kernels split the keys
  return kernels::paged_attention_workspace_bytes(batch.num_seqs, batch.num_tokens, config_.num_heads, config_.head_dim,
                                                  batch.max_kv_len);
}

CacheSpec Attention::cache_spec() const {
  const std::optional<DType> dtype = kv_scales_.cache_dtype();
  return {{CacheTensorSpec::per_token("k", {config_.num_kv_heads, config_.head_dim}, dtype),
           CacheTensorSpec::per_token("v", {config_.num_kv_heads, config_.head_dim}, dtype)}};
}

void Attention::forward(const StepContext& step, const BlockCache& cache, const Tensor& x, const Tensor& out) {
  const ForwardBatch& batch = step.batch;
  const int64_t tokens = batch.num_tokens, d = config_.head_dim;
  // With the output gate, q_proj's output holds per head the query then the gate (2 D columns).
  const int64_t q_head_stride = config_.output_gate ? 2 * d : d;
  const int64_t q_rows = config_.num_heads * q_head_stride, kv_rows = config_.num_kv_heads * d;
  const DType act = step.activation_dtype;
  // [T, Q + 2 nKV * D]: q, k and v side by side; the per-head views below are strided into it.
  const Tensor qkv = step.workspace.alloc(act, {tokens, q_rows + 2 * kv_rows});
  if (!qkv_proj_.empty()) {
    kernels::linear(x, qkv_proj_, qkv);
  } else {
    kernels::linear(x, q_proj_, qkv.slice(1, 0, q_rows));
    kernels::linear(x, k_proj_, qkv.slice(1, q_rows, q_rows + kv_rows));
    kernels::linear(x, v_proj_, qkv.slice(1, q_rows + kv_rows, q_rows + 2 * kv_rows));
  }
  const int64_t row = qkv.stride(0);
  const Tensor q(qkv.data(), act, {tokens, config_.num_heads, d}, {row, q_head_stride, 1}, qkv.device());
  const Tensor k(qkv.slice(1, q_rows, q_rows + kv_rows).data(), act, {tokens, config_.num_kv_heads, d}, {row, d, 1},
                 qkv.device());
  const Tensor v(qkv.slice(1, q_rows + kv_rows, q_rows + 2 * kv_rows).data(), act, {tokens, config_.num_kv_heads, d},
                 {row, d, 1}, qkv.device());
  write_rotated_keys(batch, cache, q, k, v);
  const Tensor attn = step.workspace.alloc(act, {tokens, config_.num_heads, d});  // [T, nH, D]
  kernels::AttentionParams params;
  params.scale = scale_;
  params.window = config_.window;
  params.max_q_len = batch.max_q_len;
  params.max_kv_len = batch.max_kv_len;
  if (!step.layer_scratch.empty()) params.workspace = step.layer_scratch;
  params.kv_scales = kv_scales_.scales_for(cache.tensors[kKeys].dtype());
  kernels::paged_attention(q, cache.tensors[kKeys], cache.tensors[kValues], batch.cu_q, batch.kv_lens,
                           batch.block_tables, attn, params);
  if (config_.output_gate) {
    const Tensor gate(qkv.slice(1, d, q_rows).data(), act, {tokens, config_.num_heads, d}, {row, q_head_stride, 1},
                      qkv.device());
    kernels::sigmoid_gate(attn, gate, attn);
  }
  kernels::linear(attn.reshape({tokens, config_.num_heads * d}), o_proj_, out);
}

void Attention::write_keys(const StepContext& step, const BlockCache& cache, const Tensor& x) {
  const ForwardBatch& batch = step.batch;
  const int64_t tokens = batch.num_tokens, d = config_.head_dim;
  const int64_t q_rows = config_.num_heads * d * (config_.output_gate ? 2 : 1), kv_rows = config_.num_kv_heads * d;
  const DType act = step.activation_dtype;
  const Tensor kv = step.workspace.alloc(act, {tokens, 2 * kv_rows});  // [T, 2 nKV * D]: k then v
  if (!qkv_proj_.empty()) {
    kernels::linear(x, qkv_proj_.rows(q_rows, q_rows + 2 * kv_rows), kv);
  } else {
    kernels::linear(x, k_proj_, kv.slice(1, 0, kv_rows));
    kernels::linear(x, v_proj_, kv.slice(1, kv_rows, 2 * kv_rows));
  }
  const int64_t row = kv.stride(0);
  const Tensor k(kv.data(), act, {tokens, config_.num_kv_heads, d}, {row, d, 1}, kv.device());
  const Tensor v(kv.slice(1, kv_rows, 2 * kv_rows).data(), act, {tokens, config_.num_kv_heads, d}, {row, d, 1},
                 kv.device());
  const Tensor no_queries(kv.data(), act, {tokens, 0, d}, {row, d, 1}, kv.device());  // [T, 0, D]
  write_rotated_keys(batch, cache, no_queries, k, v);
}

void Attention::write_rotated_keys(const ForwardBatch& batch, const BlockCache& cache, const Tensor& q, const Tensor& k,
                                   const Tensor& v) {
  const DType cache_dtype = cache.tensors[kKeys].dtype();
  if (batch.calibrate_kv_scales && kv_scales_.calibration_pending(cache_dtype)) {
    // The keys as the cache would get them, into a scratch cache: q is left for the real write.
    const Tensor no_queries(q.data(), q.dtype(), {q.size(0), 0, q.size(2)}, {q.stride(0), q.stride(1), 1}, q.device());
    kv_scales_.calibrate(batch, k.dtype(), config_.head_dim,
                         [&](const Tensor& slots, const Tensor& k_cache, const Tensor& v_cache) {
                           write_rotated_keys_to(batch, slots, k_cache, v_cache, {}, no_queries, k, v);
                         });
  }
  write_rotated_keys_to(batch, batch.slot_mapping, cache.tensors[kKeys], cache.tensors[kValues],
                        kv_scales_.scales_for(cache_dtype), q, k, v);
}

void Attention::write_rotated_keys_to(const ForwardBatch& batch, const Tensor& slots, const Tensor& k_cache,
                                      const Tensor& v_cache, const kernels::KvScales& scales, const Tensor& q,
                                      const Tensor& k, const Tensor& v) const {
  // Qwen3 normalises q and k per head before RoPE; the cache holds post-norm, post-RoPE keys.
  kernels::QkNormRopeParams prologue;
  prologue.q_norm = q_norm_.has_value() && q.size(1) > 0;
  prologue.k_norm = k_norm_.has_value();
  prologue.norm = q_norm_ ? q_norm_->params : k_norm_ ? k_norm_->params : kernels::RmsNormParams{};
  prologue.rope = rope_->params();
  prologue.kv_scales = scales;
  kernels::qk_norm_rope_kv_write(q, k, v, q_norm_ ? q_norm_->weight : Tensor(), k_norm_ ? k_norm_->weight : Tensor(),
                                 batch.positions, rope_->inv_freq(), slots, k_cache, v_cache, prologue);
}

}  // namespace metrale
