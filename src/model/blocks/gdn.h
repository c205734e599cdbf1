// Gated DeltaNet mixer (the `linear_attention` layers of Qwen3-Next and Qwen3.5, qwen.md §6):
//   [qkv | z] = in_proj(x); [b | a] = in_proj_ba(x)
//   u = silu(causal_conv1d(qkv))  with the conv window kept in the sequence's state slot
//   q, k [Hk, dk], v [Hv, dv] = split(u); beta = sigmoid(b); g = -exp(A_log) * softplus(a + dt_bias)
//   o = gated_delta_rule(l2norm(q) * dk^-1/2, l2norm(k), v, g, beta)  with the fp32 state S [Hv, dk, dv]
//   out = out_proj(gated_rms_norm(o, z))
//
// Both checkpoint layouts load into one: Qwen3-Next's in_proj_qkvz / in_proj_ba are grouped by key
// head ([q_g | k_g | v_g | z_g] per group g, §6.1); their rows are permuted at load into Qwen3.5's
// split order [Q all heads | K | V | Z] and [B | A], so the forward is the same for both.
//
// Cache (per slot): "conv", the conv window {K-1, conv_dim} in the activation dtype, and
// "recurrent", the matrices {Hv, dk, dv} fp32 (BlockCache::tensors[0], [1]). The delta rule runs the
// recurrent kernel when every sequence adds one token (decode) and the chunked kernel otherwise.
//
// Speculative verify (ForwardBatch::verify): conv and the recurrent delta rule read each sequence's
// slot and leave it as it was (write_state false), so the slots keep the state before the step; the
// projections and gates of every row stay in the caller's verify scratch (verify_scratch_bytes: per
// row (conv_dim + value_dim) activations + 2 Hv f32). commit() then replays the kept rows of each
// sequence on its real slots (gather the kept rows, causal_conv1d, recurrent delta rule), which
// computes exactly what the verify forward computed for them. No state-sized memory is allocated;
// the cost is one extra read and write of the state per verify (the replay).
//
// Workspace per step (step.workspace): projections [T, conv_dim + Hv dv] and [T, 2 Hv], conv output
// [T, conv_dim], gates 2 x [T, Hv] f32, core output [T, Hv, dv]; the chunked kernel's CUDA scratch
// comes from step.layer_scratch (scratch_bytes).
#pragma once

#include <string>

#include "kernels/gated_rms_norm.h"
#include "model/blocks/layer.h"
#include "model/weight_store.h"

namespace metrale {

enum class GdnProjectionLayout {
  kGroupedQkvz,  // qwen3_next: in_proj_qkvz [2 key_dim + 2 value_dim, H], in_proj_ba [2 Hv, H], grouped by key head
  kSplit,        // qwen3_5*: in_proj_qkv [conv_dim, H], in_proj_z [value_dim, H], in_proj_b, in_proj_a [Hv, H]
};

struct GdnConfig {
  int64_t hidden_size = 0;
  int64_t num_k_heads = 0;  // Hk (linear_num_key_heads)
  int64_t num_v_heads = 0;  // Hv (linear_num_value_heads), a multiple of Hk
  int64_t head_k_dim = 0;   // dk (linear_key_head_dim)
  int64_t head_v_dim = 0;   // dv (linear_value_head_dim)
  int64_t conv_kernel = 4;  // K (linear_conv_kernel_dim)
  double rms_norm_eps = 1e-6;
  GdnProjectionLayout layout = GdnProjectionLayout::kSplit;
  // The output norm's gate activation: silu (Qwen3-Next, Qwen3.5) or qwen4_exp's output_gate_type.
  kernels::GatedNormGate output_gate = kernels::GatedNormGate::kSilu;

  int64_t key_dim() const { return num_k_heads * head_k_dim; }
  int64_t value_dim() const { return num_v_heads * head_v_dim; }
  int64_t conv_dim() const { return 2 * key_dim() + value_dim(); }
};

// Under tensor parallelism (Weights::tensor_parallel) a rank keeps its share of the value heads and of
// the key heads they read (TensorParallel::grouped_heads), their rows of the input projections, conv
// channels, gates and state, and the matching out_proj columns; its output is a partial sum. Head
// counts that do not split keep the mixer whole on every rank.
class GatedDeltaNet : public Mixer {
 public:
  // Loads `<prefix>in_proj_*`, `conv1d.weight`, `dt_bias`, `A_log`, `norm.weight`, `out_proj.weight`.
  GatedDeltaNet(const GdnConfig& config, Weights& weights, const std::string& prefix);

  CacheSpec cache_spec() const override;
  size_t scratch_bytes(const ForwardBatch& batch, Device device) const override;
  void forward(const StepContext& step, const BlockCache& cache, const Tensor& x, const Tensor& out) override;
  bool output_is_partial() const override { return partial_; }
  size_t verify_scratch_bytes(int64_t num_tokens, int64_t num_seqs, DType activation) const override;
  void commit(const StepContext& step, const BlockCache& cache, const VerifyCommit& kept_rows) override;

 private:
  // What a verify step keeps for the commit, in StepContext::verify_scratch (256-byte aligned parts).
  struct KeptInputs {
    Tensor projected;  // [T, conv_dim + value_dim] activation dtype: the conv input [Q | K | V], then z
    Tensor g, beta;    // [T, Hv] f32 gates
  };
  KeptInputs kept_inputs(const StepContext& step) const;
  // The delta rule over conv_out [T', conv_dim] ([Q | K | V] columns) into core [T', Hv, dv].
  void delta_rule(const StepContext& step, const Tensor& conv_out, const Tensor& g, const Tensor& beta,
                  const Tensor& state, const Tensor& cu_q, const Tensor& kv_lens, const Tensor& slots,
                  int64_t max_q_len, bool recurrent, bool write_state, const Tensor& core) const;

  static constexpr size_t kConv = 0, kRecurrent = 1;  // BlockCache::tensors

  GdnConfig config_;  // this rank's heads
  bool partial_ = false;
  // [conv_dim + value_dim, H] rows [Q | K | V | Z] and [2 Hv, H] rows [B | A], when fused (GPU with
  // bf16 weights, or the permuted Qwen3-Next layout): views of the owned plain copies below, or FP8
  // weights; otherwise the four split projections after them are used (plain or FP8).
  kernels::LinearWeight qkvz_proj_, ba_proj_;
  OwnedTensor in_proj_qkvz_, in_proj_ba_;
  // Plain projections in one weight [conv_dim + value_dim + 2 Hv, H] ([QKV | Z | B | A] in the
  // kernels' order): one GEMM; qkvz_proj_ and ba_proj_ are its row slices.
  OwnedTensor in_proj_;
  // [conv_dim, H], [value_dim, H], [Hv, H], [Hv, H]
  kernels::LinearWeight in_proj_qkv_, in_proj_z_, in_proj_b_, in_proj_a_;
  Tensor conv_weight_;              // [conv_dim, K] (conv1d.weight [conv_dim, 1, K])
  Tensor dt_bias_, a_log_;          // [Hv]
  Tensor norm_weight_;              // [dv] (gated RMSNorm, plain weight)
  kernels::LinearWeight out_proj_;  // [H, value_dim]
};

}  // namespace metrale
