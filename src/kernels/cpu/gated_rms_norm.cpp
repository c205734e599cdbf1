// CPU gated RMSNorm (the GDN and KDA output norms), fp32 arithmetic:
// y = w * x * rsqrt(mean(x^2) + eps) * act(z), act = silu or sigmoid (kSigmoid and kSigmoidRounded
// differ only in bf16 rounding, which the fp32 CPU reference does not apply).
#include "kernels/gated_rms_norm.h"

#include <cmath>
#include <vector>

#include "kernels/cpu/common.h"

namespace metrale::kernels::cpu {
namespace {

// Pointer to x[t, h, 0] of a [T, H, D] view.
char* head_ptr(const Tensor& t, int64_t token, int64_t head) {
  return static_cast<char*>(t.data()) +
         (token * t.stride(0) + head * t.stride(1)) * static_cast<int64_t>(t.element_size());
}

}  // namespace

void gated_rms_norm(const Tensor& x, const Tensor& z, const Tensor& weight, const Tensor& out, float eps,
                    GatedNormGate gate_kind) {
  METRALE_CHECK(x.ndim() == 3 && z.ndim() == 3 && out.ndim() == 3, "gated_rms_norm: x {} z {} out {}", x.describe(),
                z.describe(), out.describe());
  const int64_t tokens = x.size(0), heads = x.size(1), width = x.size(2);
  for (const Tensor* t : {&z, &out}) {
    METRALE_CHECK(t->size(0) == tokens && t->size(1) == heads && t->size(2) == width && t->stride(2) == 1,
                  "gated_rms_norm: {} for x {}", t->describe(), x.describe());
  }
  METRALE_CHECK(x.stride(2) == 1 && weight.numel() == width, "gated_rms_norm: x {} weight {}", x.describe(),
                weight.describe());
  std::vector<float> w(static_cast<size_t>(width));
  convert_to_f32(weight.dtype(), weight.data(), w.data(), w.size());
  cpu_pool().parallel_for(tokens * heads, 16, [&](int64_t begin, int64_t end) {
    float* xs = scratch_a(2 * width);
    float* zs = xs + width;
    for (int64_t row = begin; row < end; ++row) {
      const int64_t t = row / heads, h = row % heads;
      convert_to_f32(x.dtype(), head_ptr(x, t, h), xs, static_cast<size_t>(width));
      convert_to_f32(z.dtype(), head_ptr(z, t, h), zs, static_cast<size_t>(width));
      double sum_squares = 0.0;  // fp64 sum, as the CPU rms_norm (the reference)
      for (int64_t i = 0; i < width; ++i) sum_squares += static_cast<double>(xs[i]) * xs[i];
      const float inv = 1.0f / std::sqrt(static_cast<float>(sum_squares / static_cast<double>(width)) + eps);
      for (int64_t i = 0; i < width; ++i) {
        const float sigmoid = 1.0f / (1.0f + std::exp(-zs[i]));
        const float gate = gate_kind == GatedNormGate::kSilu ? zs[i] * sigmoid : sigmoid;
        xs[i] = w[static_cast<size_t>(i)] * (xs[i] * inv) * gate;
      }
      store_f32(out.dtype(), xs, head_ptr(out, t, h), width);
    }
  });
}

}  // namespace metrale::kernels::cpu
