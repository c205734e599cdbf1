#include "kernels/moe.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "kernels/cpu/common.h"

namespace metrale::kernels::cpu {

void moe_route(const Tensor& router_logits, const Tensor& topk_ids, const Tensor& topk_weights,
               const MoeRouteParams& params) {
  const int64_t tokens = router_logits.size(0), experts = router_logits.size(1);
  const int k = params.top_k;
  METRALE_CHECK(k >= 1 && k <= experts, "moe top_k {} of {} experts", k, experts);
  METRALE_CHECK(topk_ids.numel() == tokens * k && topk_weights.numel() == tokens * k &&
                    topk_ids.dtype() == DType::kI32 && topk_weights.dtype() == DType::kF32,
                "moe_route outputs");
  auto* ids = topk_ids.data_as<int32_t>();
  auto* weights = topk_weights.data_as<float>();
  cpu_pool().parallel_for(tokens, 16, [&](int64_t begin, int64_t end) {
    float* probs = scratch_a(experts);
    std::vector<int32_t> order(static_cast<size_t>(experts));
    for (int64_t t = begin; t < end; ++t) {
      const float* logits = as_f32(router_logits.dtype(), row_ptr(router_logits, t), probs, experts);
      if (logits != probs) std::copy(logits, logits + experts, probs);
      const float max_logit = *std::max_element(probs, probs + experts);
      double sum = 0.0;
      for (int64_t e = 0; e < experts; ++e) {
        probs[e] = std::exp(probs[e] - max_logit);
        sum += probs[e];
      }
      const float inv = static_cast<float>(1.0 / sum);
      for (int64_t e = 0; e < experts; ++e) probs[e] *= inv;
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int32_t a, int32_t b) {
        return probs[a] > probs[b] || (probs[a] == probs[b] && a < b);
      });
      float selected_sum = 0.0f;
      for (int j = 0; j < k; ++j) selected_sum += probs[order[static_cast<size_t>(j)]];
      for (int j = 0; j < k; ++j) {
        const int32_t e = order[static_cast<size_t>(j)];
        ids[t * k + j] = e;
        weights[t * k + j] = params.normalize ? probs[e] / selected_sum : probs[e];
      }
    }
  });
}

void gather_rows(const Tensor& src, const Tensor& index, const Tensor& out) {
  const int64_t n = index.numel(), width = src.size(1);
  METRALE_CHECK(out.size(0) == n && out.size(1) == width && src.dtype() == out.dtype(), "gather_rows shapes");
  const auto* idx = index.data_as<const int32_t>();
  const size_t bytes = static_cast<size_t>(width) * src.element_size();
  for (int64_t i = 0; i < n; ++i) {
    METRALE_CHECK(idx[i] >= 0 && idx[i] < src.size(0), "gather_rows index {}", idx[i]);
    std::memcpy(row_ptr_mut(out, i), row_ptr(src, idx[i]), bytes);
  }
}

void scatter_add_rows(const Tensor& dst, const Tensor& src, const Tensor& index, const Tensor& weight) {
  const int64_t n = index.numel(), width = dst.size(1);
  METRALE_CHECK(dst.dtype() == DType::kF32 && src.size(0) == n && src.size(1) == width && weight.numel() == n,
                "scatter_add_rows shapes");
  const auto* idx = index.data_as<const int32_t>();
  const auto* w = weight.data_as<const float>();
  float* tmp = scratch_a(width);
  for (int64_t i = 0; i < n; ++i) {
    float* d = static_cast<float*>(row_ptr_mut(dst, idx[i]));
    const float* s = as_f32(src.dtype(), row_ptr(src, i), tmp, width);
    for (int64_t c = 0; c < width; ++c) d[c] += w[i] * s[c];
  }
}

}  // namespace metrale::kernels::cpu
