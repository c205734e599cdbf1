// Grouped-query attention over the paged KV cache, with optional per-head q/k RMSNorm (Qwen3),
// partial or full RoPE, optional sliding window, and optionally the sigmoid output gate of gated
// attention (Qwen3-Next, Qwen3.5, qwen.md §3.5).
//
// Cache: {k, v} per token, each [n_kv_heads, head_dim] (post-norm, post-RoPE keys):
// BlockCache::tensors [num_blocks, block_size, n_kv_heads, head_dim] each, in the activation dtype
// or the one Weights::kv_cache() asks for; f8e4m3 with per-KV-head scales (kv_scales.h).
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "model/blocks/kv_scales.h"
#include "model/blocks/layer.h"
#include "model/blocks/norms.h"
#include "model/blocks/rope.h"

namespace metrale {

struct AttentionConfig {
  int64_t hidden_size = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  double rms_norm_eps = 1e-6;
  bool qk_norm = true;  // q_norm / k_norm over head_dim
  kernels::RmsNormKind norm_kind = kernels::RmsNormKind::kPlain;
  int window = 0;  // sliding window (0 = full causal)
  // Gated attention: q_proj has 2 * num_heads * head_dim outputs, per head [query (D) | gate (D)];
  // the attention output is multiplied by sigmoid(gate) before o_proj.
  bool output_gate = false;
};

// Under tensor parallelism (Weights::tensor_parallel) a rank keeps its share of the query heads and
// of the KV heads they read (TensorParallel::grouped_heads: split, or one KV head per rank when there
// are fewer KV heads than ranks), the matching rows of q/k/v_proj and columns of o_proj; its output
// is a partial sum. Head counts that do not split keep the layer whole on every rank.
class Attention : public Mixer {
 public:
  // Loads `<prefix>q_proj.weight` etc. `rope` is shared by the layers of a model.
  Attention(const AttentionConfig& config, Weights& weights, const std::string& prefix,
            std::shared_ptr<const RotaryEmbedding> rope);
  bool output_is_partial() const override { return partial_; }

  CacheSpec cache_spec() const override;
  size_t scratch_bytes(const ForwardBatch& batch, Device device) const override;
  void forward(const StepContext& step, const BlockCache& cache, const Tensor& x, const Tensor& out) override;
  void write_keys(const StepContext& step, const BlockCache& cache, const Tensor& x) override;

 private:
  struct Share;  // this rank's heads
  static Share share_of(const AttentionConfig& config, const TensorParallel& tensor_parallel);
  Attention(const Share& share, const AttentionConfig& full, Weights& weights, const std::string& prefix,
            std::shared_ptr<const RotaryEmbedding> rope);
  // q [T, nH or 0, D] rotated (and normalised) in place; k normalised and rotated, and v, written to
  // the cache at the batch's slots.
  void write_rotated_keys(const ForwardBatch& batch, const BlockCache& cache, const Tensor& q, const Tensor& k,
                          const Tensor& v);
  // The prologue into explicit caches with explicit slots and scales.
  void write_rotated_keys_to(const ForwardBatch& batch, const Tensor& slots, const Tensor& k_cache,
                             const Tensor& v_cache, const kernels::KvScales& scales, const Tensor& q, const Tensor& k,
                             const Tensor& v) const;

  static constexpr size_t kKeys = 0, kValues = 1;  // BlockCache::tensors

  AttentionConfig config_;  // this rank's heads
  bool partial_ = false;    // a tensor-parallel share of the heads
  // On the GPU q, k and v are one fused projection [(Q + 2 nKV * D), H] (one launch per step; compute
  // dtype, or FP8 when all three are, Weights::get_fused_linear); on the CPU, and where they cannot
  // be fused, they stay three weights (views into the mapped checkpoint when plain). Q = nH * D, or
  // 2 nH * D with the output gate (query and gate interleaved per head).
  kernels::LinearWeight qkv_proj_;
  kernels::LinearWeight q_proj_, k_proj_, v_proj_, o_proj_;  // [Q, H], [nKV*D, H], [nKV*D, H], [H, nH*D]
  std::optional<RmsNorm> q_norm_, k_norm_;                   // [D]
  std::shared_ptr<const RotaryEmbedding> rope_;
  float scale_;
  AttentionKvScales kv_scales_;
};

}  // namespace metrale
