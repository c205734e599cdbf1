// Sparse mixture of experts: softmax router, top-k, optional renormalisation, SwiGLU experts, and
// an optional shared expert with a sigmoid gate (Qwen3-Next / Qwen3.5-MoE).
//
// Expert weights load from either checkpoint layout:
//   per expert: <prefix>experts.{e}.{gate,up,down}_proj.weight  [I, H], [I, H], [H, I]
//   fused:      <prefix>experts.gate_up_proj [E, 2I, H] (gate rows first), <prefix>experts.down_proj [E, H, I]
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "model/blocks/mlp.h"

namespace metrale {

struct MoeConfig {
  int64_t hidden_size = 0;
  int64_t num_experts = 0;
  int64_t top_k = 0;
  int64_t expert_intermediate_size = 0;
  bool normalize_top_k = false;
  int64_t shared_expert_intermediate_size = 0;  // 0: no shared expert
};

class Moe : public FeedForward {
 public:
  Moe(const MoeConfig& config, Weights& weights, const std::string& prefix);
  void forward(const StepContext& step, const Tensor& x, const Tensor& out) override;

 private:
  MoeConfig config_;
  Tensor router_;                        // [E, H]
  std::vector<SwiGluWeights> experts_;   // E views (into the fused tensors or per-expert tensors)
  std::optional<SwiGluWeights> shared_expert_;
  Tensor shared_expert_gate_;            // [1, H]
};

}  // namespace metrale
