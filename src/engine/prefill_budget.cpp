#include "engine/prefill_budget.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace metrale {

PrefillBudget::PrefillBudget(double ratio, int64_t min_tokens, int64_t max_tokens)
    : ratio_(ratio), min_tokens_(min_tokens), max_tokens_(max_tokens) {
  METRALE_CHECK(ratio > 1.0 && min_tokens > 0 && max_tokens >= min_tokens,
                "prefill budget: ratio {} must exceed 1 and 0 < min {} <= max {}", ratio, min_tokens, max_tokens);
}

int PrefillBudget::bucket_of(int64_t decoding) {
  int bucket = 0;
  while (bucket + 1 < kBuckets && (int64_t{1} << bucket) < decoding) ++bucket;
  return bucket;
}

double PrefillBudget::decode_seconds(int64_t decoding) const {
  const int wanted = bucket_of(std::max<int64_t>(decoding, 1));
  // The nearest measured bucket stands in for an unmeasured one (a larger batch costs at least as
  // much, so the nearest larger one is preferred at equal distance).
  for (int distance = 0; distance < kBuckets; ++distance) {
    for (const int b : {wanted + distance, wanted - distance}) {
      if (b >= 0 && b < kBuckets && decode_ema_[static_cast<size_t>(b)] > 0.0) return decode_ema_[static_cast<size_t>(b)];
    }
  }
  return -1.0;
}

int64_t PrefillBudget::limit(int64_t decoding) const {
  if (decoding <= 0) return max_tokens_;
  const double decode = decode_seconds(decoding);
  const double per_token = seconds_per_prefill_token();
  if (decode <= 0.0 || per_token <= 0.0) return max_tokens_;
  const double tokens = (ratio_ - 1.0) * decode / per_token;
  if (!std::isfinite(tokens) || tokens >= static_cast<double>(max_tokens_)) return max_tokens_;
  return std::max(min_tokens_, static_cast<int64_t>(tokens));
}

void PrefillBudget::record(int64_t decoding, int64_t prefill_tokens, double seconds) {
  if (!(seconds > 0.0) || !std::isfinite(seconds) || decoding < 0 || prefill_tokens < 0) return;
  if (prefill_tokens == 0) {
    if (decoding == 0) return;
    constexpr double kDecodeDecay = 0.9;
    double& ema = decode_ema_[static_cast<size_t>(bucket_of(decoding))];
    ema = ema > 0.0 ? kDecodeDecay * ema + (1.0 - kDecodeDecay) * seconds : seconds;
    return;
  }
  // The step's decode part, as a decode-only step of its bucket costs (a pure prefill step: the
  // smallest decode step stands for the fixed per-step cost; unmeasured, none).
  double fixed = decode_seconds(std::max<int64_t>(decoding, 1));
  if (fixed < 0.0) fixed = 0.0;
  const double excess = std::max(0.0, seconds - fixed);
  constexpr double kPrefillDecay = 0.95;
  per_token_time_ = kPrefillDecay * per_token_time_ + excess;
  per_token_weight_ = kPrefillDecay * per_token_weight_ + static_cast<double>(prefill_tokens);
}

}  // namespace metrale
