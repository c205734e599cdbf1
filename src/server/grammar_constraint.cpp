#include "server/grammar_constraint.h"

#include <algorithm>
#include <array>
#include <bit>

namespace metrale::server {
namespace {

void set_bit(std::span<uint32_t> bitmask, int32_t token) {
  const auto word = static_cast<size_t>(token >> 5);
  if (token >= 0 && word < bitmask.size()) bitmask[word] |= 1u << (token & 31);
}

// Tokens left before the closing phase must begin: a margin over the fewest bytes, since a token
// taken freely may lengthen the way to the end (an optional member opened) by more than it uses.
constexpr int64_t kClosingMargin = 8;
// Tokens left, over the fewest bytes, below which the output may no longer grow.
constexpr int64_t kTightMargin = 64;

}  // namespace

GrammarConstraint::GrammarConstraint(std::shared_ptr<const grammar::CompiledGrammar> grammar,
                                     std::shared_ptr<const ConstraintVocabulary> vocabulary,
                                     GrammarConstraintOptions options)
    : matcher_(std::move(grammar), vocabulary->stop_token_ids),
      vocabulary_(std::move(vocabulary)),
      options_(options),
      phase_(Phase::kGrammar) {
  // Without single-token tags the end of a think block cannot be seen token by token: the grammar
  // then starts at once (and a prompt that opened the block is not constrained inside it).
  const bool can_reason = options_.reasoning && vocabulary_->think_close.has_value();
  if (can_reason && options_.starts_in_reasoning) {
    phase_ = Phase::kReasoning;
  } else if (can_reason && vocabulary_->think_open.has_value()) {
    phase_ = Phase::kStart;
  }
}

int64_t GrammarConstraint::tokens_left() const {
  return options_.max_tokens - static_cast<int64_t>(history_.size());
}

bool GrammarConstraint::closing() const {
  if (options_.max_tokens <= 0) return false;
  const int64_t needed = matcher_.min_remaining_bytes() + 1 + (phase_ == Phase::kReasoning ? 1 : 0);
  return tokens_left() <= needed + kClosingMargin;
}

bool GrammarConstraint::tight() const {
  if (options_.max_tokens <= 0) return false;
  return tokens_left() <= matcher_.min_remaining_bytes() + 1 + kTightMargin;
}

void GrammarConstraint::restrict_to_fitting(std::span<uint32_t> bitmask) {
  if (matcher_.can_terminate()) {
    // Complete: end now rather than open something new (another call, an optional member).
    std::fill(bitmask.begin(), bitmask.end(), 0u);
    for (const int32_t stop : vocabulary_->stop_token_ids) set_bit(bitmask, stop);
    return;
  }
  // The first bytes after which the fewest bytes still fit the tokens left (this token included).
  const int64_t room = tokens_left() - 2 - kClosingMargin;
  std::array<bool, 257> fits{};
  fits[ConstraintVocabulary::kNoFirstByte] = true;
  bool any = false;
  for (const int32_t token : vocabulary_->byte_tokens) {
    if (!matcher_.accept_token(token)) continue;
    const int32_t after = matcher_.min_remaining_bytes();
    matcher_.rollback(1);
    const uint16_t byte = vocabulary_->first_byte[static_cast<size_t>(token)];
    if (after <= room) {
      fits[byte] = true;
      any = true;
    }
  }
  if (!any) return;  // the closing phase takes over at the next step
  const auto& first = vocabulary_->first_byte;
  for (size_t word = 0; word < bitmask.size(); ++word) {
    uint32_t bits = bitmask[word];
    while (bits != 0) {
      const int bit = std::countr_zero(bits);
      bits &= bits - 1;
      const size_t token = word * 32 + static_cast<size_t>(bit);
      if (token < first.size() && !fits[first[token]]) bitmask[word] &= ~(1u << bit);
    }
  }
}

void GrammarConstraint::fill_closing_mask(std::span<uint32_t> bitmask) {
  if (matcher_.can_terminate()) {
    for (const int32_t stop : vocabulary_->stop_token_ids) set_bit(bitmask, stop);
    return;
  }
  const int32_t remaining = matcher_.min_remaining_bytes();
  bool any = false;
  const auto try_token = [&](int32_t token) {
    if (!matcher_.accept_token(token)) return;
    const int32_t after = matcher_.min_remaining_bytes();
    matcher_.rollback(1);
    if (after < remaining) {
      set_bit(bitmask, token);
      any = true;
    }
  };
  for (const int32_t token : vocabulary_->byte_tokens) try_token(token);
  for (const int32_t token : matcher_.grammar().allowed_special_ids()) try_token(token);
  if (!any) matcher_.fill_next_token_bitmask(bitmask);
}

bool GrammarConstraint::fill_next_mask(std::span<uint32_t> bitmask) {
  switch (phase_) {
    case Phase::kReasoning:
      if (closing()) {
        set_bit(bitmask, *vocabulary_->think_close);
        return true;
      }
      // Anything but the end of the output: the answer must still come.
      std::fill(bitmask.begin(), bitmask.end(), ~0u);
      for (const int32_t stop : vocabulary_->stop_token_ids) {
        const auto word = static_cast<size_t>(stop >> 5);
        if (stop >= 0 && word < bitmask.size()) bitmask[word] &= ~(1u << (stop & 31));
      }
      return true;
    case Phase::kStart:
      if (closing()) {
        fill_closing_mask(bitmask);
      } else if (tight()) {
        matcher_.fill_next_token_bitmask(bitmask);
        restrict_to_fitting(bitmask);
      } else {
        matcher_.fill_next_token_bitmask(bitmask);
        set_bit(bitmask, *vocabulary_->think_open);
      }
      return true;
    case Phase::kGrammar:
      if (closing()) {
        fill_closing_mask(bitmask);
      } else {
        matcher_.fill_next_token_bitmask(bitmask);
        if (tight()) restrict_to_fitting(bitmask);
      }
      return true;
  }
  return false;
}

bool GrammarConstraint::accept(int32_t token) {
  const Phase before = phase_;
  switch (phase_) {
    case Phase::kStart:
      if (token == *vocabulary_->think_open) {
        phase_ = Phase::kReasoning;
        history_.push_back({before, false});
        return true;
      }
      if (!matcher_.accept_token(token)) return false;
      phase_ = Phase::kGrammar;
      history_.push_back({before, true});
      return true;
    case Phase::kReasoning:
      if (token == *vocabulary_->think_close) phase_ = Phase::kGrammar;
      history_.push_back({before, false});
      return true;
    case Phase::kGrammar:
      if (!matcher_.accept_token(token)) return false;
      history_.push_back({before, true});
      return true;
  }
  return false;
}

void GrammarConstraint::rollback(int32_t num_tokens) {
  int32_t matcher_tokens = 0;
  for (int32_t i = 0; i < num_tokens && !history_.empty(); ++i) {
    const Step step = history_.back();
    history_.pop_back();
    if (step.matcher) ++matcher_tokens;
    phase_ = step.before;
  }
  if (matcher_tokens > 0) matcher_.rollback(matcher_tokens);
}

}  // namespace metrale::server
