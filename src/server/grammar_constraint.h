// GrammarConstraint: the engine's TokenConstraint (engine/token_constraint.h) for one choice, made
// of a grammar matcher (text/grammar/matcher.h) and the reasoning block around it.
//
// - Reasoning: when the chat template thinks, the constraint starts after the think block. A prompt
//   that leaves the block open starts inside it; otherwise the first token may open one (the
//   `<think>` token is allowed beside the grammar's first tokens). Inside the block every token but
//   the stop tokens is allowed (the answer must still come) until the `</think>` token; then the
//   grammar starts.
// - Budget: the choice has `max_tokens` tokens. When the tokens left come near the fewest bytes that
//   complete the grammar (GrammarMatcher::min_remaining_bytes), the output stops growing: a complete
//   output may only end, and a token may only begin with a byte after which the rest still fits.
//   Once they barely cover it, only tokens that bring the end closer are allowed (single bytes and
//   the grammar's special tokens, each tried on the matcher), and a think block still open is
//   closed, so the output is complete whatever the model prefers.
// - Rollback undoes tokens in either phase (speculative drafts).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "engine/token_constraint.h"
#include "text/grammar/compiled_grammar.h"
#include "text/grammar/matcher.h"

namespace metrale::server {

// What every constraint of one model shares: the reasoning tags' token ids and the single-byte
// tokens (the budget's way to the end).
struct ConstraintVocabulary {
  std::optional<int32_t> think_open;   // the `<think>` token, when it is one token
  std::optional<int32_t> think_close;  // the `</think>` token, when it is one token
  std::vector<int32_t> byte_tokens;    // ids of the tokens that are exactly one byte
  // [vocab]: each token's first byte; kNoFirstByte for tokens without bytes and special tokens.
  std::vector<uint16_t> first_byte;
  static constexpr uint16_t kNoFirstByte = 256;
  std::vector<int32_t> stop_token_ids; // end the output once the grammar is complete
};

struct GrammarConstraintOptions {
  bool reasoning = false;            // the template may think: the grammar starts after </think>
  bool starts_in_reasoning = false;  // the prompt opened the think block
  int64_t max_tokens = 0;            // the choice's budget (0: unbounded)
};

class GrammarConstraint : public TokenConstraint {
 public:
  GrammarConstraint(std::shared_ptr<const grammar::CompiledGrammar> grammar,
                    std::shared_ptr<const ConstraintVocabulary> vocabulary, GrammarConstraintOptions options);

  bool fill_next_mask(std::span<uint32_t> bitmask) override;
  bool accept(int32_t token) override;
  void rollback(int32_t num_tokens) override;

 private:
  enum class Phase : uint8_t { kStart, kReasoning, kGrammar };
  struct Step {
    Phase before;
    bool matcher;  // the token went to the matcher
  };
  int64_t tokens_left() const;
  bool closing() const;  // the budget forces the end
  bool tight() const;    // the budget stops the output from growing
  void restrict_to_fitting(std::span<uint32_t> bitmask);
  void fill_closing_mask(std::span<uint32_t> bitmask);

  grammar::GrammarMatcher matcher_;
  std::shared_ptr<const ConstraintVocabulary> vocabulary_;
  GrammarConstraintOptions options_;
  Phase phase_;
  std::vector<Step> history_;
};

}  // namespace metrale::server
