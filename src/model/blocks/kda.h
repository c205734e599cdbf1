// Kimi Delta Attention mixer (the `linear_attention` layers of glm5_next, glm_deepseek.md §2.5):
//   u = [x.W_q^T | x.W_k^T | x.W_v^T]                    [3P], P = H d
//   c = silu(causal_conv1d(u))  fp32 conv weights, the sum activated before rounding, with the
//                                conv window kept in the sequence's state slot
//   f = (x.W_fa^T).W_fb^T [P];  b = x.W_b^T [H]           (the gates are formed inside the kernels)
//   o = kda(l2norm(q) d^-1/2, l2norm(k), v, g(f), sigmoid(b))   fp32 state S [H, d, d]
//   out = W_o . (o_norm(o) * sigmoid((x.W_ga^T).W_gb^T))  (the gated output norm, fp32)
//
// Weights under `prefix` ("layers.i.self_attn."): q_proj, k_proj, v_proj [P, D]; conv1d.weight
// [3P, 1, K] (or the hub layout's q_conv1d / k_conv1d / v_conv1d [P, 1, K], concatenated at load);
// forget_gate.f_a_proj [d, D], forget_gate.f_b_proj [P, d], forget_gate.dt_bias [P],
// forget_gate.A_log [H]; b_proj [H, D]; g_a_proj [d, D], g_b_proj [P, d]; o_norm.weight [d];
// o_proj [D, P]. conv1d, dt_bias and A_log are kept in fp32 (the reference's
// _keep_in_fp32_modules_strict).
//
// Cache (per slot): "conv" {K-1, 3P} in the activation dtype and "recurrent" {H, d, d} fp32. Decode
// and verify steps run the recurrent form, everything else the chunked one (chunk 64).
//
// Tensor parallelism (model/tensor_parallel.h): when the heads split evenly over the ranks, a rank
// reads its heads' rows of q/k/v, the conv, f_b, dt_bias, A_log, b and g_b (f_a, g_a and o_norm are
// shared by every head, read whole), keeps their conv channels and states, and the matching o_proj
// columns: its output is a partial sum. Otherwise the mixer stays whole on every rank.
//
// Speculative verify: the conv and the recurrence read the slots and leave them (write_state false);
// the projections u, f and b of every row stay in the verify scratch, and commit() replays the kept
// rows of every sequence on its slots with the same kernels, so the state after a commit is exactly
// the state decoding the kept rows would leave.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "model/blocks/layer.h"
#include "model/weight_store.h"

namespace metrale {

struct KdaConfig {
  int64_t hidden_size = 0;  // D
  int64_t num_heads = 0;    // H (linear_num_heads)
  int64_t head_dim = 0;     // d (linear_head_dim), keys and values alike
  int64_t conv_kernel = 4;  // K
  double rms_norm_eps = 1e-5;
  std::optional<double> lower_bound = -5.0;  // nullopt: the softplus gate

  int64_t projection_dim() const { return num_heads * head_dim; }  // P
};

class KdaMixer : public Mixer {
 public:
  KdaMixer(const KdaConfig& config, Weights& weights, const std::string& prefix);

  bool output_is_partial() const override { return partial_; }

  CacheSpec cache_spec() const override;
  size_t scratch_bytes(const ForwardBatch& batch, Device device) const override;
  void forward(const StepContext& step, const BlockCache& cache, const Tensor& x, const Tensor& out) override;
  size_t verify_scratch_bytes(int64_t num_tokens, int64_t num_seqs, DType activation) const override;
  void commit(const StepContext& step, const BlockCache& cache, const VerifyCommit& kept_rows) override;

 private:
  // The per-row inputs of the conv and the recurrence (kept in the verify scratch on verify steps).
  struct RowInputs {
    Tensor projected;  // [T, 3P] u
    Tensor f;          // [T, P] forget-gate projection
    Tensor b;          // [T, H] beta logits
  };
  RowInputs kept_inputs(const StepContext& step) const;
  // The conv and the delta rule of `rows` over the batch layout (cu_q, kv_lens, slots) into core
  // [T, H, d].
  void mix(const StepContext& step, const BlockCache& cache, const RowInputs& rows, const Tensor& cu_q,
           const Tensor& kv_lens, const Tensor& slots, int64_t max_q_len, bool recurrent, bool write_state,
           const Tensor& core) const;
  // `slice` of the stored [full] tensor `key`, as fp32 on the weights' device.
  Tensor load_f32(Weights& weights, const std::string& key, const Shape& full, const TensorSlice& slice);

  static constexpr size_t kConv = 0, kRecurrent = 1;  // BlockCache::tensors

  KdaConfig config_;  // num_heads: this rank's heads
  bool partial_ = false;
  // Projections are plain or FP8 (kernels::LinearWeight); with FP8 weights the GPU keeps q/k/v apart.
  kernels::LinearWeight q_proj_, k_proj_, v_proj_;  // [P, D] each (CPU: checkpoint views)
  Tensor qkv_proj_;                                 // [3P, D] bf16: the three in one weight (CUDA: one GEMM)
  kernels::LinearWeight f_a_, f_b_, b_proj_;        // [d, D], [P, d], [H, D]
  kernels::LinearWeight g_a_, g_b_;                 // [d, D], [P, d]
  Tensor o_norm_;                                   // [d]
  kernels::LinearWeight o_proj_;                    // [D, P]
  Tensor conv_weight_;               // [3P, K] f32
  Tensor dt_bias_, a_log_;           // [P], [H] f32
  std::vector<OwnedTensor> owned_;
};

}  // namespace metrale
