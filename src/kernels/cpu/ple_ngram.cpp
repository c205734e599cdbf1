// PLE n-gram hashing: the host utilities of kernels/ple_ngram.h (multipliers, prime table sizes)
// and the CPU id op.
#include "kernels/ple_ngram.h"

#include <algorithm>
#include <array>

#include "kernels/cpu/common.h"

namespace metrale::kernels {
namespace {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;
constexpr uint64_t kLayerPrime = 10007;

__extension__ typedef unsigned __int128 u128;

uint64_t mul_mod(uint64_t a, uint64_t b, uint64_t m) { return static_cast<uint64_t>(static_cast<u128>(a) * b % m); }

uint64_t pow_mod(uint64_t base, uint64_t exponent, uint64_t m) {
  uint64_t result = 1 % m;
  base %= m;
  while (exponent > 0) {
    if (exponent & 1u) result = mul_mod(result, base, m);
    base = mul_mod(base, base, m);
    exponent >>= 1;
  }
  return result;
}

}  // namespace

uint64_t splitmix64(uint64_t value) {
  uint64_t z = value + kGolden;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

std::vector<int64_t> ple_layer_multipliers(int64_t vocab_size, int ngram_size, int64_t ple_layer_index, int64_t seed) {
  METRALE_CHECK(ngram_size >= 1 && ple_layer_index >= 0, "ple_layer_multipliers: ngram_size {} layer {}", ngram_size,
                ple_layer_index);
  const uint64_t max_long = (uint64_t{1} << 63) - 1;
  const uint64_t bound = max_long / static_cast<uint64_t>(std::max<int64_t>(vocab_size, 1));
  const uint64_t half = std::max<uint64_t>(1, bound / 2);
  // seed + 10007 * L in Python integers, then mod 2^64 (a negative seed wraps like Python's & mask).
  const uint64_t base_seed = static_cast<uint64_t>(seed) + kLayerPrime * static_cast<uint64_t>(ple_layer_index);
  std::vector<int64_t> multipliers;
  multipliers.reserve(static_cast<size_t>(ngram_size));
  for (int i = 0; i < ngram_size; ++i) {
    const uint64_t value = base_seed + kGolden * static_cast<uint64_t>(i + 1);
    multipliers.push_back(static_cast<int64_t>(2 * (splitmix64(value) % half) + 1));
  }
  return multipliers;
}

bool is_prime_u64(uint64_t value) {
  constexpr std::array<uint64_t, 12> kBases = {2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37};
  if (value < 2) return false;
  for (uint64_t p : kBases) {
    if (value % p == 0) return value == p;
  }
  // value - 1 = d * 2^r with d odd.
  uint64_t d = value - 1;
  int r = 0;
  while ((d & 1u) == 0) {
    d >>= 1;
    ++r;
  }
  for (uint64_t a : kBases) {
    uint64_t x = pow_mod(a, d, value);
    if (x == 1 || x == value - 1) continue;
    bool composite = true;
    for (int i = 1; i < r && composite; ++i) {
      x = mul_mod(x, x, value);
      composite = x != value - 1;
    }
    if (composite) return false;
  }
  return true;
}

std::vector<int64_t> primes_at_least(int64_t base, int64_t count) {
  METRALE_CHECK(count >= 0, "primes_at_least: count {}", count);
  std::vector<int64_t> primes;
  primes.reserve(static_cast<size_t>(count));
  for (int64_t candidate = std::max<int64_t>(base, 2); static_cast<int64_t>(primes.size()) < count; ++candidate) {
    if (is_prime_u64(static_cast<uint64_t>(candidate))) primes.push_back(candidate);
  }
  return primes;
}

PleHeadTable ple_head_table(int64_t vocab_size_base, int64_t num_heads, int64_t ple_layer_index, int64_t pad_multiple) {
  METRALE_CHECK(num_heads >= 1 && ple_layer_index >= 0 && pad_multiple >= 1,
                "ple_head_table: heads {} layer {} pad {}", num_heads, ple_layer_index, pad_multiple);
  // Layer L's heads take primes L * NH .. (L + 1) * NH - 1 of the sequence (the earlier layers' first).
  const std::vector<int64_t> primes = primes_at_least(vocab_size_base, (ple_layer_index + 1) * num_heads);
  PleHeadTable table;
  for (int64_t h = 0; h < num_heads; ++h) {
    const int64_t size = primes[static_cast<size_t>(ple_layer_index * num_heads + h)];
    table.sizes.push_back(size);
    table.offsets.push_back(table.total);
    table.total += size;
  }
  table.padded_rows = (table.total + pad_multiple - 1) / pad_multiple * pad_multiple;
  return table;
}

namespace cpu {

void ple_ngram_ids(const Tensor& token_ids, const Tensor& history, const Tensor& cu_q, const Tensor& kv_lens,
                   const Tensor& slots, const Tensor& multipliers, const Tensor& head_sizes,
                   const Tensor& head_offsets, const Tensor& ids, const PleNgramParams& params) {
  const int n_max = params.ngram_size, hpn = params.heads_per_ngram;
  METRALE_CHECK(n_max >= 2 && hpn >= 1, "ple_ngram_ids: ngram_size {} heads_per_ngram {}", n_max, hpn);
  const int64_t heads = static_cast<int64_t>(n_max - 1) * hpn, context = n_max - 1;
  const int64_t tokens = token_ids.numel(), num_seqs = kv_lens.numel();
  METRALE_CHECK(token_ids.dtype() == DType::kI32 && ids.dtype() == DType::kI64 && ids.is_contiguous() &&
                    ids.ndim() == 2 && ids.size(0) == tokens && ids.size(1) == heads,
                "ple_ngram_ids: token_ids {} ids {} ({} heads)", token_ids.describe(), ids.describe(), heads);
  METRALE_CHECK(history.dtype() == DType::kI64 && history.ndim() == 2 && history.is_contiguous() &&
                    history.size(1) == context,
                "ple_ngram_ids: history {} must be [slots, {}] i64", history.describe(), context);
  METRALE_CHECK(multipliers.dtype() == DType::kI64 && multipliers.numel() == n_max &&
                    head_sizes.dtype() == DType::kI64 && head_sizes.numel() == heads &&
                    head_offsets.dtype() == DType::kI64 && head_offsets.numel() == heads,
                "ple_ngram_ids: multipliers {} sizes {} offsets {}", multipliers.describe(), head_sizes.describe(),
                head_offsets.describe());
  METRALE_CHECK(cu_q.numel() == num_seqs + 1 && slots.numel() == num_seqs, "ple_ngram_ids: cu_q {} slots {}",
                cu_q.describe(), slots.describe());
  const auto* cu = cu_q.data_as<const int32_t>();
  const auto* lens = kv_lens.data_as<const int32_t>();
  const auto* slot = slots.data_as<const int32_t>();
  const auto* tok = token_ids.data_as<const int32_t>();
  const auto* mult = multipliers.data_as<const int64_t>();
  const auto* sizes = head_sizes.data_as<const int64_t>();
  const auto* offsets = head_offsets.data_as<const int64_t>();
  auto* hist_state = history.data_as<int64_t>();
  auto* out = ids.data_as<int64_t>();
  METRALE_CHECK(cu[num_seqs] == tokens, "ple_ngram_ids: cu_q ends at {} for {} tokens", cu[num_seqs], tokens);
  for (int64_t h = 0; h < heads; ++h) {
    METRALE_CHECK(sizes[h] > 0, "ple_ngram_ids: head {} has table size {}", h, sizes[h]);
  }
  const auto eos = static_cast<uint64_t>(params.eos_token_id);

  cpu_pool().parallel_for(num_seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint64_t> hist;
    for (int64_t s = begin; s < end; ++s) {
      const int64_t first = cu[s], q_len = cu[s + 1] - cu[s];
      METRALE_CHECK(q_len >= 0 && lens[s] >= q_len, "ple_ngram_ids: sequence {} has q_len {} kv_len {}", s, q_len,
                    lens[s]);
      METRALE_CHECK(slot[s] >= -1 && slot[s] < history.size(0), "ple_ngram_ids: slot {} of {}", slot[s],
                    history.size(0));
      if (q_len == 0) continue;
      const bool fresh = lens[s] == q_len || slot[s] < 0;
      hist.assign(static_cast<size_t>(context + q_len), eos);
      if (!fresh) {
        for (int64_t k = 0; k < context; ++k) hist[static_cast<size_t>(k)] = static_cast<uint64_t>(hist_state[slot[s] * context + k]);
      }
      for (int64_t i = 0; i < q_len; ++i) {
        hist[static_cast<size_t>(context + i)] = static_cast<uint64_t>(static_cast<int64_t>(tok[first + i]));
      }
      for (int64_t i = 0; i < q_len; ++i) {
        const int64_t p = context + i;
        int64_t* row = out + (first + i) * heads;
        uint64_t mixed = hist[static_cast<size_t>(p)] * static_cast<uint64_t>(mult[0]);
        bool blocked = false;  // an EOS at or after p - k (and before p) cuts the gram
        for (int k = 1; k < n_max; ++k) {
          const uint64_t previous = hist[static_cast<size_t>(p - k)];
          blocked = blocked || previous == eos;
          const uint64_t shifted = blocked ? eos : previous;
          mixed ^= shifted * static_cast<uint64_t>(mult[k]);
          // `mixed` is now X_{k+1}: heads (k - 1) * hpn .. k * hpn - 1.
          for (int j = 0; j < hpn; ++j) {
            const int64_t h = static_cast<int64_t>(k - 1) * hpn + j;
            row[h] = static_cast<int64_t>(mixed % static_cast<uint64_t>(sizes[h])) + offsets[h];
          }
        }
      }
      if (params.write_history && slot[s] >= 0) {
        for (int64_t k = 0; k < context; ++k) {
          hist_state[slot[s] * context + k] = static_cast<int64_t>(hist[static_cast<size_t>(q_len + k)]);
        }
      }
    }
  });
}

}  // namespace cpu
}  // namespace metrale::kernels
