// Sparse mixture of experts: a softmax router (Qwen) or the DeepSeek-V3 sigmoid router (correction
// bias for the choice only, groups, routed_scaling_factor; glm_deepseek.md §1), top-k, optional
// renormalisation, SwiGLU experts (optionally clamped), and an optional shared expert, with a sigmoid
// gate (Qwen3-Next / Qwen3.5-MoE: <prefix>shared_expert.*, shared_expert_gate) or without one
// (DeepSeek-V3 style: <prefix>shared_experts.*, added after the routed sum is rounded).
//
// Expert weights load from either checkpoint layout:
//   per expert: <prefix>experts.{e}.{gate,up,down}_proj.weight  [I, H], [I, H], [H, I]
//   fused:      <prefix>experts.gate_up_proj [E, 2I, H] (gate rows first), <prefix>experts.down_proj [E, H, I]
// On the CPU the block keeps zero-copy views into the mapped checkpoint. On CUDA it builds, at load,
// the layout the kernels read (kernels::MoeExpertWeights): contiguous gate_up [E, 2I, H] and
// down [E, H, I] in the compute dtype (bf16, or f32 in an f32 run), converted at load when the
// checkpoint stores another dtype.
// FP8 experts (f8e4m3 tensors with *_scale_inv, or Weights under --quantization fp8) take that fused
// layout on both devices, in f8e4m3 with fp32 128x128 block scales (MoeExpertWeights::gate_up_scale,
// down_scale), read or quantised one expert at a time: no bf16 copy of the experts is ever made.
// The shared expert's projections read through Weights::get_linear (plain or FP8); the router
// (gate.weight) and shared_expert_gate stay plain (in the compute dtype on the GPU).
//
// forward runs the same ops on both devices, all from host-known shapes (graph-safe on CUDA):
//   router logits [T, E] f32 = x . W_gate^T (on the GPU with a gated shared expert, one GEMV over
//   [E + 1, H] also gives the gate's logit); moe_route -> topk ids [T, k], weights [T, k];
//   T * k <= kernels::kMoeDecodeMaxSlots: decode path. When the shared expert has the routed
//   experts' width and format (or there is none), two ops: moe_decode_gate_up over the k routed
//   slots plus the shared expert's slot of every token, and moe_decode_down_combine (the down
//   projections and the weighted sum in one). Otherwise per-slot GEMVs, the shared expert as an
//   MLP, and moe_combine;
//   larger steps: moe_sort by expert, grouped gate_up + SiLU, grouped down, the shared expert as an
//   MLP, moe_combine: fp32 weighted sum over the k slots (+ shared expert), one rounding.
//
// Workspace per step (allocated from step.workspace in this order, same sizes for the same T):
//   router logits T*E (or T*(E+1)) f32, topk ids T*k i32, topk weights T*k f32, then
//   fused decode: h (T*k + T)*I f32 (T*k*I without a shared slot), gate logits T f32 on the CPU;
//   otherwise slot_out T*k*H f32, then decode: h T*k*I f32; grouped: offsets E+1 i32, sorted slots
//   T*k i32, sort scratch ceil(T*k/256)*E i32, h T*k*I activation dtype; shared expert: its MLP
//   temporaries, T*H f32, T f32.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "kernels/moe.h"
#include "model/blocks/mlp.h"

namespace metrale {

struct MoeConfig {
  int64_t hidden_size = 0;
  int64_t num_experts = 0;
  int64_t top_k = 0;
  int64_t expert_intermediate_size = 0;
  bool normalize_top_k = false;
  int64_t shared_expert_intermediate_size = 0;  // 0: no shared expert
  kernels::MoeScoring scoring = kernels::MoeScoring::kSoftmax;
  bool correction_bias = false;  // <prefix>gate.e_score_correction_bias [E], kept in fp32
  int n_group = 1, topk_group = 1;
  float routed_scaling_factor = 1.0f;
  float swiglu_limit = 0.0f;  // > 0: the clamped SwiGLU in the routed and shared experts
  // The shared expert's key prefix and whether it has a sigmoid gate (shared_expert_gate.weight).
  std::string shared_expert_prefix = "shared_expert.";
  bool shared_expert_gated = true;
};

// Under tensor parallelism (Weights::tensor_parallel) a rank keeps its even share of every expert's
// intermediate units (and of the shared expert's): the matching gate and up rows and down columns;
// the router and the shared expert's gate stay whole (every rank routes alike), and the output is a
// partial sum. Units that do not split evenly, and FP8 experts, keep the block whole on every rank.
class Moe : public FeedForward {
 public:
  Moe(const MoeConfig& config, Weights& weights, const std::string& prefix);
  void forward(const StepContext& step, const Tensor& x, const Tensor& out) override;
  bool output_is_partial() const override { return partial_; }
  // Uniform routing: `rows` rows choosing top_k of E experts touch E (1 - (1 - top_k / E)^rows)
  // distinct experts in expectation, each 3 x H x I weights (gate, up, down).
  double routed_weight_bytes(int64_t rows) const override;

 private:
  // Sets the tensor-parallel share (partial_, the slices, the local sizes in config_).
  void choose_share(const TensorParallel& tensor_parallel, bool fp8_experts);
  void load_shared_expert(Weights& weights, const std::string& prefix);
  void load_experts_cpu(Weights& weights, const std::string& prefix);
  void load_experts_device(Weights& weights, const std::string& prefix);
  // FP8 experts (an f8e4m3 checkpoint, --quantization fp8, or random FP8) on either device: fused
  // f8e4m3 gate_up [E, 2I, H] and down [E, H, I] with their block scales, from either layout.
  void load_experts_fp8(Weights& weights, const std::string& prefix, bool fused);
  // The checkpoint tensor `prefix + key` in the compute dtype on the model's (CUDA) device, owned by
  // the block.
  Tensor load_device(Weights& weights, const std::string& key, const Shape& shape, const TensorSlice& slice = {});

  MoeConfig config_;  // the sizes of this rank's share
  // Tensor parallelism: the stored sizes, and this rank's rows and columns of an expert's [gate; up]
  // [2I, H] and down [H, I] (and of the shared expert's gate or up [S, H] and down [H, S]); whole
  // slices unless partial_.
  int64_t full_intermediate_ = 0, full_shared_intermediate_ = 0;
  bool partial_ = false;
  TensorSlice expert_rows_, expert_columns_, shared_rows_, shared_columns_;
  Tensor router_;  // [E, H]
  kernels::MoeExpertWeights experts_;
  std::optional<SwiGluWeights> shared_expert_;
  Tensor shared_expert_gate_;  // [1, H] (gated shared expert only)
  // GPU with a gated shared expert: [E + 1, H], router_ and shared_expert_gate_ are its rows.
  Tensor router_and_gate_;
  // The shared expert as the decode ops' extra slot (empty without one, or when it does not fit).
  kernels::MoeSharedExpert shared_slot_;
  bool fused_decode_ = false;       // the decode path runs moe_decode_down_combine
  Tensor correction_bias_;          // [E] f32 (sigmoid router only)
  std::vector<OwnedTensor> owned_;  // device copies this block made (CUDA only)
};

}  // namespace metrale
