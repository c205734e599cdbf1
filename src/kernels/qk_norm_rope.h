// The attention prologue of Qwen3-style layers in one op: per-head RMSNorm of q and k (optional),
// RoPE on both, q written back in place, and the rotated k and the raw v written into the paged KV
// cache (what rms_norm + rope + kv_cache_write do, in one pass over q, k and v).
#pragma once

#include "kernels/attention.h"
#include "kernels/dispatch.h"
#include "kernels/rms_norm.h"
#include "kernels/rope.h"

namespace metrale::kernels {

struct QkNormRopeParams {
  bool q_norm = true;   // q_norm_weight is used (else q is only rotated)
  bool k_norm = true;   // k_norm_weight is used
  RmsNormParams norm;   // eps and kind (plain or zero-centred), shared by both norms
  RopeParams rope;      // rotary_dim (<= head_dim, partial allowed) and attention_scaling
  KvScales kv_scales;   // f8e4m3 caches: the per-KV-head scales the writes quantise with
};

// q [T, n_heads, D], k [T, n_kv_heads, D], v [T, n_kv_heads, D]: views with a contiguous last dim and
// any token/head strides (e.g. slices of one fused projection output, or the query half of gated
// attention's q_proj); q_norm_weight, k_norm_weight [D] (ignored, and may be empty, when their norm is
// off); positions [T] i32; inv_freq [rotary_dim / 2] f32; slot_mapping [T] i32 (block * block_size +
// offset, or -1: rotate q, write nothing to the cache); k_cache, v_cache [num_blocks, block_size,
// n_kv_heads, D] contiguous.
//
// Effects: q <- rope(norm(q)) in place; k_cache[slot] <- rope(norm(k)); v_cache[slot] <- v. k and v are
// not modified. On the GPU, q, k, v and the caches share one dtype and every step rounds to it like
// transformers (rms_norm.h, rope.h), except that the caches may be f8e4m3: the rounded values are
// then quantised with params.kv_scales (kv_cache_write). The CPU composes cpu::rms_norm, cpu::rope
// and cpu::kv_cache_write.
METRALE_DECLARE_OP_IMPLS(qk_norm_rope_kv_write,
                         (const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& q_norm_weight,
                          const Tensor& k_norm_weight, const Tensor& positions, const Tensor& inv_freq,
                          const Tensor& slot_mapping, const Tensor& k_cache, const Tensor& v_cache,
                          const QkNormRopeParams& params))

inline void qk_norm_rope_kv_write(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& q_norm_weight,
                                  const Tensor& k_norm_weight, const Tensor& positions, const Tensor& inv_freq,
                                  const Tensor& slot_mapping, const Tensor& k_cache, const Tensor& v_cache,
                                  const QkNormRopeParams& params) {
  METRALE_KERNEL_DISPATCH(qk_norm_rope_kv_write, q.device(), q, k, v, q_norm_weight, k_norm_weight, positions,
                          inv_freq, slot_mapping, k_cache, v_cache, params);
}

}  // namespace metrale::kernels
