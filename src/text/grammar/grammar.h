// The grammar IR of constrained decoding: a set of rules, each a regular expression over bytes whose
// atoms may also be references to rules (so the language is context-free: JSON nests). Grammars are
// built by the JSON-schema and tool-call compilers (json_schema.h, tool_call_grammar.h) and
// compiled per tokenizer into a CompiledGrammar (compiled_grammar.h).
//
// Expressions live in the Grammar's pool and are named by ExprId; a node may be used in several
// places (the compiler instantiates it once per use). kGraph is an explicit automaton whose edges
// are labelled with expressions: it expresses things like "the declared properties in order, each
// optional, with commas only between those present" in linear size.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace metrale::grammar {

class ByteSet {
 public:
  ByteSet() = default;
  static ByteSet of(uint8_t byte) {
    ByteSet set;
    set.add(byte);
    return set;
  }
  static ByteSet range(uint8_t lo, uint8_t hi) {
    ByteSet set;
    set.add_range(lo, hi);
    return set;
  }
  static ByteSet of_chars(std::string_view chars);
  static ByteSet all() { return range(0, 255); }

  void add(uint8_t byte) { words_[byte >> 6] |= uint64_t{1} << (byte & 63); }
  void add_range(uint8_t lo, uint8_t hi) {
    for (int b = lo; b <= hi; ++b) add(static_cast<uint8_t>(b));
  }
  void add(const ByteSet& other) {
    for (int i = 0; i < 4; ++i) words_[i] |= other.words_[i];
  }
  void remove(uint8_t byte) { words_[byte >> 6] &= ~(uint64_t{1} << (byte & 63)); }
  bool has(uint8_t byte) const { return (words_[byte >> 6] >> (byte & 63)) & 1; }
  bool empty() const { return (words_[0] | words_[1] | words_[2] | words_[3]) == 0; }
  ByteSet complement() const {
    ByteSet set;
    for (int i = 0; i < 4; ++i) set.words_[i] = ~words_[i];
    return set;
  }
  ByteSet intersect(const ByteSet& other) const {
    ByteSet set;
    for (int i = 0; i < 4; ++i) set.words_[i] = words_[i] & other.words_[i];
    return set;
  }
  const std::array<uint64_t, 4>& words() const { return words_; }
  bool operator==(const ByteSet&) const = default;

 private:
  std::array<uint64_t, 4> words_{};
};

using ExprId = int32_t;
using RuleId = int32_t;

enum class ExprKind : uint8_t {
  kEmpty,   // the empty string
  kBytes,   // one byte of a set
  kSeq,     // children in order
  kAlt,     // one of the children
  kRepeat,  // the child min..max times (max -1: unbounded)
  kRef,     // the language of a rule
  kGraph,   // an automaton with expression-labelled edges
};

struct GraphEdge {
  int32_t from = 0;
  int32_t to = 0;
  ExprId label = -1;  // -1: an empty (epsilon) edge
};

struct ExprNode {
  ExprKind kind = ExprKind::kEmpty;
  ByteSet bytes;                 // kBytes
  std::vector<ExprId> children;  // kSeq, kAlt, kRepeat (one child)
  int32_t min = 0;               // kRepeat
  int32_t max = 0;               // kRepeat; -1: unbounded
  RuleId rule = -1;              // kRef
  int32_t num_nodes = 0;         // kGraph: nodes 0..num_nodes-1, node 0 the start
  std::vector<GraphEdge> edges;  // kGraph
  std::vector<int32_t> finals;   // kGraph: the accepting nodes
};

class Grammar {
 public:
  Grammar() = default;

  ExprId empty();
  ExprId bytes(const ByteSet& set);
  ExprId byte(uint8_t b) { return bytes(ByteSet::of(b)); }
  ExprId literal(std::string_view text);
  ExprId seq(std::vector<ExprId> children);
  ExprId alt(std::vector<ExprId> children);
  ExprId repeat(ExprId child, int32_t min, int32_t max);
  ExprId optional(ExprId child) { return repeat(child, 0, 1); }
  ExprId star(ExprId child) { return repeat(child, 0, -1); }
  ExprId plus(ExprId child) { return repeat(child, 1, -1); }
  ExprId ref(RuleId rule);
  ExprId graph(int32_t num_nodes, std::vector<GraphEdge> edges, std::vector<int32_t> finals);

  // A rule is declared first (so it can be referenced, recursively too) and given its body later.
  RuleId add_rule(std::string name);
  void set_body(RuleId rule, ExprId body);
  void set_root(RuleId rule) { root_ = rule; }

  // Special tokens (by their text) that the grammar may produce as literals, such as DeepSeek's
  // tool-call markers; every other special token is never allowed.
  void allow_special_token(std::string text) { allowed_special_tokens_.push_back(std::move(text)); }

  const ExprNode& node(ExprId id) const { return nodes_.at(static_cast<size_t>(id)); }
  size_t num_exprs() const { return nodes_.size(); }
  int32_t num_rules() const { return static_cast<int32_t>(rules_.size()); }
  const std::string& rule_name(RuleId rule) const { return rules_.at(static_cast<size_t>(rule)).name; }
  ExprId rule_body(RuleId rule) const { return rules_.at(static_cast<size_t>(rule)).body; }
  RuleId root() const { return root_; }
  const std::vector<std::string>& allowed_special_tokens() const { return allowed_special_tokens_; }

  // An EBNF-like listing of the rules, for debugging and error messages.
  std::string to_string() const;

 private:
  struct Rule {
    std::string name;
    ExprId body = -1;
  };
  ExprId add(ExprNode node);

  std::vector<ExprNode> nodes_;
  std::vector<Rule> rules_;
  RuleId root_ = -1;
  std::vector<std::string> allowed_special_tokens_;
};

}  // namespace metrale::grammar
