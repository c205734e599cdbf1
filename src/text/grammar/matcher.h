// The per-sequence state of constrained decoding: which tokens may come next, advanced token by
// token, rolled back when speculative drafts are rejected, copied for n > 1.
//
// Use per step: fill_next_token_bitmask(row) before sampling (bit t of word t / 32 set: token t is
// allowed; apply as logits[t] = -inf where the bit is clear), then accept_token(sampled). A stop
// token is allowed exactly when the output so far is complete (can_terminate()); accepting one ends
// the matcher (is_terminated()).
//
// Cost: a mask is the precomputed context-independent tokens of each live stack top (a copy of a
// bitset or a few ids) plus a walk over that position's uncertain tokens (those that finish the rule
// and go on into the stack below); docs/structured_outputs.md has measurements.
//
// Not thread-safe: one matcher per sequence, used by one thread at a time. The CompiledGrammar it
// points to is shared and immutable.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "text/grammar/compiled_grammar.h"
#include "text/grammar/simulator.h"

namespace metrale::grammar {

class GrammarMatcher {
 public:
  // `stop_token_ids` end generation once the output is complete (empty: the tokenizer's EOS).
  explicit GrammarMatcher(std::shared_ptr<const CompiledGrammar> grammar, std::vector<int32_t> stop_token_ids = {});

  GrammarMatcher(const GrammarMatcher& other);
  GrammarMatcher& operator=(const GrammarMatcher& other);
  GrammarMatcher(GrammarMatcher&&) noexcept = default;
  GrammarMatcher& operator=(GrammarMatcher&&) noexcept = default;
  // A copy that continues independently (n > 1, beam branches).
  GrammarMatcher fork() const { return *this; }

  // Writes the allowed tokens of the next step: `bitmask` has at least bitmask_words() words; the
  // words past the vocabulary's are left untouched.
  void fill_next_token_bitmask(std::span<uint32_t> bitmask) const;
  int32_t bitmask_words() const { return grammar_->tokenizer().bitmask_words(); }

  // Advances by one token; false (and nothing changes) when the grammar does not allow it.
  bool accept_token(int32_t token);
  // Advances by raw bytes (a forced prefix, tests); false and unchanged when not allowed.
  bool accept_string(std::string_view bytes);
  bool is_allowed(int32_t token) const;  // on a copy of the matcher: for checks, not per step

  // Undoes the last `num_tokens` accepted tokens (or strings); at most num_accepted() of them.
  void rollback(int32_t num_tokens);
  int32_t num_accepted() const { return static_cast<int32_t>(history_.size()) - 1; }
  void reset();

  bool can_terminate() const { return !is_terminated() && current().completed; }
  bool is_terminated() const { return current().terminated; }
  // Nothing but a stop token can follow (the output is complete and cannot be extended).
  bool is_complete() const { return current().completed && current().count == 0; }

  // The fewest bytes that would complete the output from here (0 when it may end now).
  int32_t min_remaining_bytes() const;

  const CompiledGrammar& grammar() const { return *grammar_; }
  std::string describe() const;  // the live stacks, for debugging

 private:
  // The matcher's state after some accepted tokens: the tops of the live stacks.
  struct Snapshot {
    int32_t offset = 0;  // into tops_
    int32_t count = 0;
    bool completed = false;  // the grammar may end here
    bool terminated = false;
  };
  struct NodeKey {
    int32_t rule, state, parent;
    bool operator==(const NodeKey&) const = default;
  };
  struct NodeKeyHash {
    size_t operator()(const NodeKey& key) const {
      return (static_cast<size_t>(key.rule) * 0x9E3779B97F4A7C15ull) ^
             (static_cast<size_t>(key.state) * 0xC2B2AE3D27D4EB4Full) ^ static_cast<size_t>(key.parent);
    }
  };

  const Snapshot& current() const { return history_.back(); }
  std::span<const int32_t> current_tops() const {
    return std::span<const int32_t>(tops_).subspan(static_cast<size_t>(current().offset),
                                                   static_cast<size_t>(current().count));
  }
  bool is_stop(int32_t token) const;
  // Runs `bytes` from the current tops; on success pushes the new snapshot.
  bool advance(std::string_view bytes);
  int32_t intern(std::span<const int32_t> thread);
  void start();
  void prepare_simulator() const;
  void add_uncertain(const PositionMask& mask, int32_t parent, std::span<uint32_t> bitmask) const;

  std::shared_ptr<const CompiledGrammar> grammar_;
  std::vector<int32_t> stop_ids_;
  std::vector<StackNode> nodes_;
  std::unordered_map<NodeKey, int32_t, NodeKeyHash> node_ids_;
  std::vector<int32_t> tops_;
  std::vector<Snapshot> history_;
  // Scratch, reset on every use.
  mutable std::unique_ptr<Simulator> simulator_;
  mutable std::vector<ThreadSet> levels_;
};

}  // namespace metrale::grammar
