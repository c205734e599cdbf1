#include "model/blocks/hyper_connections.h"

#include "core/error.h"
#include "kernels/linear.h"

namespace metrale {

HyperConnectionWeights HyperConnectionWeights::load(Weights& weights, const std::string& prefix, int64_t streams,
                                                    int64_t hidden, int64_t rank, bool with_inject) {
  const int64_t width = streams * hidden;
  HyperConnectionWeights w;
  w.norm = weights.get(prefix + "hc_norm.weight", {width});
  if (weights.device().is_cuda() && with_inject) {
    w.down_inject = OwnedTensor(weights.compute_dtype(), {rank + streams, width}, weights.device());
    weights.load_into(prefix + "input_mix_weight_down.weight", w.down_inject.tensor.slice(0, 0, rank));
    weights.load_into(prefix + "block_inject_weight.weight", w.down_inject.tensor.slice(0, rank, rank + streams));
    w.down = w.down_inject.tensor.slice(0, 0, rank);
    w.inject = w.down_inject.tensor.slice(0, rank, rank + streams);
  } else {
    w.down = weights.get(prefix + "input_mix_weight_down.weight", {rank, width});
    if (with_inject) w.inject = weights.get(prefix + "block_inject_weight.weight", {streams, width});
  }
  w.up = weights.get(prefix + "input_mix_weight_up.weight", {width, rank});
  return w;
}

HyperConnectionResidual::HyperConnectionResidual(int64_t streams, int64_t hidden, int64_t rank, double eps,
                                                 std::vector<HyperConnectionWeights> sites,
                                                 HyperConnectionWeights mixer)
    : streams_(streams),
      hidden_(hidden),
      rank_(rank),
      eps_(static_cast<float>(eps)),
      sites_(std::move(sites)),
      mixer_(std::move(mixer)) {
  METRALE_CHECK(streams_ > 1 && hidden_ > 0 && rank_ > 0, "hyper-connections: {} streams of {}, rank {}", streams_,
                hidden_, rank_);
  for (size_t s = 0; s < sites_.size(); ++s) {
    METRALE_CHECK(!sites_[s].inject.empty(), "hyper-connections: site {} without injection weights", s);
  }
  METRALE_CHECK(mixer_.inject.empty(), "hyper-connections: the final mixer has no injection weights");
}

const HyperConnectionWeights& HyperConnectionResidual::site(int64_t index) const {
  METRALE_CHECK(index >= 0 && index < num_sites(), "hyper-connections: site {} of {}", index, num_sites());
  return sites_[static_cast<size_t>(index)];
}

kernels::HcParams HyperConnectionResidual::params(kernels::HcUpdate update) const {
  return {static_cast<int>(streams_), eps_, update};
}

ResidualStreams HyperConnectionResidual::allocate(const StepContext& step) const {
  const int64_t tokens = step.batch.num_tokens, width = stream_width();
  const DType act = step.activation_dtype;
  ResidualStreams streams;
  streams.streams = step.workspace.alloc(act, {tokens, width});                    // [T, N*H] R
  streams.input = step.workspace.alloc(act, {tokens, hidden_});                    // [T, H] the embeddings
  streams.state.push_back(step.workspace.alloc(act, {tokens, width}));             // kNormed
  streams.state.push_back(step.workspace.alloc(act, {tokens, rank_ + streams_}));  // kGemm
  streams.state.push_back(step.workspace.alloc(act, {tokens, rank_}));             // kAct
  streams.state.push_back(step.workspace.alloc(act, {tokens, streams_}));          // kBeta
  streams.state.push_back(step.workspace.alloc(act, {tokens, width}));             // kUp
  return streams;
}

void HyperConnectionResidual::begin(const StepContext& /*step*/, const ResidualStreams& streams) const {
  // R_n = e for every stream; only the update runs.
  kernels::hc_norm(streams.streams, streams.input, Tensor(), mixer_.norm, Tensor(),
                   params(kernels::HcUpdate::kBroadcast));
}

void HyperConnectionResidual::norm(const ResidualStreams& streams, const HyperConnectionWeights& connection,
                                   kernels::HcUpdate update, const Tensor& out) const {
  const bool inject = update == kernels::HcUpdate::kInject;
  kernels::hc_norm(streams.streams, inject ? out : Tensor(), inject ? streams.state[kBeta] : Tensor(), connection.norm,
                   streams.state[kNormed], params(update));
}

void HyperConnectionResidual::mix(const ResidualStreams& streams, const HyperConnectionWeights& connection,
                                  const Tensor& x) const {
  const Tensor& normed = streams.state[kNormed];
  const Tensor& gemm = streams.state[kGemm];
  const bool injects = !connection.inject.empty();
  const Tensor down = gemm.slice(1, 0, rank_);
  const Tensor inject = gemm.slice(1, rank_, rank_ + streams_);
  if (!connection.down_inject.tensor.empty()) {
    kernels::linear(normed, connection.down_inject.tensor, gemm);  // [T, r + N] in one GEMM
  } else {
    kernels::linear(normed, connection.down, down);
    if (injects) kernels::linear(normed, connection.inject, inject);
  }
  kernels::hc_gates_up_mix(down, injects ? inject : Tensor(), connection.up, normed, streams.state[kAct],
                           injects ? streams.state[kBeta] : Tensor(), streams.state[kUp], x,
                           params(kernels::HcUpdate::kNone));
}

void HyperConnectionResidual::pre(const StepContext& /*step*/, const ResidualStreams& streams, int64_t index,
                                  const Tensor& x) const {
  const HyperConnectionWeights& connection = site(index);
  norm(streams, connection, kernels::HcUpdate::kNone, Tensor());
  mix(streams, connection, x);
}

void HyperConnectionResidual::post(const StepContext& /*step*/, const ResidualStreams& streams, int64_t index,
                                   const Tensor& out) const {
  site(index);  // range check
  // R_n <- D(R_n + D(beta_n * u)) with the beta of this site's pre map; no norm.
  kernels::hc_norm(streams.streams, out, streams.state[kBeta], mixer_.norm, Tensor(),
                   params(kernels::HcUpdate::kInject));
}

void HyperConnectionResidual::finish(const StepContext& /*step*/, const ResidualStreams& streams,
                                     const Tensor& hidden) const {
  norm(streams, mixer_, kernels::HcUpdate::kNone, Tensor());
  mix(streams, mixer_, hidden);
}

void HyperConnectionResidual::post_pre(const StepContext& /*step*/, const ResidualStreams& streams, int64_t index,
                                       const Tensor& out, const Tensor& next_x) const {
  site(index);
  const HyperConnectionWeights& next = site(index + 1);
  norm(streams, next, kernels::HcUpdate::kInject, out);
  mix(streams, next, next_x);
}

void HyperConnectionResidual::post_finish(const StepContext& /*step*/, const ResidualStreams& streams, int64_t index,
                                          const Tensor& out, const Tensor& hidden) const {
  site(index);
  norm(streams, mixer_, kernels::HcUpdate::kInject, out);
  mix(streams, mixer_, hidden);
}

}  // namespace metrale
