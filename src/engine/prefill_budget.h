// PrefillBudget: how many prefill tokens a step that also decodes may carry, so that a decoding
// sequence never waits behind a long prefill chunk. A step's wall time grows with the prefill
// tokens it carries (a 8K-token chunk of an 8B model is ~300 ms on an H200, against ~25 ms for a
// decode step of 256 sequences), and every decoding sequence of that step waits for all of it:
// that is the inter-token latency tail under load. The budget keeps a step that carries decode rows
// within `ratio` times the measured decode-only step of the same batch bucket, by the measured
// cost per prefill token; steps without decode rows are not limited (nobody waits on them).
//
// Measurements, per step: decode-only steps give an EMA of the wall time per batch bucket (the power
// of two at or above the decoding sequences); steps with prefill tokens give the cost per prefill
// token, an exponentially weighted ratio of (step time - the decode-only time of its bucket) to its
// prefill tokens. Until both are measured the budget is the step's whole token budget.
#pragma once

#include <array>
#include <cstdint>

namespace metrale {

class PrefillBudget {
 public:
  // ratio > 1: a step with decode rows takes at most ratio x a decode-only step (measured).
  // min_tokens: the least prefill a step with decode rows may still carry, so that prompts
  // progress however slow the model; max_tokens: the step's token budget.
  PrefillBudget(double ratio, int64_t min_tokens, int64_t max_tokens);

  // Prefill tokens the next step may carry when `decoding` sequences decode in it.
  int64_t limit(int64_t decoding) const;
  // After a step: its decoding sequences, its prefill tokens and its wall time.
  void record(int64_t decoding, int64_t prefill_tokens, double seconds);

  // The measurements (tests, logs): the decode-only time of a bucket (< 0: not measured, nor any
  // other bucket) and the seconds per prefill token (< 0: not measured).
  double decode_seconds(int64_t decoding) const;
  double seconds_per_prefill_token() const { return per_token_weight_ > 0.0 ? per_token_time_ / per_token_weight_ : -1.0; }

 private:
  static constexpr int kBuckets = 16;  // 1, 2, 4, ..., 32768 decoding sequences
  static int bucket_of(int64_t decoding);

  double ratio_;
  int64_t min_tokens_;
  int64_t max_tokens_;
  std::array<double, kBuckets> decode_ema_{};  // seconds; 0: not measured
  // Exponentially weighted sums of excess seconds and of prefill tokens: their ratio is the cost
  // of one prefill token.
  double per_token_time_ = 0.0;
  double per_token_weight_ = 0.0;
};

}  // namespace metrale
