#include "engine/sampler.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <functional>
#include <limits>
#include <optional>

#include "core/error.h"

namespace metrale {

namespace {

constexpr float kInfinity = std::numeric_limits<float>::infinity();
constexpr float kLargestFloat = std::numeric_limits<float>::max();

// Row passes keep kLanes independent accumulators so that the compiler can vectorise them without
// reassociating floating-point sums (which it may not do without -ffast-math). The summation order is
// fixed by the code, so results are deterministic.
constexpr size_t kLanes = 8;

// The lazily ranked prefix starts with the best kRankedPrefix tokens of the row: LLM distributions put
// nearly all their mass there, so top-p and the draw rarely look further.
constexpr size_t kRankedPrefix = 64;
// A top-k up to this size is sorted whole and becomes the ranked prefix.
constexpr size_t kRankedTopK = 1024;
// collect_top_set() guesses a threshold from a strided sample of this many logits.
constexpr size_t kThresholdSampleSize = 4096;
// find_crossing() sorts and scans its window once it is this small.
constexpr size_t kSortedWindow = 256;
// weight_of() is exactly 0 once (logit - max) / T < -87; bucketing starts a little below that.
constexpr float kZeroWeightBelow = 88.0f;

void raise_out_of_range(const char* field, double value, const char* range) {
  raise(ErrorCode::kInvalidArgument, "sampling parameter {} = {} is out of range: it must be {}", field, value, range);
}

// The hot row passes below are written so that GCC and Clang vectorise them under the project's strict
// IEEE flags: with trapping math on, a compiler will not if-convert a floating-point comparison, so
// comparisons and selects are done on the bit patterns as integers instead.

// Order-preserving map of a float's bits to int32: for non-NaN x < y, key(x) < key(y) (-0 sits just
// below +0). Negative NaNs map below key(-inf) and positive NaNs above key(+inf). It is its own inverse.
inline int32_t ordered_key(int32_t bits) {
  return bits ^ static_cast<int32_t>(static_cast<uint32_t>(bits >> 31) >> 1);
}
inline int32_t ordered_key(float x) {
  return ordered_key(std::bit_cast<int32_t>(x));
}
inline float from_ordered_key(int32_t key) {
  return std::bit_cast<float>(ordered_key(key));
}

// e^x for x <= 0 (including -inf; never NaN), branch-free so that loops over it vectorise (std::exp
// does not, and it dominates a 150k-token row). Relative error below 4e-7; results below e^-87
// (~1.6e-38, far below anything a probability can resolve next to the maximum's weight 1) are flushed
// to exactly 0, which also keeps subnormals out. e^0 is exactly 1.
inline float exp_nonpositive(float x) {
  constexpr uint32_t kFlushBelowBits = 0xc2ae0000u;  // -87.0f; for x <= 0, bits > this <=> x < -87
  constexpr float kLog2e = 1.44269502163f;
  constexpr float kLn2High = 0.693145751953125f;  // 14 significant bits: n * kLn2High is exact for |n| <= 126
  constexpr float kLn2Low = 1.428606765330187e-06f;
  constexpr float kRoundingShift = 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  const uint32_t flush_mask = bits > kFlushBelowBits ? 0xffffffffu : 0u;
  const float clamped = std::bit_cast<float>((bits & ~flush_mask) | (kFlushBelowBits & flush_mask));
  const float n = (clamped * kLog2e + kRoundingShift) - kRoundingShift;  // an integer in [-126, 0]
  const float r = (clamped - n * kLn2High) - n * kLn2Low;                // |r| <= ln(2) / 2 (+ rounding)
  // Taylor polynomial of e^r to degree 7; truncation error below 6e-9 on |r| <= 0.35.
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t biased_exponent = static_cast<int32_t>(n) + 127;  // in [1, 127]: 2^n is a normal float
  const float two_to_n = std::bit_cast<float>(static_cast<uint32_t>(biased_exponent) << 23);
  return std::bit_cast<float>(std::bit_cast<uint32_t>(p * two_to_n) & ~flush_mask);
}

// The sampling weight of a penalised logit: exp((logit - max_logit) / T), proportional to
// softmax(logit / T), and exactly 1 for the most likely token. Subtracting before dividing keeps every
// case finite: logit - max_logit <= 0 (or -inf for a masked token) for any finite max_logit.
// Monotone in the logit, so weights never increase along the descending-probability order.
inline float weight_of(float logit, float max_logit, float temperature) {
  return exp_nonpositive((logit - max_logit) / temperature);
}

// The smallest and largest ordered_key of a row (a NaN lands outside [key(-inf), key(+inf)]).
struct KeyRange {
  int32_t min;
  int32_t max;
};

KeyRange key_range(std::span<const float> row) {
  std::array<int32_t, kLanes> lane_min;
  std::array<int32_t, kLanes> lane_max;
  lane_min.fill(std::numeric_limits<int32_t>::max());
  lane_max.fill(std::numeric_limits<int32_t>::min());
  size_t i = 0;
  for (; i + kLanes <= row.size(); i += kLanes) {
    for (size_t lane = 0; lane < kLanes; ++lane) {
      const int32_t key = ordered_key(row[i + lane]);
      lane_min[lane] = std::min(lane_min[lane], key);
      lane_max[lane] = std::max(lane_max[lane], key);
    }
  }
  for (; i < row.size(); ++i) {
    const int32_t key = ordered_key(row[i]);
    lane_min[0] = std::min(lane_min[0], key);
    lane_max[0] = std::max(lane_max[0], key);
  }
  return {*std::min_element(lane_min.begin(), lane_min.end()), *std::max_element(lane_max.begin(), lane_max.end())};
}

// Precondition: row holds no NaN.
float row_max(std::span<const float> row) {
  return from_ordered_key(key_range(row).max);
}

// Sum over the row of exp(x - shift) for shift >= every x, in double.
double sum_of_shifted_exp(std::span<const float> row, float shift) {
  std::array<double, kLanes> lane_sum{};
  size_t i = 0;
  for (; i + kLanes <= row.size(); i += kLanes) {
    for (size_t lane = 0; lane < kLanes; ++lane) lane_sum[lane] += exp_nonpositive(row[i + lane] - shift);
  }
  for (; i < row.size(); ++i) lane_sum[0] += exp_nonpositive(row[i] - shift);
  double total = 0.0;
  for (double partial : lane_sum) total += partial;
  return total;
}

// Writes weights[i] = weight_of(row[i]) and returns their sum, in double.
double fill_weights(std::span<const float> row, float max_logit, float temperature, std::span<float> weights) {
  std::array<double, kLanes> lane_sum{};
  size_t i = 0;
  for (; i + kLanes <= row.size(); i += kLanes) {
    for (size_t lane = 0; lane < kLanes; ++lane) {
      const float weight = weight_of(row[i + lane], max_logit, temperature);
      weights[i + lane] = weight;
      lane_sum[lane] += weight;
    }
  }
  for (; i < row.size(); ++i) {
    weights[i] = weight_of(row[i], max_logit, temperature);
    lane_sum[0] += weights[i];
  }
  double total = 0.0;
  for (double partial : lane_sum) total += partial;
  return total;
}

// Sum of the weights that are >= min_weight (0: all of them), in double. Weights are non-negative, so
// comparing their bits as int32 compares their values.
double sum_of_weights_at_least(std::span<const float> weights, float min_weight) {
  const int32_t min_weight_bits = std::bit_cast<int32_t>(min_weight);
  auto kept_weight = [min_weight_bits](float weight) {
    const int32_t bits = std::bit_cast<int32_t>(weight);
    return std::bit_cast<float>(bits & -static_cast<int32_t>(bits >= min_weight_bits));
  };
  std::array<double, kLanes> lane_sum{};
  size_t i = 0;
  for (; i + kLanes <= weights.size(); i += kLanes) {
    for (size_t lane = 0; lane < kLanes; ++lane) lane_sum[lane] += kept_weight(weights[i + lane]);
  }
  for (; i < weights.size(); ++i) lane_sum[0] += kept_weight(weights[i]);
  double total = 0.0;
  for (double partial : lane_sum) total += partial;
  return total;
}

// One token: its penalised logit, id and sampling weight.
struct Candidate {
  float logit;
  int32_t id;
  float weight;
};

// (logit desc, id asc): descending probability with ties broken by the lower id. A strict total order,
// so every selection, sort and prefix below has exactly one answer whatever the algorithm.
struct MoreLikely {
  bool operator()(const Candidate& a, const Candidate& b) const {
    return a.logit > b.logit || (a.logit == b.logit && a.id < b.id);
  }
};

// The ordered_key of a logit with -0 turned into +0 (x + 0.0f does that), so that logits that compare
// equal share a key: a higher key means strictly more likely, an equal key means "ask the id".
inline int32_t sort_key(float logit) {
  return ordered_key(logit + 0.0f);
}

// Splits the key range [lowest, highest] into at most kBuckets buckets of equal width (a power of two),
// over a caller's mass array; keys outside the range are clamped into the end buckets, which keeps the
// mapping monotone.
class KeyBuckets {
 public:
  static constexpr int kBits = 11;
  static constexpr size_t kCount = size_t{1} << kBits;

  KeyBuckets(int64_t lowest, int64_t highest, std::array<double, kCount>& mass) : lowest_(lowest), mass_(mass) {
    const auto span = static_cast<uint64_t>(highest - lowest);
    shift_ = std::max(0, static_cast<int>(std::bit_width(span)) - kBits);
    mass_.fill(0.0);
  }

  size_t of(const Candidate& candidate) const {
    const int64_t offset = std::max<int64_t>(0, sort_key(candidate.logit) - lowest_);
    return std::min(static_cast<size_t>(offset >> shift_), kCount - 1);
  }

  // Adds bucket masses to `running` from the most likely bucket down and returns the bucket where
  // `reached` first holds, with `running` left at the mass of all buckets above it; none when no bucket
  // reaches (only through rounding).
  template <typename Reached>
  std::optional<size_t> find_reached(double& running, const Reached& reached) const {
    for (size_t bucket = kCount; bucket-- > 0;) {
      if (reached(running + mass_[bucket])) return bucket;
      running += mass_[bucket];
    }
    return std::nullopt;
  }

 private:
  int64_t lowest_;
  int shift_ = 0;
  std::array<double, kCount>& mass_;
};

// A row being sampled: penalised logits and their weights (see weight_of), both [V].
struct WeightedRow {
  std::span<const float> logits;
  std::span<const float> weights;
  float max_logit;
  float temperature;

  size_t size() const { return logits.size(); }
  Candidate operator[](size_t i) const { return {logits[i], static_cast<int32_t>(i), weights[i]}; }
};

// Fills `out` (unsorted) with a top set of at least min(count, V) tokens: every token whose logit is >= a
// threshold, so every token left out is strictly less likely than every token taken. The threshold is
// guessed from a strided sample (about twice the needed fraction) and lowered if too few pass.
void collect_top_set(const WeightedRow& row, size_t count, std::vector<Candidate>& out, std::vector<float>& sample) {
  const size_t vocab_size = row.size();
  count = std::min(count, vocab_size);
  auto collect_at_least = [&](float threshold) {
    out.clear();
    for (size_t i = 0; i < vocab_size; ++i) {
      if (row.logits[i] >= threshold) out.push_back(row[i]);
    }
  };
  const size_t stride = std::max<size_t>(1, vocab_size / kThresholdSampleSize);
  sample.clear();
  for (size_t i = 0; i < vocab_size; i += stride) sample.push_back(row.logits[i]);
  double wanted_fraction = 2.0 * static_cast<double>(count) / static_cast<double>(vocab_size);
  while (wanted_fraction < 0.25) {
    const size_t rank = static_cast<size_t>(wanted_fraction * static_cast<double>(sample.size())) + 4;
    if (rank + 1 >= sample.size()) break;
    std::nth_element(sample.begin(), sample.begin() + static_cast<std::ptrdiff_t>(rank), sample.end(),
                     std::greater<float>());
    collect_at_least(sample[rank]);
    if (out.size() >= count) return;
    wanted_fraction *= 4.0;
  }
  collect_at_least(-kInfinity);  // the whole row
}

// The set of tokens still allowed after truncation. It is always a top set (closed towards more likely
// tokens, since weights fall along the order): every token at least as likely as `worst_kept` whose
// weight is at least `min_weight`.
struct KeptSet {
  std::optional<Candidate> worst_kept;  // none: no rank cut
  float min_weight = 0.0f;              // > 0 after min-p

  bool contains(const Candidate& candidate) const {
    if (worst_kept && MoreLikely{}(*worst_kept, candidate)) return false;
    return candidate.weight >= min_weight;
  }
};

struct Crossing {
  Candidate token;
  double mass;  // running mass through `token`, in descending-probability order
};

}  // namespace

struct Sampler::Workspace {
  // apply_penalties; the two [V] arrays are all zero between calls.
  std::vector<int32_t> output_counts;
  std::vector<uint8_t> in_prompt;
  std::vector<int32_t> distinct_ids;
  std::vector<std::pair<int32_t, float>> raw_logits;  // (id, logit before penalties) of penalised ids

  // Non-greedy sampling of one row; everything here is rebuilt by every call.
  std::vector<float> weights;          // [V]
  std::vector<Candidate> ranked;       // the row's best tokens, sorted by MoreLikely (empty: not built yet)
  bool ranked_holds_all_kept = false;  // no kept token lies beyond `ranked`
  std::vector<Candidate> pool;         // top-k selection, then find_crossing's window
  std::array<double, KeyBuckets::kCount> bucket_mass;
  std::vector<float> threshold_sample;

  // The first token of `kept`, in descending probability, whose running mass satisfies `reached`.
  // Running masses are double sums of float weights; they are exact up to rounding (~1e-12 relative),
  // which only matters if a target falls that close to a boundary.
  template <typename Reached>
  Crossing find_crossing(const WeightedRow& row, const KeptSet& kept, const Reached& reached);

  // Mass of the kept set, summed in id order.
  double kept_mass(const WeightedRow& row, const KeptSet& kept) const {
    if (!kept.worst_kept) return sum_of_weights_at_least(row.weights, kept.min_weight);
    double mass = 0.0;
    for (size_t i = 0; i < row.size(); ++i) {
      const Candidate candidate = row[i];
      if (kept.contains(candidate)) mass += candidate.weight;
    }
    return mass;
  }

  int32_t sample_row(const WeightedRow& row, double total_weight, const SamplingParams& params, float uniform);
};

template <typename Reached>
Crossing Sampler::Workspace::find_crossing(const WeightedRow& row, const KeptSet& kept, const Reached& reached) {
  if (ranked.empty()) {
    collect_top_set(row, kRankedPrefix, ranked, threshold_sample);
    std::sort(ranked.begin(), ranked.end(), MoreLikely{});
    ranked_holds_all_kept = ranked.size() == row.size();
  }
  // Only reached through rounding (targets stay below the kept mass by at least 6e-8 relative): then the
  // answer is the last token with positive weight that was scanned, or the most likely one.
  std::optional<Candidate> last_positive;
  double running = 0.0;
  auto fallback = [&] { return Crossing{last_positive.value_or(ranked.front()), running}; };

  // Phase 1: the sorted prefix, one token at a time.
  for (const Candidate& candidate : ranked) {
    if (!kept.contains(candidate)) return fallback();  // kept is a top set: nothing further is kept
    running += candidate.weight;
    if (candidate.weight > 0.0f) last_positive = candidate;
    if (reached(running)) return {candidate, running};
  }
  if (ranked_holds_all_kept) return fallback();

  // Phase 2: the kept tokens less likely than the prefix (the window), narrowed down by buckets of their
  // sort keys. A bucket holds a contiguous key range, so every token of a higher bucket is more likely
  // than every token of a lower one: summing bucket masses from the top finds the bucket where the
  // running mass is reached; its members go through the same step on a finer grid, until few enough
  // remain (or they share one key) to sort and scan. Tokens of weight 0 can never be the crossing.
  const Candidate prefix_end = ranked.back();
  auto in_window = [&](const Candidate& c) {
    return c.weight > 0.0f && MoreLikely{}(prefix_end, c) && kept.contains(c);
  };
  // First level, over the whole row without copying it. Its key range is [lowest, prefix_end]: no
  // window token ranks above prefix_end, and `lowest` is at or below the key of any positive weight
  // (keys below it share bucket 0, which keeps the bucketing monotone).
  const int64_t highest_key = sort_key(prefix_end.logit);
  const int64_t lowest_key =
      std::min(highest_key, static_cast<int64_t>(sort_key(row.max_logit - kZeroWeightBelow * row.temperature)));
  KeyBuckets buckets(lowest_key, highest_key, bucket_mass);
  for (size_t i = 0; i < row.size(); ++i) {
    const Candidate candidate = row[i];
    if (in_window(candidate)) bucket_mass[buckets.of(candidate)] += candidate.weight;
  }
  std::optional<size_t> bucket = buckets.find_reached(running, reached);
  if (!bucket) return fallback();
  pool.clear();
  for (size_t i = 0; i < row.size(); ++i) {
    const Candidate candidate = row[i];
    if (in_window(candidate) && buckets.of(candidate) == *bucket) pool.push_back(candidate);
  }
  // Finer levels, over the members of the chosen bucket.
  while (pool.size() > kSortedWindow) {
    const auto [lowest, highest] = std::minmax_element(
        pool.begin(), pool.end(),
        [](const Candidate& a, const Candidate& b) { return sort_key(a.logit) < sort_key(b.logit); });
    if (sort_key(lowest->logit) == sort_key(highest->logit)) {
      // One logit, hence one weight: the running sums are the same in any order, so count how many
      // members it takes and select that member by id instead of sorting them all.
      for (size_t taken = 0; taken < pool.size(); ++taken) {
        running += pool[taken].weight;
        if (reached(running)) {
          const auto crossing = pool.begin() + static_cast<std::ptrdiff_t>(taken);
          std::nth_element(pool.begin(), crossing, pool.end(), MoreLikely{});
          return {*crossing, running};
        }
      }
      last_positive = *std::max_element(pool.begin(), pool.end(), MoreLikely{});  // the least likely member
      return fallback();
    }
    KeyBuckets finer(sort_key(lowest->logit), sort_key(highest->logit), bucket_mass);
    for (const Candidate& candidate : pool) bucket_mass[finer.of(candidate)] += candidate.weight;
    bucket = finer.find_reached(running, reached);
    if (!bucket) return fallback();
    std::erase_if(pool, [&](const Candidate& c) { return finer.of(c) != *bucket; });
  }
  std::sort(pool.begin(), pool.end(), MoreLikely{});
  for (const Candidate& candidate : pool) {
    running += candidate.weight;
    last_positive = candidate;
    if (reached(running)) return {candidate, running};
  }
  return fallback();
}

int32_t Sampler::Workspace::sample_row(const WeightedRow& row, double total_weight, const SamplingParams& params,
                                       float uniform) {
  ranked.clear();
  ranked_holds_all_kept = false;
  KeptSet kept;
  double mass = total_weight;  // mass of `kept`

  // (5) top-k: the k-th most likely token bounds the kept set.
  if (params.top_k > 0 && static_cast<size_t>(params.top_k) < row.size()) {
    const size_t top_k = static_cast<size_t>(params.top_k);
    collect_top_set(row, top_k, pool, threshold_sample);
    const auto kth = pool.begin() + static_cast<std::ptrdiff_t>(top_k - 1);
    std::nth_element(pool.begin(), kth, pool.end(), MoreLikely{});
    kept.worst_kept = *kth;
    mass = 0.0;
    for (auto it = pool.begin(); it <= kth; ++it) mass += it->weight;
    if (top_k <= kRankedTopK) {
      // Small k: the kept tokens are the ranked prefix, which spares find_crossing a row pass.
      ranked.assign(pool.begin(), kth + 1);
      std::sort(ranked.begin(), ranked.end(), MoreLikely{});
      ranked_holds_all_kept = true;
    }
  }

  // (6) top-p: the shortest most-likely prefix whose mass reaches top_p of the kept mass (>= 1 token,
  // since the first token alone has weight 1 > 0).
  if (params.top_p < 1.0f) {
    const double threshold = static_cast<double>(params.top_p) * mass;
    const Crossing cut = find_crossing(row, kept, [threshold](double running) { return running >= threshold; });
    kept.worst_kept = cut.token;
    mass = cut.mass;
  }

  // (7) min-p: probability below min_p x the maximum probability <=> weight below min_p, whatever the
  // renormalisation by (5) and (6). The most likely token (weight 1) always stays.
  if (params.min_p > 0.0f) {
    kept.min_weight = params.min_p;
    const bool removes_nothing = kept.worst_kept && kept.worst_kept->weight >= params.min_p;
    if (!removes_nothing) mass = kept_mass(row, kept);
  }

  // (8) inverse CDF: the first token, in descending probability, whose running mass exceeds u x mass.
  // "Exceeds" (not "reaches") means a token whose weight underflowed to 0 is never drawn.
  const double target = static_cast<double>(uniform) * mass;
  return find_crossing(row, kept, [target](double running) { return running > target; }).token.id;
}

Sampler::Sampler() : workspace_(std::make_unique<Workspace>()) {}
Sampler::~Sampler() = default;
Sampler::Sampler(Sampler&&) noexcept = default;
Sampler& Sampler::operator=(Sampler&&) noexcept = default;

void SamplingParams::validate() const {
  // Every float test is written so that NaN fails it.
  for (const auto& [id, bias] : logit_bias) {
    if (id < 0) raise(ErrorCode::kInvalidArgument, "logit_bias names the token id {}, which is negative", id);
    if (!(bias >= -kMaxLogitBias && bias <= kMaxLogitBias)) raise_out_of_range("logit_bias", bias, "in [-100, 100]");
  }
  if (!(std::isfinite(temperature) && temperature >= 0.0f)) {
    raise_out_of_range("temperature", temperature, "finite and >= 0 (0 means greedy)");
  }
  if (top_k < -1) raise_out_of_range("top_k", top_k, "-1 or 0 (off), or >= 1");
  if (!(top_p > 0.0f && top_p <= 1.0f)) raise_out_of_range("top_p", top_p, "in (0, 1]");
  if (!(min_p >= 0.0f && min_p <= 1.0f)) raise_out_of_range("min_p", min_p, "in [0, 1]");
  if (!(std::isfinite(repetition_penalty) && repetition_penalty > 0.0f)) {
    raise_out_of_range("repetition_penalty", repetition_penalty, "finite and > 0 (1 means off)");
  }
  if (!(presence_penalty >= -2.0f && presence_penalty <= 2.0f)) {
    raise_out_of_range("presence_penalty", presence_penalty, "in [-2, 2]");
  }
  if (!(frequency_penalty >= -2.0f && frequency_penalty <= 2.0f)) {
    raise_out_of_range("frequency_penalty", frequency_penalty, "in [-2, 2]");
  }
  if (top_logprobs < 0 || top_logprobs > kMaxTopLogprobs) {
    raise(ErrorCode::kInvalidArgument, "sampling parameter top_logprobs = {} is out of range: it must be in [0, {}]",
          top_logprobs, kMaxTopLogprobs);
  }
}


void Sampler::apply_penalties(std::span<float> logits, const SamplingParams& params, std::span<const int32_t> prompt,
                              std::span<const int32_t> output) {
  Workspace& ws = *workspace_;
  const size_t vocab_size = logits.size();
  // Check every id before touching the scratch, so an exception leaves it all zero.
  for (std::span<const int32_t> tokens : {prompt, output}) {
    for (int32_t id : tokens) {
      if (id < 0 || static_cast<size_t>(id) >= vocab_size) {
        raise(ErrorCode::kInvalidArgument, "token id {} is outside the vocabulary [0, {})", id, vocab_size);
      }
    }
  }
  ws.raw_logits.clear();
  const bool penalties_off =
      params.repetition_penalty == 1.0f && params.frequency_penalty == 0.0f && params.presence_penalty == 0.0f;
  if (penalties_off) return;

  if (ws.output_counts.size() < vocab_size) {
    ws.output_counts.resize(vocab_size, 0);
    ws.in_prompt.resize(vocab_size, 0);
  }
  ws.distinct_ids.clear();
  for (int32_t id : prompt) {
    if (ws.in_prompt[id] == 0) {
      ws.in_prompt[id] = 1;
      ws.distinct_ids.push_back(id);
    }
  }
  for (int32_t id : output) {
    if (ws.in_prompt[id] == 0 && ws.output_counts[id] == 0) ws.distinct_ids.push_back(id);
    ++ws.output_counts[id];
  }

  const float repetition = params.repetition_penalty;
  for (int32_t id : ws.distinct_ids) {
    const float raw = logits[id];
    ws.raw_logits.emplace_back(id, raw);
    float penalised = raw;
    if (repetition != 1.0f) penalised = penalised > 0.0f ? penalised / repetition : penalised * repetition;
    const int32_t count = ws.output_counts[id];
    if (count > 0) {
      penalised -= params.frequency_penalty * static_cast<float>(count) + params.presence_penalty;
    }
    if (std::isfinite(raw)) penalised = std::clamp(penalised, -kLargestFloat, kLargestFloat);
    logits[id] = penalised;
    // Restore the all-zero invariant of the scratch for the next call.
    ws.in_prompt[id] = 0;
    ws.output_counts[id] = 0;
  }
}

SampledToken Sampler::sample(std::span<float> logits, const SamplingParams& params, std::span<const int32_t> prompt,
                             std::span<const int32_t> output, uint64_t seed, uint64_t step) {
  params.validate();
  const size_t vocab_size = logits.size();
  if (vocab_size == 0) raise(ErrorCode::kInternal, "sampler: empty logits row");
  if (vocab_size > static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
    raise(ErrorCode::kInternal, "sampler: vocabulary of {} does not fit int32 token ids", vocab_size);
  }

  const KeyRange raw_keys = key_range(logits);
  if (raw_keys.max >= ordered_key(kInfinity) || raw_keys.min < ordered_key(-kInfinity)) {
    const auto bad = std::find_if(logits.begin(), logits.end(), [](float x) { return !(x < kInfinity); });
    raise(ErrorCode::kInternal, "sampler: logits row holds {} at token {} (of {}): the forward pass produced it",
          std::isnan(*bad) ? "NaN" : "+inf", bad - logits.begin(), vocab_size);
  }
  const float raw_max = from_ordered_key(raw_keys.max);
  if (raw_max == -kInfinity) raise(ErrorCode::kInternal, "sampler: every one of the {} logits is -inf", vocab_size);

  // (1) Reported logprobs: log-softmax of the raw row, x - (max + log(sum exp(x - max))), the sum in
  // double; masked tokens contribute exp(-inf) = 0. When sampling at temperature 1, the same pass
  // leaves the weights exp(x - max) behind for step (4), to be patched after the penalties.
  Workspace& ws = *workspace_;
  const bool greedy = params.is_greedy();
  const bool reuse_raw_weights = !greedy && params.temperature == 1.0f;
  double raw_sum_exp = 0.0;
  if (reuse_raw_weights) {
    ws.weights.resize(vocab_size);
    raw_sum_exp = fill_weights(logits, raw_max, 1.0f, ws.weights);
  } else {
    raw_sum_exp = sum_of_shifted_exp(logits, raw_max);
  }
  const double log_normalizer = static_cast<double>(raw_max) + std::log(raw_sum_exp);

  SampledToken result;
  const size_t num_top = std::min(static_cast<size_t>(params.top_logprobs), vocab_size);
  if (num_top > 0) {
    // Bounded insertion in one pass: `best` stays sorted by MoreLikely and at most num_top long. Ids
    // arrive in ascending order, so a later id with an equal logit never displaces an earlier one.
    std::vector<Candidate> best;
    best.reserve(num_top + 1);
    for (size_t i = 0; i < vocab_size; ++i) {
      const Candidate candidate{logits[i], static_cast<int32_t>(i), 0.0f};
      if (best.size() == num_top && !(candidate.logit > best.back().logit)) continue;
      best.insert(std::upper_bound(best.begin(), best.end(), candidate, MoreLikely{}), candidate);
      if (best.size() > num_top) best.pop_back();
    }
    result.top_logprobs.reserve(num_top);
    for (const Candidate& candidate : best) {
      result.top_logprobs.emplace_back(candidate.id, static_cast<float>(candidate.logit - log_normalizer));
    }
  }

  // (2), (3) penalties, in place on the ids of prompt ∪ output; the workspace remembers the raw values.
  apply_penalties(logits, params, prompt, output);
  // Finite: penalties keep finite logits finite. Unchanged when no penalty applied.
  const float max_logit = ws.raw_logits.empty() ? raw_max : row_max(logits);

  if (greedy) {
    // (4) argmax of the penalised row: the first (lowest) id holding the maximum.
    result.token = static_cast<int32_t>(std::find(logits.begin(), logits.end(), max_logit) - logits.begin());
  } else {
    // (4) temperature: weights exp((logit - max) / T). At T = 1 with an unchanged maximum only the
    // penalised ids differ from the weights of step (1).
    const float temperature = params.temperature;
    double total_weight = 0.0;
    if (reuse_raw_weights && max_logit == raw_max) {
      for (const auto& [id, unused_raw] : ws.raw_logits) ws.weights[id] = weight_of(logits[id], max_logit, temperature);
      total_weight = ws.raw_logits.empty() ? raw_sum_exp : sum_of_weights_at_least(ws.weights, 0.0f);
    } else {
      ws.weights.resize(vocab_size);
      total_weight = fill_weights(logits, max_logit, temperature, ws.weights);
    }
    // (5)-(8)
    const WeightedRow row{logits, std::span<const float>(ws.weights.data(), vocab_size), max_logit, temperature};
    result.token = ws.sample_row(row, total_weight, params, uniform_for(seed, step));
  }
  METRALE_CHECK(
      result.token >= 0 && static_cast<size_t>(result.token) < vocab_size && logits[result.token] > -kInfinity,
      "sampled token {} of {}", result.token, vocab_size);

  // The reported logprob uses the raw logit: the row still holds it unless a penalty rewrote it.
  float raw_logit = logits[static_cast<size_t>(result.token)];
  for (const auto& [id, raw_value] : ws.raw_logits) {
    if (id == result.token) {
      raw_logit = raw_value;
      break;
    }
  }
  result.logprob = static_cast<float>(raw_logit - log_normalizer);
  return result;
}

}  // namespace metrale
