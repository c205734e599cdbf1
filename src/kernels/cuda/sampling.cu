// Sampling on the GPU: one CTA of 512 threads (96 registers, ~153 KB of shared memory) per row of
// logits, no sort, no workspace.
//
// The decision is defined in kernels/sampling.h and computed by the CPU twin (kernels/cpu/sampling.cpp)
// with a plain sort. Here every question of the form "which kept token, in descending probability,
// first brings the running count or mass to a target?" is answered by a radix-style descent over the
// tokens' rank keys (sort_key, higher = more likely; equal keys are ordered by id):
//   level 1   2048 bins over the keys [lowest useful key, key of the maximum], filled once per row
//             (pass B) with the exact 128-bit mass of every bin (and its token count when top-k is on);
//   level 2+  a pass over the tokens of the chosen bin only, into 2048 finer bins, until one key is
//             left (2 or 3 levels); the tokens of the first such pass are compacted into shared memory
//             when they fit (4096), so later levels do not read the row again;
//   ids       all tokens of one key have the same weight, so the crossing is the j-th lowest id among
//             them, with j computed from the weight; j = 1 is the bin's minimum id (recorded by every
//             pass), otherwise the same descent runs over the ids.
// Masses are sums of fixed_weight (floor(w x 2^100)) in 128-bit integers, kept per bin as four 32-bit
// limbs and accumulated with native 32-bit shared-memory atomics (a weight's 24 significant bits span
// at most two limbs; a wrap carries into the next limb): integer sums do not depend on the order of
// the atomics, so the result is deterministic and equal to the CPU twin's.
//
// Passes over the row (V floats; at large batches the rows do not stay in L2): A max; B log-sum-exp,
// argmax and the level-1 histograms. Greedy rows stop after B. With top-k, or top-p, the histograms
// alone give the lowest level-1 bin any later question can reach (the k-th token's, else the top-p
// cut's): pass C puts every token of the bins at and above it into the buffer, and when they fit
// (4096) every later search and kept mass reads the buffer. Otherwise (and for temperature and min-p
// alone) each search makes one pass over the row plus passes over the tokens it compacts, and each
// partial kept mass (top-k, min-p) one more.
#include <climits>
#include <cstdlib>
#include <string_view>

#include "kernels/cuda/common.cuh"
#include "kernels/sampling.h"

namespace metrale::kernels::cuda {
namespace {

using sampling_detail::Fixed128;
namespace sd = sampling_detail;
using u64 = unsigned long long;

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kBinBits = 11;
constexpr int kBins = 1 << kBinBits;
constexpr int kBufferCapacity = 4096;
constexpr int kUnroll = 4;
constexpr int kLimbs = 4;  // 32-bit limbs of a 128-bit mass
constexpr float kInfinity = __builtin_huge_valf();

constexpr int kBinsPerThread = kBins / kThreads;  // in walk_down
static_assert(kBins % kThreads == 0, "walk_down gives each thread the same number of bins");

struct alignas(16) SamplerShared {
  Fixed128 warp_sums[kWarps];  // block scans and sums
  Fixed128 walk_running;
  Fixed128 walk_total;
  double warp_doubles[kWarps];
  unsigned int warp_words[kWarps];
  int walk_bin;
  unsigned int buffer_size;  // tokens appended by the last compacting pass (may exceed the capacity)
  // The buffer holds every token of the level-1 bins at and above the lowest one any later question
  // of the row can reach (precompact_candidates): passes read it instead of the row.
  bool row_in_buffer;
  // Level 1, filled by pass B: 128-bit masses (limb-major: [limb][bin], limb i = bits 32i..32i+31) of
  // the tokens with positive fixed weight, of those with w >= min_p, and token counts (top-k rows
  // only; bin 0 is derived).
  unsigned int l1_all[kLimbs * kBins];
  unsigned int l1_minp[kLimbs * kBins];
  unsigned int l1_count[kBins];
  // Levels 2+ and the id descent.
  unsigned int level_mass[kLimbs * kBins];
  unsigned int level_count[kBins];
  int level_min_id[kBins];
  // Compacted tokens of the current search.
  float buffer_logit[kBufferCapacity];
  int buffer_id[kBufferCapacity];
};

// ----------------------------------------------------------------------------------------------
// Block-wide helpers (every thread of the CTA must call them).

__device__ __forceinline__ Fixed128 make_fixed(u64 high, u64 low) { return (static_cast<Fixed128>(high) << 64) | low; }

__device__ __forceinline__ Fixed128 shfl_down_fixed(Fixed128 value, int offset) {
  const u64 low = __shfl_down_sync(0xffffffffu, static_cast<u64>(value), offset);
  const u64 high = __shfl_down_sync(0xffffffffu, static_cast<u64>(value >> 64), offset);
  return make_fixed(high, low);
}
__device__ __forceinline__ Fixed128 shfl_xor_fixed(Fixed128 value, int mask) {
  const u64 low = __shfl_xor_sync(0xffffffffu, static_cast<u64>(value), mask);
  const u64 high = __shfl_xor_sync(0xffffffffu, static_cast<u64>(value >> 64), mask);
  return make_fixed(high, low);
}

// Sum over the threads t' > t of `value` (a suffix sum: bins are walked from the top).
__device__ Fixed128 block_exclusive_suffix_sum(Fixed128 value, SamplerShared& s) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  Fixed128 inclusive = value;  // becomes the sum over lanes >= lane of this warp
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const Fixed128 other = shfl_down_fixed(inclusive, offset);
    if (lane + offset < 32) inclusive += other;
  }
  if (lane == 0) s.warp_sums[warp] = inclusive;
  __syncthreads();
  Fixed128 warps_above = 0;
  for (int w = warp + 1; w < kWarps; ++w) warps_above += s.warp_sums[w];
  __syncthreads();
  return warps_above + inclusive - value;
}

__device__ Fixed128 block_sum_fixed(Fixed128 value, SamplerShared& s) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int mask = 16; mask > 0; mask >>= 1) value += shfl_xor_fixed(value, mask);
  if (lane == 0) s.warp_sums[warp] = value;
  __syncthreads();
  Fixed128 total = 0;
  for (int w = 0; w < kWarps; ++w) total += s.warp_sums[w];
  __syncthreads();
  return total;
}

// Fixed reduction tree: the same inputs give the same bits on every run.
__device__ double block_sum_double(double value, SamplerShared& s) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int mask = 16; mask > 0; mask >>= 1) value += __shfl_xor_sync(0xffffffffu, value, mask);
  if (lane == 0) s.warp_doubles[warp] = value;
  __syncthreads();
  double total = 0.0;
  for (int w = 0; w < kWarps; ++w) total += s.warp_doubles[w];
  __syncthreads();
  return total;
}

__device__ unsigned int block_max_u32(unsigned int value, SamplerShared& s) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  value = __reduce_max_sync(0xffffffffu, value);
  if (lane == 0) s.warp_words[warp] = value;
  __syncthreads();
  unsigned int result = 0;
  for (int w = 0; w < kWarps; ++w) result = max(result, s.warp_words[w]);
  __syncthreads();
  return result;
}

__device__ unsigned int block_min_u32(unsigned int value, SamplerShared& s) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  value = __reduce_min_sync(0xffffffffu, value);
  if (lane == 0) s.warp_words[warp] = value;
  __syncthreads();
  unsigned int result = UINT_MAX;
  for (int w = 0; w < kWarps; ++w) result = min(result, s.warp_words[w]);
  __syncthreads();
  return result;
}

// Adds a 128-bit value to bin `bin` of limb-major 32-bit counters ([kLimbs][kBins]). Limb i receives
// the value's bits 32i..32i+31 plus the carries out of limb i-1: each add is below 2^32, so it wraps
// the limb at most once, and every wrap carries one into the next limb. The limbs therefore end as
// the exact sum, whatever the order of the atomics. (Native 32-bit shared atomics: 64-bit shared
// atomic adds may compile to compare-and-swap loops, slow under contention.)
__device__ __forceinline__ void atomic_add_fixed(unsigned int* limbs, int bin, Fixed128 value) {
  unsigned int carry = 0;
#pragma unroll
  for (int i = 0; i < kLimbs; ++i) {
    const unsigned long long add = static_cast<unsigned long long>(static_cast<unsigned int>(value >> (32 * i))) + carry;
    carry = 0;
    if (add == 0) continue;
    if (add >> 32) {  // exactly 2^32: the limb is unchanged mod 2^32, one carry
      carry = 1;
      continue;
    }
    const auto addend = static_cast<unsigned int>(add);
    const unsigned int old = atomicAdd(&limbs[i * kBins + bin], addend);
    carry = old + addend < old ? 1u : 0u;
  }
}

__device__ __forceinline__ Fixed128 read_fixed(const unsigned int* limbs, int bin) {
  Fixed128 value = 0;
#pragma unroll
  for (int i = 0; i < kLimbs; ++i) value |= static_cast<Fixed128>(limbs[i * kBins + bin]) << (32 * i);
  return value;
}

// Visits every logit of the row; all threads run the same number of iterations (so visit may use warp
// votes), `valid` is false past the end.
template <typename Visit>
__device__ __forceinline__ void for_each_logit(const float* __restrict__ x, int vocab, Visit&& visit) {
  for (int base = 0; base < vocab; base += kThreads * kUnroll) {
    float values[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * kThreads + static_cast<int>(threadIdx.x);
      values[u] = i < vocab ? __ldg(x + i) : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * kThreads + static_cast<int>(threadIdx.x);
      visit(values[u], i, i < vocab);
    }
  }
}

__device__ __forceinline__ int bit_width(unsigned int value) { return 32 - __clz(static_cast<int>(value)); }

// Bin width (as a shift) for a key or id range [lo, hi] split into at most kBins bins.
__device__ __forceinline__ int range_shift(unsigned int lo, unsigned int hi) {
  return max(0, bit_width(hi - lo) - kBinBits);
}

// ----------------------------------------------------------------------------------------------
// The row and the kept set.

struct Row {
  const float* x;  // [V]
  int vocab;
  float max_logit;
  float temperature;
  float min_p;           // > 0 when min-p is on
  unsigned int max_key;  // sort_key(max_logit)
  unsigned int l1_lo;    // keys <= l1_lo share bin 0
  int l1_shift;

  __device__ float weight(float logit) const { return sd::weight_of(logit, max_logit, temperature); }
  __device__ int l1_bin(unsigned int key) const {
    return key <= l1_lo ? 0 : min(kBins - 1, static_cast<int>((key - l1_lo) >> l1_shift));
  }
  // Keys of level-1 bin b: [lo, hi].
  __device__ void l1_range(int bin, unsigned int& lo, unsigned int& hi) const {
    const unsigned long long start = static_cast<unsigned long long>(l1_lo) + (static_cast<unsigned long long>(bin) << l1_shift);
    lo = bin == 0 ? 0u : static_cast<unsigned int>(start);
    hi = static_cast<unsigned int>(min(static_cast<unsigned long long>(max_key),
                                       start + (1ull << l1_shift) - 1ull));
  }
};

// Kept tokens: ranked at or above (cut_key, cut_id) — key > cut_key, or key == cut_key and id <=
// cut_id — and, with min-p, of weight >= min_p. No cut: cut_key 0, cut_id INT_MAX.
struct Kept {
  unsigned int cut_key = 0;
  int cut_id = INT_MAX;
  bool has_cut = false;
  bool min_p = false;

  __device__ bool ranked_in(unsigned int key, int id) const { return key > cut_key || (key == cut_key && id <= cut_id); }
};

// A histogram's bins as walk_down reads them: 128-bit masses (limb-major) or counts.
template <bool kMass>
struct Bins {
  const unsigned int* values;  // kMass: [kLimbs][kBins] limbs; else [kBins] counts
  __device__ Fixed128 operator()(int bin) const {
    if constexpr (kMass) {
      return read_fixed(values, bin);
    } else {
      return values[bin];
    }
  }
};

struct WalkResult {
  int bin;           // -1: not reached
  Fixed128 running;  // count or mass of the bins above `bin`
};

// Walks bins num_bins-1 down to 0 adding their values to `running` and returns the first bin where
// running + value >= target (target > running). Bins <= stop_bin count as empty; when the target is not
// reached above stop_bin, the answer is stop_bin (the partially kept bin, to be descended into).
// Thread t holds bins [t * kBinsPerThread, (t + 1) * kBinsPerThread).
template <bool kMass>
__device__ WalkResult walk_down(Bins<kMass> bins, int num_bins, int stop_bin, Fixed128 running, Fixed128 target,
                                SamplerShared& s) {
  const int first_bin = static_cast<int>(threadIdx.x) * kBinsPerThread;
  Fixed128 values[kBinsPerThread];
  Fixed128 mine = 0;
#pragma unroll
  for (int k = 0; k < kBinsPerThread; ++k) {
    const int bin = first_bin + k;
    values[k] = (bin < num_bins && bin > stop_bin) ? bins(bin) : Fixed128{0};
    mine += values[k];
  }
  if (threadIdx.x == 0) s.walk_bin = -1;
  const Fixed128 above = block_exclusive_suffix_sum(mine, s);  // synchronises
  Fixed128 base = running + above;
  if (base < target && base + mine >= target) {  // exactly one thread holds the crossing
#pragma unroll
    for (int k = kBinsPerThread - 1; k >= 0; --k) {
      if (base + values[k] >= target) {
        s.walk_bin = first_bin + k;
        s.walk_running = base;
        break;
      }
      base += values[k];
    }
  }
  if (threadIdx.x == 0) s.walk_total = above + mine;
  __syncthreads();
  WalkResult result{s.walk_bin, s.walk_running};
  if (result.bin < 0 && stop_bin >= 0) result = {stop_bin, running + s.walk_total};
  __syncthreads();
  return result;
}

// Appends the tokens of the lanes with `in` to the buffer (warp-aggregated: one atomic per warp);
// every lane of the warp calls it. Positions past the capacity are counted, not written.
__device__ __forceinline__ void append_to_buffer(bool in, float logit, int id, SamplerShared& s) {
  const unsigned int ballot = __ballot_sync(0xffffffffu, in);
  if (ballot == 0) return;
  const int lane = threadIdx.x & 31;
  unsigned int first = 0;
  if (lane == 0) first = atomicAdd(&s.buffer_size, static_cast<unsigned int>(__popc(ballot)));
  first = __shfl_sync(0xffffffffu, first, 0);
  const unsigned int position = first + __popc(ballot & ((1u << lane) - 1u));
  if (in && position < kBufferCapacity) {
    s.buffer_logit[position] = logit;
    s.buffer_id[position] = id;
  }
}

// Visits the row's tokens (all threads the same number of times, `valid` false past the end), or,
// once precompact_candidates has filled the buffer, the buffered tokens (a superset of the tokens
// any later pass of the row keeps; no warp votes in `visit` then).
template <typename Visit>
__device__ __forceinline__ void for_each_candidate(const Row& row, const SamplerShared& s, Visit&& visit) {
  if (s.row_in_buffer) {
    const int size = static_cast<int>(s.buffer_size);
    for (int i = threadIdx.x; i < size; i += kThreads) visit(s.buffer_logit[i], s.buffer_id[i], true);
  } else {
    for_each_logit(row.x, row.vocab, visit);
  }
}

// One level of a descent: bins [0, num_bins) of width 2^shift over [lo, hi] of the token's key (or, in
// id mode, of its id among the tokens whose key is `exact_key`, stored in reverse so that walk_down
// meets the lowest ids first). Counts, minimum ids and (kMass) fixed masses of the kept tokens in range.
// With `compact`, appends those tokens to the buffer.
template <bool kMass, bool kIdMode>
__device__ void level_pass(const Row& row, const Kept& kept, unsigned int lo, unsigned int hi, int shift, int num_bins,
                           unsigned int exact_key, bool from_buffer, bool compact, SamplerShared& s) {
  for (int b = threadIdx.x; b < num_bins; b += kThreads) {
#pragma unroll
    for (int i = 0; i < kLimbs; ++i) s.level_mass[i * kBins + b] = 0;
    s.level_count[b] = 0;
    s.level_min_id[b] = INT_MAX;
  }
  if (compact && threadIdx.x == 0) s.buffer_size = 0;
  __syncthreads();
  auto visit = [&](float logit, int id, bool valid) {
    const unsigned int key = sd::sort_key(logit);
    const unsigned int coordinate = kIdMode ? static_cast<unsigned int>(id) : key;
    bool in = valid && coordinate >= lo && coordinate <= hi && kept.ranked_in(key, id);
    if constexpr (kIdMode) in = in && key == exact_key;
    Fixed128 mass = 0;
    if (in && (kMass || kept.min_p)) {
      const float weight = row.weight(logit);
      if (kept.min_p && !(weight >= row.min_p)) in = false;
      if constexpr (kMass) {
        mass = sd::fixed_weight(weight);
        if (mass == 0) in = false;  // never a crossing, no mass
      }
    }
    if (compact) append_to_buffer(in, logit, id, s);  // `compact` is uniform and every lane is here
    if (in) {
      const int bin = static_cast<int>((coordinate - lo) >> shift);
      const int slot = kIdMode ? num_bins - 1 - bin : bin;
      atomicAdd(&s.level_count[slot], 1u);
      atomicMin(&s.level_min_id[slot], id);
      if constexpr (kMass) atomic_add_fixed(s.level_mass, slot, mass);
    }
  };
  if (from_buffer) {
    const int size = static_cast<int>(s.buffer_size);
    for (int i = threadIdx.x; i < size; i += kThreads) visit(s.buffer_logit[i], s.buffer_id[i], true);
  } else {
    for_each_logit(row.x, row.vocab, visit);
  }
  __syncthreads();
}

struct Found {
  bool ok;
  unsigned int key;
  int id;
  Fixed128 prefix;  // running count or mass through the found token
};

// The j-th lowest id (j >= 1) among the kept tokens whose key is `key`.
__device__ int select_id(const Row& row, const Kept& kept, unsigned int key, unsigned int j, bool from_buffer,
                         SamplerShared& s) {
  unsigned int lo = 0, hi = static_cast<unsigned int>(row.vocab - 1);
  Fixed128 running = 0;
  const Bins<false> bins{s.level_count};
  for (;;) {
    const int shift = range_shift(lo, hi);
    const int num_bins = static_cast<int>((hi - lo) >> shift) + 1;
    level_pass<false, true>(row, kept, lo, hi, shift, num_bins, key, from_buffer, false, s);
    const WalkResult walk = walk_down(bins, num_bins, -1, running, j, s);
    if (walk.bin < 0) return -1;
    const int bin = num_bins - 1 - walk.bin;  // slots are stored in reverse
    if (j - walk.running == 1 || shift == 0) return s.level_min_id[walk.bin];
    running = walk.running;
    const unsigned long long start = static_cast<unsigned long long>(lo) + (static_cast<unsigned long long>(bin) << shift);
    hi = static_cast<unsigned int>(min(static_cast<unsigned long long>(hi), start + (1ull << shift) - 1ull));
    lo = static_cast<unsigned int>(start);
    __syncthreads();  // level_min_id was read above; the next pass clears it
  }
}

// The first kept token, in descending probability, whose running count (kMass false) or mass reaches
// `target` (>= 1). Level 1 comes from the pass-B histogram `l1`.
template <bool kMass>
__device__ Found search(const Row& row, const Kept& kept, Fixed128 target, Bins<kMass> l1, SamplerShared& s) {
  const Found not_found{false, 0u, -1, 0};
  const int stop_bin = kept.has_cut ? row.l1_bin(kept.cut_key) : -1;
  const WalkResult first = walk_down(l1, kBins, stop_bin, Fixed128{0}, target, s);
  if (first.bin < 0) return not_found;
  Fixed128 running = first.running;
  unsigned int lo, hi;
  row.l1_range(first.bin, lo, hi);
  const Bins<kMass> level{kMass ? s.level_mass : s.level_count};
  bool from_buffer = s.row_in_buffer;  // then the buffer is kept: no pass compacts into it
  unsigned int count = 0;
  int min_id = INT_MAX;
  for (;;) {
    const int shift = range_shift(lo, hi);
    const int num_bins = static_cast<int>((hi - lo) >> shift) + 1;
    const bool compact = !from_buffer;
    level_pass<kMass, false>(row, kept, lo, hi, shift, num_bins, 0u, from_buffer, compact, s);
    if (compact) from_buffer = s.buffer_size <= kBufferCapacity;
    const WalkResult walk = walk_down(level, num_bins, -1, running, target, s);
    if (walk.bin < 0) return not_found;
    running = walk.running;
    count = s.level_count[walk.bin];
    min_id = s.level_min_id[walk.bin];
    const unsigned long long start = static_cast<unsigned long long>(lo) + (static_cast<unsigned long long>(walk.bin) << shift);
    hi = static_cast<unsigned int>(min(static_cast<unsigned long long>(hi), start + (1ull << shift) - 1ull));
    lo = static_cast<unsigned int>(start);
    __syncthreads();  // the level arrays were read above; the next pass clears them
    if (shift == 0) break;  // one key left
  }
  // Every token of key `lo` has the same weight: the crossing is the j-th of them by id.
  const unsigned int key = lo;
  unsigned int j = 0;
  Fixed128 prefix = 0;
  if constexpr (kMass) {
    const Fixed128 unit = sd::fixed_weight(row.weight(sd::from_raw_key(key)));
    if (unit == 0 || running + unit * count < target) return not_found;
    unsigned int low_j = 1, high_j = count;
    while (low_j < high_j) {
      const unsigned int mid = low_j + (high_j - low_j) / 2;
      if (running + unit * mid >= target) {
        high_j = mid;
      } else {
        low_j = mid + 1;
      }
    }
    j = low_j;
    prefix = running + unit * j;
  } else {
    j = static_cast<unsigned int>(target - running);
    if (j > count) return not_found;
    prefix = target;
  }
  const int id = j == 1 ? min_id : select_id(row, kept, key, j, from_buffer, s);
  if (id < 0) return not_found;
  return {true, key, id, prefix};
}

// Mass of the kept set: the whole level-1 bins above the cut's bin plus a pass over the cut's bin.
__device__ Fixed128 kept_mass(const Row& row, const Kept& kept, Bins<true> l1, SamplerShared& s) {
  const int cut_bin = kept.has_cut ? row.l1_bin(kept.cut_key) : -1;
  Fixed128 mine = 0;
  for (int b = threadIdx.x; b < kBins; b += kThreads) {
    if (b > cut_bin) mine += l1(b);
  }
  if (kept.has_cut) {
    unsigned int lo, hi;
    row.l1_range(cut_bin, lo, hi);
    for_each_candidate(row, s, [&](float logit, int id, bool valid) {
      const unsigned int key = sd::sort_key(logit);
      if (!valid || key < lo || key > hi || !kept.ranked_in(key, id)) return;
      const float weight = row.weight(logit);
      if (kept.min_p && !(weight >= row.min_p)) return;
      mine += sd::fixed_weight(weight);
    });
  }
  return block_sum_fixed(mine, s);
}

// Every question after pass B concerns tokens of level-1 bins >= `lowest_bin` (the bin of the k-th
// token with top-k, else the top-p cut's bin: the kept set lies at and above it). One pass puts all
// of them in the buffer, whatever their weight (top-k counts tokens, not mass); when they fit, the
// remaining searches and masses read the buffer instead of the row (2 to 4 passes over the row
// saved). Integer sums and atomicMin do not depend on the buffer's order, so the result is the same.
__device__ void precompact_candidates(const Row& row, int lowest_bin, SamplerShared& s) {
  if (threadIdx.x == 0) s.buffer_size = 0;
  __syncthreads();
  for_each_logit(row.x, row.vocab, [&](float logit, int id, bool valid) {
    append_to_buffer(valid && row.l1_bin(sd::sort_key(logit)) >= lowest_bin, logit, id, s);
  });
  __syncthreads();
  if (threadIdx.x == 0) s.row_in_buffer = s.buffer_size <= kBufferCapacity;
  __syncthreads();
}

struct RowParamsView {
  const float* temperature;
  const int32_t* top_k;
  const float* top_p;
  const float* min_p;
  const int64_t* seed;
  const int64_t* step;
};

__global__ void __launch_bounds__(kThreads, 1)
    sample_kernel(const float* __restrict__ logits, int64_t row_stride, int vocab, RowParamsView params,
                  int32_t* __restrict__ tokens, float* __restrict__ logprobs, bool precompact) {
  extern __shared__ __align__(16) unsigned char shared_raw[];
  SamplerShared& s = *reinterpret_cast<SamplerShared*>(shared_raw);
  const int r = blockIdx.x;
  const float* x = logits + r * row_stride;

  // Parameters, sanitised (the engine validates them; see kernels/sampling.h).
  const float temperature = params.temperature[r];
  const bool greedy = !(temperature > sd::kGreedyTemperature && temperature < kInfinity);
  const int top_k = params.top_k[r];
  const bool top_k_on = top_k > 0 && top_k < vocab;
  const float top_p = params.top_p[r];
  const bool top_p_on = top_p > 0.0f && top_p < 1.0f;
  const float raw_min_p = params.min_p[r];
  const bool min_p_on = raw_min_p > 0.0f;  // false for NaN
  const float min_p = raw_min_p > 1.0f ? 1.0f : raw_min_p;

  // Pass A: the maximum (by the raw order key, as the Sampler) and the check for NaN and +inf.
  unsigned int max_key = 0, bad = 0;
  for_each_logit(x, vocab, [&](float logit, int, bool valid) {
    if (!valid) return;
    bad |= !(logit < kInfinity);
    max_key = max(max_key, sd::raw_key(logit));
  });
  max_key = block_max_u32(max_key, s);
  bad = block_max_u32(bad, s);
  const float max_logit = sd::from_raw_key(max_key);
  if (bad != 0 || max_logit == -kInfinity) {
    if (threadIdx.x == 0) {
      tokens[r] = -1;
      logprobs[r] = __int_as_float(0x7fc00000);
    }
    return;
  }

  Row row;
  row.x = x;
  row.vocab = vocab;
  row.max_logit = max_logit;
  row.temperature = greedy ? 1.0f : temperature;
  row.min_p = min_p;
  row.max_key = sd::sort_key(max_logit);
  row.l1_lo = min(row.max_key, sd::sort_key(sd::sub_rn(max_logit, sd::mul_rn(88.0f, row.temperature))));
  row.l1_shift = range_shift(row.l1_lo, row.max_key);

  if (threadIdx.x == 0) s.row_in_buffer = false;  // published by the barriers of pass B
  if (!greedy) {
    for (int b = threadIdx.x; b < kBins; b += kThreads) {
#pragma unroll
      for (int i = 0; i < kLimbs; ++i) {
        s.l1_all[i * kBins + b] = 0;
        s.l1_minp[i * kBins + b] = 0;
      }
      s.l1_count[b] = 0;
    }
    __syncthreads();
  }

  // Pass B: sum of exp(x - max) for the logprob, the argmax, and the level-1 histograms.
  double sum_exp = 0.0;
  unsigned int argmax = UINT_MAX;
  const bool unit_temperature = row.temperature == 1.0f;
  for_each_logit(x, vocab, [&](float logit, int id, bool valid) {
    if (!valid) return;
    const float shifted_exp = sd::exp_nonpositive(sd::sub_rn(logit, max_logit));
    sum_exp += shifted_exp;
    if (logit == max_logit) argmax = min(argmax, static_cast<unsigned int>(id));
    if (greedy) return;
    // (x - max) / 1 == x - max, so at temperature 1 the weight is the same exponential.
    const float weight = unit_temperature ? shifted_exp : row.weight(logit);
    const int bin = row.l1_bin(sd::sort_key(logit));
    if (top_k_on && bin > 0) atomicAdd(&s.l1_count[bin], 1u);
    const Fixed128 mass = sd::fixed_weight(weight);
    if (mass != 0) {
      atomic_add_fixed(s.l1_all, bin, mass);
      if (min_p_on && weight >= min_p) atomic_add_fixed(s.l1_minp, bin, mass);
    }
  });
  sum_exp = block_sum_double(sum_exp, s);
  argmax = block_min_u32(argmax, s);
  const double log_normalizer = static_cast<double>(max_logit) + log(sum_exp);
  auto finish = [&](int token) {
    if (threadIdx.x == 0) {
      tokens[r] = token;
      logprobs[r] = token < 0 ? __int_as_float(0x7fc00000)
                              : static_cast<float>(static_cast<double>(x[token]) - log_normalizer);
    }
  };
  if (greedy) {
    finish(static_cast<int>(argmax));
    return;
  }

  const Bins<true> l1_all{s.l1_all};
  const Bins<true> l1_minp{s.l1_minp};
  Kept kept;
  Fixed128 mass = 0;

  // top-k: the k-th token in rank order bounds the kept set.
  if (top_k_on) {
    unsigned int counted = 0;
    for (int b = 1 + threadIdx.x; b < kBins; b += kThreads) counted += s.l1_count[b];
    counted = static_cast<unsigned int>(block_sum_fixed(counted, s));
    if (threadIdx.x == 0) s.l1_count[0] = static_cast<unsigned int>(vocab) - counted;
    __syncthreads();
    if (precompact) {
      // The k-th token's bin, and the tokens at and above it: they fit, or precompaction would not.
      const WalkResult kth_bin = walk_down(Bins<false>{s.l1_count}, kBins, -1, Fixed128{0}, top_k, s);
      if (kth_bin.bin >= 0 && kth_bin.running + s.l1_count[kth_bin.bin] <= kBufferCapacity)
        precompact_candidates(row, kth_bin.bin, s);
    }
    const Found kth = search(row, kept, static_cast<Fixed128>(top_k), Bins<false>{s.l1_count}, s);
    if (!kth.ok) {
      finish(-1);
      return;
    }
    kept.cut_key = kth.key;
    kept.cut_id = kth.id;
    kept.has_cut = true;
  }
  mass = kept_mass(row, kept, l1_all, s);

  // top-p: the first token whose running mass reaches top_p x the kept mass.
  if (top_p_on) {
    const Fixed128 target = sd::top_p_target(top_p, mass);
    if (precompact && !s.row_in_buffer && !kept.has_cut) {
      // Without top-k the cut's bin comes from the histogram alone (the same walk as the search's).
      const WalkResult cut_bin = walk_down(l1_all, kBins, -1, Fixed128{0}, target, s);
      if (cut_bin.bin >= 0) precompact_candidates(row, cut_bin.bin, s);
    }
    const Found cut = search(row, kept, target, l1_all, s);
    if (!cut.ok) {
      finish(-1);
      return;
    }
    kept.cut_key = cut.key;
    kept.cut_id = cut.id;
    kept.has_cut = true;
    mass = cut.prefix;
  }

  // min-p, token by token.
  if (min_p_on) {
    kept.min_p = true;
    mass = kept_mass(row, kept, l1_minp, s);
  }

  // The draw: the first token whose running mass exceeds u x the kept mass.
  const float uniform = rng::uniform_for(static_cast<uint64_t>(params.seed[r]), static_cast<uint64_t>(params.step[r]));
  const Found drawn = search(row, kept, sd::draw_target(uniform, mass), min_p_on ? l1_minp : l1_all, s);
  finish(drawn.ok ? drawn.id : -1);
}

void check_row_tensor(const Tensor& t, DType dtype, int64_t rows, const char* what) {
  METRALE_EXPECT(t.device().is_cuda() && t.ndim() == 1 && t.dtype() == dtype && t.numel() == rows &&
                     (rows <= 1 || t.stride(0) == 1),
                 std::string("sample_tokens ") + what + ": " + t.describe());
}

}  // namespace

void sample_tokens(const Tensor& logits, const SamplingRowParams& params, const Tensor& tokens,
                   const Tensor& logprobs) {
  METRALE_EXPECT(logits.device().is_cuda() && logits.ndim() == 2 && logits.dtype() == DType::kF32 &&
                     logits.stride(1) == 1 && logits.stride(0) >= logits.size(1),
                 "sample_tokens logits " + logits.describe());
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  METRALE_EXPECT(vocab >= 1 && vocab < (int64_t{1} << 27), "sample_tokens: vocabulary too large or empty");
  check_row_tensor(params.temperature, DType::kF32, rows, "temperature");
  check_row_tensor(params.top_k, DType::kI32, rows, "top_k");
  check_row_tensor(params.top_p, DType::kF32, rows, "top_p");
  check_row_tensor(params.min_p, DType::kF32, rows, "min_p");
  check_row_tensor(params.seed, DType::kI64, rows, "seed");
  check_row_tensor(params.step, DType::kI64, rows, "step");
  check_row_tensor(tokens, DType::kI32, rows, "tokens");
  check_row_tensor(logprobs, DType::kF32, rows, "logprobs");
  if (rows == 0) return;
  METRALE_EXPECT(rows <= INT_MAX, "sample_tokens: too many rows");
  constexpr size_t kSharedBytes = sizeof(SamplerShared);
  // Above the default 48 KB: opt in (a host-side attribute, allowed during graph capture).
  METRALE_CUDA_CHECK(cudaFuncSetAttribute(sample_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(kSharedBytes)));
  const RowParamsView view{params.temperature.data_as<const float>(), params.top_k.data_as<const int32_t>(),
                           params.top_p.data_as<const float>(),       params.min_p.data_as<const float>(),
                           params.seed.data_as<const int64_t>(),      params.step.data_as<const int64_t>()};
  // METRALE_SAMPLER_PRECOMPACT=0: every search reads the row (A/B timing of precompact_candidates).
  static const bool precompact = [] {
    const char* value = std::getenv("METRALE_SAMPLER_PRECOMPACT");
    return value == nullptr || std::string_view(value) != "0";
  }();
  sample_kernel<<<static_cast<unsigned int>(rows), kThreads, kSharedBytes, stream_of(logits)>>>(
      logits.data_as<const float>(), logits.stride(0), static_cast<int>(vocab), view, tokens.data_as<int32_t>(),
      logprobs.data_as<float>(), precompact);
  METRALE_CHECK_LAUNCH("sample_kernel");
}

}  // namespace metrale::kernels::cuda
