#include "model/blocks/qsa.h"

#include <algorithm>
#include <cmath>
#include <optional>

#include "core/error.h"
#include "kernels/linear_weight.h"
#include "kernels/qk_norm_rope.h"
#include "kernels/qsa.h"
#include "kernels/sigmoid_gate.h"
#include "model/tensor_parallel.h"

namespace metrale {

QsaAttention::QsaAttention(const QsaConfig& config, Weights& weights, const std::string& prefix,
                           std::shared_ptr<const RotaryEmbedding> rope)
    : config_(config), rope_(std::move(rope)), scale_(1.0f / std::sqrt(static_cast<float>(config.head_dim))) {
  const int64_t h = config.hidden_size, d = config.head_dim, d_idx = config.index_head_dim;
  if (config.index_heads < 1 || d_idx < 1 || config.compress_ratio < 1 || config.budget < config.compress_ratio ||
      config.budget % config.compress_ratio != 0) {
    raise(ErrorCode::kBadFormat,
          "{}: QSA needs indexer_n_heads >= 1, indexer_head_dim >= 1 and an indexer_budget that is a positive "
          "multiple of indexer_compress_ratio, got {} heads of {}, budget {}, ratio {}",
          weights.source_name(), config.index_heads, d_idx, config.budget, config.compress_ratio);
  }
  if (rope_->rotary_dim() > d_idx) {
    raise(ErrorCode::kBadFormat, "{}: the rotary dim {} exceeds indexer_head_dim {}", weights.source_name(),
          rope_->rotary_dim(), d_idx);
  }
  // This rank's heads: the whole layer, or its query heads and the KV heads they read under tensor
  // parallelism (as Attention); the indexer runs whole on every rank, so every rank selects alike.
  const TensorParallel& tensor_parallel = weights.tensor_parallel();
  const std::optional<TensorParallel::GroupedHeads> share =
      tensor_parallel.active() ? tensor_parallel.grouped_heads(config.num_heads, config.num_kv_heads)
                               : std::optional<TensorParallel::GroupedHeads>();
  partial_ = share.has_value();
  TensorSlice q_slice, kv_slice, o_slice;
  if (share) {
    config_.num_heads = share->heads.size();
    config_.num_kv_heads = share->groups.size();
    q_slice = unit_slice(share->heads, 2 * d);  // query and gate rows interleave per head
    kv_slice = unit_slice(share->groups, d);
    o_slice = TensorSlice::of_columns(share->heads.begin * d, share->heads.end * d);
  }
  const Shape q_full{2 * config.num_heads * d, h}, kv_full{config.num_kv_heads * d, h};
  const int64_t q_rows = 2 * config_.num_heads * d, kv_rows = config_.num_kv_heads * d;
  if (weights.device().is_cuda() && !weights.fp8_linears()) {
    qkv_proj_ = OwnedTensor(weights.compute_dtype(), {q_rows + 2 * kv_rows, h}, weights.device());
    weights.load_into(prefix + "q_proj.weight", q_full, q_slice, qkv_proj_.tensor.slice(0, 0, q_rows));
    weights.load_into(prefix + "k_proj.weight", kv_full, kv_slice, qkv_proj_.tensor.slice(0, q_rows, q_rows + kv_rows));
    weights.load_into(prefix + "v_proj.weight", kv_full, kv_slice,
                      qkv_proj_.tensor.slice(0, q_rows + kv_rows, q_rows + 2 * kv_rows));
  } else {
    q_proj_ = weights.get_linear(prefix + "q_proj.weight", q_full, q_slice);
    k_proj_ = weights.get_linear(prefix + "k_proj.weight", kv_full, kv_slice);
    v_proj_ = weights.get_linear(prefix + "v_proj.weight", kv_full, kv_slice);
  }
  o_proj_ = weights.get_linear(prefix + "o_proj.weight", {h, config.num_heads * d}, o_slice);
  const auto zero_centred = kernels::RmsNormKind::kZeroCentered;
  q_norm_ = RmsNorm::load(weights, prefix + "q_norm.weight", d, config.rms_norm_eps, zero_centred);
  k_norm_ = RmsNorm::load(weights, prefix + "k_norm.weight", d, config.rms_norm_eps, zero_centred);
  index_qk_proj_ = weights.get_linear(prefix + "indexer.index_qk_proj.weight", {(config.index_heads + 1) * d_idx, h});
  index_q_norm_ = weights.get(prefix + "indexer.q_layernorm.weight", {d_idx});
  index_k_norm_ = weights.get(prefix + "indexer.k_layernorm.weight", {d_idx});
}

CacheSpec QsaAttention::cache_spec() const {
  return {{CacheTensorSpec::per_token("k", {config_.num_kv_heads, config_.head_dim}),
           CacheTensorSpec::per_token("v", {config_.num_kv_heads, config_.head_dim}),
           CacheTensorSpec::per_token("index_keys", {config_.index_head_dim}),
           CacheTensorSpec::per_group("block_keys", config_.compress_ratio, {config_.index_head_dim})}};
}

size_t QsaAttention::scratch_bytes(const ForwardBatch& batch, Device device) const {
  if (!device.is_cuda()) return 0;
  return kernels::qsa_attention_workspace_bytes(batch.num_tokens, config_.num_heads, config_.num_kv_heads,
                                                config_.head_dim, config_.block_topk(), config_.compress_ratio);
}

void QsaAttention::select_blocks(const StepContext& step, const BlockCache& cache, const Tensor& x,
                                 const Tensor& selected, bool sparse) const {
  const ForwardBatch& batch = step.batch;
  const int64_t tokens = batch.num_tokens, n_idx = config_.index_heads, d_idx = config_.index_head_dim;
  const DType act = step.activation_dtype;
  const Tensor index = step.workspace.alloc(act, {tokens, (n_idx + 1) * d_idx});  // [T, n_idx d_idx | d_idx]
  kernels::linear(x, index_qk_proj_, index);
  const Tensor q_idx(index.data(), act, {tokens, n_idx, d_idx}, {index.stride(0), d_idx, 1}, index.device());
  const Tensor k_tok = index.slice(1, n_idx * d_idx, (n_idx + 1) * d_idx);  // [T, d_idx] raw
  kernels::QsaParams params;
  params.compress_ratio = static_cast<int>(config_.compress_ratio);
  params.block_topk = static_cast<int>(config_.block_topk());
  params.eps = static_cast<float>(config_.rms_norm_eps);
  params.rope = rope_->params();
  params.all_blocks = false;
  params.row_slots = batch.slot_mapping;  // rows that write nothing complete no block keys
  params.max_q_len = batch.max_q_len;
  params.max_kv_len = batch.max_kv_len;
  kernels::qsa_index_prologue(q_idx, k_tok, index_q_norm_, batch.positions, rope_->inv_freq(), batch.slot_mapping,
                              cache.tensors[kIndexKeys], params);
  // The keys of the blocks this step completes; earlier blocks are cached (shared pages included).
  kernels::qsa_block_keys(cache.tensors[kIndexKeys], index_k_norm_, rope_->inv_freq(), batch.cu_q, batch.kv_lens,
                          batch.block_tables, cache.tensors[kBlockKeys], params);
  if (!sparse) return;
  const int64_t width = std::max<int64_t>(1, batch.max_kv_len / config_.compress_ratio);
  const Tensor scores = step.workspace.alloc(DType::kF32, {tokens, width});  // [T, max nb] f32
  kernels::qsa_scores(q_idx, cache.tensors[kBlockKeys], batch.cu_q, batch.kv_lens, batch.block_tables, scores, params);
  kernels::qsa_topk(scores, batch.cu_q, batch.kv_lens, selected, params);
}

void QsaAttention::forward(const StepContext& step, const BlockCache& cache, const Tensor& x, const Tensor& out) {
  const ForwardBatch& batch = step.batch;
  METRALE_CHECK(cache.tensors.size() == 4, "QSA layer: {} cache tensors, expected k, v, index and block keys",
                cache.tensors.size());
  const int64_t tokens = batch.num_tokens, d = config_.head_dim, heads = config_.num_heads;
  if (tokens == 0) return;
  const int64_t q_rows = 2 * heads * d, kv_rows = config_.num_kv_heads * d;
  const DType act = step.activation_dtype;
  const Tensor qkv = step.workspace.alloc(act, {tokens, q_rows + 2 * kv_rows});  // [T, 2 nH D | nKV D | nKV D]
  if (!qkv_proj_.tensor.empty()) {
    kernels::linear(x, qkv_proj_.tensor, qkv);
  } else {
    kernels::linear(x, q_proj_, qkv.slice(1, 0, q_rows));
    kernels::linear(x, k_proj_, qkv.slice(1, q_rows, q_rows + kv_rows));
    kernels::linear(x, v_proj_, qkv.slice(1, q_rows + kv_rows, q_rows + 2 * kv_rows));
  }
  const int64_t row = qkv.stride(0);
  // Per head the query, then the gate (2 D columns).
  const Tensor q(qkv.data(), act, {tokens, heads, d}, {row, 2 * d, 1}, qkv.device());
  const Tensor k(qkv.slice(1, q_rows, q_rows + kv_rows).data(), act, {tokens, config_.num_kv_heads, d}, {row, d, 1},
                 qkv.device());
  const Tensor v(qkv.slice(1, q_rows + kv_rows, q_rows + 2 * kv_rows).data(), act, {tokens, config_.num_kv_heads, d},
                 {row, d, 1}, qkv.device());
  kernels::QkNormRopeParams prologue;
  prologue.q_norm = true;
  prologue.k_norm = true;
  prologue.norm = q_norm_.params;
  prologue.rope = rope_->params();
  kernels::qk_norm_rope_kv_write(q, k, v, q_norm_.weight, k_norm_.weight, batch.positions, rope_->inv_freq(),
                                 batch.slot_mapping, cache.tensors[kKeys], cache.tensors[kValues], prologue);

  // Dense when no query of the step can have more than block_topk complete blocks.
  const bool sparse = batch.max_kv_len / config_.compress_ratio > config_.block_topk();
  const Tensor selected = step.workspace.alloc(DType::kI32, {tokens, config_.block_topk()});  // [T, block_topk]
  select_blocks(step, cache, x, selected, sparse);

  const Tensor attn = step.workspace.alloc(act, {tokens, heads, d});  // [T, nH, D]
  kernels::QsaAttentionParams params;
  params.scale = scale_;
  params.compress_ratio = static_cast<int>(config_.compress_ratio);
  params.block_topk = static_cast<int>(config_.block_topk());
  params.max_q_len = batch.max_q_len;
  params.max_kv_len = batch.max_kv_len;
  if (!step.layer_scratch.empty()) params.workspace = step.layer_scratch;
  kernels::qsa_attention(q, cache.tensors[kKeys], cache.tensors[kValues], batch.cu_q, batch.kv_lens,
                         batch.block_tables, selected, attn, params);
  const Tensor gate(qkv.slice(1, d, q_rows).data(), act, {tokens, heads, d}, {row, 2 * d, 1}, qkv.device());
  kernels::sigmoid_gate(attn, gate, attn);
  kernels::linear(attn.reshape({tokens, heads * d}), o_proj_, out);
}

}  // namespace metrale
