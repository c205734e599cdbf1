// Paged attention over a ragged batch, and the KV-cache write that precedes it.
//
// Batch layout: S sequences; sequence s owns query rows [cu_q[s], cu_q[s+1]) and sees kv_lens[s]
// keys in its paged cache after this step's write (kv_lens[s] = cached + q_len). Query row i of
// sequence s sits at position kv_lens[s] - q_len_s + i and attends keys [0, that position]
// (causal), or the last `window` of them for sliding-window layers.
#pragma once

#include "kernels/dispatch.h"

namespace metrale::kernels {

// k, v [T, n_kv_heads, head_dim]; slot_mapping [T] i32 (block * block_size + offset, or -1 to skip);
// k_cache, v_cache [num_blocks, block_size, n_kv_heads, head_dim].
METRALE_DECLARE_OP_IMPLS(kv_cache_write, (const Tensor& k, const Tensor& v, const Tensor& slot_mapping,
                                          const Tensor& k_cache, const Tensor& v_cache))

struct AttentionParams {
  float scale = 1.0f;  // usually head_dim^-0.5
  int window = 0;      // 0: full causal; w > 0: a query at position p sees keys (p - w, p]
};

// q [T, n_heads, head_dim]; out [T, n_heads, head_dim]; cu_q [S+1] i32; kv_lens [S] i32;
// block_tables [S, max_blocks] i32. n_heads must be a multiple of n_kv_heads (GQA).
METRALE_DECLARE_OP_IMPLS(paged_attention, (const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                                           const Tensor& cu_q, const Tensor& kv_lens, const Tensor& block_tables,
                                           const Tensor& out, const AttentionParams& params))

inline void kv_cache_write(const Tensor& k, const Tensor& v, const Tensor& slot_mapping, const Tensor& k_cache,
                           const Tensor& v_cache) {
  METRALE_KERNEL_DISPATCH(kv_cache_write, k_cache.device(), k, v, slot_mapping, k_cache, v_cache);
}
inline void paged_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& cu_q,
                            const Tensor& kv_lens, const Tensor& block_tables, const Tensor& out,
                            const AttentionParams& params) {
  METRALE_KERNEL_DISPATCH(paged_attention, out.device(), q, k_cache, v_cache, cu_q, kv_lens, block_tables, out,
                          params);
}

}  // namespace metrale::kernels
