// QSA attention (qwen4_exp `qwen_sparse_attention` layers, qwen.md §3.5, §7.3): gated attention whose
// queries attend only to the key blocks an indexer selects.
//   [q | gate] = q_proj(x) (interleaved per head), k = k_proj(x), v = v_proj(x)
//   q, k <- RoPE(zc_norm(q)), RoPE(zc_norm(k)) (partial RoPE); k, v -> the paged KV cache
//   [q_idx | k_tok] = index_qk_proj(x): n_idx query heads x d_idx, then one raw key x d_idx
//   q_idx <- RoPE(zc(q_idx)); k_tok -> the index cache (raw, per token)
//   block keys K_j = RoPE_{jc}(zc(mean_f32(k_tok[jc .. jc+c)))), computed once when block j completes
//   score_j = sum_h relu(q_idx,h . K_j) / sqrt(d_idx) (fp32); top min(block_topk, nb) blocks per query
//   (ties toward the lower block, on the device) plus the tail; attention over exactly those keys
//   out = o_proj(attn * sigmoid(gate))
// Below the budget (every query of the step has nb <= block_topk) the scores and top-k are skipped
// and every row attends densely, which is what the selection would give.
//
// Cache: "k", "v" per token [n_kv_heads, head_dim]; "index_keys" per token [d_idx]; "block_keys" per
// group of c tokens [d_idx]; all in the activation dtype and paged with the KV blocks (so prefix
// sharing carries them, and a rejected draft's blocks are rewritten by the next step, whose context
// starts at the committed length).
//
// Tensor parallelism (model/tensor_parallel.h): the query heads split with the KV heads they read
// (TensorParallel::grouped_heads, as Attention), with their q/k/v rows and o_proj columns: the
// output is then a partial sum. The indexer, its caches and the selection stay whole on every rank.
#pragma once

#include <memory>
#include <string>

#include "model/blocks/layer.h"
#include "model/blocks/norms.h"
#include "model/blocks/rope.h"

namespace metrale {

struct QsaConfig {
  int64_t hidden_size = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  double rms_norm_eps = 1e-6;
  int64_t index_heads = 0;     // n_idx (indexer_n_heads)
  int64_t index_head_dim = 0;  // d_idx (indexer_head_dim)
  int64_t compress_ratio = 4;  // c (indexer_compress_ratio)
  int64_t budget = 2048;       // indexer_budget, a multiple of c

  int64_t block_topk() const { return budget / compress_ratio; }
};

class QsaAttention : public Mixer {
 public:
  // Loads `<prefix>q_proj.weight`, k_proj, v_proj, o_proj, q_norm, k_norm and
  // `<prefix>indexer.{index_qk_proj,q_layernorm,k_layernorm}.weight`. `rope` is the attention's
  // partial RoPE, shared by the layers (its rotary_dim must not exceed d_idx).
  QsaAttention(const QsaConfig& config, Weights& weights, const std::string& prefix,
               std::shared_ptr<const RotaryEmbedding> rope);

  CacheSpec cache_spec() const override;
  size_t scratch_bytes(const ForwardBatch& batch, Device device) const override;
  void forward(const StepContext& step, const BlockCache& cache, const Tensor& x, const Tensor& out) override;
  bool output_is_partial() const override { return partial_; }

 private:
  // The indexer: q_idx after its prologue, the caches updated; selected [T, block_topk] i32 (left
  // unread by the attention when `sparse` is false).
  void select_blocks(const StepContext& step, const BlockCache& cache, const Tensor& x, const Tensor& selected,
                     bool sparse) const;

  static constexpr size_t kKeys = 0, kValues = 1, kIndexKeys = 2, kBlockKeys = 3;  // BlockCache::tensors

  QsaConfig config_;  // num_heads, num_kv_heads: this rank's heads
  bool partial_ = false;
  OwnedTensor qkv_proj_;  // GPU with bf16 weights: [2 nH D + 2 nKV D, H] fused
  // Plain (CPU views) or FP8: [2 nH D, H], [nKV D, H] x 2; [H, nH D].
  kernels::LinearWeight q_proj_, k_proj_, v_proj_, o_proj_;
  RmsNorm q_norm_, k_norm_;                    // [D] zero-centred
  kernels::LinearWeight index_qk_proj_;        // [(n_idx + 1) d_idx, H]
  Tensor index_q_norm_, index_k_norm_;         // [d_idx] zero-centred
  std::shared_ptr<const RotaryEmbedding> rope_;
  float scale_;
};

}  // namespace metrale
