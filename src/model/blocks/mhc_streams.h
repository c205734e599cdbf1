// mHC, manifold-constrained hyper-connections (glm_deepseek.md §2.4) as a residual scheme: every
// token carries n residual streams X [n, D]; each site (a layer's mixer or FFN) reads
//   (post, M, h) = hc_pre(site maps, X);  x = site_norm(h)
// and hands its output y back as X' = post (x) y + M^T X; the model's final hidden state is
// final_norm(mean_j X_j). The map computation of a site (unweighted RMSNorm over the n*D values,
// the (2+n)n projection, sigmoid pre / post, 20 Sinkhorn iterations, the collapse) is one
// kernels::mhc_pre call, its application one kernels::mhc_post call.
//
// Per step (allocate): streams [T, n*D] (stream-major per token), input [T, D] (the embeddings,
// copied into every stream by begin), and the state one site's pre map leaves for its post map:
// post [T, n] f32, comb [T, n, n] f32, h [T, D] activation dtype. A site's maps fn [(2+n)n, n*D],
// base [(2+n)n], scale [3] are held in bf16, as the reference rounds them on a bf16 load.
#pragma once

#include <string>
#include <vector>

#include "kernels/mhc.h"
#include "model/blocks/norms.h"
#include "model/blocks/residual.h"

namespace metrale {

struct MhcSiteMaps {
  Tensor fn, base, scale;  // [(2+n)n, n*D], [(2+n)n], [3]
  RmsNorm norm;            // the site's input norm (input_layernorm / post_attention_layernorm)
};

class MhcResidual : public ResidualScheme {
 public:
  MhcResidual(std::vector<MhcSiteMaps> sites, RmsNorm final_norm, int64_t num_streams, kernels::MhcParams params,
              std::vector<OwnedTensor> owned, Device device);

  // The maps of one site under `prefix` ("layers.3.attn_hc."): fn, base, scale, read into owned
  // bf16 tensors (appended to `owned`).
  static MhcSiteMaps load_site(Weights& weights, const std::string& prefix, int64_t num_streams,
                               int64_t hidden_size, RmsNorm norm, std::vector<OwnedTensor>& owned);

  int64_t hidden_size() const override { return final_norm_.weight.numel(); }
  int64_t stream_width() const override { return num_streams_ * hidden_size(); }
  int64_t num_sites() const override { return static_cast<int64_t>(sites_.size()); }

  ResidualStreams allocate(const StepContext& step) const override;
  void begin(const StepContext& step, const ResidualStreams& streams) const override;
  void pre(const StepContext& step, const ResidualStreams& streams, int64_t site, const Tensor& x) const override;
  void post(const StepContext& step, const ResidualStreams& streams, int64_t site, const Tensor& out) const override;
  void finish(const StepContext& step, const ResidualStreams& streams, const Tensor& hidden) const override;

 private:
  // Calls run(first_row, rows) over [0, T) in pieces of at most kRowsPerCall rows (the bound the
  // spread index and the CUDA pre-map workspace are sized for).
  template <typename Run>
  static void by_rows(int64_t tokens, Run&& run);
  Tensor stream_view(const ResidualStreams& streams) const;  // [T, n, D]
  const MhcSiteMaps& site_of(int64_t site) const;

  static constexpr int64_t kRowsPerCall = 4096;
  std::vector<MhcSiteMaps> sites_;
  RmsNorm final_norm_;
  int64_t num_streams_;
  kernels::MhcParams params_;
  std::vector<OwnedTensor> owned_;
  OwnedTensor spread_index_;  // [kRowsPerCall * n] i32: row i reads input row i / n
  OwnedTensor pre_workspace_;  // CUDA: mhc_pre's split-reduction scratch, zeroed at construction
};

}  // namespace metrale
