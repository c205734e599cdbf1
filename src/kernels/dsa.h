// DeepSeek Sparse Attention as glm5_next runs it (glm_deepseek.md §2.6): a NoPE MLA that caches only
// the latent c per token, and a lightning indexer that scores pools of kp consecutive tokens and
// selects, per query, the index_topk / kp best complete pools; the query attends to their tokens plus
// the tail (its own incomplete pool).
//
// Caches (paged like the KV cache; slot = block * block_size + offset, block_size a multiple of kp):
//   latent_cache [num_blocks, block_size, r]          c = kv_a_layernorm(x . W_kva^T), activation dtype
//   index_cache  [num_blocks, block_size, 2 * d_I]    per token [k^I || gamma], activation dtype
//   pool_cache   [num_blocks, block_size / kp, d_I]   K_p of every complete pool, activation dtype
// Pool p of a sequence covers its positions p*kp .. p*kp+kp-1, which share one block; its key sits
// in that block at row (p*kp mod block_size) / kp and is computed once, by dsa_index_write, in the
// step that writes the pool's last token.
//
// Selection for the query at position s of a sequence (§2.6.4): the candidates are the complete
// pools p < n_cand(s) = (s + 1) / kp (integer division); the top min(K, n_cand) of them by
//   I(s, p) = sum_h weight_scale * w_h(s) * relu(score_scale * q^I_h(s) . K_p)      (fp32)
// with ties toward the lower pool index (§2.6.5), K = index_topk / kp. The attended set is
//   A(s) = { tokens of the selected pools } u { n_cand(s) * kp, ..., s }   (the tail, < kp tokens)
// which is every token 0..s when n_cand(s) <= K (the dense regime).
//
// Attention in the absorbed form (§2.6.1): with W_uk,h, W_uv,h [d, r] the key and value rows of head
// h in kv_b_proj, q~_h = W_uk,h^T q_h [r] (mla_absorb with the transposed key weights), then
//   o~_h(s) = sum_{t in A(s)} softmax_t(scale * q~_h(s) . c_t) c_t      (one pass over the latents,
// all heads together), and o_h = W_uv,h o~_h (mla_absorb with the value weights). Prefill uses the
// same form: the selection is per query token and shared by all heads, so a query's heads form one
// M = H tile against its own selected latents, each latent read once for all heads; the expanded
// form would need per-head K and V of every cached token (H * 2d values per token instead of r) and
// recompute them for the whole context every step.
#pragma once

#include "kernels/dispatch.h"

namespace metrale::kernels {

// rows [T, W] (rows may be strided); slot_mapping [T] i32 (-1 skips a row); cache
// [num_blocks, block_size, W] contiguous, same dtype as rows on CUDA (f32 | bf16), any on the CPU.
METRALE_DECLARE_OP_IMPLS(dsa_latent_write, (const Tensor& rows, const Tensor& slot_mapping, const Tensor& cache))

struct DsaIndexWriteParams {
  int64_t kpool = 16;   // kp, index_kpool
  float ln_eps = 1e-6f;  // the indexer k_norm LayerNorm eps
};

// Per new token t with slot = slot_mapping[t] >= 0:
//   index_cache[slot] = [ D(LayerNorm(k_raw[t]) * ln_weight + ln_bias) || gate[t] ]
// (LayerNorm in fp32 with the biased variance, rounded once), and when slot % kp == kp - 1 (the
// token completes its pool) the pool key of rows slot-kp+1 .. slot:
//   w[j][d] = D(softmax_j(gamma_j[d] + ape[j][d]))   (fp32 over the kp rows, rounded to D)
//   K[d]    = D(sum_j D(w[j][d] * k^I_j[d]))
// into pool_cache at (slot / block_size, (slot % block_size) / kp). The earlier rows of a pool may
// come from earlier steps (they are read back from index_cache).
// k_raw, gate [T, d_I] activations (x . W_k^T, x . G^T; rows may be strided); ln_weight, ln_bias
// [d_I], ape [kp, d_I] any float dtype; caches as in the header comment (CUDA: one activation dtype).
METRALE_DECLARE_OP_IMPLS(dsa_index_write, (const Tensor& k_raw, const Tensor& gate, const Tensor& ln_weight,
                                           const Tensor& ln_bias, const Tensor& ape, const Tensor& slot_mapping,
                                           const Tensor& index_cache, const Tensor& pool_cache,
                                           const DsaIndexWriteParams& params))

struct DsaSelectParams {
  int64_t kpool = 16;          // kp
  int64_t top_pools = 128;     // K = index_topk / kp
  float score_scale = 1.0f;    // d_I^-1/2, inside the relu
  float weight_scale = 1.0f;   // H_I^-1/2, on the head weights
  // Host upper bound of kv_len over the batch (0: max_blocks * block_size), for the scratch and the
  // grid; CUDA graphs capture with a bound.
  int64_t max_kv_len = 0;
  // CUDA scratch: dsa_select_workspace_bytes(...) bytes; nothing survives the call.
  Tensor workspace;
};

// q_index [T, H_I, d_I] activations (rows may be strided, d_I contiguous); weights [T, H_I]
// (weights_proj output, any float dtype, rows may be strided); pool_cache as above; cu_q [S+1],
// kv_lens [S], block_tables [S, max_blocks] i32; selected [T, K] i32: the selected pools of each
// query in ascending order, padded with -1 (the tail is implied, see the header comment).
// CUDA: the scores and the top-k run on the device (graph-capturable); H_I <= 64; bf16 with d_I 64
// or 128 on tensor cores, other shapes on CUDA cores.
METRALE_DECLARE_OP_IMPLS(dsa_select, (const Tensor& q_index, const Tensor& weights, const Tensor& pool_cache,
                                      const Tensor& cu_q, const Tensor& kv_lens, const Tensor& block_tables,
                                      const Tensor& selected, const DsaSelectParams& params))

// Bytes of DsaSelectParams::workspace for T query rows with kv_len <= max_kv_len (0 on the CPU).
size_t dsa_select_workspace_bytes(Device device, int64_t num_tokens, int64_t max_kv_len, int64_t kpool);

struct DsaAttentionParams {
  float scale = 1.0f;     // qk_head_dim^-1/2 (the expanded head dim, not r)
  int64_t kpool = 16;     // kp
  int64_t max_kv_len = 0;  // host bound of kv_len (0: max_blocks * block_size), for planning
  // Key splits per query row on CUDA (1: none; 0: chosen from T so that the GPU fills). A split
  // attends a share of the row's selected pools; a second launch merges the partial results.
  int num_splits = 0;
  // CUDA scratch for the splits: dsa_attention_workspace_bytes(...) bytes (unused when no split).
  Tensor workspace;
};

// q [T, H, r] activations (the absorbed queries; rows may be strided, r contiguous); latent_cache as
// above; selected [T, K] i32 from dsa_select; cu_q, kv_lens, block_tables as for dsa_select;
// out [T, H, r] activation dtype (o~, rows may be strided). Softmax in fp32, outputs rounded once.
// CUDA: bf16 with r in {64, 128, 256, 512} and kp dividing 64 on tensor cores, any H; other shapes
// and f32 on a simple path (at most 12288 attended tokens per row).
METRALE_DECLARE_OP_IMPLS(dsa_attention, (const Tensor& q, const Tensor& latent_cache, const Tensor& selected,
                                         const Tensor& cu_q, const Tensor& kv_lens, const Tensor& block_tables,
                                         const Tensor& out, const DsaAttentionParams& params))

// The split count dsa_attention uses for T rows when params.num_splits is 0, and the scratch it
// needs for `num_splits` splits (0 on the CPU or for one split).
int dsa_attention_splits(Device device, int64_t num_tokens, int64_t num_heads, int64_t top_pools);
size_t dsa_attention_workspace_bytes(Device device, int64_t num_tokens, int64_t num_heads, int64_t latent_dim,
                                     int num_splits);

// Per-head matmul: out[t, h, :] = x[t, h, :] . W[h]^T. x [T, H, K] (rows and heads strided, K
// contiguous); W [H, N, K] (rows contiguous, heads strided: W[h] may be a row slice of kv_b_proj);
// out [T, H, N] (strided likewise), rounded once from fp32 sums. The value absorption takes
// W[h] = W_uv,h directly; the query absorption takes W[h] = W_uk,h^T, a transposed copy made at
// load. CUDA: bf16 x and W; small T streams each weight row once for all rows, larger T runs one
// tensor-core GEMM per head.
METRALE_DECLARE_OP_IMPLS(mla_absorb, (const Tensor& x, const Tensor& weight, const Tensor& out))

inline void dsa_latent_write(const Tensor& rows, const Tensor& slot_mapping, const Tensor& cache) {
  METRALE_KERNEL_DISPATCH(dsa_latent_write, cache.device(), rows, slot_mapping, cache);
}
inline void dsa_index_write(const Tensor& k_raw, const Tensor& gate, const Tensor& ln_weight, const Tensor& ln_bias,
                            const Tensor& ape, const Tensor& slot_mapping, const Tensor& index_cache,
                            const Tensor& pool_cache, const DsaIndexWriteParams& params) {
  METRALE_KERNEL_DISPATCH(dsa_index_write, index_cache.device(), k_raw, gate, ln_weight, ln_bias, ape, slot_mapping,
                          index_cache, pool_cache, params);
}
inline void dsa_select(const Tensor& q_index, const Tensor& weights, const Tensor& pool_cache, const Tensor& cu_q,
                       const Tensor& kv_lens, const Tensor& block_tables, const Tensor& selected,
                       const DsaSelectParams& params) {
  METRALE_KERNEL_DISPATCH(dsa_select, selected.device(), q_index, weights, pool_cache, cu_q, kv_lens, block_tables,
                          selected, params);
}
inline void dsa_attention(const Tensor& q, const Tensor& latent_cache, const Tensor& selected, const Tensor& cu_q,
                          const Tensor& kv_lens, const Tensor& block_tables, const Tensor& out,
                          const DsaAttentionParams& params) {
  METRALE_KERNEL_DISPATCH(dsa_attention, out.device(), q, latent_cache, selected, cu_q, kv_lens, block_tables, out,
                          params);
}
inline void mla_absorb(const Tensor& x, const Tensor& weight, const Tensor& out) {
  METRALE_KERNEL_DISPATCH(mla_absorb, out.device(), x, weight, out);
}

}  // namespace metrale::kernels
