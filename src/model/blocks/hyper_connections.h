// Hyper-connection residual scheme (qwen4_exp, qwen.md §5.5, §7.1): every token carries N residual
// streams R [T, N*H] (stream n = channels [n*H, (n+1)*H)), all starting as the token embedding. No
// layer norm: each site (layer i's mixer is site 2i with `attn_hyper_connection`, its MoE site 2i + 1
// with `mlp_hyper_connection`) reads its input through a connection:
//   R~ = hc_norm(R)                                   grouped zero-centred RMSNorm, one weight per stream
//   a  = D(silu(D(D(W_down R~) / N)))                 [T, r_hc]
//   m  = D(sigmoid(D(W_up a)))                        [T, N*H]
//   x  = D(mean_n D(m_n * R~_n))                      [T, H] the site input (fp32 sum, one rounding)
//   beta = 2 * D(sigmoid(D(D(W_inj R~) / N)))         [T, N] the injection weights
// and its output u [T, H] goes back as R_n <- D(R_n + D(beta_n * u)). The final
// `hyper_connection_mixer` runs the first four steps (no injection) and gives the hidden state the
// LM head reads. The kernels are those of kernels/hyper_connection.h; the injection of site k is
// fused with the norm of site k + 1 (post_pre) or of the final mixer (post_finish).
//
// Per-step memory (ResidualStreams::state, one set shared by the sites: a site's pre map fills it,
// its post map reads beta before the next pre map overwrites it):
//   [0] R~ [T, N*H]   [1] GEMM outputs [T, r_hc + N] (down | inject)   [2] a [T, r_hc]
//   [3] beta [T, N]   [4] W_up a [T, N*H]          all in the activation dtype.
#pragma once

#include <string>
#include <vector>

#include "kernels/hyper_connection.h"
#include "model/blocks/residual.h"
#include "model/weight_store.h"

namespace metrale {

// One connection's weights (an attn/mlp connection, or the final mixer without `inject`).
struct HyperConnectionWeights {
  Tensor norm;    // hc_norm.weight [N*H]
  Tensor down;    // input_mix_weight_down.weight [r_hc, N*H]
  Tensor up;      // input_mix_weight_up.weight [N*H, r_hc]
  Tensor inject;  // block_inject_weight.weight [N, N*H] (empty for the final mixer)
  // GPU: [W_down; W_inj] [r_hc + N, N*H] side by side, one GEMM over R~ per site (`down` and `inject`
  // are then views of its rows); empty on the CPU, where the two stay views into the checkpoint.
  OwnedTensor down_inject;

  // Loads `<prefix>hc_norm.weight` etc.; `with_inject` false for the final mixer.
  static HyperConnectionWeights load(Weights& weights, const std::string& prefix, int64_t streams, int64_t hidden,
                                     int64_t rank, bool with_inject);
};

class HyperConnectionResidual : public ResidualScheme {
 public:
  // `sites`: two per layer (attn, mlp), each with inject weights; `mixer` without.
  HyperConnectionResidual(int64_t streams, int64_t hidden, int64_t rank, double eps,
                          std::vector<HyperConnectionWeights> sites, HyperConnectionWeights mixer);

  int64_t hidden_size() const override { return hidden_; }
  int64_t stream_width() const override { return streams_ * hidden_; }
  int64_t num_sites() const override { return static_cast<int64_t>(sites_.size()); }
  int64_t num_streams() const { return streams_; }

  ResidualStreams allocate(const StepContext& step) const override;
  void begin(const StepContext& step, const ResidualStreams& streams) const override;
  void pre(const StepContext& step, const ResidualStreams& streams, int64_t site, const Tensor& x) const override;
  void post(const StepContext& step, const ResidualStreams& streams, int64_t site, const Tensor& out) const override;
  void finish(const StepContext& step, const ResidualStreams& streams, const Tensor& hidden) const override;
  void post_pre(const StepContext& step, const ResidualStreams& streams, int64_t site, const Tensor& out,
                const Tensor& next_x) const override;
  void post_finish(const StepContext& step, const ResidualStreams& streams, int64_t site, const Tensor& out,
                   const Tensor& hidden) const override;

 private:
  enum State : size_t { kNormed = 0, kGemm = 1, kAct = 2, kBeta = 3, kUp = 4 };
  const HyperConnectionWeights& site(int64_t index) const;
  kernels::HcParams params(kernels::HcUpdate update) const;
  // hc_norm of `connection` on the streams, with `update` applied first (the previous site's
  // injection of `out`, or nothing).
  void norm(const ResidualStreams& streams, const HyperConnectionWeights& connection, kernels::HcUpdate update,
            const Tensor& out) const;
  // From R~ (state kNormed): the GEMMs, gates and mix into x [T, H] (and beta when the connection
  // injects).
  void mix(const ResidualStreams& streams, const HyperConnectionWeights& connection, const Tensor& x) const;

  int64_t streams_, hidden_, rank_;
  float eps_;
  std::vector<HyperConnectionWeights> sites_;
  HyperConnectionWeights mixer_;
};

}  // namespace metrale
