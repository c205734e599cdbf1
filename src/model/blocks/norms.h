// RMSNorm weights bound to their kernel parameters.
#pragma once

#include <string>

#include "kernels/rms_norm.h"
#include "model/weight_store.h"

namespace metrale {

struct RmsNorm {
  Tensor weight;  // [dim]
  kernels::RmsNormParams params;

  static RmsNorm load(Weights& weights, const std::string& key, int64_t dim, double eps, kernels::RmsNormKind kind) {
    return RmsNorm{weights.get(key, {dim}), {static_cast<float>(eps), kind}};
  }
  void apply(const Tensor& x, const Tensor& out) const { kernels::rms_norm(x, weight, out, params); }
  // residual += x; out = norm(residual)
  void add_and_apply(const Tensor& residual, const Tensor& x, const Tensor& out) const {
    kernels::add_rms_norm(residual, x, weight, out, params);
  }
};

}  // namespace metrale
