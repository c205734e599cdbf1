// QSA, block-compressed token selection for sparse attention (qwen.md §7.3), as five ops over the
// paged caches. Batch layout as in attention.h: query row i of sequence s sits at position
// p = kv_lens[s] - q_len_s + i and sees the n = p + 1 keys [0, p] (keys are indexed by position).
// With c = compress_ratio (which divides the cache block size, so a compress block never straddles
// a page) query p has nb = floor(n / c) complete blocks, block j = tokens [j c, j c + c), and the
// tail [nb c, p] of fewer than c tokens.
//
//   qsa_index_prologue  q_idx <- RoPE(zc(q_idx)) in place; the raw index key k_tok -> index cache
//   qsa_block_keys      K_j = RoPE_{jc}(zc(D(mean_f32(k_tok[jc .. jc+c))))) for the blocks that
//                       complete in this step (or for all blocks), into the block-key cache
//   qsa_scores          score_j = sum_h relu(q_idx,h . K_j) / sqrt(d_idx), fp32, j < nb
//   qsa_topk            the min(block_topk, nb) best blocks per query, ties toward the lower index,
//                       ascending, on the device
//   qsa_attention       attention over the selected blocks plus the tail (all keys when nb <= block_topk)
//
// The caches share the K/V block table: index cache [num_blocks, block_size, d_idx] (one raw key per
// token, D) and block-key cache [num_blocks, block_size / c, d_idx] (one key per compress block, D).
// A block key depends only on its c raw keys and its position, so computing it once when its block
// completes (all_blocks = false) gives exactly what recomputing every step gives (all_blocks = true);
// pages shared by prefix caching carry their block keys along. After a rejected speculative draft
// the next step's ctx is the committed length, so blocks touched by the rejected rows are rewritten.
// Everything is capturable in a CUDA graph: metadata is read on the device only, grids come from the
// host bounds.
#pragma once

#include "kernels/dispatch.h"
#include "kernels/rope.h"

namespace metrale::kernels {

struct QsaParams {
  int compress_ratio = 4;  // c >= 1, divides the cache block size
  int block_topk = 512;    // indexer_budget / c >= 1
  float eps = 1e-6f;       // q_layernorm / k_layernorm eps (zero-centred norms)
  RopeParams rope;         // the attention's partial RoPE: rotary_dim <= d_idx, attention_scaling
  bool all_blocks = false;  // qsa_block_keys: every complete block (true) or the new ones (false)
  // qsa_block_keys, optional [T] i32 (the batch's slot_mapping): a block whose last token is a row of
  // this step with slot -1 is not written (rows that write nothing: the padding sequences and padding
  // rows of a fixed batch layout, whose positions may map to block table entries they do not own).
  // Empty: every block is written.
  Tensor row_slots = {};
  // Host upper bounds over the batch, for grids (CUDA graphs capture with bounds; the CPU checks
  // them). 0: not given (then T and the table width are used).
  int64_t max_q_len = 0;
  int64_t max_kv_len = 0;
};

// q_idx [T, n_idx, d_idx] (strided views allowed, d_idx contiguous), rotated in place;
// k_tok [T, d_idx] (rows may be strided); q_norm_weight [d_idx] any float dtype; positions [T] i32;
// inv_freq [rotary_dim / 2] f32; slot_mapping [T] i32 (block * block_size + offset, or -1: no write);
// index_cache [num_blocks, block_size, d_idx] contiguous, the activation dtype.
// q <- D(D(q_h * cos) + D(rotate_half(q_h) * sin)) on the first rotary_dim channels of
// q_h = D(zc(q_h; w)) (cos, sin = D(cos(p inv_freq) s), D(sin(p inv_freq) s)); index_cache[slot] <- k_tok.
METRALE_DECLARE_OP_IMPLS(qsa_index_prologue, (const Tensor& q_idx, const Tensor& k_tok, const Tensor& q_norm_weight,
                                              const Tensor& positions, const Tensor& inv_freq,
                                              const Tensor& slot_mapping, const Tensor& index_cache,
                                              const QsaParams& params))

// index_cache [num_blocks, block_size, d_idx]; k_norm_weight [d_idx]; inv_freq [rotary_dim / 2] f32;
// cu_q [S+1], kv_lens [S] i32; block_tables [S, max_blocks] i32; block_keys [num_blocks,
// block_size / c, d_idx] (output, the activation dtype). Writes blocks j in [floor(ctx / c),
// floor(kv_len / c)) of every sequence (from 0 with all_blocks):
//   K_j = D(RoPE_{pos = j c}(D(zc(D(sum_{i<c} k_tok[jc + i] / c); w))))   (the sum in fp32)
METRALE_DECLARE_OP_IMPLS(qsa_block_keys, (const Tensor& index_cache, const Tensor& k_norm_weight,
                                          const Tensor& inv_freq, const Tensor& cu_q, const Tensor& kv_lens,
                                          const Tensor& block_tables, const Tensor& block_keys,
                                          const QsaParams& params))

// q_idx [T, n_idx, d_idx] (after the prologue); block_keys as above; scores [T, W] f32 with W >= the
// largest nb of the batch (a row's entries from its nb on are left as they were):
//   scores[t, j] = (sum_h relu(sum_d q[t, h, d] * K_j[d])) / sqrt(d_idx), fp32 from the D values.
METRALE_DECLARE_OP_IMPLS(qsa_scores, (const Tensor& q_idx, const Tensor& block_keys, const Tensor& cu_q,
                                      const Tensor& kv_lens, const Tensor& block_tables, const Tensor& scores,
                                      const QsaParams& params))

// scores [T, W] f32 (qsa_scores' output; entries j < nb of each row are read); selected
// [T, block_topk] i32 (output): the first k = min(block_topk, nb) entries of row t are the indices of
// the k highest scores in ascending order (among equal scores the lower index wins; -0 equals +0),
// the rest -1. Rows with nb <= block_topk get 0 .. nb - 1 without reading the scores.
METRALE_DECLARE_OP_IMPLS(qsa_topk, (const Tensor& scores, const Tensor& cu_q, const Tensor& kv_lens,
                                    const Tensor& selected, const QsaParams& params))

struct QsaAttentionParams {
  float scale = 1.0f;      // head_dim^-0.5
  int compress_ratio = 4;  // c
  int block_topk = 512;    // entries per row of `selected`
  int64_t max_q_len = 0;   // host bounds, as in AttentionParams
  int64_t max_kv_len = 0;
  // CUDA scratch for split-key partial results: at least qsa_attention_workspace_bytes(...) bytes on
  // the device, no initialisation needed, nothing survives the call. May be empty (no splitting:
  // correct, slower at small batch). Unused on the CPU.
  Tensor workspace;
};

// Bytes of QsaAttentionParams::workspace the CUDA kernels need for a batch of at most num_tokens
// query rows (0 without CUDA): 8.7 MB for head_dim 256 on 132 SMs, 0 when the batch alone fills the
// GPU; also needed at any batch size when block_topk is above ~1000 (at c 4).
size_t qsa_attention_workspace_bytes(int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                     int64_t block_topk, int64_t compress_ratio);

// q [T, n_heads, head_dim] (strided views, head_dim contiguous; partial RoPE already applied);
// k_cache, v_cache [num_blocks, block_size, n_kv_heads, head_dim]; cu_q, kv_lens, block_tables as in
// paged_attention; selected [T, block_topk] i32 (qsa_topk's output); out [T, n_heads, head_dim].
// Query row t at position p attends, per head (GQA: head h reads KV head h / (n_heads / n_kv_heads)):
//   nb <= block_topk: every key [0, p] (dense; `selected` is not read)
//   otherwise:        the keys of blocks selected[t, 0 .. block_topk) and the tail [nb c, p]
// with softmax(scale * q.k) in fp32 over exactly those keys. The sigmoid output gate stays outside
// (sigmoid_gate). CUDA: bf16 q, caches and out, head_dim 64, 128 or 256 on the tensor cores, other
// even sizes up to 256 on a slower generic path; f32 q, caches and out (f32 runs) on the generic path.
METRALE_DECLARE_OP_IMPLS(qsa_attention, (const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                                         const Tensor& cu_q, const Tensor& kv_lens, const Tensor& block_tables,
                                         const Tensor& selected, const Tensor& out, const QsaAttentionParams& params))

inline void qsa_index_prologue(const Tensor& q_idx, const Tensor& k_tok, const Tensor& q_norm_weight,
                               const Tensor& positions, const Tensor& inv_freq, const Tensor& slot_mapping,
                               const Tensor& index_cache, const QsaParams& params) {
  METRALE_KERNEL_DISPATCH(qsa_index_prologue, q_idx.device(), q_idx, k_tok, q_norm_weight, positions, inv_freq,
                          slot_mapping, index_cache, params);
}
inline void qsa_block_keys(const Tensor& index_cache, const Tensor& k_norm_weight, const Tensor& inv_freq,
                           const Tensor& cu_q, const Tensor& kv_lens, const Tensor& block_tables,
                           const Tensor& block_keys, const QsaParams& params) {
  METRALE_KERNEL_DISPATCH(qsa_block_keys, block_keys.device(), index_cache, k_norm_weight, inv_freq, cu_q, kv_lens,
                          block_tables, block_keys, params);
}
inline void qsa_scores(const Tensor& q_idx, const Tensor& block_keys, const Tensor& cu_q, const Tensor& kv_lens,
                       const Tensor& block_tables, const Tensor& scores, const QsaParams& params) {
  METRALE_KERNEL_DISPATCH(qsa_scores, scores.device(), q_idx, block_keys, cu_q, kv_lens, block_tables, scores,
                          params);
}
inline void qsa_topk(const Tensor& scores, const Tensor& cu_q, const Tensor& kv_lens, const Tensor& selected,
                     const QsaParams& params) {
  METRALE_KERNEL_DISPATCH(qsa_topk, selected.device(), scores, cu_q, kv_lens, selected, params);
}
inline void qsa_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& cu_q,
                          const Tensor& kv_lens, const Tensor& block_tables, const Tensor& selected,
                          const Tensor& out, const QsaAttentionParams& params) {
  METRALE_KERNEL_DISPATCH(qsa_attention, out.device(), q, k_cache, v_cache, cu_q, kv_lens, block_tables, selected,
                          out, params);
}

}  // namespace metrale::kernels
