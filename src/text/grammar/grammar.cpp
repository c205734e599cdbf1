#include "text/grammar/grammar.h"

#include <fmt/format.h>

#include <iterator>

#include "core/error.h"

namespace metrale::grammar {

ByteSet ByteSet::of_chars(std::string_view chars) {
  ByteSet set;
  for (char c : chars) set.add(static_cast<uint8_t>(c));
  return set;
}

ExprId Grammar::add(ExprNode node) {
  nodes_.push_back(std::move(node));
  return static_cast<ExprId>(nodes_.size() - 1);
}

ExprId Grammar::empty() {
  return add(ExprNode{});
}

ExprId Grammar::bytes(const ByteSet& set) {
  ExprNode node;
  node.kind = ExprKind::kBytes;
  node.bytes = set;
  return add(std::move(node));
}

ExprId Grammar::literal(std::string_view text) {
  if (text.empty()) return empty();
  if (text.size() == 1) return byte(static_cast<uint8_t>(text[0]));
  std::vector<ExprId> bytes_of;
  bytes_of.reserve(text.size());
  for (char c : text) bytes_of.push_back(byte(static_cast<uint8_t>(c)));
  return seq(std::move(bytes_of));
}

ExprId Grammar::seq(std::vector<ExprId> children) {
  if (children.empty()) return empty();
  if (children.size() == 1) return children[0];
  ExprNode node;
  node.kind = ExprKind::kSeq;
  node.children = std::move(children);
  return add(std::move(node));
}

ExprId Grammar::alt(std::vector<ExprId> children) {
  METRALE_CHECK(!children.empty(), "an alternative needs at least one branch");
  if (children.size() == 1) return children[0];
  ExprNode node;
  node.kind = ExprKind::kAlt;
  node.children = std::move(children);
  return add(std::move(node));
}

ExprId Grammar::repeat(ExprId child, int32_t min, int32_t max) {
  METRALE_CHECK(min >= 0 && (max == -1 || max >= min), "bad repetition bounds {}..{}", min, max);
  if (min == 1 && max == 1) return child;
  if (max == 0) return empty();
  ExprNode node;
  node.kind = ExprKind::kRepeat;
  node.children = {child};
  node.min = min;
  node.max = max;
  return add(std::move(node));
}

ExprId Grammar::ref(RuleId rule) {
  METRALE_CHECK(rule >= 0 && rule < num_rules(), "reference to an undeclared rule {}", rule);
  ExprNode node;
  node.kind = ExprKind::kRef;
  node.rule = rule;
  return add(std::move(node));
}

ExprId Grammar::graph(int32_t num_nodes, std::vector<GraphEdge> edges, std::vector<int32_t> finals) {
  METRALE_CHECK(num_nodes > 0, "a graph needs a start node");
  for (const GraphEdge& edge : edges) {
    METRALE_CHECK(edge.from >= 0 && edge.from < num_nodes && edge.to >= 0 && edge.to < num_nodes,
                  "graph edge out of range");
  }
  ExprNode node;
  node.kind = ExprKind::kGraph;
  node.num_nodes = num_nodes;
  node.edges = std::move(edges);
  node.finals = std::move(finals);
  return add(std::move(node));
}

RuleId Grammar::add_rule(std::string name) {
  rules_.push_back(Rule{std::move(name), -1});
  return static_cast<RuleId>(rules_.size() - 1);
}

void Grammar::set_body(RuleId rule, ExprId body) {
  METRALE_CHECK(rule >= 0 && rule < num_rules(), "no rule {}", rule);
  rules_[static_cast<size_t>(rule)].body = body;
}

namespace {

void append_shown(std::string& out, int c) {
  if (c >= 0x21 && c < 0x7f && c != '\\' && c != ']' && c != '-') {
    out.push_back(static_cast<char>(c));
  } else {
    fmt::format_to(std::back_inserter(out), "\\x{:02x}", c);
  }
}

std::string byte_set_string(const ByteSet& set) {
  std::string out = "[";
  for (int b = 0; b < 256; ++b) {
    if (!set.has(static_cast<uint8_t>(b))) continue;
    int end = b;
    while (end + 1 < 256 && set.has(static_cast<uint8_t>(end + 1))) ++end;
    append_shown(out, b);
    if (end > b) {
      out.push_back('-');
      append_shown(out, end);
    }
    b = end;
  }
  out.push_back(']');
  return out;
}

void print(const Grammar& grammar, ExprId id, std::string& out, int depth) {
  if (depth > 64) {
    out += "...";
    return;
  }
  const ExprNode& node = grammar.node(id);
  switch (node.kind) {
    case ExprKind::kEmpty:
      out += "\"\"";
      return;
    case ExprKind::kBytes:
      out += byte_set_string(node.bytes);
      return;
    case ExprKind::kRef:
      out += grammar.rule_name(node.rule);
      return;
    case ExprKind::kSeq:
    case ExprKind::kAlt:
      out += "(";
      for (size_t i = 0; i < node.children.size(); ++i) {
        if (i > 0) out += node.kind == ExprKind::kSeq ? " " : " | ";
        print(grammar, node.children[i], out, depth + 1);
      }
      out += ")";
      return;
    case ExprKind::kRepeat:
      print(grammar, node.children[0], out, depth + 1);
      out += node.max == -1 ? fmt::format("{{{},}}", node.min) : fmt::format("{{{},{}}}", node.min, node.max);
      return;
    case ExprKind::kGraph:
      out += fmt::format("graph<{} nodes>(", node.num_nodes);
      for (const GraphEdge& edge : node.edges) {
        out += fmt::format(" {}->{}:", edge.from, edge.to);
        if (edge.label < 0) {
          out += "eps";
        } else {
          print(grammar, edge.label, out, depth + 1);
        }
      }
      out += ")";
      return;
  }
}

}  // namespace

std::string Grammar::to_string() const {
  std::string out;
  for (RuleId rule = 0; rule < num_rules(); ++rule) {
    out += rule_name(rule) + (rule == root_ ? " (root)" : "") + " ::= ";
    if (rule_body(rule) >= 0) print(*this, rule_body(rule), out, 0);
    out += "\n";
  }
  return out;
}

}  // namespace metrale::grammar
