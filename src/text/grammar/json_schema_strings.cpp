// The string parts of JsonSchemaCompiler: JSON strings (unconstrained, constrained, object keys
// other than declared names) and the raw strings of the XML-like tool-call formats.
#include <algorithm>
#include <cmath>
#include <optional>

#include "core/error.h"
#include "text/grammar/json_schema.h"
#include "text/grammar/json_schema_util.h"
#include "text/grammar/pattern.h"
#include "text/tool_calls/argument_types.h"

namespace metrale::grammar {
namespace {

using Json = nlohmann::ordered_json;

using detail::count_member;
using detail::where;

}  // namespace

ExprId JsonSchemaCompiler::quoted_string() {
  Grammar& g = grammar_;
  if (options_.forbidden_in_strings.empty()) {
    return g.seq({g.byte('"'), g.star(encoded_char(g, CharSet::all(), StringEncoding::kJson)), g.byte('"')});
  }
  // The avoiding automaton has tens of states that accept almost every token: one shared rule keeps
  // their masks computed once instead of once per string of the schemas. The closing quote belongs
  // to the rule, so the rule ends only there (the tokens that run on past it are few).
  if (string_rule_ < 0) {
    const std::vector<std::string_view> forbidden(options_.forbidden_in_strings.begin(),
                                                  options_.forbidden_in_strings.end());
    string_rule_ = g.add_rule("string");
    g.set_body(string_rule_, g.seq({g.byte('"'), text_avoiding(g, forbidden, StringEncoding::kJson), g.byte('"')}));
  }
  return g.ref(string_rule_);
}

ExprId JsonSchemaCompiler::key_not_in(const std::vector<std::string>& names) {
  Grammar& g = grammar_;
  const ExprId json_char = encoded_char(g, constrained_chars(), StringEncoding::kJson);
  // Names that JSON writes as they are (printable ASCII, no quote or backslash) are excluded byte by
  // byte through a trie; others are not excluded.
  std::vector<std::string> plain;
  for (const std::string& name : names) {
    if (std::all_of(name.begin(), name.end(), [](char c) { return c >= 0x20 && c < 0x7f && c != '"' && c != '\\'; })) {
      plain.push_back(name);
    }
  }
  if (plain.empty()) return quoted_string();
  // Trie nodes 0..n-1 (0: nothing after the quote), then `free` (no name can match any more) and `end`.
  struct TrieNode {
    std::vector<std::pair<uint8_t, int32_t>> children;
    bool terminal = false;
  };
  std::vector<TrieNode> trie(1);
  for (const std::string& name : plain) {
    int32_t at = 0;
    for (char c : name) {
      auto& children = trie[static_cast<size_t>(at)].children;
      const auto it = std::find_if(children.begin(), children.end(),
                                   [&](const auto& e) { return e.first == static_cast<uint8_t>(c); });
      if (it != children.end()) {
        at = it->second;
      } else {
        trie.emplace_back();
        const auto child = static_cast<int32_t>(trie.size() - 1);
        trie[static_cast<size_t>(at)].children.emplace_back(static_cast<uint8_t>(c), child);
        at = child;
      }
    }
    trie[static_cast<size_t>(at)].terminal = true;
  }
  const auto n = static_cast<int32_t>(trie.size());
  const int32_t start = n;
  const int32_t free_node = n + 1;
  const int32_t end = n + 2;
  std::vector<GraphEdge> edges;
  edges.push_back(GraphEdge{start, 0, g.byte('"')});
  const ExprId escape = g.alt(
      {g.seq({g.byte('\\'), g.bytes(ByteSet::of_chars("\"\\/bfnrt"))}), g.seq({g.literal("\\u"), g.repeat(g.bytes([] {
                                                                                 ByteSet hex = ByteSet::range('0', '9');
                                                                                 hex.add(ByteSet::range('a', 'f'));
                                                                                 hex.add(ByteSet::range('A', 'F'));
                                                                                 return hex;
                                                                               }()),
                                                                                                          4, 4)})});
  const ExprId multibyte = utf8_chars(g, CharSet::range(0x80, CharSet::kMax));
  for (int32_t t = 0; t < n; ++t) {
    ByteSet other = ByteSet::range(0x20, 0x7e);
    other.remove('"');
    other.remove('\\');
    if (!options_.forbidden_in_strings.empty()) other.remove('<');
    for (const auto& [byte, child] : trie[static_cast<size_t>(t)].children) {
      edges.push_back(GraphEdge{t, child, g.byte(byte)});
      other.remove(byte);
    }
    if (!other.empty()) edges.push_back(GraphEdge{t, free_node, g.bytes(other)});
    edges.push_back(GraphEdge{t, free_node, escape});
    edges.push_back(GraphEdge{t, free_node, multibyte});
    if (!trie[static_cast<size_t>(t)].terminal) edges.push_back(GraphEdge{t, end, g.byte('"')});
  }
  edges.push_back(GraphEdge{free_node, free_node, json_char});
  edges.push_back(GraphEdge{free_node, end, g.byte('"')});
  // The start node must be node 0 of a graph: renumber by putting `start` first.
  for (GraphEdge& edge : edges) {
    const auto renumber = [&](int32_t node) { return node == start ? 0 : node < start ? node + 1 : node; };
    edge.from = renumber(edge.from);
    edge.to = renumber(edge.to);
  }
  return g.graph(n + 3, std::move(edges), {end});
}

ExprId JsonSchemaCompiler::string(const Json& schema, const std::string& path, StringEncoding encoding) {
  Grammar& g = grammar_;
  const CharSet allowed =
      encoding == StringEncoding::kRaw ? CharSet::all().minus(CharSet::of('<')) : constrained_chars();
  const auto min = count_member(schema, "minLength", path, options_.max_repetition);
  const auto max = count_member(schema, "maxLength", path, options_.max_repetition);
  const auto pattern = schema.find("pattern");
  const auto format = schema.find("format");
  ExprId content = -1;
  if (format != schema.end() || pattern != schema.end()) {
    if (min || max) {
      raise(ErrorCode::kUnsupported, "'{}' together with minLength/maxLength at {}",
            format != schema.end() ? "format" : "pattern", where(path));
    }
    if (format != schema.end() && pattern != schema.end()) {
      raise(ErrorCode::kUnsupported, "'format' together with 'pattern' at {}", where(path));
    }
    std::string regex;
    if (format != schema.end()) {
      if (!format->is_string()) raise(ErrorCode::kInvalidArgument, "'format' at {} must be a string", where(path));
      regex = std::string(format_pattern(format->get<std::string>()));
      if (regex.empty())
        raise(ErrorCode::kUnsupported, "unsupported string format '{}' at {}", format->get<std::string>(), where(path));
    } else {
      if (!pattern->is_string()) raise(ErrorCode::kInvalidArgument, "'pattern' at {} must be a string", where(path));
      regex = pattern->get<std::string>();
    }
    try {
      content = pattern_expr(g, regex, encoding, allowed);
    } catch (const Error& e) {
      rethrow_with_context(e, "at {}", where(path));
    }
  } else {
    if (min && max && *max < *min) raise(ErrorCode::kUnsupported, "maxLength < minLength at {}", where(path));
    if (!min && !max && encoding == StringEncoding::kJson) return quoted_string();
    content = g.repeat(encoded_char(g, allowed, encoding), static_cast<int32_t>(min.value_or(0)),
                       max ? static_cast<int32_t>(*max) : -1);
  }
  if (encoding == StringEncoding::kRaw) return content;
  return g.seq({g.byte('"'), content, g.byte('"')});
}

bool JsonSchemaCompiler::is_string_only(const Json& schema) {
  return text::tool_calls::schema_types(schema, root_ != nullptr ? *root_ : schema) == text::tool_calls::kTypeString;
}

ExprId JsonSchemaCompiler::raw_string(const Json& schema, const std::string& path,
                                      const std::vector<std::string_view>& forbidden, std::string_view suffix) {
  Grammar& g = grammar_;
  const Json* at = &schema;
  for (int hops = 0; at->is_object() && at->contains("$ref") && (*at)["$ref"].is_string(); ++hops) {
    if (hops > 32) raise(ErrorCode::kUnsupported, "a $ref chain that does not end at {}", where(path));
    at = &resolve((*at)["$ref"].get<std::string>(), path);
  }
  if (!at->is_object()) return raw_text(forbidden, suffix);
  check_keywords(*at, path);
  const auto literal = [&](const Json& value) {
    if (!value.is_string())
      raise(ErrorCode::kUnsupported, "a non-string enum value for a string parameter at {}", where(path));
    const std::string text = value.get<std::string>();
    for (std::string_view marker : forbidden) {
      if (text.find(marker) != std::string::npos) {
        raise(ErrorCode::kUnsupported, "an enum value at {} contains the markup '{}'", where(path), marker);
      }
    }
    return g.literal(text + std::string(suffix));
  };
  if (at->contains("const")) return literal((*at)["const"]);
  if (const auto values = at->find("enum"); values != at->end() && values->is_array() && !values->empty()) {
    std::vector<ExprId> branches;
    for (const Json& value : *values) branches.push_back(literal(value));
    return g.alt(std::move(branches));
  }
  if (at->contains("pattern") || at->contains("format") || at->contains("minLength") || at->contains("maxLength")) {
    return g.seq({string(*at, path, StringEncoding::kRaw), g.literal(suffix)});
  }
  return raw_text(forbidden, suffix);
}

ExprId JsonSchemaCompiler::raw_text(const std::vector<std::string_view>& forbidden, std::string_view suffix) {
  std::string key(suffix);
  for (std::string_view marker : forbidden) key.append(1, '\0').append(marker);
  auto it = raw_text_rules_.find(key);
  if (it == raw_text_rules_.end()) {
    // Shared by every parameter, and ending with the closing markup, like quoted_string().
    const RuleId rule = grammar_.add_rule("raw_text");
    grammar_.set_body(
        rule, grammar_.seq({text_avoiding(grammar_, forbidden, StringEncoding::kRaw), grammar_.literal(suffix)}));
    it = raw_text_rules_.emplace(key, rule).first;
  }
  return grammar_.ref(it->second);
}

}  // namespace metrale::grammar
