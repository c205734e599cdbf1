// The chunked KDA delta rule on tensor cores, for key_head_dim 128 and bf16 activations
// (glm_deepseek.md §2.5). Three launches, all reading the batch metadata on the device only:
//
//  1. chunks::offsets_kernel (chunk_offsets.cuh): chunk_offsets[s] = sum over earlier sequences of ceil(q_len / 64).
//  2. prep_kernel, one CTA per (head, chunk), all chunks in parallel: the per-channel cumulative
//     decay G (from the raw forget-gate projection; stored for the scan, fp32 [64][128] per record),
//     the l2-norm factors and beta; the intra-chunk
//     matrices
//       Akk_ij = beta_i sum_d k^_i k^_j exp(G_i - G_j)  (j < i),  Aqk_ij = sum_d q^_i k^_j exp(G_i - G_j)  (j <= i)
//     in 16 x 16 blocks on tensor cores, each block (I, J) with a reference row rho between its
//     row and column ranges, exp(G_i - G_j) = exp(G_i - G_rho) exp(G_rho - G_j), so that no factor
//     exceeds 1 off the diagonal (any gate) and none exceeds e^80 on it (the bounded gate with
//     lambda >= -5: |G_i - G_j| <= 16 |lambda| inside a block). Other gates compute the diagonal
//     blocks element by element in fp32 with the exact difference. Then T = (I + Akk)^-1 by 16 x 16
//     blocks (kernels/cuda/unit_lower_inverse.cuh: diagonal blocks by substitution, the others on
//     tensor cores with hi/lo operands), stored as t_hi + t_lo bf16; Aqk as bf16 (it feeds the output only).
//  3. scan_kernel, one CTA of 8 warps per (sequence, head, 64 state columns), sequential over the
//     chunks with the fp32 state tile [128, 64] in registers. Per chunk it forms K^ exp(G),
//     Q^ exp(G) and K^ exp(G_C - G) (all factors <= 1) from the record's G, and then
//       Y  = beta (V - (K^ e^G) S)          S as s_hi + s_lo, K^ e^G as hi + lo (3 products)
//       V' = T Y                             t_hi y_hi + t_hi y_lo + t_lo y_hi
//       O  = (Q^ e^G) S + Aqk V'             s_hi and v'_hi only: output precision
//       S  = diag(e^{G_C}) S + (K^ e^{G_C - G})^T V'   hi/lo on both sides
//     which is the reference's U - W S, Q' S + Aqk V', S' + K'^T V'. The next chunk's G, q, k, v
//     and T arrive by cp.async while the current one is computed, each load issued as soon as its
//     buffer is free.
// Products that reach the state use hi/lo bf16 splits (relative error ~2^-16), so the state tracks
// the fp32 reference to ~1e-5; the output carries bf16 operand rounding (~2e-3), below its own.
#pragma once

#include "kernels/cuda/kda_chunked_prep.cuh"
#include "kernels/cuda/kda_chunked_scan.cuh"
