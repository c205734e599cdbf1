// Random inputs of kernels::apply_token_bitmask shared by the CPU test and the CUDA test: logits
// rows with a padded stride (NaN, infinities, signed zeros and subnormals among them, so that "left
// bit for bit" is checked), masks mixing words with every token out, every token in, single bits and
// random bits (bits past the vocabulary set at random), and a row list that skips some rows, names
// others, and pads with -1.
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>
#include <limits>
#include <vector>

#include "kernels/kernel_helpers.h"

namespace metrale::testing {

struct BitmaskCase {
  int64_t num_rows = 0;         // R
  int64_t vocab = 0;            // V
  int64_t stride = 0;           // row stride of the logits, >= V
  int64_t words = 0;            // W >= ceil(V / 32)
  std::vector<float> logits;    // [R, stride]
  std::vector<uint32_t> masks;  // [K, W]
  std::vector<int32_t> rows;    // [K]

  int64_t num_masks() const { return static_cast<int64_t>(rows.size()); }
  // Token t of mask k is allowed.
  bool allowed(int64_t k, int64_t t) const {
    return ((masks[static_cast<size_t>(k * words + t / 32)] >> (t % 32)) & 1u) != 0;
  }
};

inline float special_logit(Random& rng) {
  switch (rng.integer(0, 5)) {
    case 0:
      return std::numeric_limits<float>::quiet_NaN();
    case 1:
      return std::numeric_limits<float>::infinity();
    case 2:
      return -0.0f;
    case 3:
      return std::numeric_limits<float>::denorm_min();
    case 4:
      return -std::numeric_limits<float>::infinity();
    default:
      return 0.0f;
  }
}

inline uint32_t random_word(Random& rng, int64_t density_kind) {
  // density_kind 0: mostly masked (a JSON structure position), 1: mostly allowed (inside a string),
  // 2: uniform random bits.
  const int64_t pick = rng.integer(0, 99);
  if (density_kind == 0) {
    if (pick < 85) return 0u;
    if (pick < 95) return 1u << rng.integer(0, 31);
    return static_cast<uint32_t>(rng.engine()());
  }
  if (density_kind == 1) {
    if (pick < 80) return ~0u;
    if (pick < 90) return ~(1u << rng.integer(0, 31));
    return static_cast<uint32_t>(rng.engine()());
  }
  if (pick < 10) return 0u;
  if (pick < 20) return ~0u;
  return static_cast<uint32_t>(rng.engine()());
}

// `num_masks` masks over `num_rows` rows; extra_words > 0 widens the mask rows past ceil(V / 32).
inline BitmaskCase make_bitmask_case(Random& rng, int64_t num_rows, int64_t vocab, int64_t num_masks,
                                     int64_t stride_pad = 0, int64_t extra_words = 0) {
  BitmaskCase c;
  c.num_rows = num_rows;
  c.vocab = vocab;
  c.stride = vocab + stride_pad;
  c.words = (vocab + 31) / 32 + extra_words;
  c.logits.resize(static_cast<size_t>(num_rows * c.stride));
  for (float& x : c.logits) x = rng.integer(0, 199) == 0 ? special_logit(rng) : rng.uniform(-20.0f, 20.0f);
  c.masks.resize(static_cast<size_t>(num_masks * c.words));
  for (int64_t k = 0; k < num_masks; ++k) {
    const int64_t kind = rng.integer(0, 2);
    for (int64_t w = 0; w < c.words; ++w) c.masks[static_cast<size_t>(k * c.words + w)] = random_word(rng, kind);
  }
  // Distinct rows in random order, some masks padding (-1).
  std::vector<int32_t> order(static_cast<size_t>(num_rows));
  for (int64_t r = 0; r < num_rows; ++r) order[static_cast<size_t>(r)] = static_cast<int32_t>(r);
  std::shuffle(order.begin(), order.end(), rng.engine());
  for (int64_t k = 0; k < num_masks; ++k) {
    const bool pad = k >= num_rows || rng.integer(0, 5) == 0;
    c.rows.push_back(pad ? -1 : order[static_cast<size_t>(k)]);
  }
  return c;
}

// The documented result, token by token: masked tokens of listed rows -inf, everything else (row
// padding included) as it was, bit for bit.
inline std::vector<float> expected_masked(const BitmaskCase& c) {
  std::vector<float> out = c.logits;
  for (int64_t k = 0; k < c.num_masks(); ++k) {
    const int32_t row = c.rows[static_cast<size_t>(k)];
    if (row < 0 || row >= c.num_rows) continue;
    for (int64_t t = 0; t < c.vocab; ++t) {
      if (!c.allowed(k, t)) out[static_cast<size_t>(row * c.stride + t)] = -std::numeric_limits<float>::infinity();
    }
  }
  return out;
}

// Index of the first element whose bits differ, or -1.
inline int64_t first_bit_difference(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::bit_cast<uint32_t>(a[i]) != std::bit_cast<uint32_t>(b[i])) return static_cast<int64_t>(i);
  }
  return -1;
}

}  // namespace metrale::testing
