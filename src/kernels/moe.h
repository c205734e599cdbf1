// Mixture-of-experts routing and token grouping.
#pragma once

#include "kernels/dispatch.h"

namespace metrale::kernels {

struct MoeRouteParams {
  int top_k = 1;
  bool normalize = false;  // renormalise the top-k probabilities to sum to 1
};

// Softmax over experts, then top-k (descending probability; ties broken by lower expert id),
// optionally renormalised. router_logits [T, E] f32|bf16; topk_ids [T, k] i32; topk_weights [T, k] f32.
METRALE_DECLARE_OP_IMPLS(moe_route, (const Tensor& router_logits, const Tensor& topk_ids,
                                     const Tensor& topk_weights, const MoeRouteParams& params))

// out[i] = src[index[i]]. src [T, H]; index [n] i32; out [n, H].
METRALE_DECLARE_OP_IMPLS(gather_rows, (const Tensor& src, const Tensor& index, const Tensor& out))

// dst[index[i]] += weight[i] * src[i]. dst [T, H] f32; src [n, H]; index [n] i32; weight [n] f32.
METRALE_DECLARE_OP_IMPLS(scatter_add_rows, (const Tensor& dst, const Tensor& src, const Tensor& index,
                                            const Tensor& weight))

inline void moe_route(const Tensor& router_logits, const Tensor& topk_ids, const Tensor& topk_weights,
                      const MoeRouteParams& params) {
  METRALE_KERNEL_DISPATCH(moe_route, topk_ids.device(), router_logits, topk_ids, topk_weights, params);
}
inline void gather_rows(const Tensor& src, const Tensor& index, const Tensor& out) {
  METRALE_KERNEL_DISPATCH(gather_rows, out.device(), src, index, out);
}
inline void scatter_add_rows(const Tensor& dst, const Tensor& src, const Tensor& index, const Tensor& weight) {
  METRALE_KERNEL_DISPATCH(scatter_add_rows, dst.device(), dst, src, index, weight);
}

}  // namespace metrale::kernels
