// StepSampler: turns a step's logits into the tokens each of its chunks emits. Plain decode rows
// are sampled on the device when every row can be (no penalties, logit bias, top logprobs or prompt
// logits; constrained rows get their token masks applied on the device first, in greedy verify
// steps too);
// verify steps of greedy requests accept from their argmax rows (Runner::fetch_greedy_rows: a few
// bytes per row reach the host, not the logits); everything else samples on the host with the
// Sampler, and a verify chunk accepts its drafts in order (greedy: while each equals the Sampler's
// own choice; sampling: rejection sampling against the Sampler's distribution). Scoring requests
// get their prompt logits copied here.
#pragma once

#include <memory>
#include <vector>

#include "engine/constrained_rows.h"
#include "engine/runner.h"
#include "engine/sampler.h"
#include "engine/speculator.h"

namespace metrale {

// What the chunks of one step emit.
struct StepTokens {
  std::vector<std::vector<SampledToken>> emitted;  // per LogitRowUse: accepted drafts, then the sampled token
  std::vector<int64_t> accepted;                   // drafts each chunk kept
  std::vector<int64_t> kept_rows;                  // rows each sequence keeps: its known rows + accepted drafts
  bool from_greedy_rows = false;                   // a verify accepted from per-row tokens on the device
  bool all_greedy = false;                         // StepSampler::all_greedy of the step
};

class StepSampler {
 public:
  StepSampler(const SpeculativeConfig& speculative, int64_t vocab_size, int64_t max_num_seqs);
  ~StepSampler();
  StepSampler(StepSampler&&) noexcept;
  StepSampler& operator=(StepSampler&&) noexcept;

  // Before the forward of `plan`: starts the token masks of its constrained rows (engine/
  // constrained_rows.h), which the forward overlaps.
  void begin_step(const SchedulePlan& plan);
  // The step failed: waits for the mask worker, dropping its work.
  void abandon() noexcept;
  // The tokens of every chunk of `plan` (result.logits may be replaced by a host copy). Rows with a
  // logit bias sample on the host after their bias and mask; constrained decode rows sample on the
  // device after their mask when the rest of the step can; the tokens a constrained chunk emits
  // advance its constraint.
  StepTokens sample(const SchedulePlan& plan, StepResult& result, Runner& runner);
  // Every sequence of the step samples greedily (or acceptance is replayed), without penalties, top
  // logprobs or prompt logits: its next token is the argmax, its MTP drafts the head's argmax, and a
  // verify step accepts from the argmax rows alone.
  bool all_greedy(const StepResult& result) const;
  // The same, except that rows may have a constraint (whose masks the device can apply).
  bool greedy_but_for_constraints(const StepResult& result) const;
  // A verify step whose rows can all be sampled and accepted on the device: deterministic drafts
  // (no draft distribution), no penalties, top logprobs, prompt logits, bias or constraint.
  bool verifies_on_device(const StepResult& result) const;

  // Sampling on the device: per-row parameters and results (a pinned staging area and the device
  // arrays), sized for max_num_seqs rows or the step's.
  struct DeviceSampling;

 private:
  // Samples rows [0, uses.size()) of a device logits tensor on the device when every row can be
  // and rows line up with the chunks; returns false otherwise.
  bool sample_on_device(const StepResult& result, std::vector<SampledToken>& sampled);
  // The tokens one sampling chunk emits: for a verify chunk the accepted drafts then the
  // replacement or bonus token; otherwise the one sampled token. Sets `accepted` (drafts kept).
  std::vector<SampledToken> accept_chunk(const LogitRowUse& use, const Tensor& logits, int64_t& accepted);
  // Greedy acceptance from StepResult::greedy_tokens.
  void accept_greedy_rows(const StepResult& result, Runner& runner, StepTokens& tokens);
  // Acceptance of a verify of sampled (and greedy) requests on the device: every verify row sampled
  // with its request's parameters and plain decoding's uniform, drafts kept while they equal it.
  void accept_sampled_rows(const StepResult& result, StepTokens& tokens);
  // Walks each chunk's rows: drafts kept while they equal their row's token (`tokens`, `logprobs`
  // [R] on the host), then the first other row's token (or the bonus row's).
  void accept_rows(const StepResult& result, std::span<const int32_t> tokens, std::span<const float> logprobs,
                   StepTokens& out);
  // Prompt logits for scoring: rows for positions below num_prompt.
  void copy_prompt_logits(const LogitRowUse& use, const Tensor& logits) const;

  SpeculativeConfig speculative_;
  int64_t vocab_ = 0;
  int64_t max_num_seqs_ = 0;
  Sampler sampler_;
  std::unique_ptr<ConstrainedRows> constrained_;
  std::vector<float> host_logits_;  // logits rows copied from the device for sampling
  std::vector<float> scratch_;      // [V] a row for acceptance
  std::vector<float> probs_;        // [V] the target distribution
  std::unique_ptr<DeviceSampling> device_sampling_;
  std::unique_ptr<DeviceSampling> verify_sampling_;  // every row of a sampled verify step
};

}  // namespace metrale
