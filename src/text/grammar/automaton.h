// A Grammar compiled into one deterministic automaton per rule. Bytes move within a rule; a reference
// edge (rule R, target t) means "run R from its start, then continue at t": the matcher keeps a stack
// of (rule, state) frames. Every state of every automaton can still reach an accepting state, and
// every referenced rule accepts some string, so a matcher never walks into a dead end.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "text/grammar/grammar.h"

namespace metrale::grammar {

struct RefEdge {
  RuleId rule = -1;
  int32_t target = -1;
};

struct RuleAutomaton {
  static constexpr uint8_t kFinal = 1;     // the rule may end here
  static constexpr uint8_t kHasBytes = 2;  // some byte moves on
  static constexpr uint8_t kHasRefs = 4;   // some reference edge leaves

  std::string name;
  int32_t num_states = 0;   // state 0 is the start
  int32_t num_classes = 0;  // bytes that no edge tells apart share a class
  std::array<uint8_t, 256> byte_class{};
  std::vector<int32_t> next;         // [num_states * num_classes] target state, -1: no edge
  std::vector<uint8_t> flags;        // [num_states] kFinal | kHasBytes | kHasRefs
  std::vector<int32_t> ref_offsets;  // [num_states + 1] into refs
  std::vector<RefEdge> refs;

  int32_t step(int32_t state, uint8_t byte) const {
    return next[static_cast<size_t>(state) * static_cast<size_t>(num_classes) + byte_class[byte]];
  }
  bool is_final(int32_t state) const { return (flags[state] & kFinal) != 0; }
  bool has_bytes(int32_t state) const { return (flags[state] & kHasBytes) != 0; }
  bool has_refs(int32_t state) const { return (flags[state] & kHasRefs) != 0; }
  std::span<const RefEdge> refs_of(int32_t state) const {
    return std::span<const RefEdge>(refs).subspan(ref_offsets[state], ref_offsets[state + 1] - ref_offsets[state]);
  }
};

struct AutomatonLimits {
  int64_t max_nfa_states = 4'000'000;  // summed over the rules
  int64_t max_dfa_states = 400'000;    // summed over the rules
};

struct CompiledRules {
  std::vector<RuleAutomaton> rules;
  RuleId root = -1;
  // completion[r][s]: the fewest bytes that take state s of rule r to the rule's end (the rules it
  // references included). Used to steer random walks in tests and to explain states.
  std::vector<std::vector<int32_t>> completion;
  int64_t total_states() const;
};

// Throws kUnsupported when the grammar is too large for `limits`, accepts nothing, or is left
// recursive (a rule that can reach itself without consuming a byte).
CompiledRules compile_rules(const Grammar& grammar, const AutomatonLimits& limits = {});

}  // namespace metrale::grammar
