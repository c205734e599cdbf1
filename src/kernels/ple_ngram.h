// PLE hashed n-gram ids (qwen.md §7.2 a-d, §8): the per-layer hash multipliers and prime table
// sizes (host utilities, computed once at load and checked against the checkpoint's buffers), and
// the op that turns a ragged batch of token ids into NH table row ids per token, with the per-slot
// history of the last n_max - 1 token ids.
//
// Notation: n_max = ngram_size, hpn = heads_per_ngram, NH = (n_max - 1) * hpn heads; head
// h = (n - 2) * hpn + j (j < hpn) hashes the order-n gram (n = 2..n_max), order-2 heads first.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/dispatch.h"

namespace metrale::kernels {

// ---- host utilities (exact integer arithmetic, no device) ----

// SplitMix64 finaliser: z = v + 0x9E3779B97F4A7C15; z = (z ^ z>>30) * 0xBF58476D1CE4E5B9;
// z = (z ^ z>>27) * 0x94D049BB133111EB; z ^ z>>31 (all mod 2^64).
uint64_t splitmix64(uint64_t value);

// The n_max multipliers of PLE layer `ple_layer_index` (0-based position in the sorted
// ple_layer_ids): half = max(1, ((2^63 - 1) / max(vocab_size, 1)) / 2);
// m_i = 2 * (splitmix64(seed + 10007 * L + 0x9E3779B97F4A7C15 * (i + 1) mod 2^64) mod half) + 1.
// Odd and below 2^63 / vocab_size, so t * m_i never overflows int64 for a token id t < vocab_size.
std::vector<int64_t> ple_layer_multipliers(int64_t vocab_size, int ngram_size, int64_t ple_layer_index, int64_t seed);

// True when `value` is prime (deterministic Miller-Rabin with the first 12 prime bases, exact for
// every value below 2^64).
bool is_prime_u64(uint64_t value);

// The first `count` primes >= `base`, ascending.
std::vector<int64_t> primes_at_least(int64_t base, int64_t count);

// One PLE layer's table geometry: head h has P_h rows, P_h = the (L * NH + h + 1)-th prime >= base;
// offset_h = sum of P_h' for h' < h (offsets restart at 0 in every PLE layer); the concatenated
// table has `total` = sum P_h rows, padded up to a multiple of pad_multiple (`padded_rows`).
struct PleHeadTable {
  std::vector<int64_t> sizes;    // [NH]
  std::vector<int64_t> offsets;  // [NH]
  int64_t total = 0;
  int64_t padded_rows = 0;
};
PleHeadTable ple_head_table(int64_t vocab_size_base, int64_t num_heads, int64_t ple_layer_index, int64_t pad_multiple);

// ---- the id op ----

struct PleNgramParams {
  int64_t eos_token_id = 0;  // the PLE EOS (first entry of eos_token_id)
  int ngram_size = 3;        // n_max >= 2 (CUDA: <= kMaxPleNgram)
  int heads_per_ngram = 1;   // hpn >= 1
  // false: the history slots are read, never updated (a speculative verify keeps them for its commit).
  bool write_history = true;
};

inline constexpr int kMaxPleNgram = 8;

// token_ids [T] i32; history [num_slots, n_max - 1] i64 contiguous; cu_q [S+1], kv_lens [S],
// slots [S] i32 (batch layout as in attention.h); multipliers [n_max] i64; head_sizes,
// head_offsets [NH] i64; ids [T, NH] i64 contiguous (output). All on one device.
//
// Sequence s with q_len rows and ctx = kv_lens[s] - q_len cached tokens reads
//   hist = (ctx == 0 or slots[s] == -1 ? [EOS] * (n_max - 1) : history[slots[s]]) ++ token_ids[rows of s]
// (oldest first). For its row i (hist position p = n_max - 1 + i) and shift k < n_max,
//   t_k = hist[p - k] when none of hist[p - k .. p - 1] is EOS (k = 0: always hist[p]), else EOS;
// X_n = (t_0 * m_0) ^ ... ^ (t_{n-1} * m_{n-1}) for n = 2..n_max (uint64, exact for token ids below
// the vocab size the multipliers were built for); ids[row, h] = X_n mod P_h + offset_h.
// Afterwards (write_history, slot >= 0, q_len > 0) history[slot] holds the last n_max - 1 entries
// of hist, which is the first-call EOS padding of transformers' id state when q_len < n_max - 1.
// CUDA: metadata read on the device only (graph-capturable).
METRALE_DECLARE_OP_IMPLS(ple_ngram_ids, (const Tensor& token_ids, const Tensor& history, const Tensor& cu_q,
                                         const Tensor& kv_lens, const Tensor& slots, const Tensor& multipliers,
                                         const Tensor& head_sizes, const Tensor& head_offsets, const Tensor& ids,
                                         const PleNgramParams& params))

inline void ple_ngram_ids(const Tensor& token_ids, const Tensor& history, const Tensor& cu_q, const Tensor& kv_lens,
                          const Tensor& slots, const Tensor& multipliers, const Tensor& head_sizes,
                          const Tensor& head_offsets, const Tensor& ids, const PleNgramParams& params) {
  METRALE_KERNEL_DISPATCH(ple_ngram_ids, ids.device(), token_ids, history, cu_q, kv_lens, slots, multipliers,
                          head_sizes, head_offsets, ids, params);
}

}  // namespace metrale::kernels
