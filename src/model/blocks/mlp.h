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

// Loads `<prefix>{gate,up,down}_proj.weight` of a SwiGLU of `intermediate_size` units; `fuse`: gate and
// up in one weight where Weights::get_fused_linear can. Under tensor parallelism
// (Weights::tensor_parallel) the rank's even share of the units when they split evenly: the matching
// gate and up rows and down columns (the result's intermediate_size() tells), whose output is then a
// partial sum; otherwise all of them.
SwiGluWeights load_swiglu(Weights& weights, const std::string& prefix, int64_t hidden_size, int64_t intermediate_size,
                          float swiglu_limit, bool fuse);

class Mlp : public FeedForward {
 public:
  // Loads `<prefix>{gate,up,down}_proj.weight`; swiglu_limit > 0 clamps the projections.
  Mlp(Weights& weights, const std::string& prefix, int64_t hidden_size, int64_t intermediate_size,
      float swiglu_limit = 0.0f);
  void forward(const StepContext& step, const Tensor& x, const Tensor& out) override;
  bool output_is_partial() const override { return partial_; }

 private:
  SwiGluWeights weights_;
  bool partial_ = false;  // a tensor-parallel share of the units
};

}  // namespace metrale
