// Paged attention over a ragged batch, and the KV-cache write that precedes it.
//
// Batch layout: S sequences; sequence s owns query rows [cu_q[s], cu_q[s+1]) and sees kv_lens[s]
// keys in its paged cache after this step's write (kv_lens[s] = cached + q_len). Query row i of
// sequence s sits at position kv_lens[s] - q_len_s + i and attends keys [0, that position]
// (causal), or the last `window` of them for sliding-window layers.
#pragma once

#include "kernels/dispatch.h"

namespace metrale::kernels {

// The dequantisation scales of FP8 (e4m3) KV caches, one per KV head: a cached element e of head h
// stands for e * k[h] (keys) or e * v[h] (values), and a write stores sat(x / scale[h]) rounded to
// the nearest e4m3 value (saturating at +-448). k, v [n_kv_heads] f32 contiguous, on the caches'
// device. Empty tensors mean a scale of 1; caches of any other dtype ignore them.
struct KvScales {
  Tensor k;
  Tensor v;
};

// k, v [T, n_kv_heads, head_dim] (strided views allowed, head_dim contiguous); slot_mapping [T] i32
// (block * block_size + offset, or -1 to skip); k_cache, v_cache [num_blocks, block_size,
// n_kv_heads, head_dim], bf16, f16, f32 or f8e4m3 (quantised with `scales`). CUDA: bf16, f32 or
// f8e4m3 caches; k, v of any float dtype, copied bit for bit when it is the caches' and rounded (or
// quantised) otherwise.
METRALE_DECLARE_OP_IMPLS(kv_cache_write, (const Tensor& k, const Tensor& v, const Tensor& slot_mapping,
                                          const Tensor& k_cache, const Tensor& v_cache, const KvScales& scales))

struct AttentionParams {
  float scale = 1.0f;  // usually head_dim^-0.5
  int window = 0;      // 0: full causal; w > 0: a query at position p sees keys (p - w, p]
  // Host-side upper bounds over the batch, for planning (split-KV, tiles). They may exceed the
  // true values (CUDA graphs capture with bounds), never fall short (the CPU checks them). 0: not given.
  int64_t max_q_len = 0;
  int64_t max_kv_len = 0;
  // Scratch for the CUDA kernels (split-KV partial results): at least
  // paged_attention_workspace_bytes(...) bytes on the device. Unused on the CPU.
  Tensor workspace;
  // f8e4m3 caches: their per-KV-head scales (the keys' fold into the scores, the values' into the
  // output, both in fp32).
  KvScales kv_scales;
};

// Bytes of scratch the CUDA paged attention needs for a batch within these bounds (0 without CUDA).
// The split-KV path keeps, for at most 4 * SMs CTAs of the current device, 16 rows of head_dim fp32
// partial outputs plus one fp32 log-sum-exp each: 4 * SMs * 16 * (head_dim + 1) * 4 bytes
// (4.4 MB for head_dim 128 on 132 SMs), independent of num_tokens and num_heads; 0 when no split can
// happen (max_kv_len given and <= 256, or num_seqs >= 2 * SMs). The contents need no initialisation
// and nothing survives the call, so one buffer can serve every layer of a step. An empty
// AttentionParams::workspace is allowed (the kernels then never split a sequence's keys: correct,
// slower at small batch and long context); a non-empty one that is too small raises kInvalidArgument.
size_t paged_attention_workspace_bytes(int64_t num_seqs, int64_t num_tokens, int64_t num_heads, int64_t head_dim,
                                       int64_t max_kv_len);

// q [T, n_heads, head_dim]; out [T, n_heads, head_dim]; cu_q [S+1] i32; kv_lens [S] i32;
// block_tables [S, max_blocks] i32. n_heads must be a multiple of n_kv_heads (GQA). q and out may be
// strided views (head_dim contiguous); the caches are contiguous.
// CUDA: q and out both bf16 or both f32, the caches of their dtype or f8e4m3 (FP8 elements are
// widened to bf16 exactly in shared memory, the scales applied in fp32); bf16 at head_dim 64, 128
// and 256 on the tensor cores, other even head_dim up to 256 and every f32 run on a CUDA-core kernel
// (fp32 throughout); the
// metadata on the device (it is read there, never on the host, so the call can be graph-captured);
// grids follow the host bounds in AttentionParams (or T and max_blocks * block_size when 0).
METRALE_DECLARE_OP_IMPLS(paged_attention, (const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                                           const Tensor& cu_q, const Tensor& kv_lens, const Tensor& block_tables,
                                           const Tensor& out, const AttentionParams& params))

#if METRALE_WITH_CUDA
namespace cuda {
// Where split-KV attention merges the partials of a split key range: in the last split CTA of each
// chunk to finish (the default, for plans of 8 splits and more: one kernel), or in a separate merge
// kernel (fewer splits, or METRALE_SPLIT_MERGE_KERNEL=1 at start-up). Tests and benchmarks may switch
// it (not while other threads run attention).
bool split_merge_in_kernel();
void set_split_merge_in_kernel(bool in_kernel);
}  // namespace cuda
#endif

inline void kv_cache_write(const Tensor& k, const Tensor& v, const Tensor& slot_mapping, const Tensor& k_cache,
                           const Tensor& v_cache, const KvScales& scales = {}) {
  METRALE_KERNEL_DISPATCH(kv_cache_write, k_cache.device(), k, v, slot_mapping, k_cache, v_cache, scales);
}
inline void paged_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& cu_q,
                            const Tensor& kv_lens, const Tensor& block_tables, const Tensor& out,
                            const AttentionParams& params) {
  METRALE_KERNEL_DISPATCH(paged_attention, out.device(), q, k_cache, v_cache, cu_q, kv_lens, block_tables, out,
                          params);
}

}  // namespace metrale::kernels
