// CPU mHC maps (fp32, glm_deepseek.md §2.4): one token per task; the reference the CUDA kernels are
// tested against.
#include "kernels/mhc.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/common.h"

namespace metrale::kernels::cpu {
namespace {

struct StreamShape {
  int64_t tokens = 0, streams = 0, width = 0;
};

StreamShape check_streams(const char* op, const Tensor& X) {
  METRALE_CHECK(X.ndim() == 3 && X.stride(2) == 1 && X.stride(1) == X.size(2), "{}: X {} must be [T, n, D] with contiguous streams",
                op, X.describe());
  return {X.size(0), X.size(1), X.size(2)};
}

const char* token_ptr(const Tensor& t, int64_t token) {
  return static_cast<const char*>(t.data()) + token * t.stride(0) * static_cast<int64_t>(t.element_size());
}


}  // namespace

void mhc_pre(const Tensor& X, const Tensor& fn, const Tensor& base, const Tensor& scale, const Tensor& post,
            const Tensor& comb, const Tensor& h, const MhcParams& params) {
  const StreamShape shape = check_streams("mhc_pre", X);
  const int64_t n = shape.streams, D = shape.width, flat = n * D, mix = (2 + n) * n;
  METRALE_CHECK(fn.ndim() == 2 && fn.size(0) == mix && fn.size(1) == flat && fn.is_contiguous(),
                "mhc_pre: fn {} must be [{}, {}]", fn.describe(), mix, flat);
  METRALE_CHECK(base.numel() == mix && scale.numel() == 3 && base.is_contiguous() && scale.is_contiguous(),
                "mhc_pre: base {} scale {}", base.describe(), scale.describe());
  METRALE_CHECK(post.dtype() == DType::kF32 && post.is_contiguous() && post.numel() == shape.tokens * n &&
                    comb.dtype() == DType::kF32 && comb.is_contiguous() && comb.numel() == shape.tokens * n * n,
                "mhc_pre: post {} comb {} must be f32 [T, n] and [T, n, n]", post.describe(), comb.describe());
  METRALE_CHECK(h.ndim() == 2 && h.size(0) == shape.tokens && h.size(1) == D && h.stride(1) == 1, "mhc_pre: h {}",
                h.describe());
  METRALE_CHECK(params.sinkhorn_iters >= 1, "mhc_pre: {} Sinkhorn iterations", params.sinkhorn_iters);
  std::vector<float> weights(static_cast<size_t>(mix * flat)), bias(static_cast<size_t>(mix)), scales(3);
  convert_to_f32(fn.dtype(), fn.data(), weights.data(), weights.size());
  convert_to_f32(base.dtype(), base.data(), bias.data(), bias.size());
  convert_to_f32(scale.dtype(), scale.data(), scales.data(), scales.size());
  const float eps = params.hc_eps;
  cpu_pool().parallel_for(shape.tokens, 1, [&](int64_t begin, int64_t end) {
    float* f = scratch_a(flat);
    float* m = scratch_b(mix + n * n + n + D);
    float* M = m + mix;
    float* pre = M + n * n;
    float* collapsed = pre + n;
    for (int64_t t = begin; t < end; ++t) {
      convert_to_f32(X.dtype(), token_ptr(X, t), f, static_cast<size_t>(flat));
      const float inv = 1.0f / std::sqrt(dot_f32(f, f, flat) / static_cast<float>(flat) + params.norm_eps);
      std::vector<float> rho(f, f + flat);
      for (float& value : rho) value *= inv;
      for (int64_t i = 0; i < mix; ++i) m[i] = dot_f32(rho.data(), weights.data() + i * flat, flat);
      float* post_t = post.data_as<float>() + t * n;
      for (int64_t j = 0; j < n; ++j) {
        pre[j] = sigmoid_f32(m[j] * scales[0] + bias[static_cast<size_t>(j)]) + eps;
        post_t[j] = 2.0f * sigmoid_f32(m[n + j] * scales[1] + bias[static_cast<size_t>(n + j)]);
      }
      for (int64_t a = 0; a < n; ++a) {
        float* row = M + a * n;
        float max_logit = -INFINITY;
        for (int64_t c = 0; c < n; ++c) {
          row[c] = m[2 * n + a * n + c] * scales[2] + bias[static_cast<size_t>(2 * n + a * n + c)];
          max_logit = std::max(max_logit, row[c]);
        }
        float sum = 0.0f;
        for (int64_t c = 0; c < n; ++c) sum += (row[c] = std::exp(row[c] - max_logit));
        for (int64_t c = 0; c < n; ++c) row[c] = row[c] / sum + eps;
      }
      const auto normalize_columns = [&] {
        for (int64_t c = 0; c < n; ++c) {
          float sum = 0.0f;
          for (int64_t a = 0; a < n; ++a) sum += M[a * n + c];
          for (int64_t a = 0; a < n; ++a) M[a * n + c] /= sum + eps;
        }
      };
      normalize_columns();
      for (int it = 1; it < params.sinkhorn_iters; ++it) {
        for (int64_t a = 0; a < n; ++a) {
          float sum = 0.0f;
          for (int64_t c = 0; c < n; ++c) sum += M[a * n + c];
          for (int64_t c = 0; c < n; ++c) M[a * n + c] /= sum + eps;
        }
        normalize_columns();
      }
      std::copy_n(M, n * n, comb.data_as<float>() + t * n * n);
      std::fill_n(collapsed, D, 0.0f);
      for (int64_t j = 0; j < n; ++j) {
        for (int64_t d = 0; d < D; ++d) collapsed[d] += pre[j] * f[j * D + d];
      }
      store_f32(h.dtype(), collapsed, row_ptr_mut(h, t), D);
    }
  });
}

void mhc_post(const Tensor& X, const Tensor& y, const Tensor& post, const Tensor& comb, const Tensor& out) {
  const StreamShape shape = check_streams("mhc_post", X);
  const int64_t n = shape.streams, D = shape.width;
  METRALE_CHECK(out.ndim() == 3 && out.size(0) == shape.tokens && out.size(1) == n && out.size(2) == D &&
                    out.stride(2) == 1 && out.stride(1) == D && out.dtype() == X.dtype(),
                "mhc_post: out {} for X {}", out.describe(), X.describe());
  METRALE_CHECK(y.ndim() == 2 && y.size(0) == shape.tokens && y.size(1) == D && y.stride(1) == 1, "mhc_post: y {}",
                y.describe());
  METRALE_CHECK(post.dtype() == DType::kF32 && post.is_contiguous() && post.numel() == shape.tokens * n &&
                    comb.dtype() == DType::kF32 && comb.is_contiguous() && comb.numel() == shape.tokens * n * n,
                "mhc_post: post {} comb {}", post.describe(), comb.describe());
  const DType act = out.dtype();
  cpu_pool().parallel_for(shape.tokens, 1, [&](int64_t begin, int64_t end) {
    float* streams = scratch_a(n * D + D);
    float* yv = streams + n * D;
    float* result = scratch_b(n * D);
    for (int64_t t = begin; t < end; ++t) {
      convert_to_f32(X.dtype(), token_ptr(X, t), streams, static_cast<size_t>(n * D));
      convert_to_f32(y.dtype(), row_ptr(y, t), yv, static_cast<size_t>(D));
      const float* post_t = post.data_as<const float>() + t * n;
      const float* M = comb.data_as<const float>() + t * n * n;
      for (int64_t c = 0; c < n; ++c) {
        const float p = round_as(act, post_t[c]);
        float* row = result + c * D;
        for (int64_t d = 0; d < D; ++d) {
          float mixed = 0.0f;
          for (int64_t a = 0; a < n; ++a) mixed += round_as(act, M[a * n + c]) * streams[a * D + d];
          row[d] = round_as(act, p * yv[d]) + round_as(act, mixed);
        }
      }
      store_f32(act, result, static_cast<char*>(out.data()) + t * out.stride(0) * static_cast<int64_t>(out.element_size()),
                n * D);
    }
  });
}

void mhc_mean(const Tensor& X, const Tensor& out) {
  const StreamShape shape = check_streams("mhc_mean", X);
  const int64_t n = shape.streams, D = shape.width;
  METRALE_CHECK(out.ndim() == 2 && out.size(0) == shape.tokens && out.size(1) == D && out.stride(1) == 1,
                "mhc_mean: out {}", out.describe());
  cpu_pool().parallel_for(shape.tokens, 4, [&](int64_t begin, int64_t end) {
    float* streams = scratch_a(n * D);
    float* mean = scratch_b(D);
    for (int64_t t = begin; t < end; ++t) {
      convert_to_f32(X.dtype(), token_ptr(X, t), streams, static_cast<size_t>(n * D));
      for (int64_t d = 0; d < D; ++d) {
        float sum = 0.0f;
        for (int64_t j = 0; j < n; ++j) sum += streams[j * D + d];
        mean[d] = sum / static_cast<float>(n);
      }
      store_f32(out.dtype(), mean, row_ptr_mut(out, t), D);
    }
  });
}

}  // namespace metrale::kernels::cpu

#if !METRALE_WITH_CUDA
namespace metrale::kernels {

size_t mhc_pre_workspace_bytes(Device /*device*/, int64_t /*num_tokens*/, int64_t /*num_streams*/,
                              int64_t /*hidden_size*/) {
  return 0;
}

}  // namespace metrale::kernels
#endif
