#include "model/blocks/mhc_streams.h"

#include <algorithm>

#include "core/error.h"
#include "kernels/moe.h"

namespace metrale {

MhcResidual::MhcResidual(std::vector<MhcSiteMaps> sites, RmsNorm final_norm, int64_t num_streams,
                         kernels::MhcParams params, std::vector<OwnedTensor> owned, Device device)
    : sites_(std::move(sites)),
      final_norm_(std::move(final_norm)),
      num_streams_(num_streams),
      params_(std::move(params)),
      owned_(std::move(owned)) {
  const int64_t n = num_streams_, d = hidden_size(), mix = (2 + n) * n;
  METRALE_CHECK(n >= 1, "mHC: {} streams", n);
  for (size_t s = 0; s < sites_.size(); ++s) {
    const MhcSiteMaps& site = sites_[s];
    METRALE_CHECK(site.fn.ndim() == 2 && site.fn.size(0) == mix && site.fn.size(1) == n * d &&
                      site.base.numel() == mix && site.scale.numel() == 3 && site.norm.weight.numel() == d,
                  "mHC site {}: fn {} base {} scale {} norm {} for {} streams of {}", s, site.fn.describe(),
                  site.base.describe(), site.scale.describe(), site.norm.weight.describe(), n, d);
  }
  std::vector<int32_t> index(static_cast<size_t>(kRowsPerCall * n));
  for (size_t i = 0; i < index.size(); ++i) index[i] = static_cast<int32_t>(i / static_cast<size_t>(n));
  spread_index_ = OwnedTensor(DType::kI32, {kRowsPerCall * n}, device);
  copy_bytes(spread_index_->data(), device, index.data(), Device::cpu(), index.size() * sizeof(int32_t));
  // The split count (and so the scratch) depends on the row count: size for the largest over every
  // call this scheme can make.
  size_t workspace = 0;
  for (int64_t rows = 1; rows <= kRowsPerCall && device.is_cuda(); ++rows) {
    workspace = std::max(workspace, kernels::mhc_pre_workspace_bytes(device, rows, n, d));
  }
  if (workspace > 0) {
    pre_workspace_ = OwnedTensor(DType::kU8, {static_cast<int64_t>(workspace)}, device);
    pre_workspace_.buffer.zero();
    params_.workspace = *pre_workspace_;
  }
}

MhcSiteMaps MhcResidual::load_site(Weights& weights, const std::string& prefix, int64_t num_streams,
                                   int64_t hidden_size, RmsNorm norm, std::vector<OwnedTensor>& owned) {
  const int64_t mix = (2 + num_streams) * num_streams;
  const auto load = [&](const std::string& key, const Shape& shape) {
    OwnedTensor placed(DType::kBF16, shape, weights.device());
    // f32 in the file: rounded to bf16 as the reference loads it, on both devices and in f32 runs too
    // (the maps' dtype is part of the model, not of the activations).
    weights.load_into(prefix + key, *placed);
    const Tensor view = *placed;
    owned.push_back(std::move(placed));
    return view;
  };
  MhcSiteMaps site;
  site.fn = load("fn", {mix, num_streams * hidden_size});
  site.base = load("base", {mix});
  site.scale = load("scale", {3});
  site.norm = std::move(norm);
  return site;
}

template <typename Run>
void MhcResidual::by_rows(int64_t tokens, Run&& run) {
  for (int64_t first = 0; first < tokens; first += kRowsPerCall) run(first, std::min(kRowsPerCall, tokens - first));
}

const MhcSiteMaps& MhcResidual::site_of(int64_t site) const {
  METRALE_CHECK(site >= 0 && site < num_sites(), "mHC: site {} of {}", site, num_sites());
  return sites_[static_cast<size_t>(site)];
}

Tensor MhcResidual::stream_view(const ResidualStreams& streams) const {
  return streams.streams.reshape({streams.streams.size(0), num_streams_, hidden_size()});
}

ResidualStreams MhcResidual::allocate(const StepContext& step) const {
  const int64_t tokens = step.batch.num_tokens, n = num_streams_, d = hidden_size();
  Arena& ws = step.workspace;
  ResidualStreams streams;
  streams.streams = ws.alloc(step.activation_dtype, {tokens, n * d});
  streams.input = ws.alloc(step.activation_dtype, {tokens, d});
  streams.state = {ws.alloc(DType::kF32, {tokens, n}), ws.alloc(DType::kF32, {tokens, n, n}),
                   ws.alloc(step.activation_dtype, {tokens, d})};
  return streams;
}

void MhcResidual::begin(const StepContext& step, const ResidualStreams& streams) const {
  const int64_t n = num_streams_, d = hidden_size();
  const Tensor copies = streams.streams.reshape({step.batch.num_tokens * n, d});
  by_rows(step.batch.num_tokens, [&](int64_t first, int64_t rows) {
    kernels::gather_rows(streams.input.slice(0, first, first + rows), spread_index_->slice(0, 0, rows * n),
                         copies.slice(0, first * n, (first + rows) * n));
  });
}

void MhcResidual::pre(const StepContext& step, const ResidualStreams& streams, int64_t site, const Tensor& x) const {
  const MhcSiteMaps& maps = site_of(site);
  const Tensor X = stream_view(streams);
  const Tensor& post = streams.state[0];
  const Tensor& comb = streams.state[1];
  const Tensor& h = streams.state[2];
  by_rows(step.batch.num_tokens, [&](int64_t first, int64_t rows) {
    const int64_t last = first + rows;
    kernels::mhc_pre(X.slice(0, first, last), maps.fn, maps.base, maps.scale, post.slice(0, first, last),
                     comb.slice(0, first, last), h.slice(0, first, last), params_);
  });
  maps.norm.apply(h, x);
}

void MhcResidual::post(const StepContext& /*step*/, const ResidualStreams& streams, int64_t site,
                       const Tensor& out) const {
  site_of(site);  // range check
  const Tensor X = stream_view(streams);
  kernels::mhc_post(X, out, streams.state[0], streams.state[1], X);
}

void MhcResidual::finish(const StepContext& /*step*/, const ResidualStreams& streams, const Tensor& hidden) const {
  const Tensor& mean = streams.state[2];
  kernels::mhc_mean(stream_view(streams), mean);
  final_norm_.apply(mean, hidden);
}

}  // namespace metrale
