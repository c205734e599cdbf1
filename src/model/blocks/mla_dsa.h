// The DSA mixer of glm5_next (glm_deepseek.md §2.6): NoPE multi-head latent attention that caches
// only the latent c per token, and the pooled lightning indexer that chooses which tokens each query
// attends to (kernels/dsa.h has the selection and attention rules).
//   c_q = q_a_layernorm(x.W_qa^T) [r_q];  q_h = (c_q.W_qb^T)_h [d_n]
//   c = kv_a_layernorm(x.W_kva^T) [r]                              -> latent cache
//   indexer ("full" layers): k^I = LayerNorm(x.W_k^T), gamma = x.G^T  -> index cache, pool keys;
//     q^I = c_q.W_qb^I^T [H_I, d_I], w = x.W_w^T [H_I] (fp32)  -> dsa_select: pools per query
//   "shared" layers reuse the selection of the DSA layer before them (DsaSelectionLink)
//   q~_h = W_uk,h^T q_h [r];  o~_h = sum_{t in A(s)} softmax(d_n^-1/2 q~_h.c_t) c_t;  o_h = W_uv,h o~_h
//   out = concat_h(o_h).W_o^T
// Decode and prefill both take the absorbed form (kernels/dsa.h says why).
//
// Weights under `prefix` ("layers.i.self_attn."): q_a_proj [r_q, D], q_a_layernorm [r_q], q_b_proj
// [H d_n, r_q], kv_a_proj_with_mqa [r, D], kv_a_layernorm [r], kv_b_proj [H (d_n + d_v), r] (per head
// d_n key rows then d_v value rows), o_proj [D, H d_v]; full layers also indexer.{wq_b [H_I d_I, r_q],
// wk [d_I, D], k_norm.weight / bias [d_I], weights_proj [H_I, D], index_kpool_compress_ape [kp, d_I],
// index_kpool_compress_gate [d_I, D]}.
//
// Cache (paged; the block size must be a multiple of kp): "latent" [r] per token; full layers also
// "index_keys" [2 d_I] per token ([k^I | gamma]) and "pool_keys" [d_I] per group of kp tokens.
// Everything is paged, so a verify step needs no commit (the engine truncates rejected rows; a pool
// key is recomputed whenever its last token is written again).
//
// Tensor parallelism (model/tensor_parallel.h): when the heads split evenly over the ranks, a rank
// reads its heads' q_b_proj rows, kv_b_proj blocks and o_proj columns and attends with them only:
// its output is a partial sum. The latent, the indexer and the selection are computed whole on
// every rank (every rank caches every token's latent, as MLA engines do: the latent is shared by
// all heads).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "model/blocks/layer.h"
#include "model/weight_store.h"

namespace metrale {

struct DsaConfig {
  int64_t hidden_size = 0;       // D
  int64_t num_heads = 0;         // H
  int64_t q_lora_rank = 0;       // r_q
  int64_t kv_lora_rank = 0;      // r
  int64_t qk_nope_head_dim = 0;  // d_n
  int64_t v_head_dim = 0;        // d_v
  int64_t index_n_heads = 0;     // H_I
  int64_t index_head_dim = 0;    // d_I
  int64_t index_topk = 0;        // tokens selected per query (index_topk / kp pools)
  int64_t index_kpool = 16;      // kp
  double rms_norm_eps = 1e-5;    // q_a_layernorm, kv_a_layernorm
};

// The selection a DSA layer hands the "shared" layer after it within one forward: [T, index_topk / kp]
// i32 pools per query, in the publishing layer's StepContext::step_output (fixed per batch shape,
// so graph replays read what the capture wrote).
struct DsaSelectionLink {
  Tensor selected;
};

class DsaMixer : public Mixer {
 public:
  // `shared_from`: a shared layer's link to the layer before it (no indexer weights are loaded);
  // `publish_to`: the link of the shared layer after this one, or null.
  DsaMixer(const DsaConfig& config, Weights& weights, const std::string& prefix,
           std::shared_ptr<DsaSelectionLink> shared_from, std::shared_ptr<DsaSelectionLink> publish_to);

  CacheSpec cache_spec() const override;
  size_t scratch_bytes(const ForwardBatch& batch, Device device) const override;
  size_t step_output_bytes(int64_t num_tokens) const override;
  void forward(const StepContext& step, const BlockCache& cache, const Tensor& x, const Tensor& out) override;
  void write_keys(const StepContext& step, const BlockCache& cache, const Tensor& x) override;
  bool output_is_partial() const override { return partial_; }

 private:
  bool has_indexer() const { return shared_from_ == nullptr; }
  int64_t top_pools() const { return config_.index_topk / config_.index_kpool; }
  // c_q [T, r_q] of x.
  Tensor query_latent(const StepContext& step, const Tensor& x) const;
  // The latent and (full layers) the indexer rows of x into the cache.
  void write_cache(const StepContext& step, const BlockCache& cache, const Tensor& x) const;
  // [T, top_pools] i32: this layer's selection (full) or the previous layer's (shared).
  Tensor selection(const StepContext& step, const BlockCache& cache, const Tensor& x, const Tensor& c_q) const;
  Tensor load_as(Weights& weights, const std::string& key, const Shape& shape, DType dtype);

  static constexpr size_t kLatent = 0, kIndexKeys = 1, kPoolKeys = 2;  // BlockCache::tensors

  DsaConfig config_;  // num_heads: this rank's heads
  bool partial_ = false;
  std::shared_ptr<DsaSelectionLink> shared_from_, publish_to_;
  // The projections are plain or FP8 (kernels::LinearWeight); kv_b_proj, absorbed per head, is plain.
  kernels::LinearWeight q_a_, q_b_;   // [r_q, D], [H d_n, r_q]
  Tensor q_a_norm_;                   // [r_q]
  kernels::LinearWeight kv_a_;        // [r, D]
  Tensor kv_a_norm_;                  // [r]
  Tensor key_absorb_;                 // [H, r, d_n]: W_uk,h^T (a transposed copy of kv_b_proj's key rows)
  Tensor value_absorb_;               // [H, d_v, r]: W_uv,h (a view of kv_b_proj's value rows)
  kernels::LinearWeight o_proj_;      // [D, H d_v]
  // [H_I d_I, r_q], [d_I, D], [d_I, D], [H_I, D]
  kernels::LinearWeight index_q_, index_k_, index_gate_, index_weights_;
  Tensor index_ln_weight_, index_ln_bias_, index_ape_;     // [d_I], [d_I], [kp, d_I]
  std::vector<OwnedTensor> owned_;
};

}  // namespace metrale
