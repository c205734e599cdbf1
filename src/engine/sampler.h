// Sampler: turns one row of logits into the next token of one request, on the CPU.
//
// The pipeline follows vLLM: (1) logprobs for reporting come from the raw logits; (2) repetition and
// (3) frequency / presence penalties; (4) greedy argmax, or temperature, then (5) top-k, (6) top-p,
// (7) min-p and (8) an inverse-CDF draw with a uniform that depends only on (seed, step). Top-p is
// measured on the top-k renormalised distribution; min-p compares with the maximum probability, so it
// gives the same answer before or after renormalisation. Because the uniform is
// counter-based and every tie is broken by the lower token id, a request's tokens depend only on its
// own logits, parameters, history, seed and step — never on what else is in the batch or on the order
// in which the engine samples its requests.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "core/random.h"

namespace metrale {

struct SamplingParams {
  float temperature = 1.0f;         // >= 0; <= kGreedyTemperature means greedy (argmax, ties -> lowest id)
  int32_t top_k = 0;                // 0 or -1: off; k >= 1 keeps the k most likely tokens
  float top_p = 1.0f;               // (0, 1]
  float min_p = 0.0f;               // [0, 1]
  float repetition_penalty = 1.0f;  // > 0; applied to ids in prompt + output
  float presence_penalty = 0.0f;    // [-2, 2]; applied to ids in output
  float frequency_penalty = 0.0f;   // [-2, 2]; applied to ids in output
  std::optional<uint64_t> seed;     // same seed -> same tokens, independent of batching
  int32_t top_logprobs = 0;         // how many alternatives to report (0..kMaxTopLogprobs)
  // Added to the raw logits before everything else (OpenAI's logit_bias): (token id, bias in
  // [-100, 100]), ids distinct. Reported logprobs are those of the biased row. StepSampler applies it
  // (the Sampler itself does not read it).
  std::vector<std::pair<int32_t, float>> logit_bias;

  static constexpr float kGreedyTemperature = 1e-5f;
  static constexpr int32_t kMaxTopLogprobs = 20;
  static constexpr float kMaxLogitBias = 100.0f;

  // Throws Error(kInvalidArgument) naming the first field out of range and its allowed range.
  // NaN is out of range for every float field.
  void validate() const;
  bool is_greedy() const { return temperature <= kGreedyTemperature; }
};

struct SampledToken {
  int32_t token = -1;
  float logprob = 0.0f;  // log-softmax of the raw (unpenalised, untempered) logits
  // The top-N tokens by the same distribution, descending, ties by lower id. A masked (-inf) logit
  // can appear here as -inf when fewer than N tokens are finite; the serialiser must map it.
  std::vector<std::pair<int32_t, float>> top_logprobs;
};

// The counter-based random stream of core/random.h (shared with the CUDA sampler): the uniform for
// (seed, step) depends on nothing else, so a request's tokens do not depend on what else is in the
// batch.
using rng::splitmix64_at;
using rng::uniform_for;

// Not thread-safe: a Sampler owns scratch buffers reused across calls (one Sampler per thread). The
// scratch never carries information from one call to the next, so results do not depend on call order.
//
// Cost for a row of V tokens: a few linear passes (the exp and max passes vectorise) and no full sort.
// Tokens are ranked lazily: the best few dozen are found by a threshold pass and sorted (a top-k up to
// 1024 is sorted whole); when top-p or the draw must go deeper, the crossing token is located by
// bucketing the remaining tokens on their order-preserving float keys and refining the one bucket where
// the running mass is reached. Measured at V = 151,936 on a shared 2-core x86-64-v2 VM: greedy ~0.3 ms,
// top-k 50 ~0.45 ms, untruncated ~0.6 ms, top-p 0.9 ~1.2 ms per row.
//
// The order of the inverse CDF is (penalised logit desc, id asc), which is descending probability at
// any temperature > 0. Running masses are double sums of float weights exp((logit - max) / T) (an
// exp accurate to ~4e-7 relative), so a draw can differ from exact arithmetic only when its target falls
// within that distance of a boundary.
class Sampler {
 public:
  Sampler();
  ~Sampler();
  Sampler(Sampler&&) noexcept;
  Sampler& operator=(Sampler&&) noexcept;

  // logits: one row [V] f32, modified in place (scratch). prompt/output: the request's tokens so far.
  // seed: the request's seed (the engine draws one at random for requests without a seed; params.seed
  // is not read here); step: index of the token being sampled within the request's output (0 for the first).
  // Throws kInvalidArgument for bad params or a token id outside [0, V); kInternal when the row holds
  // NaN or +inf, or every logit is -inf (a bug upstream). -inf logits are masked tokens.
  SampledToken sample(std::span<float> logits, const SamplingParams& params, std::span<const int32_t> prompt,
                      std::span<const int32_t> output, uint64_t seed, uint64_t step);

  // Applies steps (2) and (3) of the pipeline in place, for every distinct id in prompt ∪ output:
  //   repetition (if != 1):  logit > 0 ? logit / p : logit * p
  //   then, for ids in output with count c:  logit -= frequency * c + presence
  // Penalties never change whether a logit is finite: -inf stays -inf, and a finite result that would
  // overflow is clamped to +-FLT_MAX. Cost is O(|prompt| + |output|), not O(V). Throws kInvalidArgument
  // for an id outside [0, V), before modifying anything.
  void apply_penalties(std::span<float> logits, const SamplingParams& params, std::span<const int32_t> prompt,
                       std::span<const int32_t> output);

 private:
  struct Workspace;
  std::unique_ptr<Workspace> workspace_;
};

}  // namespace metrale
