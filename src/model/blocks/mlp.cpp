#include "model/blocks/mlp.h"

#include "kernels/activation.h"
#include "kernels/linear.h"

namespace metrale {

void SwiGluWeights::run(const StepContext& step, const Tensor& x, const Tensor& out, bool accumulate) const {
  const int64_t rows = x.size(0), width = intermediate_size();
  const Tensor gate_out = step.workspace.alloc(step.activation_dtype, {rows, width});
  const Tensor up_out = step.workspace.alloc(step.activation_dtype, {rows, width});
  kernels::linear(x, gate, gate_out);
  kernels::linear(x, up, up_out);
  kernels::silu_mul(gate_out, up_out, gate_out);
  kernels::linear(gate_out, down, out, accumulate);
}

Mlp::Mlp(Weights& weights, const std::string& prefix, int64_t hidden_size, int64_t intermediate_size) {
  weights_.gate = weights.get(prefix + "gate_proj.weight", {intermediate_size, hidden_size});
  weights_.up = weights.get(prefix + "up_proj.weight", {intermediate_size, hidden_size});
  weights_.down = weights.get(prefix + "down_proj.weight", {hidden_size, intermediate_size});
}

void Mlp::forward(const StepContext& step, const Tensor& x, const Tensor& out) { weights_.run(step, x, out); }

}  // namespace metrale
