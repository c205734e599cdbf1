// Rotary embedding: inverse frequencies computed the way transformers computes them (fp32), for
// the default, linear and YaRN rope types.
#pragma once

#include "kernels/rope.h"
#include "model/config.h"

namespace metrale {

class RotaryEmbedding {
 public:
  // head_dim: the attention head size; the rotary part is head_dim * partial_rotary_factor
  // (or `rotary_dim_override` when > 0).
  RotaryEmbedding(const RopeConfig& config, int64_t head_dim, int64_t max_position_embeddings, Device device,
                  int64_t rotary_dim_override = 0);

  int rotary_dim() const { return params_.rotary_dim; }
  const Tensor& inv_freq() const { return inv_freq_.tensor; }
  const kernels::RopeParams& params() const { return params_; }
  // x [T, heads, head_dim], rotated in place at `positions` [T] i32.
  void apply(const Tensor& x, const Tensor& positions) const { kernels::rope(x, positions, inv_freq_.tensor, params_); }

 private:
  OwnedTensor inv_freq_;  // [rotary_dim / 2] f32
  kernels::RopeParams params_;
};

}  // namespace metrale
