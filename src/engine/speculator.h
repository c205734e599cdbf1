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
// - MTP: the checkpoint's multi-token-prediction head (engine/mtp_drafter.h).
// Both implement Drafter (engine/drafter.h); the SpeculativeDecoder (engine/speculative_decoder.h)
// owns the drafter, the controller and everything a verify leaves pending until its commit.
//
// Adaptivity (SpeculationController, below): measured acceptance and measured step times choose,
// per step, how many drafts the step verifies (0: a plain step).
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "engine/request.h"
#include "engine/sampler.h"
#include "engine/speculation_cost.h"

namespace metrale {

// A sequence that decodes next step: its only uncomputed token is the last one (and it asks for no
// prompt logits).
bool decodes_next(const Sequence& sequence);

// Independent counter-based random streams of a request, besides the Sampler's own (seed, step):
// acceptance, residual draws, sampled MTP drafts, and benchmark replay.
inline constexpr uint64_t kAcceptStream = 0x5eca'cce9'7000'0001ull;
inline constexpr uint64_t kResidualStream = 0x5eca'cce9'7000'0002ull;
inline constexpr uint64_t kDraftStream = 0x5eca'cce9'7000'0003ull;
inline constexpr uint64_t kReplayStream = 0x5eca'cce9'7000'0004ull;
// The uniform in [0, 1) of `stream` at `step` for a request seeded `seed`.
float stream_uniform(uint64_t seed, uint64_t stream, uint64_t step);

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
// The engine uses NgramIndex (engine/ngram_index.h), which proposes the same without the scan.
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
// norm(max(0, p - q)) (for a one-hot q: p without the draft, renormalised). One row of
// kernels::rejection_sample_rows (kernels/rejection_sampling.h), whose CUDA twin decides alike.
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

// Expected tokens a verify of k drafts emits with per-draft acceptance a (drafts accepted in order,
// plus the replacement or bonus token): 1 + a + ... + a^k.
double expected_tokens(double acceptance, int32_t drafts);

// What one step did, for the controller's cost tables.
struct SpeculativeStepRecord {
  int64_t num_decoding = 0;  // sequences with one known row (and their drafts)
  int64_t other_rows = 0;    // prefill rows of the same step
  int32_t drafts = 0;        // drafts per sequence the step's layout verified (0: a plain step)
  bool drafter_ran = false;  // the step also ran the MTP head (catch-up and drafts for the next step)
  double seconds = 0.0;      // wall time of the whole step (forward, acceptance, drafter, bookkeeping)
  int64_t draft_rows = 0;    // draft rows of the decoding sequences, in all
  bool ragged = false;       // a verify in the ragged layout (each sequence its own drafts, no padding)
};

// Acceptance statistics and the per-step choice of k.
//
// Decode-only steps (every scheduled sequence decodes) are costed from measurements, not a model:
// per batch bucket (the power of two at or above the number of decoding sequences: the size a
// captured graph pads to) and per k, an EMA of the wall time of the steps that verified k drafts
// (k = 0: plain steps that ran no drafter). A step verifies the k with the most expected tokens per
// second, Σ_i E(a_i, min(k, drafts_i)) / time(bucket, k), and drafts only for a margin over plain.
// Unmeasured cells are estimated from the nearest measured cell of their bucket, scaled by a fit of
// time against rows over all decode-only steps; only cells next to a measured one (or k <= 1 in a
// new bucket) are candidates, so k climbs one draft at a time. Every kExploreEvery steps of a bucket
// one neighbour of the best k whose measurement is older than kStaleSteps is re-measured (always k
// = 0 when plain was never measured there), and while drafting is off a one-draft probe runs at a
// backing-off interval so that a change in acceptance is noticed.
//
// Steps with prefill rows run in the ragged layout; they are costed by two linear fits (plain and
// verify) of time against rows.
//
// Decode-only verifies may run in the ragged layout too, each sequence with its own number of
// drafts (0 included) and no padding rows. Their cost per bucket is RaggedVerifyFit
// (engine/speculation_cost.h): time relative to the bucket's plain step against the draft rows and
// the model's cost feature (the weights the draft rows select, e.g. the experts a MoE layer adds),
// starting from a prior built from the fixed-layout cells. The drafts per sequence maximise the
// batch's expected tokens per second (allocate_drafts), and the ragged layout is chosen when it is
// predicted faster than the best fixed k. Probes run ragged: only the sequences with drafts get a
// draft row, and they measure the ragged fit.
//
// Only k under which the batch's slowest tenth (by acceptance) still progresses as fast as plain
// decoding are candidates: every sequence pays the step's k, and a batch finishes with its slowest
// sequence. The slow tenth's acceptance is shrunk toward the batch mean by the share of the spread
// that the per-sequence estimates' noise explains. A probe whose own acceptance and cost say that
// drafting pays is followed by another at once, until the estimates catch up.
//
// Acceptance: per-sequence EMAs of the per-draft rate, and a global one that record_step moves by
// the step's pooled rate (many sequences in one step are one sample). The engine leaves out verifies
// whose drafts came from an MTP head that missed much of the sequence (drafting was off): their
// lower acceptance says nothing about drafting that stays on, and counting it would keep drafting
// off for good.
class SpeculationController {
 public:
  static constexpr int64_t kExploreEvery = 32;
  static constexpr int64_t kStaleSteps = 256;
  static constexpr int64_t kFirstProbe = 64;
  static constexpr int64_t kLongestProbeInterval = 1024;

  SpeculationController() = default;
  // `feature`: the model's step cost feature (Model::routed_weight_bytes); empty for none.
  SpeculationController(const SpeculativeConfig& config, double prior_acceptance, StepCostFeature feature = {});

  // The step's draft cap (0..num_drafts). `acceptance[i]` is decoding sequence i's expected
  // acceptance and `available[i]` the drafts it could verify (num_drafts before any are proposed);
  // `other_rows` prefill rows join the step. Counts the step in its bucket (exploration and probes
  // follow the count), so call it once per step; refine() narrows the choice once drafts exist.
  struct Choice {
    int32_t drafts = 0;
    bool explored = false;  // an exploration or probe: keep it (refine() would undo it)
    bool probe = false;     // a one-draft probe while drafting is off
    bool ragged = false;    // the ragged layout is expected to pay (or is explored): layout() decides
  };
  Choice choose(std::span<const double> acceptance, std::span<const int32_t> available, int64_t other_rows);
  // The best cap for the drafts proposed, at most `cap` (no exploration): 0 when verifying them
  // would not pay, e.g. when only a few sequences found an n-gram draft.
  int32_t refine(int32_t cap, std::span<const double> acceptance, std::span<const int32_t> available,
                 int64_t other_rows) const;
  // The step's drafts per sequence once the proposals are known (`available[i]` drafts each, at most
  // choice.drafts): the fixed layout at refine()'s cap, or the ragged allocation when it is predicted
  // faster by a margin (always for a probe or a ragged exploration).
  struct Layout {
    std::vector<int32_t> drafts;  // per decoding sequence
    bool ragged = false;
  };
  Layout layout(const Choice& choice, std::span<const double> acceptance, std::span<const int32_t> available,
                int64_t other_rows) const;
  // The cap the next step of `num_decoding` sequences is expected to choose, at the global
  // acceptance: when > 0 the MTP head must run after this step (and draft that many).
  int32_t planned_drafts(int64_t num_decoding) const;

  // The expected acceptance of one draft for a sequence (its EMA, or the global one before it has any).
  double acceptance(double sequence_ema) const { return sequence_ema >= 0.0 ? sequence_ema : global_acceptance_; }
  // After a verify: a sequence accepted `accepted` of `drafted` drafts; returns its updated EMA.
  double record_verify(double sequence_ema, int64_t drafted, int64_t accepted);
  // After each step (its verifies recorded): the cost tables and the global acceptance.
  void record_step(const SpeculativeStepRecord& step);
  // A step failed before record_step: its verifies and its probe count for nothing.
  void abandon_step();

  double global_acceptance() const { return global_acceptance_; }
  // The measured time of a decode-only step of `num_decoding` sequences verifying k drafts (< 0: unmeasured).
  double measured_seconds(int64_t num_decoding, int32_t drafts) const;
  // The predicted time of a ragged decode-only verify of `num_decoding` sequences and `draft_rows`
  // draft rows, and how many ragged steps of that bucket were measured.
  double predicted_ragged_seconds(int64_t num_decoding, int64_t draft_rows) const;
  int64_t ragged_samples(int64_t num_decoding) const;

 private:
  struct Cell {
    double seconds = 0.0;
    int64_t samples = 0;
    int64_t measured_at = 0;  // the bucket's step count at the latest sample
  };
  struct Bucket {
    std::vector<Cell> cells;  // [num_drafts + 1]
    int64_t steps = 0;
    int64_t next_probe = kFirstProbe;
    int64_t probe_interval = kFirstProbe;
    RaggedVerifyFit ragged;
  };
  static size_t bucket_index(int64_t num_decoding);
  Bucket& bucket(int64_t num_decoding);
  const Bucket* find_bucket(int64_t num_decoding) const;
  double estimate_seconds(const Bucket* bucket, int64_t num_decoding, int32_t drafts) const;
  RaggedVerifyFit::Vector ragged_features(int64_t num_decoding, int64_t draft_rows) const;
  double ragged_seconds(const Bucket* bucket, int64_t num_decoding, int64_t draft_rows) const;
  // The best per-sequence drafts of a ragged verify (available[i] each).
  DraftAllocation ragged_allocation(const Bucket* bucket, std::span<const double> acceptance,
                                    std::span<const int32_t> available) const;
  bool candidate(const Bucket* bucket, int32_t drafts) const;
  // The best k by expected tokens per second; tokens[k] for k = 0..most drafts available (a cap
  // above `most_available` costs what most_available costs), among the k that do not slow down a
  // sequence of acceptance `slow_acceptance` (the batch's slowest tenth).
  int32_t best_drafts(const Bucket* bucket, int64_t num_decoding, std::span<const double> tokens,
                      int32_t most_available, double slow_acceptance) const;
  // The choice at bucket step `step` (exploration and probes included).
  Choice decide(const Bucket* bucket, int64_t step, int64_t num_decoding, std::span<const double> tokens,
                double slow_acceptance) const;
  // The acceptance of the slowest tenth of the sequences (the lowest for fewer than ten), shrunk
  // toward the mean by the share of the spread that the estimates' noise explains.
  static double slow_acceptance(std::span<const double> acceptance);
  int32_t choose_mixed(std::span<const double> tokens, int64_t num_decoding, int64_t other_rows) const;
  // The step's wall time into its cell (decode-only steps) or the mixed fits.
  void record_cost(const SpeculativeStepRecord& step);
  std::vector<double> tokens_by_drafts(std::span<const double> acceptance, std::span<const int32_t> available) const;

  SpeculativeConfig config_;
  CostFeatureScale feature_;
  double global_acceptance_ = 0.5;
  std::vector<Bucket> buckets_;
  double step_accepted_ = 0.0, step_trials_ = 0.0;  // this step's verifies, pooled (record_verify)
  std::vector<double> last_tokens_;                 // the last decode-only choice's expected tokens by k
  double last_slow_acceptance_ = 0.0;               // and its slowest tenth's acceptance
  bool probe_pending_ = false;                      // the last choice was a probe (record_step follows)
  StepCostFit decode_fit_;                          // all decode-only steps: time against rows
  StepCostFit mixed_plain_, mixed_verify_;          // steps with prefill rows
};

}  // namespace metrale
