#include "text/grammar/automaton.h"

#include <algorithm>
#include <deque>
#include <limits>
#include <numeric>
#include <unordered_map>

#include "core/error.h"

namespace metrale::grammar {
namespace {

struct VectorHash {
  size_t operator()(const std::vector<int32_t>& values) const {
    uint64_t hash = 0x9E3779B97F4A7C15ull ^ values.size();
    for (int32_t v : values) hash = (hash ^ static_cast<uint32_t>(v)) * 0x100000001B3ull + (hash >> 29);
    return static_cast<size_t>(hash);
  }
};

// --- Thompson NFA of one rule ---

class Nfa {
 public:
  struct State {
    std::vector<int32_t> eps;
    std::vector<std::pair<int32_t, int32_t>> bytes;  // (byte-set index, target)
    std::vector<RefEdge> refs;
  };

  Nfa(const Grammar& grammar, int64_t& budget) : grammar_(grammar), budget_(budget) {}

  int32_t add_state() {
    if (--budget_ < 0) raise(ErrorCode::kUnsupported, "the grammar is too large (too many automaton states)");
    states_.emplace_back();
    return static_cast<int32_t>(states_.size() - 1);
  }

  // Adds the expression's automaton starting at `from`; returns its end state. Invariant: no
  // construct loops back to its own `from` (loops get a fresh state), so several constructs may
  // start at the same state.
  int32_t build(ExprId id, int32_t from) {
    const ExprNode& node = grammar_.node(id);
    switch (node.kind) {
      case ExprKind::kEmpty:
        return from;
      case ExprKind::kBytes: {
        const int32_t to = add_state();
        states_[from].bytes.emplace_back(set_index(node.bytes), to);
        return to;
      }
      case ExprKind::kSeq: {
        int32_t at = from;
        for (ExprId child : node.children) at = build(child, at);
        return at;
      }
      case ExprKind::kAlt: {
        const int32_t to = add_state();
        for (ExprId child : node.children) {
          const int32_t end = build(child, from);
          states_[end].eps.push_back(to);
        }
        return to;
      }
      case ExprKind::kRepeat:
        return build_repeat(node, from);
      case ExprKind::kRef: {
        const int32_t to = add_state();
        states_[from].refs.push_back(RefEdge{node.rule, to});
        return to;
      }
      case ExprKind::kGraph: {
        std::vector<int32_t> at(static_cast<size_t>(node.num_nodes));
        for (int32_t& state : at) state = add_state();
        states_[from].eps.push_back(at[0]);
        for (const GraphEdge& edge : node.edges) {
          if (edge.label < 0) {
            states_[at[edge.from]].eps.push_back(at[edge.to]);
          } else {
            const int32_t end = build(edge.label, at[edge.from]);
            states_[end].eps.push_back(at[edge.to]);
          }
        }
        const int32_t to = add_state();
        for (int32_t final_node : node.finals) states_[at[final_node]].eps.push_back(to);
        return to;
      }
    }
    return from;
  }

  const std::vector<State>& states() const { return states_; }
  const std::vector<ByteSet>& sets() const { return sets_; }

 private:
  int32_t build_repeat(const ExprNode& node, int32_t from) {
    const ExprId child = node.children[0];
    int32_t at = from;
    for (int32_t i = 0; i < node.min; ++i) at = build(child, at);
    if (node.max == -1) {
      const int32_t loop = add_state();
      states_[at].eps.push_back(loop);
      const int32_t end = build(child, loop);
      states_[end].eps.push_back(loop);
      return loop;
    }
    if (node.max == node.min) return at;
    const int32_t to = add_state();
    for (int32_t i = node.min; i < node.max; ++i) {
      states_[at].eps.push_back(to);
      at = build(child, at);
    }
    states_[at].eps.push_back(to);
    return to;
  }

  int32_t set_index(const ByteSet& set) {
    for (size_t i = 0; i < sets_.size(); ++i) {
      if (sets_[i] == set) return static_cast<int32_t>(i);
    }
    sets_.push_back(set);
    return static_cast<int32_t>(sets_.size() - 1);
  }

  const Grammar& grammar_;
  int64_t& budget_;
  std::vector<State> states_;
  std::vector<ByteSet> sets_;
};

// Byte classes: bytes that every set either contains or does not share a class. Returns the number
// of classes; set_classes[i] lists the classes set i covers.
int32_t byte_classes(const std::vector<ByteSet>& sets, std::array<uint8_t, 256>& byte_class,
                     std::vector<std::vector<int32_t>>& set_classes) {
  std::array<int32_t, 256> cls{};
  int32_t num_classes = 1;
  for (const ByteSet& set : sets) {
    std::unordered_map<int64_t, int32_t> split;
    int32_t count = 0;
    std::array<int32_t, 256> next_cls{};
    for (int b = 0; b < 256; ++b) {
      const int64_t key = int64_t{cls[b]} * 2 + (set.has(static_cast<uint8_t>(b)) ? 1 : 0);
      const auto [it, inserted] = split.emplace(key, count);
      if (inserted) ++count;
      next_cls[b] = it->second;
    }
    cls = next_cls;
    num_classes = count;
  }
  for (int b = 0; b < 256; ++b) byte_class[b] = static_cast<uint8_t>(cls[b]);
  set_classes.assign(sets.size(), {});
  for (size_t i = 0; i < sets.size(); ++i) {
    std::vector<uint8_t> seen(static_cast<size_t>(num_classes), 0);
    for (int b = 0; b < 256; ++b) {
      if (sets[i].has(static_cast<uint8_t>(b)) && !seen[cls[b]]) {
        seen[cls[b]] = 1;
        set_classes[i].push_back(cls[b]);
      }
    }
  }
  return num_classes;
}

// --- Subset construction ---

// A DFA before trimming: the same layout as RuleAutomaton.
RuleAutomaton determinize(const Nfa& nfa, int32_t start, int32_t end, std::string name, int64_t& budget) {
  RuleAutomaton dfa;
  dfa.name = std::move(name);
  std::vector<std::vector<int32_t>> set_classes;
  dfa.num_classes = byte_classes(nfa.sets(), dfa.byte_class, set_classes);
  const int32_t num_classes = dfa.num_classes;

  const auto& states = nfa.states();
  std::vector<uint32_t> mark(states.size(), 0);
  uint32_t generation = 0;
  std::vector<int32_t> stack;
  // A subset keeps only the NFA states that matter for what follows (those with byte or reference
  // edges, and the end): states reached by different edges that only lead on by epsilon would
  // otherwise make equal subsets look different (a character class's branches, say).
  const auto important = [&](int32_t s) { return s == end || !states[s].bytes.empty() || !states[s].refs.empty(); };
  const auto closure = [&](std::vector<int32_t>& set) {
    ++generation;
    stack.assign(set.begin(), set.end());
    set.clear();
    while (!stack.empty()) {
      const int32_t s = stack.back();
      stack.pop_back();
      if (mark[s] == generation) continue;
      mark[s] = generation;
      if (important(s)) set.push_back(s);
      for (int32_t t : states[s].eps) stack.push_back(t);
    }
    std::sort(set.begin(), set.end());
  };

  std::unordered_map<std::vector<int32_t>, int32_t, VectorHash> ids;
  std::vector<std::vector<int32_t>> subsets;
  const auto intern = [&](std::vector<int32_t> set) {
    const auto it = ids.find(set);
    if (it != ids.end()) return it->second;
    if (--budget < 0) raise(ErrorCode::kUnsupported, "the grammar is too large (too many automaton states)");
    const auto id = static_cast<int32_t>(subsets.size());
    ids.emplace(set, id);
    subsets.push_back(std::move(set));
    return id;
  };
  std::vector<int32_t> initial{start};
  closure(initial);
  intern(std::move(initial));

  std::vector<std::vector<int32_t>> buckets(static_cast<size_t>(num_classes));
  std::vector<std::pair<RuleId, int32_t>> ref_targets;
  for (size_t d = 0; d < subsets.size(); ++d) {
    for (auto& bucket : buckets) bucket.clear();
    ref_targets.clear();
    bool is_final = false;
    for (int32_t s : subsets[d]) {
      if (s == end) is_final = true;
      for (const auto& [set, target] : states[s].bytes) {
        for (int32_t c : set_classes[set]) buckets[c].push_back(target);
      }
      for (const RefEdge& ref : states[s].refs) ref_targets.emplace_back(ref.rule, ref.target);
    }
    dfa.next.resize(subsets.size() * static_cast<size_t>(num_classes), -1);
    dfa.flags.resize(subsets.size(), 0);
    if (is_final) dfa.flags[d] |= RuleAutomaton::kFinal;
    for (int32_t c = 0; c < num_classes; ++c) {
      if (buckets[c].empty()) continue;
      closure(buckets[c]);
      const int32_t target = intern(buckets[c]);
      dfa.next[d * num_classes + c] = target;
      dfa.flags[d] |= RuleAutomaton::kHasBytes;
    }
    std::sort(ref_targets.begin(), ref_targets.end());
    for (size_t i = 0; i < ref_targets.size();) {
      size_t j = i;
      std::vector<int32_t> targets;
      while (j < ref_targets.size() && ref_targets[j].first == ref_targets[i].first)
        targets.push_back(ref_targets[j++].second);
      closure(targets);
      const int32_t target = intern(std::move(targets));
      dfa.refs.push_back(RefEdge{ref_targets[i].first, target});
      dfa.ref_offsets.push_back(static_cast<int32_t>(d));  // owner, turned into offsets below
      i = j;
    }
  }
  dfa.num_states = static_cast<int32_t>(subsets.size());
  dfa.next.resize(static_cast<size_t>(dfa.num_states) * num_classes, -1);
  dfa.flags.resize(static_cast<size_t>(dfa.num_states), 0);
  std::vector<int32_t> owners = std::move(dfa.ref_offsets);
  dfa.ref_offsets.assign(static_cast<size_t>(dfa.num_states) + 1, 0);
  for (int32_t owner : owners) ++dfa.ref_offsets[owner + 1];
  for (int32_t s = 0; s < dfa.num_states; ++s) dfa.ref_offsets[s + 1] += dfa.ref_offsets[s];
  for (int32_t s = 0; s < dfa.num_states; ++s) {
    if (dfa.ref_offsets[s + 1] > dfa.ref_offsets[s]) dfa.flags[s] |= RuleAutomaton::kHasRefs;
  }
  return dfa;
}

// --- Trimming, minimisation, renumbering ---

// Rebuilds `dfa` keeping the states with keep[s] >= 0 (their new numbers), dropping reference edges
// to rules that `usable` rejects (nullptr: keep all). The start state must be kept and numbered 0.
RuleAutomaton rebuild(const RuleAutomaton& dfa, const std::vector<int32_t>& keep, int32_t num_kept,
                      const std::vector<uint8_t>* usable) {
  RuleAutomaton out;
  out.name = dfa.name;
  out.num_states = num_kept;
  out.num_classes = dfa.num_classes;
  out.byte_class = dfa.byte_class;
  out.next.assign(static_cast<size_t>(num_kept) * dfa.num_classes, -1);
  out.flags.assign(static_cast<size_t>(num_kept), 0);
  std::vector<std::vector<RefEdge>> refs(static_cast<size_t>(num_kept));
  for (int32_t s = 0; s < dfa.num_states; ++s) {
    const int32_t n = keep[s];
    if (n < 0) continue;
    if (dfa.is_final(s)) out.flags[n] |= RuleAutomaton::kFinal;
    for (int32_t c = 0; c < dfa.num_classes; ++c) {
      const int32_t t = dfa.next[static_cast<size_t>(s) * dfa.num_classes + c];
      if (t >= 0 && keep[t] >= 0) {
        out.next[static_cast<size_t>(n) * dfa.num_classes + c] = keep[t];
        out.flags[n] |= RuleAutomaton::kHasBytes;
      }
    }
    for (const RefEdge& ref : dfa.refs_of(s)) {
      if ((usable != nullptr && !(*usable)[ref.rule]) || keep[ref.target] < 0) continue;
      const RefEdge edge{ref.rule, keep[ref.target]};
      if (std::find_if(refs[n].begin(), refs[n].end(), [&](const RefEdge& e) {
            return e.rule == edge.rule && e.target == edge.target;
          }) == refs[n].end()) {
        refs[n].push_back(edge);
      }
    }
  }
  out.ref_offsets.assign(static_cast<size_t>(num_kept) + 1, 0);
  for (int32_t s = 0; s < num_kept; ++s) {
    std::sort(refs[s].begin(), refs[s].end(), [](const RefEdge& a, const RefEdge& b) {
      return a.rule != b.rule ? a.rule < b.rule : a.target < b.target;
    });
    for (const RefEdge& edge : refs[s]) out.refs.push_back(edge);
    out.ref_offsets[s + 1] = static_cast<int32_t>(out.refs.size());
    if (!refs[s].empty()) out.flags[s] |= RuleAutomaton::kHasRefs;
  }
  return out;
}

// The states that can reach an accepting state through bytes and references to `usable` rules.
std::vector<uint8_t> co_reachable(const RuleAutomaton& dfa, const std::vector<uint8_t>& usable) {
  std::vector<std::vector<int32_t>> back(static_cast<size_t>(dfa.num_states));
  for (int32_t s = 0; s < dfa.num_states; ++s) {
    for (int32_t c = 0; c < dfa.num_classes; ++c) {
      const int32_t t = dfa.next[static_cast<size_t>(s) * dfa.num_classes + c];
      if (t >= 0) back[t].push_back(s);
    }
    for (const RefEdge& ref : dfa.refs_of(s)) {
      if (usable[ref.rule]) back[ref.target].push_back(s);
    }
  }
  std::vector<uint8_t> live(static_cast<size_t>(dfa.num_states), 0);
  std::vector<int32_t> work;
  for (int32_t s = 0; s < dfa.num_states; ++s) {
    if (dfa.is_final(s)) {
      live[s] = 1;
      work.push_back(s);
    }
  }
  while (!work.empty()) {
    const int32_t s = work.back();
    work.pop_back();
    for (int32_t p : back[s]) {
      if (!live[p]) {
        live[p] = 1;
        work.push_back(p);
      }
    }
  }
  return live;
}

// Moore's partition refinement to the coarsest stable partition; returns the block of every state
// (block of the start is 0 after renumbering by the caller). Gives up (identity) after `max_rounds`.
std::vector<int32_t> minimize(const RuleAutomaton& dfa, int32_t& num_blocks, int32_t max_rounds) {
  const int32_t n = dfa.num_states;
  std::vector<int32_t> block(static_cast<size_t>(n));
  for (int32_t s = 0; s < n; ++s) block[s] = dfa.is_final(s) ? 1 : 0;
  int32_t count = 2;
  std::vector<int32_t> signature;
  for (int32_t round = 0; round < max_rounds; ++round) {
    std::unordered_map<std::vector<int32_t>, int32_t, VectorHash> ids;
    std::vector<int32_t> next_block(static_cast<size_t>(n));
    for (int32_t s = 0; s < n; ++s) {
      signature.clear();
      signature.push_back(block[s]);
      for (int32_t c = 0; c < dfa.num_classes; ++c) {
        const int32_t t = dfa.next[static_cast<size_t>(s) * dfa.num_classes + c];
        signature.push_back(t < 0 ? -1 : block[t]);
      }
      for (const RefEdge& ref : dfa.refs_of(s)) {
        signature.push_back(ref.rule);
        signature.push_back(block[ref.target]);
      }
      const auto [it, inserted] = ids.emplace(signature, static_cast<int32_t>(ids.size()));
      next_block[s] = it->second;
    }
    const auto new_count = static_cast<int32_t>(ids.size());
    block.swap(next_block);
    if (new_count == count) {
      num_blocks = count;
      return block;
    }
    count = new_count;
  }
  num_blocks = n;
  std::iota(block.begin(), block.end(), 0);
  return block;
}

// Merges equivalent states and numbers the rest in breadth-first order from the start.
RuleAutomaton canonicalize(const RuleAutomaton& dfa, int32_t max_rounds) {
  int32_t num_blocks = 0;
  const std::vector<int32_t> block = minimize(dfa, num_blocks, max_rounds);
  // One representative per block, then BFS numbering from the start's block.
  std::vector<int32_t> representative(static_cast<size_t>(num_blocks), -1);
  for (int32_t s = 0; s < dfa.num_states; ++s) {
    if (representative[block[s]] < 0) representative[block[s]] = s;
  }
  std::vector<int32_t> order(static_cast<size_t>(num_blocks), -1);
  std::deque<int32_t> queue{block[0]};
  order[block[0]] = 0;
  int32_t numbered = 1;
  while (!queue.empty()) {
    const int32_t b = queue.front();
    queue.pop_front();
    const int32_t s = representative[b];
    const auto visit = [&](int32_t t) {
      if (t >= 0 && order[block[t]] < 0) {
        order[block[t]] = numbered++;
        queue.push_back(block[t]);
      }
    };
    for (int32_t c = 0; c < dfa.num_classes; ++c) visit(dfa.next[static_cast<size_t>(s) * dfa.num_classes + c]);
    for (const RefEdge& ref : dfa.refs_of(s)) visit(ref.target);
  }
  // Keep only representatives (mapped to their block's number).
  std::vector<int32_t> keep(static_cast<size_t>(dfa.num_states), -1);
  for (int32_t b = 0; b < num_blocks; ++b) {
    if (order[b] >= 0) keep[representative[b]] = order[b];
  }
  // Edges of a representative point at arbitrary members of a block: map them through the block.
  RuleAutomaton merged = dfa;
  for (int32_t s = 0; s < dfa.num_states; ++s) {
    for (int32_t c = 0; c < dfa.num_classes; ++c) {
      int32_t& t = merged.next[static_cast<size_t>(s) * dfa.num_classes + c];
      if (t >= 0) t = representative[block[t]];
    }
  }
  for (RefEdge& ref : merged.refs) ref.target = representative[block[ref.target]];
  return rebuild(merged, keep, numbered, nullptr);
}

// Rules that can reach a reference to themselves without consuming a byte would make the matcher
// push forever.
void check_left_recursion(const std::vector<RuleAutomaton>& rules, const Grammar& grammar) {
  const auto num_rules = rules.size();
  // Nullable rules: an accepting state reachable from the start through nullable references only.
  std::vector<uint8_t> nullable(num_rules, 0);
  const auto reach_without_bytes = [&](const RuleAutomaton& dfa, auto&& on_ref) {
    std::vector<uint8_t> seen(static_cast<size_t>(dfa.num_states), 0);
    std::vector<int32_t> work{0};
    seen[0] = 1;
    bool reaches_final = false;
    while (!work.empty()) {
      const int32_t s = work.back();
      work.pop_back();
      if (dfa.is_final(s)) reaches_final = true;
      for (const RefEdge& ref : dfa.refs_of(s)) {
        on_ref(ref.rule);
        if (nullable[ref.rule] && !seen[ref.target]) {
          seen[ref.target] = 1;
          work.push_back(ref.target);
        }
      }
    }
    return reaches_final;
  };
  for (bool changed = true; changed;) {
    changed = false;
    for (size_t r = 0; r < num_rules; ++r) {
      if (!nullable[r] && reach_without_bytes(rules[r], [](RuleId) {})) {
        nullable[r] = 1;
        changed = true;
      }
    }
  }
  std::vector<std::vector<RuleId>> first(num_rules);
  for (size_t r = 0; r < num_rules; ++r) {
    reach_without_bytes(rules[r], [&](RuleId target) { first[r].push_back(target); });
  }
  // Depth-first search for a cycle in `first`.
  std::vector<uint8_t> color(num_rules, 0);
  const auto visit = [&](auto&& self, size_t r) -> void {
    color[r] = 1;
    for (RuleId next : first[r]) {
      if (color[next] == 1) {
        raise(ErrorCode::kUnsupported,
              "the grammar is left-recursive at rule {} (a reference that reaches itself "
              "without consuming text)",
              grammar.rule_name(next));
      }
      if (color[next] == 0) self(self, static_cast<size_t>(next));
    }
    color[r] = 2;
  };
  for (size_t r = 0; r < num_rules; ++r) {
    if (color[r] == 0) visit(visit, r);
  }
}

// completion[r][s]: the fewest bytes from state s of rule r to its end, to a fixed point (every rule
// is productive, so all are finite).
std::vector<std::vector<int32_t>> shortest_completions(const std::vector<RuleAutomaton>& rules) {
  constexpr int32_t kInfinite = std::numeric_limits<int32_t>::max() / 4;
  std::vector<std::vector<int32_t>> completion(rules.size());
  for (size_t r = 0; r < rules.size(); ++r) {
    completion[r].assign(static_cast<size_t>(rules[r].num_states), kInfinite);
    for (int32_t s = 0; s < rules[r].num_states; ++s) {
      if (rules[r].is_final(s)) completion[r][static_cast<size_t>(s)] = 0;
    }
  }
  for (bool changed = true; changed;) {
    changed = false;
    for (size_t r = 0; r < rules.size(); ++r) {
      const RuleAutomaton& dfa = rules[r];
      std::vector<int32_t>& best = completion[r];
      for (int32_t s = 0; s < dfa.num_states; ++s) {
        int32_t value = best[static_cast<size_t>(s)];
        for (int32_t c = 0; c < dfa.num_classes; ++c) {
          const int32_t t = dfa.next[static_cast<size_t>(s) * dfa.num_classes + c];
          if (t >= 0) value = std::min(value, 1 + best[static_cast<size_t>(t)]);
        }
        for (const RefEdge& ref : dfa.refs_of(s)) {
          value = std::min(value, completion[static_cast<size_t>(ref.rule)][0] + best[static_cast<size_t>(ref.target)]);
        }
        if (value < best[static_cast<size_t>(s)]) {
          best[static_cast<size_t>(s)] = value;
          changed = true;
        }
      }
    }
  }
  return completion;
}

}  // namespace

int64_t CompiledRules::total_states() const {
  int64_t total = 0;
  for (const RuleAutomaton& rule : rules) total += rule.num_states;
  return total;
}

CompiledRules compile_rules(const Grammar& grammar, const AutomatonLimits& limits) {
  if (grammar.root() < 0) raise(ErrorCode::kInvalidArgument, "the grammar has no root rule");
  const auto num_rules = static_cast<size_t>(grammar.num_rules());
  int64_t nfa_budget = limits.max_nfa_states;
  int64_t dfa_budget = limits.max_dfa_states;
  std::vector<RuleAutomaton> dfas;
  dfas.reserve(num_rules);
  for (RuleId r = 0; r < grammar.num_rules(); ++r) {
    if (grammar.rule_body(r) < 0) raise(ErrorCode::kInternal, "grammar rule {} has no body", grammar.rule_name(r));
    Nfa nfa(grammar, nfa_budget);
    const int32_t start = nfa.add_state();
    const int32_t end = nfa.build(grammar.rule_body(r), start);
    dfas.push_back(determinize(nfa, start, end, grammar.rule_name(r), dfa_budget));
  }
  // Productive rules (those accepting some string), to a fixed point.
  std::vector<uint8_t> productive(num_rules, 0);
  for (bool changed = true; changed;) {
    changed = false;
    for (size_t r = 0; r < num_rules; ++r) {
      if (!productive[r] && co_reachable(dfas[r], productive)[0]) {
        productive[r] = 1;
        changed = true;
      }
    }
  }
  if (!productive[grammar.root()]) {
    raise(ErrorCode::kUnsupported, "the grammar accepts no string (the schema admits no value)");
  }
  CompiledRules compiled;
  compiled.root = grammar.root();
  for (size_t r = 0; r < num_rules; ++r) {
    if (!productive[r]) {
      // Never referenced once the edges to it are dropped; keep a one-state placeholder.
      RuleAutomaton placeholder;
      placeholder.name = dfas[r].name;
      placeholder.num_states = 1;
      placeholder.num_classes = 1;
      placeholder.next = {-1};
      placeholder.flags = {RuleAutomaton::kFinal};
      placeholder.ref_offsets = {0, 0};
      compiled.rules.push_back(std::move(placeholder));
      continue;
    }
    const std::vector<uint8_t> live = co_reachable(dfas[r], productive);
    std::vector<int32_t> keep(static_cast<size_t>(dfas[r].num_states), -1);
    int32_t kept = 0;
    for (int32_t s = 0; s < dfas[r].num_states; ++s) {
      if (live[s]) keep[s] = kept++;
    }
    const RuleAutomaton trimmed = rebuild(dfas[r], keep, kept, &productive);
    // Moore's refinement takes as many rounds as the longest distinguishing path, which for the long
    // counted chains of big automata (maxLength, maxItems) costs far more than the few merges it
    // finds there: large automata are only renumbered.
    compiled.rules.push_back(canonicalize(trimmed, trimmed.num_states <= 1024 ? trimmed.num_states + 1 : 0));
  }
  check_left_recursion(compiled.rules, grammar);
  compiled.completion = shortest_completions(compiled.rules);
  return compiled;
}

}  // namespace metrale::grammar
