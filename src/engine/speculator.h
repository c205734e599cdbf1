// Speculative decoding, the engine side: drafters, acceptance and the adaptive choice of how many
// drafts a step verifies.
//
// A speculating sequence sits at tokens = [..., x] with x not yet computed. A drafter proposes k
// tokens d_0..d_{k-1} to follow x; the next step gives the sequence 1 + k rows (x, d_0, ...) in the
// ragged batch (a verify step), row i's logits give the target distribution p_i of the token after
// it, and acceptance walks the rows: d_i is kept while it passes (greedy: d_i == argmax p_i;
// sampling: rejection sampling), the first failing row emits a replacement drawn from the residual,
// and when every draft passes row k yields one more token. The sequence keeps 1 + accepted rows of
// the verify step (Model::commit_verified), so a step emits accepted + 1 tokens.
//
// Drafters:
// - n-gram prompt lookup: the longest suffix of the sequence (ngram_max down to ngram_min tokens)
//   that occurred earlier in its own prompt + output proposes the tokens that followed its latest
//   earlier occurrence;
// - MTP: the checkpoint's multi-token-prediction head (Engine, engine/mtp_drafter.h).
//
// Adaptivity (SpeculationController): per-sequence and global acceptance EMAs give the expected
// tokens of k drafts, E(k) = (1 - a^(k+1)) / (1 - a); a linear fit of step time against rows gives
// the cost of the extra rows at the current batch size. A step verifies the k (the same bound for
// every sequence of the step) with the best tokens per second, and 0 drafts unless that beats plain
// decoding by a margin.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "engine/sampler.h"

namespace metrale {

enum class SpeculativeMethod { kNone, kNgram, kMtp };

std::string_view speculative_method_name(SpeculativeMethod method);  // "none", "ngram", "mtp"
// Throws kInvalidArgument for anything but none|ngram|mtp.
SpeculativeMethod parse_speculative_method(std::string_view name);

struct SpeculativeConfig {
  SpeculativeMethod method = SpeculativeMethod::kNone;
  int32_t num_drafts = 3;  // k: drafts per sequence per step at most (1..15)
  int32_t ngram_min = 1;   // n-gram lookup: shortest suffix matched
  int32_t ngram_max = 4;   // longest suffix matched
  bool adaptive = true;    // choose k per step from measured acceptance and step cost
  // Benchmark mode only (`bench --spec-accept-rate`): in [0, 1] the engine accepts each draft by a
  // seeded Bernoulli(p) draw instead of comparing it with the target (outputs are then NOT the
  // model's); < 0 off.
  double replay_accept_rate = -1.0;
  uint64_t replay_seed = 1;

  void validate() const;  // throws kInvalidArgument naming the bad field
};

// The n-gram drafter: up to `max_drafts` tokens proposed to follow `tokens` (empty when no suffix
// of length in [ngram_min, ngram_max] occurred earlier). Among matches of the longest length the
// latest earlier occurrence wins; it proposes the tokens that followed it (fewer near the end).
std::vector<int32_t> propose_ngram_drafts(std::span<const int32_t> tokens, int32_t ngram_min, int32_t ngram_max,
                                          int32_t max_drafts);

// The target distribution the Sampler draws from for one row: penalties, temperature, top-k, top-p
// and min-p applied exactly as Sampler::sample does (same order, same tie rule), normalised.
// `logits` [V] is modified (scratch); `probs` [V] receives the probabilities (0 outside the kept set).
// Requires params not greedy.
void target_distribution(Sampler& sampler, std::span<float> logits, const SamplingParams& params,
                         std::span<const int32_t> prompt, std::span<const int32_t> output, std::span<float> probs);

// Logprob (raw log-softmax) and top logprobs of `token` in a raw logits row, as Sampler reports them.
SampledToken describe_token(std::span<const float> logits, int32_t token, int32_t top_logprobs);

// Rejection-sampling step for one draft (sampling, not greedy). p [V] the target distribution,
// q [V] the draft's distribution (empty: a deterministic draft, q one-hot at `draft`). Accepts with
// probability min(1, p(draft) / q(draft)); `accept_uniform` and `residual_uniform` are independent
// uniforms in [0, 1). Returns `draft` when accepted, otherwise a token drawn from
// norm(max(0, p - q)) (for a one-hot q: p without the draft, renormalised).
int32_t rejection_sample(std::span<const float> p, std::span<const float> q, int32_t draft, float accept_uniform,
                         float residual_uniform, bool& accepted);

// Exponentially weighted least squares of a step's wall time against its rows:
// time = fixed + per_row * rows (seconds).
class StepCostFit {
 public:
  void add(int64_t rows, double seconds);
  bool measured() const { return w_ > 0.0; }
  double predict(double rows) const { return fixed_ + per_row_ * rows; }
  double fixed() const { return fixed_; }
  double per_row() const { return per_row_; }

 private:
  double w_ = 0.0, sx_ = 0.0, sy_ = 0.0, sxx_ = 0.0, sxy_ = 0.0;
  double fixed_ = 1.0, per_row_ = 0.0;  // until measured: rows cost nothing next to the step
};

// Acceptance statistics and the per-step choice of k.
class SpeculationController {
 public:
  SpeculationController() = default;
  SpeculationController(const SpeculativeConfig& config, double prior_acceptance);

  // Drafts each sequence of a step with `num_decoding` decode rows (and `other_rows` prefill rows)
  // should verify at most: 0..num_drafts.
  int32_t choose_num_drafts(int64_t num_decoding, int64_t other_rows) const;
  // The expected acceptance of one draft for a sequence (its EMA, or the global one before it has any).
  double acceptance(double sequence_ema) const { return sequence_ema >= 0.0 ? sequence_ema : global_acceptance_; }
  // After a verify: a sequence accepted `accepted` of `drafted` drafts; returns its updated EMA.
  double record_verify(double sequence_ema, int64_t drafted, int64_t accepted);
  // After each step: its rows, wall time (seconds) and whether it verified drafts. Plain and verify
  // steps are fitted apart: a verify step can cost more than its rows suggest (it runs eagerly,
  // without the decode graphs, and its logits go to the host for acceptance), and k > 0 is chosen
  // only when the verify fit predicts a gain over the plain one.
  void record_step(int64_t rows, double seconds, bool verify);

  double global_acceptance() const { return global_acceptance_; }
  const StepCostFit& plain_cost() const { return plain_; }
  const StepCostFit& verify_cost() const { return verify_; }

 private:
  SpeculativeConfig config_;
  double global_acceptance_ = 0.5;
  StepCostFit plain_, verify_;
};

}  // namespace metrale
