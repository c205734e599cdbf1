// A grammar compiled for one tokenizer: the rule automata and, for every position (a rule and one of
// its states with a byte edge), the tokens whose acceptance there does not depend on the stack below
// (xgrammar's adaptive token mask cache, built by our own walk of the tokenizer trie):
//   accepted   the token's bytes are consumed inside the rule (or end exactly where it may end);
//   rejected   no path of the rule consumes them (nothing stored);
//   uncertain  the rule may end partway through the token, and the rest of the token must then be
//              accepted by the stack below: stored as a trie of those remainders, walked at mask time.
// Immutable once built, shared by every matcher of the grammar (thread-safe; masks that were not
// precomputed are filled on first use under a once-flag).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "text/grammar/automaton.h"
#include "text/grammar/grammar.h"
#include "text/grammar/tokenizer_info.h"

namespace metrale::grammar {

struct GrammarCompileOptions {
  bool precompute = true;  // build every position's mask now (else on first use)
  // With precompute, rules are precomputed while their positions fit this budget; the positions of
  // the rest (long bounded repetitions: maxLength 300 is about 4,000 positions) are built on first
  // use, a few milliseconds each on the Qwen3 vocabulary.
  int32_t max_precomputed_positions = 4096;
  bool use_cache = true;          // reuse (and store) rule masks in the tokenizer's RuleMaskCache
  int32_t max_stack_depth = 128;  // nesting bound for recursive rules (JSON depth)
  AutomatonLimits limits;
};

class CompiledGrammar {
 public:
  struct Stats {
    int32_t num_rules = 0;
    int32_t cached_rules = 0;  // rules whose masks came from the tokenizer's cache
    int32_t lazy_rules = 0;    // rules whose masks are built on first use
    int64_t num_states = 0;
    int32_t num_positions = 0;
    int64_t num_uncertain = 0;  // summed over the positions computed
    size_t mask_bytes = 0;      // of the positions computed
    double compile_ms = 0;      // automata plus precomputed masks
  };

  const TokenizerInfo& tokenizer() const { return *tokenizer_; }
  const std::shared_ptr<const TokenizerInfo>& tokenizer_ptr() const { return tokenizer_; }
  const CompiledRules& rules() const { return rules_; }
  int32_t max_stack_depth() const { return max_stack_depth_; }
  // Special tokens the grammar names (sorted); every other special token is never allowed.
  const std::vector<int32_t>& allowed_special_ids() const { return allowed_special_ids_; }
  bool allows_special(int32_t id) const;

  // The mask of position (rule, state); the state must have a byte edge.
  const PositionMask& mask_at(RuleId rule, int32_t state) const;

  Stats stats() const;

 private:
  friend std::shared_ptr<const CompiledGrammar> compile_grammar(const Grammar&, std::shared_ptr<const TokenizerInfo>,
                                                                const GrammarCompileOptions&);
  CompiledGrammar() = default;
  PositionMask compute_mask(RuleId rule, int32_t state) const;
  std::string fingerprint(RuleId rule) const;
  int32_t position(RuleId rule, int32_t state) const { return position_offset_[static_cast<size_t>(rule)] + state; }

  std::shared_ptr<const TokenizerInfo> tokenizer_;
  CompiledRules rules_;
  int32_t max_stack_depth_ = 128;
  std::vector<int32_t> allowed_special_ids_;
  std::vector<int32_t> position_offset_;  // [rules]: position of (rule, state) = offset + state
  // Precomputed rules: all their masks at once (possibly shared with other grammars). Otherwise
  // each position's mask is made on first use.
  std::vector<std::shared_ptr<const RuleMasks>> rule_masks_;  // [rules]
  mutable std::vector<std::unique_ptr<PositionMask>> masks_;
  mutable std::unique_ptr<std::once_flag[]> mask_once_;
  int32_t cached_rules_ = 0;
  int32_t lazy_rules_ = 0;
  double compile_ms_ = 0;
};

// Compiles `grammar` for `tokenizer`. Throws kUnsupported (naming the problem) for grammars the
// engine cannot handle: too large, accepting nothing, left-recursive, or naming a special token the
// tokenizer lacks.
std::shared_ptr<const CompiledGrammar> compile_grammar(const Grammar& grammar,
                                                       std::shared_ptr<const TokenizerInfo> tokenizer,
                                                       const GrammarCompileOptions& options = {});

}  // namespace metrale::grammar
