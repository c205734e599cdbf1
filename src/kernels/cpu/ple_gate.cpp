// CPU PLE gating (kernels/ple_gate.h): fp32 arithmetic with the reference's rounding points in the
// activation dtype (no-ops for f32, the CPU path).
#include "kernels/ple_gate.h"

#include <cmath>
#include <vector>

#include "kernels/cpu/common.h"

namespace metrale::kernels::cpu {
namespace {

// 1 / sqrt(mean(x^2) + eps) with an fp64 sum of squares (as cpu::rms_norm).
float inverse_rms(const float* x, int64_t width, float eps) {
  double sum = 0.0;
  for (int64_t i = 0; i < width; ++i) sum += static_cast<double>(x[i]) * x[i];
  return 1.0f / std::sqrt(static_cast<float>(sum / static_cast<double>(width)) + eps);
}

}  // namespace

void ple_gate(const Tensor& key, const Tensor& value, const Tensor& residual, const Tensor& key_norm_weight,
              const Tensor& query_norm_weight, const Tensor& conv_norm_weight, const Tensor& gated,
              const Tensor& gated_normed, const PleGateParams& params) {
  const int64_t streams = params.num_streams;
  METRALE_CHECK(streams >= 1 && key.ndim() == 2 && value.ndim() == 2 && residual.ndim() == 2 && gated.ndim() == 2 &&
                    gated_normed.ndim() == 2,
                "ple_gate: ranks key {} value {} residual {}", key.describe(), value.describe(), residual.describe());
  const int64_t tokens = key.size(0), hidden = value.size(1), width = streams * hidden;
  for (const Tensor* t : {&key, &residual, &gated, &gated_normed}) {
    METRALE_CHECK(t->size(0) == tokens && t->size(1) == width && t->stride(1) == 1, "ple_gate: {} for [{}, {}]",
                  t->describe(), tokens, width);
  }
  METRALE_CHECK(value.size(0) == tokens && value.stride(1) == 1 && key_norm_weight.numel() == width &&
                    query_norm_weight.numel() == width && conv_norm_weight.numel() == width,
                "ple_gate: value {} weights {}", value.describe(), key_norm_weight.describe());
  const std::vector<float> wk = weights_f32(key_norm_weight), wq = weights_f32(query_norm_weight),
                           wc = weights_f32(conv_norm_weight);
  const DType act = gated.dtype();
  const auto sqrt_h = static_cast<float>(std::sqrt(static_cast<double>(hidden)));  // math.sqrt, then fp32
  cpu_pool().parallel_for(tokens * streams, 4, [&](int64_t begin, int64_t end) {
    float* buffer = scratch_a(4 * hidden);
    float* k = buffer;
    float* q = buffer + hidden;
    float* v = buffer + 2 * hidden;
    float* g = buffer + 3 * hidden;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / streams, n = item % streams, c0 = n * hidden;
      const auto element = [](const Tensor& x, int64_t row, int64_t col) {
        return static_cast<const char*>(row_ptr(x, row)) + col * static_cast<int64_t>(x.element_size());
      };
      convert_to_f32(key.dtype(), element(key, t, c0), k, static_cast<size_t>(hidden));
      convert_to_f32(residual.dtype(), element(residual, t, c0), q, static_cast<size_t>(hidden));
      convert_to_f32(value.dtype(), element(value, t, 0), v, static_cast<size_t>(hidden));
      const float inv_k = inverse_rms(k, hidden, params.eps), inv_q = inverse_rms(q, hidden, params.eps);
      double dot = 0.0;
      for (int64_t c = 0; c < hidden; ++c) {
        const float kn = round_as(act, k[c] * inv_k * (1.0f + wk[static_cast<size_t>(c0 + c)]));
        const float qn = round_as(act, q[c] * inv_q * (1.0f + wq[static_cast<size_t>(c0 + c)]));
        dot += round_as(act, kn * qn);
      }
      const float s = round_as(act, round_as(act, static_cast<float>(dot)) / sqrt_h);
      const float magnitude = round_as(act, std::sqrt(round_as(act, std::max(std::fabs(s), 1e-6f))));
      const float s_hat = s > 0.0f ? magnitude : (s < 0.0f ? -magnitude : 0.0f);
      const float sigma = round_as(act, 1.0f / (1.0f + std::exp(-s_hat)));
      for (int64_t c = 0; c < hidden; ++c) g[c] = round_as(act, sigma * v[c]);
      store_f32(act, g, static_cast<char*>(row_ptr_mut(gated, t)) + c0 * static_cast<int64_t>(gated.element_size()),
                hidden);
      const float inv_g = inverse_rms(g, hidden, params.eps);
      for (int64_t c = 0; c < hidden; ++c) g[c] = g[c] * inv_g * (1.0f + wc[static_cast<size_t>(c0 + c)]);
      store_f32(gated_normed.dtype(), g,
                static_cast<char*>(row_ptr_mut(gated_normed, t)) +
                    c0 * static_cast<int64_t>(gated_normed.element_size()),
                hidden);
    }
  });
}

}  // namespace metrale::kernels::cpu
