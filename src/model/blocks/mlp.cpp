#include "model/blocks/mlp.h"

#include "kernels/activation.h"
#include "kernels/linear_weight.h"

namespace metrale {

void SwiGluWeights::run(const StepContext& step, const Tensor& x, const Tensor& out, bool accumulate) const {
  const int64_t rows = x.size(0), width = intermediate_size();
  // [rows, 2I]: gate columns then up columns.
  const Tensor gate_up_out = step.workspace.alloc(step.activation_dtype, {rows, 2 * width});
  const Tensor gate_out = gate_up_out.slice(1, 0, width);
  const Tensor up_out = gate_up_out.slice(1, width, 2 * width);
  if (!gate_up.empty()) {
    kernels::linear(x, gate_up, gate_up_out);
  } else {
    kernels::linear(x, gate, gate_out);
    kernels::linear(x, up, up_out);
  }
  const Tensor hidden = step.workspace.alloc(step.activation_dtype, {rows, width});
  kernels::silu_mul(gate_out, up_out, hidden, limit);
  kernels::linear(hidden, down, out, accumulate);
}

Mlp::Mlp(Weights& weights, const std::string& prefix, int64_t hidden_size, int64_t intermediate_size,
         float swiglu_limit) {
  weights_ = load_swiglu(weights, prefix, hidden_size, intermediate_size, swiglu_limit, /*fuse=*/true);
  partial_ = weights_.intermediate_size() != intermediate_size;
}

SwiGluWeights load_swiglu(Weights& weights, const std::string& prefix, int64_t hidden_size, int64_t intermediate_size,
                          float swiglu_limit, bool fuse) {
  SwiGluWeights loaded;
  loaded.limit = swiglu_limit;
  const std::optional<IndexRange> share = weights.tensor_parallel().split_share(intermediate_size);
  const int64_t width = share ? share->size() : intermediate_size;
  TensorSlice rows, columns;  // gate and up rows, down columns: this rank's intermediate units
  if (share) {
    append_rows(rows.rows, *share);
    columns = TensorSlice::of_columns(share->begin, share->end);
  }
  const std::string keys[] = {prefix + "gate_proj.weight", prefix + "up_proj.weight"};
  const int64_t local_rows[] = {width, width}, full_rows[] = {intermediate_size, intermediate_size};
  const TensorSlice slices[] = {rows, rows};
  if (fuse) loaded.gate_up = weights.get_fused_linear(keys, local_rows, hidden_size, slices, full_rows);
  if (loaded.gate_up.empty()) {
    loaded.gate = weights.get_linear(keys[0], {intermediate_size, hidden_size}, rows);
    loaded.up = weights.get_linear(keys[1], {intermediate_size, hidden_size}, rows);
  }
  loaded.down = weights.get_linear(prefix + "down_proj.weight", {hidden_size, intermediate_size}, columns);
  return loaded;
}

void Mlp::forward(const StepContext& step, const Tensor& x, const Tensor& out) {
  weights_.run(step, x, out);
}

}  // namespace metrale
