// SwiGLU feed-forward: down(silu(gate(x)) * up(x)).
#pragma once

#include <string>

#include "model/blocks/layer.h"
#include "model/weight_store.h"

namespace metrale {

struct SwiGluWeights {
  Tensor gate;  // [I, H]
  Tensor up;    // [I, H]
  Tensor down;  // [H, I]

  int64_t intermediate_size() const { return gate.size(0); }
  // x [n, H] -> out [n, H] (overwritten, or added to with `accumulate`).
  void run(const StepContext& step, const Tensor& x, const Tensor& out, bool accumulate = false) const;
};

class Mlp : public FeedForward {
 public:
  // Loads `<prefix>{gate,up,down}_proj.weight`.
  Mlp(Weights& weights, const std::string& prefix, int64_t hidden_size, int64_t intermediate_size);
  void forward(const StepContext& step, const Tensor& x, const Tensor& out) override;

 private:
  SwiGluWeights weights_;
};

}  // namespace metrale
