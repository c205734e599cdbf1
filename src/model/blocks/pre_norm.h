// The pre-norm residual (Qwen3 family): one stream h [T, H], the residual itself.
//   site s:  x = norm_s(h);  h += sublayer_s(x)
//   finish:  hidden = norm_final(h)
// post(s) fused with pre(s + 1) is one kernel (kernels::add_rms_norm: h += out; x = norm_{s+1}(h)),
// as is post(last) with finish. The residual is in the activation dtype (f32 on the CPU, bf16 on
// the GPU unless the model runs in f32), as transformers' `hidden = residual + hidden` in the checkpoint's dtype.
#pragma once

#include <vector>

#include "model/blocks/norms.h"
#include "model/blocks/residual.h"

namespace metrale {

class PreNormResidual : public ResidualScheme {
 public:
  // site_norms[s]: the norm of site s's input (per layer: input_layernorm, then
  // post_attention_layernorm); final_norm: the model's last norm.
  PreNormResidual(std::vector<RmsNorm> site_norms, RmsNorm final_norm);

  const std::vector<RmsNorm>& site_norms() const { return site_norms_; }
  const RmsNorm& final_norm() const { return final_norm_; }

  int64_t hidden_size() const override { return final_norm_.weight.numel(); }
  int64_t stream_width() const override { return hidden_size(); }
  int64_t num_sites() const override { return static_cast<int64_t>(site_norms_.size()); }

  // streams = input = h [T, H]; no state.
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
  const RmsNorm& norm_of(int64_t site) const;

  std::vector<RmsNorm> site_norms_;
  RmsNorm final_norm_;
};

}  // namespace metrale
