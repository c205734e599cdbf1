// SwiGLU feed-forward: down(silu(gate(x)) * up(x)).
#pragma once

#include <string>

#include "model/blocks/layer.h"
#include "model/weight_store.h"

namespace metrale {

// Plain or FP8 block-scaled weights (kernels::LinearWeight).
struct SwiGluWeights {
  kernels::LinearWeight gate;     // [I, H]
  kernels::LinearWeight up;       // [I, H]
  kernels::LinearWeight down;     // [H, I]
  kernels::LinearWeight gate_up;  // [2I, H]: gate rows then up rows, when both live in one tensor (one GEMM)
  float limit = 0.0f;             // > 0: the clamped SwiGLU (swiglu_limit, glm_deepseek.md §1)

  int64_t intermediate_size() const { return down.size(1); }
  // x [n, H] -> out [n, H] (overwritten, or added to with `accumulate`).
  void run(const StepContext& step, const Tensor& x, const Tensor& out, bool accumulate = false) const;
};

class Mlp : public FeedForward {
 public:
  // Loads `<prefix>{gate,up,down}_proj.weight`; swiglu_limit > 0 clamps the projections.
  Mlp(Weights& weights, const std::string& prefix, int64_t hidden_size, int64_t intermediate_size,
      float swiglu_limit = 0.0f);
  void forward(const StepContext& step, const Tensor& x, const Tensor& out) override;

 private:
  SwiGluWeights weights_;
};

}  // namespace metrale
