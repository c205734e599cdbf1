// LinearWeight: the weight of a projection as the model blocks hold it, either a plain matrix or an
// FP8 block-scaled one with its scales; linear() runs whichever it is.
#pragma once

#include <string>

#include "core/error_base.h"
#include "kernels/linear.h"
#include "kernels/linear_fp8.h"

namespace metrale::kernels {

struct LinearWeight {
  Tensor weight;     // [N, K] bf16|f16|f32, or f8e4m3 with scale_inv
  Tensor scale_inv;  // [ceil(N/128), ceil(K/128)] f32 for an f8e4m3 weight; empty otherwise

  LinearWeight() = default;
  // A plain weight: blocks that assign a Tensor keep working unchanged.
  LinearWeight(Tensor plain) : weight(std::move(plain)) {}  // NOLINT(google-explicit-constructor)
  LinearWeight(Tensor fp8, Tensor scales) : weight(std::move(fp8)), scale_inv(std::move(scales)) {}

  bool empty() const { return weight.empty(); }
  bool is_fp8() const { return !scale_inv.empty(); }
  int64_t out_features() const { return weight.size(0); }
  int64_t in_features() const { return weight.size(1); }
  int64_t size(int dim) const { return weight.size(dim); }
  // Output rows [begin, end): for an FP8 weight `begin` must start a 128-row scale block.
  LinearWeight rows(int64_t begin, int64_t end) const {
    if (!is_fp8()) return LinearWeight(weight.slice(0, begin, end));
    if (begin % kFp8Block != 0) {
      raise_message(ErrorCode::kInternal,
                    "FP8 weight rows from " + std::to_string(begin) + ": not the start of a 128-row scale block");
    }
    return LinearWeight(weight.slice(0, begin, end), scale_inv.slice(0, begin / kFp8Block, fp8_scale_blocks(end)));
  }
};

// x [M, K] -> out [M, N] as linear() / linear_fp8() (overwritten, or added to with `accumulate`).
inline void linear(const Tensor& x, const LinearWeight& weight, const Tensor& out, bool accumulate = false) {
  if (weight.is_fp8()) {
    linear_fp8(x, weight.weight, weight.scale_inv, out, accumulate);
  } else {
    linear(x, weight.weight, out, accumulate);
  }
}

}  // namespace metrale::kernels
