#include "model/blocks/pre_norm.h"

#include "core/error.h"
#include "kernels/elementwise.h"

namespace metrale {

PreNormResidual::PreNormResidual(std::vector<RmsNorm> site_norms, RmsNorm final_norm)
    : site_norms_(std::move(site_norms)), final_norm_(std::move(final_norm)) {
  for (size_t s = 0; s < site_norms_.size(); ++s) {
    METRALE_CHECK(site_norms_[s].weight.numel() == hidden_size(), "pre-norm residual: site {} norm {} for width {}", s,
                  site_norms_[s].weight.describe(), hidden_size());
  }
}

const RmsNorm& PreNormResidual::norm_of(int64_t site) const {
  METRALE_CHECK(site >= 0 && site < num_sites(), "pre-norm residual: site {} of {}", site, num_sites());
  return site_norms_[static_cast<size_t>(site)];
}

ResidualStreams PreNormResidual::allocate(const StepContext& step) const {
  ResidualStreams streams;
  streams.streams = step.workspace.alloc(step.activation_dtype, {step.batch.num_tokens, hidden_size()});  // [T, H] h
  streams.input = streams.streams;
  return streams;
}

void PreNormResidual::begin(const StepContext& /*step*/, const ResidualStreams& /*streams*/) const {
  // The input rows are the residual already.
}

void PreNormResidual::pre(const StepContext& /*step*/, const ResidualStreams& streams, int64_t site,
                          const Tensor& x) const {
  norm_of(site).apply(streams.streams, x);
}

void PreNormResidual::post(const StepContext& /*step*/, const ResidualStreams& streams, int64_t site,
                           const Tensor& out) const {
  norm_of(site);  // range check
  kernels::add_inplace(streams.streams, out);
}

void PreNormResidual::finish(const StepContext& /*step*/, const ResidualStreams& streams, const Tensor& hidden) const {
  final_norm_.apply(streams.streams, hidden);
}

void PreNormResidual::post_pre(const StepContext& /*step*/, const ResidualStreams& streams, int64_t site,
                               const Tensor& out, const Tensor& next_x) const {
  norm_of(site + 1).add_and_apply(streams.streams, out, next_x);
}

void PreNormResidual::post_finish(const StepContext& /*step*/, const ResidualStreams& streams, int64_t site,
                                  const Tensor& out, const Tensor& hidden) const {
  norm_of(site);
  final_norm_.add_and_apply(streams.streams, out, hidden);
}

}  // namespace metrale
