#include "text/grammar/compiled_grammar.h"

#include <algorithm>
#include <chrono>

#include "core/error.h"
#include "text/grammar/simulator.h"

namespace metrale::grammar {

bool CompiledGrammar::allows_special(int32_t id) const {
  return std::binary_search(allowed_special_ids_.begin(), allowed_special_ids_.end(), id);
}

const PositionMask& CompiledGrammar::mask_at(RuleId rule, int32_t state) const {
  if (const auto& masks = rule_masks_[static_cast<size_t>(rule)]) return (*masks)[static_cast<size_t>(state)];
  const auto at = static_cast<size_t>(position(rule, state));
  std::call_once(mask_once_[at], [&] { masks_[at] = std::make_unique<PositionMask>(compute_mask(rule, state)); });
  return *masks_[at];
}

namespace {

// The walk's state after the bytes of the current trie node's string. A level is "simple" when one
// thread sits inside the rule itself at a state without reference edges (the common case: string
// contents, literals, numbers), and general otherwise.
struct Level {
  int32_t simple_state = -1;  // -1: no simple thread
  bool general = false;
  ThreadSet set;           // when general
  bool exit_here = false;  // the rule may end right after this byte
  bool has_exit = false;   // ... after this byte or an earlier one of the string
};

}  // namespace

// Classifies every token at (rule, state) by walking the tokenizer trie once, pruning subtrees that
// neither move on inside the rule nor passed a point where the rule may end.
PositionMask CompiledGrammar::compute_mask(RuleId rule, int32_t state) const {
  const RuleAutomaton& dfa = rules_.rules[static_cast<size_t>(rule)];
  const PrefixTree& trie = tokenizer_->trie();
  Simulator simulator(rules_, nullptr, max_stack_depth_);
  std::vector<Level> levels(static_cast<size_t>(trie.max_depth()) + 1);
  levels.at(0).simple_state = state;
  std::vector<int32_t> accepted;
  std::vector<std::pair<std::string, int32_t>> uncertain;
  for (int32_t i = 0; i < trie.size();) {
    const int32_t depth = trie.depth[static_cast<size_t>(i)];
    const uint8_t byte = trie.byte[static_cast<size_t>(i)];
    const Level& previous = levels[static_cast<size_t>(depth) - 1];
    Level& level = levels[static_cast<size_t>(depth)];
    level.simple_state = -1;
    level.general = false;
    level.exit_here = false;
    bool alive = false;
    if (previous.general) {
      alive = simulator.step(previous.set, byte, level.set);
      level.general = true;
      level.exit_here = level.set.exited;
    } else if (previous.simple_state >= 0) {
      const int32_t next = dfa.step(previous.simple_state, byte);
      if (next >= 0) {
        alive = true;
        if (!dfa.has_refs(next)) {
          // Still one thread in the rule itself; where the rule may end, it may also exit.
          if (dfa.has_bytes(next)) level.simple_state = next;
          level.exit_here = dfa.is_final(next);
        } else {
          level.general = true;
          level.set.clear();
          simulator.clear_visited();
          const int32_t thread[3] = {kBoundary, rule, next};
          simulator.close(thread, level.set);
          level.exit_here = level.set.exited;
        }
      }
    }
    level.has_exit = previous.has_exit || level.exit_here;
    for (int32_t v = trie.values_offset[static_cast<size_t>(i)]; v < trie.values_offset[static_cast<size_t>(i) + 1];
         ++v) {
      const int32_t token = trie.values[static_cast<size_t>(v)];
      if (tokenizer_->is_special(token) && !allows_special(token)) continue;
      if (alive) {
        accepted.push_back(token);
      } else if (previous.has_exit) {
        const std::string_view bytes = tokenizer_->token_bytes(token);
        for (int32_t e = 1; e < depth; ++e) {
          if (levels[static_cast<size_t>(e)].exit_here)
            uncertain.emplace_back(std::string(bytes.substr(static_cast<size_t>(e))), token);
        }
      }
    }
    const bool moves_on = level.general ? !level.set.empty() : level.simple_state >= 0;
    i = moves_on || level.has_exit ? i + 1 : trie.end[static_cast<size_t>(i)];
  }
  PositionMask mask;
  mask.num_accepted = static_cast<int32_t>(accepted.size());
  mask.num_uncertain = static_cast<int32_t>(uncertain.size());
  const int32_t words = tokenizer_->bitmask_words();
  if (static_cast<int64_t>(accepted.size()) > words) {
    mask.accepted_bits.assign(static_cast<size_t>(words), 0);
    for (int32_t token : accepted) mask.accepted_bits[static_cast<size_t>(token) >> 5] |= 1u << (token & 31);
  } else {
    std::sort(accepted.begin(), accepted.end());
    mask.accepted_ids = std::move(accepted);
  }
  mask.uncertain = PrefixTree::build(std::move(uncertain));
  return mask;
}

// Everything a rule's masks depend on: its automaton and those of the rules it reaches (numbered in
// the order first reached), the special tokens allowed and the nesting bound.
std::string CompiledGrammar::fingerprint(RuleId rule) const {
  std::string key;
  const auto put = [&](int32_t value) { key.append(reinterpret_cast<const char*>(&value), sizeof(value)); };
  std::vector<RuleId> order{rule};
  std::vector<int32_t> local(rules_.rules.size(), -1);
  local[static_cast<size_t>(rule)] = 0;
  for (size_t i = 0; i < order.size(); ++i) {
    const RuleAutomaton& dfa = rules_.rules[static_cast<size_t>(order[i])];
    put(dfa.num_states);
    put(dfa.num_classes);
    key.append(reinterpret_cast<const char*>(dfa.byte_class.data()), dfa.byte_class.size());
    key.append(reinterpret_cast<const char*>(dfa.next.data()), dfa.next.size() * sizeof(int32_t));
    key.append(reinterpret_cast<const char*>(dfa.flags.data()), dfa.flags.size());
    key.append(reinterpret_cast<const char*>(dfa.ref_offsets.data()), dfa.ref_offsets.size() * sizeof(int32_t));
    for (const RefEdge& ref : dfa.refs) {
      if (local[static_cast<size_t>(ref.rule)] < 0) {
        local[static_cast<size_t>(ref.rule)] = static_cast<int32_t>(order.size());
        order.push_back(ref.rule);
      }
      put(local[static_cast<size_t>(ref.rule)]);
      put(ref.target);
    }
  }
  put(-1);
  for (int32_t id : allowed_special_ids_) put(id);
  put(max_stack_depth_);
  return key;
}

CompiledGrammar::Stats CompiledGrammar::stats() const {
  Stats stats;
  stats.num_rules = static_cast<int32_t>(rules_.rules.size());
  stats.num_states = rules_.total_states();
  stats.compile_ms = compile_ms_;
  stats.cached_rules = cached_rules_;
  stats.lazy_rules = lazy_rules_;
  for (size_t r = 0; r < rules_.rules.size(); ++r) {
    const RuleAutomaton& dfa = rules_.rules[r];
    for (int32_t s = 0; s < dfa.num_states; ++s) {
      if (!dfa.has_bytes(s)) continue;
      ++stats.num_positions;
      // Only precomputed masks are read: a lazy one may be in the making on another thread.
      if (rule_masks_[r]) {
        const PositionMask& mask = (*rule_masks_[r])[static_cast<size_t>(s)];
        stats.num_uncertain += mask.num_uncertain;
        stats.mask_bytes += mask.memory_bytes();
      }
    }
  }
  return stats;
}

std::shared_ptr<const CompiledGrammar> compile_grammar(const Grammar& grammar,
                                                       std::shared_ptr<const TokenizerInfo> tokenizer,
                                                       const GrammarCompileOptions& options) {
  METRALE_CHECK(tokenizer != nullptr, "compile_grammar needs a tokenizer");
  const auto started = std::chrono::steady_clock::now();
  auto compiled = std::shared_ptr<CompiledGrammar>(new CompiledGrammar());
  compiled->tokenizer_ = std::move(tokenizer);
  compiled->rules_ = compile_rules(grammar, options.limits);
  compiled->max_stack_depth_ = std::max(options.max_stack_depth, 2);
  for (const std::string& text : grammar.allowed_special_tokens()) {
    // A marker that is not a special token of this tokenizer is produced from ordinary tokens.
    if (const std::optional<int32_t> id = compiled->tokenizer_->special_token(text))
      compiled->allowed_special_ids_.push_back(*id);
  }
  std::sort(compiled->allowed_special_ids_.begin(), compiled->allowed_special_ids_.end());
  int32_t positions = 0;
  for (const RuleAutomaton& dfa : compiled->rules_.rules) {
    compiled->position_offset_.push_back(positions);
    positions += dfa.num_states;
  }
  compiled->masks_.resize(static_cast<size_t>(positions));
  compiled->mask_once_ = std::make_unique<std::once_flag[]>(static_cast<size_t>(positions));
  compiled->rule_masks_.resize(compiled->rules_.rules.size());
  if (options.precompute) {
    RuleMaskCache& cache = compiled->tokenizer_->mask_cache();
    int64_t budget = options.max_precomputed_positions;
    for (size_t r = 0; r < compiled->rules_.rules.size(); ++r) {
      const auto rule = static_cast<RuleId>(r);
      const RuleAutomaton& automaton = compiled->rules_.rules[r];
      const int64_t rule_positions = std::count_if(automaton.flags.begin(), automaton.flags.end(), [](uint8_t flags) {
        return (flags & RuleAutomaton::kHasBytes) != 0;
      });
      if (rule_positions > budget) {
        ++compiled->lazy_rules_;  // built on first use, position by position
        continue;
      }
      budget -= rule_positions;
      const std::string key = options.use_cache ? compiled->fingerprint(rule) : std::string();
      if (options.use_cache) {
        if (std::shared_ptr<const RuleMasks> hit = cache.find(key)) {
          compiled->rule_masks_[r] = std::move(hit);
          ++compiled->cached_rules_;
          continue;
        }
      }
      const RuleAutomaton& dfa = compiled->rules_.rules[r];
      auto masks = std::make_shared<RuleMasks>(static_cast<size_t>(dfa.num_states));
      for (int32_t s = 0; s < dfa.num_states; ++s) {
        if (dfa.has_bytes(s)) (*masks)[static_cast<size_t>(s)] = compiled->compute_mask(rule, s);
      }
      if (options.use_cache) cache.insert(key, masks);
      compiled->rule_masks_[r] = std::move(masks);
    }
  }
  compiled->compile_ms_ = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - started).count();
  return compiled;
}

}  // namespace metrale::grammar
