// Request: what a caller asks the engine for. Sequence: the engine's running state of one request.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "engine/ngram_index.h"
#include "engine/sampler.h"
#include "engine/token_constraint.h"

namespace metrale {

enum class FinishReason {
  kNone,    // still running
  kStop,    // an EOS id or a stop token id was generated
  kLength,  // max_tokens reached, or the model's context is full
  kAbort,   // cancelled by the caller
  kError,   // the engine failed while running it (Sequence::error says why)
};

std::string_view finish_reason_name(FinishReason reason);  // "stop", "length", "abort", "error", ""

struct Request {
  std::vector<int32_t> prompt;            // token ids, at least one
  SamplingParams sampling;
  int32_t max_tokens = 16;                // tokens to generate; 0 only with return_prompt_logits
  bool ignore_eos = false;                // do not stop on the model's EOS ids
  std::vector<int32_t> stop_token_ids;    // extra ids that end generation (the id is kept in the output)
  bool return_prompt_logits = false;      // keep the logits of every prompt position (scoring)
  // With return_prompt_logits: >= 0 keeps, instead of the logits, each prompt token's logprob given
  // the tokens before it and this many top alternatives (Sequence::prompt_logprobs; the legacy API's
  // echo with logprobs).
  int32_t prompt_logprobs = -1;
  // Constrained decoding (engine/token_constraint.h): which tokens may come next; null: any. Owned
  // by this request alone (n > 1 gives each choice its own).
  std::shared_ptr<TokenConstraint> constraint;
};

enum class SequenceStatus { kWaiting, kRunning, kFinished };

struct Sequence {
  int64_t id = 0;
  Request request;
  std::vector<int32_t> tokens;  // prompt followed by generated tokens
  int64_t num_prompt = 0;
  int64_t num_computed = 0;     // leading tokens whose keys/values are in the cache
  SequenceStatus status = SequenceStatus::kWaiting;
  FinishReason finish_reason = FinishReason::kNone;
  uint64_t seed = 0;            // the request's seed, or one drawn by the engine
  int64_t arrival = 0;          // admission order, for FCFS and preemption
  int32_t num_preemptions = 0;
  std::vector<float> prompt_logits;  // [num_prompt, vocab] when requested
  // [num_prompt] with Request::prompt_logprobs: entry i describes prompt token i (entry 0, which
  // nothing predicts, has token -1). Handed to the first token's event.
  std::vector<SampledToken> prompt_logprobs;
  std::string error;                 // FinishReason::kError: why the request failed

  // Speculative decoding (engine/speculator.h). Drafts proposed to follow tokens.back(): verified by
  // the next step when the scheduler gives them rows, dropped otherwise.
  std::vector<int32_t> draft_tokens;
  // [draft_tokens.size(), vocab] f32: the distribution each draft was sampled from (MTP drafts at
  // temperature > 0); empty for deterministic drafts (n-gram, greedy), whose q is one-hot.
  std::vector<float> draft_probs;
  int64_t draft_base = -1;        // num_tokens() when the drafts were made; stale once it changes
  double acceptance_ema = -1.0;   // accepted / drafted, per verify (< 0: no verify yet)
  int64_t mtp_computed = 0;       // leading positions whose MTP-layer keys/values are written
  int64_t mtp_missed = 0;         // positions below mtp_computed the MTP head skipped (drafting was off)
  NgramIndex ngram_index;         // the n-gram drafter's index of `tokens`

  // Drops the drafts (verified, or made for a state the sequence left).
  void clear_drafts() {
    draft_tokens.clear();
    draft_probs.clear();
    draft_base = -1;
  }
  int64_t num_tokens() const { return static_cast<int64_t>(tokens.size()); }
  int64_t num_output() const { return num_tokens() - num_prompt; }
  std::span<const int32_t> prompt() const { return {tokens.data(), static_cast<size_t>(num_prompt)}; }
  std::span<const int32_t> output() const {
    return {tokens.data() + num_prompt, static_cast<size_t>(num_output())};
  }
  bool finished() const { return status == SequenceStatus::kFinished; }
};

}  // namespace metrale
