#include "text/grammar/json_schema.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <set>

#include "core/error.h"
#include "text/grammar/json_schema_util.h"
#include "text/grammar/number_ranges.h"
#include "text/grammar/pattern.h"
#include "text/tool_calls/argument_types.h"

namespace metrale::grammar {
namespace {

using detail::count_member;
using detail::where;

using Json = nlohmann::ordered_json;

// Keywords that describe but do not constrain (ignored), and those that constrain in ways this
// engine does not express (refused).
const std::set<std::string_view> kAnnotations = {
    "title",           "description",      "default",       "examples",      "example", "$schema",      "$id",
    "$comment",        "deprecated",       "readOnly",      "writeOnly",     "$defs",   "definitions",  "$anchor",
    "contentEncoding", "contentMediaType", "contentSchema", "discriminator", "xml",     "externalDocs", "strict"};
const std::set<std::string_view> kUnsupported = {"not",
                                                 "if",
                                                 "then",
                                                 "else",
                                                 "patternProperties",
                                                 "propertyNames",
                                                 "contains",
                                                 "minContains",
                                                 "maxContains",
                                                 "multipleOf",
                                                 "minProperties",
                                                 "maxProperties",
                                                 "dependentRequired",
                                                 "dependentSchemas",
                                                 "dependencies",
                                                 "unevaluatedProperties",
                                                 "unevaluatedItems",
                                                 "$dynamicRef",
                                                 "$recursiveRef",
                                                 "$dynamicAnchor",
                                                 "$recursiveAnchor"};
// Keywords this compiler reads (besides the combinators handled first).
const std::set<std::string_view> kValidation = {"type",
                                                "properties",
                                                "required",
                                                "additionalProperties",
                                                "items",
                                                "prefixItems",
                                                "additionalItems",
                                                "minItems",
                                                "maxItems",
                                                "minLength",
                                                "maxLength",
                                                "pattern",
                                                "format",
                                                "minimum",
                                                "maximum",
                                                "exclusiveMinimum",
                                                "exclusiveMaximum",
                                                "enum",
                                                "const",
                                                "nullable",
                                                "uniqueItems"};

constexpr int32_t kMaxNesting = 256;

std::string child_path(const std::string& path, std::string_view key) {
  return path + "/" + std::string(key);
}

bool is_annotation(std::string_view key) {
  return kAnnotations.contains(key) || key.starts_with("x-");
}

// The members of `schema` that constrain values.
Json validation_members(const Json& schema) {
  Json out = Json::object();
  for (const auto& [key, value] : schema.items()) {
    if (!is_annotation(key)) out[key] = value;
  }
  return out;
}

// `a` and `b` as one schema (allOf, or a combinator's siblings pushed into its branches). Keys set
// by both must agree, except required (united) and properties (merged by name).
Json merge(const Json& a, const Json& b, const std::string& path, std::string_view what) {
  if (a.is_boolean() || b.is_boolean()) {
    if (a == Json(false) || b == Json(false))
      raise(ErrorCode::kUnsupported, "a false schema in {} at {}", what, where(path));
    return a.is_boolean() ? b : a;
  }
  Json out = a;
  for (const auto& [key, value] : b.items()) {
    if (!out.contains(key) || out[key] == value || is_annotation(key)) {
      out[key] = value;
      continue;
    }
    if (key == "required" && value.is_array() && out[key].is_array()) {
      for (const Json& name : value) {
        if (std::find(out[key].begin(), out[key].end(), name) == out[key].end()) out[key].push_back(name);
      }
      continue;
    }
    if (key == "properties" && value.is_object() && out[key].is_object()) {
      for (const auto& [name, property] : value.items()) {
        if (out[key].contains(name) && out[key][name] != property) {
          raise(ErrorCode::kUnsupported, "{} at {} gives property '{}' two different schemas", what, where(path), name);
        }
        out[key][name] = property;
      }
      continue;
    }
    raise(ErrorCode::kUnsupported, "{} at {} sets '{}' twice with different values", what, where(path), key);
  }
  return out;
}

std::optional<double> number_member(const Json& schema, std::string_view key, const std::string& path) {
  const auto it = schema.find(key);
  if (it == schema.end()) return std::nullopt;
  if (!it->is_number()) raise(ErrorCode::kInvalidArgument, "'{}' at {} must be a number", key, where(path));
  return it->get<double>();
}

// A rough size of an expression once instantiated (capped), to decide what to share as a rule.
int64_t expr_size(const Grammar& g, ExprId id, int64_t cap) {
  const ExprNode& node = g.node(id);
  int64_t size = 1;
  switch (node.kind) {
    case ExprKind::kSeq:
    case ExprKind::kAlt:
      for (ExprId child : node.children) {
        size += expr_size(g, child, cap - size);
        if (size >= cap) return cap;
      }
      return size;
    case ExprKind::kRepeat: {
      const int64_t child = expr_size(g, node.children[0], cap);
      const int64_t copies = node.max == -1 ? node.min + 1 : node.max;
      return std::min(cap, size + child * std::max<int64_t>(copies, 1));
    }
    case ExprKind::kGraph:
      for (const GraphEdge& edge : node.edges) {
        if (edge.label >= 0) size += expr_size(g, edge.label, cap - size);
        if (size >= cap) return cap;
      }
      return size;
    default:
      return size;
  }
}

}  // namespace

namespace detail {

std::string where(const std::string& path) {
  return path.empty() ? "the root" : path;
}

std::optional<int64_t> count_member(const Json& schema, std::string_view key, const std::string& path, int32_t limit) {
  const auto it = schema.find(key);
  if (it == schema.end()) return std::nullopt;
  if (!it->is_number_integer() && !it->is_number_unsigned() &&
      !(it->is_number_float() && std::floor(it->get<double>()) == it->get<double>())) {
    raise(ErrorCode::kInvalidArgument, "'{}' at {} must be a non-negative integer", key, where(path));
  }
  const double value = it->get<double>();
  if (value < 0) raise(ErrorCode::kInvalidArgument, "'{}' at {} must be a non-negative integer", key, where(path));
  if (value > limit)
    raise(ErrorCode::kUnsupported, "'{}' at {} is above {}, the largest count supported", key, where(path), limit);
  return static_cast<int64_t>(value);
}

}  // namespace detail

JsonSchemaCompiler::JsonSchemaCompiler(Grammar& grammar, JsonSchemaOptions options)
    : grammar_(grammar), options_(options) {}

void JsonSchemaCompiler::set_root(const Json& root) {
  root_ = &root;
  ref_rules_.clear();
  expanding_.clear();
}

ExprId JsonSchemaCompiler::whitespace() {
  if (!options_.any_whitespace) return grammar_.empty();
  return grammar_.repeat(grammar_.bytes(ByteSet::of_chars(" \t\n\r")), 0, options_.max_whitespace);
}

ExprId JsonSchemaCompiler::separated(ExprId item) {
  return grammar_.seq({whitespace(), grammar_.byte(','), whitespace(), item});
}

CharSet JsonSchemaCompiler::constrained_chars() const {
  return options_.forbidden_in_strings.empty() ? CharSet::all() : CharSet::all().minus(CharSet::of('<'));
}

ExprId JsonSchemaCompiler::literal_value(const Json& value) {
  return grammar_.literal(text::tool_calls::dump_compact(value));
}

ExprId JsonSchemaCompiler::any_value() {
  if (any_rule_ >= 0) return grammar_.ref(any_rule_);
  any_rule_ = grammar_.add_rule("json_value");
  Grammar& g = grammar_;
  const ExprId value = g.ref(any_rule_);
  const ExprId string_expr = quoted_string();
  const ExprId member = g.seq({string_expr, whitespace(), g.byte(':'), whitespace(), value});
  const ExprId object_expr = g.seq(
      {g.byte('{'), whitespace(), g.optional(g.seq({member, g.star(separated(member))})), whitespace(), g.byte('}')});
  const ExprId array_expr = g.seq(
      {g.byte('['), whitespace(), g.optional(g.seq({value, g.star(separated(value))})), whitespace(), g.byte(']')});
  g.set_body(any_rule_, g.alt({object_expr, array_expr, string_expr, number(Json::object(), ""), g.literal("true"),
                               g.literal("false"), g.literal("null")}));
  return g.ref(any_rule_);
}

ExprId JsonSchemaCompiler::any_object() {
  Grammar& g = grammar_;
  const ExprId string_expr = quoted_string();
  const ExprId member = g.seq({string_expr, whitespace(), g.byte(':'), whitespace(), any_value()});
  return g.seq(
      {g.byte('{'), whitespace(), g.optional(g.seq({member, g.star(separated(member))})), whitespace(), g.byte('}')});
}

void JsonSchemaCompiler::check_keywords(const Json& schema, const std::string& path) const {
  for (const auto& [key, value] : schema.items()) {
    if (kUnsupported.contains(key))
      raise(ErrorCode::kUnsupported, "unsupported JSON Schema keyword '{}' at {}", key, where(path));
    if (key == "uniqueItems" && value == Json(true)) {
      raise(ErrorCode::kUnsupported, "unsupported JSON Schema keyword 'uniqueItems' (true) at {}", where(path));
    }
  }
}

const Json& JsonSchemaCompiler::resolve(const std::string& ref, const std::string& path) const {
  METRALE_CHECK(root_ != nullptr, "set_root before compiling schemas");
  if (ref.empty() || ref[0] != '#')
    raise(ErrorCode::kUnsupported, "remote $ref '{}' at {} (only \"#...\" references)", ref, where(path));
  const Json* at = root_;
  size_t pos = 1;
  if (pos < ref.size() && ref[pos] != '/')
    raise(ErrorCode::kUnsupported, "$ref '{}' at {}: anchors are not supported", ref, where(path));
  while (pos < ref.size()) {
    const size_t next = std::min(ref.find('/', pos + 1), ref.size());
    std::string token = ref.substr(pos + 1, next - pos - 1);
    for (size_t i = 0; (i = token.find('~', i)) != std::string::npos; ++i) {
      if (i + 1 < token.size() && token[i + 1] == '1')
        token.replace(i, 2, "/");
      else if (i + 1 < token.size() && token[i + 1] == '0')
        token.replace(i, 2, "~");
    }
    if (at->is_object() && at->contains(token)) {
      at = &(*at)[token];
    } else if (at->is_array() && !token.empty() && token.size() <= 9 &&
               std::all_of(token.begin(), token.end(), [](char c) { return c >= '0' && c <= '9'; }) &&
               std::stoul(token) < at->size()) {
      at = &(*at)[std::stoul(token)];
    } else {
      raise(ErrorCode::kInvalidArgument, "$ref '{}' at {} does not resolve", ref, where(path));
    }
    pos = next;
  }
  return *at;
}

ExprId JsonSchemaCompiler::reference(const std::string& ref, const std::string& path) {
  if (const auto it = ref_rules_.find(ref); it != ref_rules_.end()) return grammar_.ref(it->second);
  const Json& target = resolve(ref, path);
  if (std::find(expanding_.begin(), expanding_.end(), ref) != expanding_.end()) {
    // Recursion: the definition becomes a rule that refers to itself.
    const RuleId rule = grammar_.add_rule("ref " + ref);
    ref_rules_.emplace(ref, rule);
    grammar_.set_body(rule, value_at(target, ref));
    return grammar_.ref(rule);
  }
  expanding_.push_back(ref);
  const ExprId expr = value_at(target, ref);
  expanding_.pop_back();
  return expr;
}

ExprId JsonSchemaCompiler::value(const Json& schema, const std::string& path) {
  if (root_ == nullptr) set_root(schema);
  return value_at(schema, path);
}

ExprId JsonSchemaCompiler::value_at(const Json& schema, const std::string& path) {
  struct Depth {
    int32_t& depth;
    explicit Depth(int32_t& d) : depth(d) { ++depth; }
    ~Depth() { --depth; }
  } nesting(depth_);
  if (depth_ > kMaxNesting) raise(ErrorCode::kUnsupported, "the schema nests too deeply at {}", where(path));
  if (schema.is_boolean()) {
    if (schema.get<bool>()) return any_value();
    raise(ErrorCode::kUnsupported, "a false schema at {} admits no value", where(path));
  }
  if (!schema.is_object())
    raise(ErrorCode::kInvalidArgument, "the schema at {} must be an object or a boolean", where(path));
  check_keywords(schema, path);
  Grammar& g = grammar_;
  const Json members = validation_members(schema);
  if (const auto ref = schema.find("$ref"); ref != schema.end()) {
    if (!ref->is_string()) raise(ErrorCode::kInvalidArgument, "$ref at {} must be a string", where(path));
    if (members.size() == 1) return reference(ref->get<std::string>(), path);
    // Keywords beside $ref: the referenced schema and they both apply (non-recursive use only).
    Json rest = members;
    rest.erase("$ref");
    return value_at(merge(resolve(ref->get<std::string>(), path), rest, path, "$ref with sibling keywords"), path);
  }
  if (const auto constant = schema.find("const"); constant != schema.end()) return literal_value(*constant);
  if (const auto values = schema.find("enum"); values != schema.end()) {
    if (!values->is_array() || values->empty())
      raise(ErrorCode::kInvalidArgument, "'enum' at {} must be a non-empty list", where(path));
    std::vector<ExprId> branches;
    for (const Json& value : *values) branches.push_back(literal_value(value));
    return g.alt(std::move(branches));
  }
  if (const ExprId combined = combination(schema, members, path); combined >= 0) return combined;
  std::vector<ExprId> branches;
  for (const std::string& type : types_of(schema, path)) branches.push_back(typed(type, schema, path));
  if (branches.empty()) return any_value();
  return g.alt(std::move(branches));
}

// allOf, anyOf, oneOf; -1 when the schema has none. allOf merges first (what remains may still be a
// choice); the keywords beside a choice go into each branch.
ExprId JsonSchemaCompiler::combination(const Json& schema, const Json& members, const std::string& path) {
  if (const auto all = schema.find("allOf"); all != schema.end()) {
    if (!all->is_array() || all->empty()) {
      raise(ErrorCode::kInvalidArgument, "'allOf' at {} must be a non-empty list", where(path));
    }
    Json merged = members;
    merged.erase("allOf");
    for (size_t i = 0; i < all->size(); ++i) {
      const std::string part_path = child_path(path, "allOf") + "/" + std::to_string(i);
      merged = merge(merged, inline_ref((*all)[i], part_path), part_path, "allOf");
    }
    return value_at(merged, path);
  }
  for (const char* combinator : {"anyOf", "oneOf"}) {
    const auto branches = schema.find(combinator);
    if (branches == schema.end()) continue;
    if (!branches->is_array() || branches->empty()) {
      raise(ErrorCode::kInvalidArgument, "'{}' at {} must be a non-empty list", combinator, where(path));
    }
    Json siblings = members;
    siblings.erase(combinator);
    std::vector<ExprId> alternatives;
    for (size_t i = 0; i < branches->size(); ++i) {
      const std::string branch_path = child_path(path, combinator) + "/" + std::to_string(i);
      const Json& branch = (*branches)[i];
      alternatives.push_back(
          siblings.empty()
              ? value_at(branch, branch_path)
              : value_at(merge(inline_ref(branch, branch_path), siblings, branch_path, combinator), branch_path));
    }
    return grammar_.alt(std::move(alternatives));
  }
  return -1;
}

// A schema that is a $ref (with keywords beside it) as the referenced schema with those keywords
// merged in, for merging with other schemas (non-recursive use only).
Json JsonSchemaCompiler::inline_ref(const Json& schema, const std::string& path) const {
  if (!schema.is_object() || !schema.contains("$ref") || !schema["$ref"].is_string()) return schema;
  Json rest = validation_members(schema);
  rest.erase("$ref");
  return merge(resolve(schema["$ref"].get<std::string>(), path), rest, path, "$ref");
}

// The types `schema` names, or those its keywords imply; empty: any value.
std::vector<std::string> JsonSchemaCompiler::types_of(const Json& schema, const std::string& path) const {
  std::vector<std::string> types;
  if (const auto type = schema.find("type"); type != schema.end()) {
    if (type->is_string()) {
      types.push_back(type->get<std::string>());
    } else if (type->is_array() && !type->empty()) {
      for (const Json& entry : *type) {
        if (!entry.is_string()) raise(ErrorCode::kInvalidArgument, "'type' at {} must name types", where(path));
        types.push_back(entry.get<std::string>());
      }
    } else {
      raise(ErrorCode::kInvalidArgument, "'type' at {} must be a string or a non-empty list", where(path));
    }
  } else {
    const auto has_any = [&](std::initializer_list<const char*> keys) {
      return std::any_of(keys.begin(), keys.end(), [&](const char* key) { return schema.contains(key); });
    };
    if (has_any({"properties", "required", "additionalProperties"})) types.emplace_back("object");
    if (has_any({"items", "prefixItems", "additionalItems", "minItems", "maxItems"})) types.emplace_back("array");
    if (has_any({"minLength", "maxLength", "pattern", "format"})) types.emplace_back("string");
    if (has_any({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})) types.emplace_back("number");
    if (types.empty()) return types;
  }
  if (schema.contains("nullable") && schema["nullable"] == Json(true) &&
      std::find(types.begin(), types.end(), "null") == types.end()) {
    types.emplace_back("null");
  }
  return types;
}

ExprId JsonSchemaCompiler::typed(const std::string& type, const Json& schema, const std::string& path) {
  Grammar& g = grammar_;
  if (type == "object") return object(schema, path);
  if (type == "array") return array(schema, path);
  if (type == "string") return string(schema, path, StringEncoding::kJson);
  if (type == "integer") return integer(schema, path);
  if (type == "number") return number(schema, path);
  if (type == "boolean") return g.alt({g.literal("true"), g.literal("false")});
  if (type == "null") return g.literal("null");
  raise(ErrorCode::kInvalidArgument, "unknown type '{}' at {}", type, where(path));
}

ExprId JsonSchemaCompiler::object(const Json& schema, const std::string& path) {
  Grammar& g = grammar_;
  std::vector<std::pair<std::string, const Json*>> properties;
  static const Json kAnything = true;
  if (const auto declared = schema.find("properties"); declared != schema.end()) {
    if (!declared->is_object()) raise(ErrorCode::kInvalidArgument, "'properties' at {} must be an object", where(path));
    for (const auto& [name, property] : declared->items()) properties.emplace_back(name, &property);
  }
  const bool declares_properties = !properties.empty();
  std::set<std::string> required;
  if (const auto names = schema.find("required"); names != schema.end()) {
    if (!names->is_array()) raise(ErrorCode::kInvalidArgument, "'required' at {} must be a list", where(path));
    for (const Json& name : *names) {
      if (!name.is_string()) raise(ErrorCode::kInvalidArgument, "'required' at {} must list names", where(path));
      required.insert(name.get<std::string>());
      if (std::none_of(properties.begin(), properties.end(),
                       [&](const auto& p) { return p.first == name.get<std::string>(); })) {
        properties.emplace_back(name.get<std::string>(), &kAnything);
      }
    }
  }
  // What extra keys may hold: nullptr when none are allowed.
  const Json* additional = nullptr;
  if (const auto extra = schema.find("additionalProperties"); extra != schema.end()) {
    if (!extra->is_boolean() && !extra->is_object()) {
      raise(ErrorCode::kInvalidArgument, "'additionalProperties' at {} must be a boolean or a schema", where(path));
    }
    if (*extra != Json(false)) additional = &*extra;
  } else if (!(options_.strict && declares_properties)) {
    additional = &kAnything;
  }
  // Nodes: A_i (nothing written yet, before property i), B_i (something written), X_i (about to
  // write property i), then Y (about to write an extra member) and C (after one).
  const auto n = static_cast<int32_t>(properties.size());
  const auto a = [](int32_t i) { return i; };
  const auto b = [n](int32_t i) { return n + 1 + i; };
  const auto x = [n](int32_t i) { return 2 * n + 2 + i; };
  const int32_t y = 3 * n + 2;
  const int32_t c = 3 * n + 3;
  std::vector<GraphEdge> edges;
  const ExprId separator = g.seq({whitespace(), g.byte(','), whitespace()});
  for (int32_t i = 0; i < n; ++i) {
    const auto& [name, property] = properties[static_cast<size_t>(i)];
    const ExprId member = g.seq({g.literal(text::tool_calls::dump_compact(Json(name))), whitespace(), g.byte(':'),
                                 whitespace(), value_at(*property, child_path(child_path(path, "properties"), name))});
    edges.push_back(GraphEdge{a(i), x(i), -1});
    edges.push_back(GraphEdge{b(i), x(i), separator});
    edges.push_back(GraphEdge{x(i), b(i + 1), member});
    if (!required.contains(name)) {
      edges.push_back(GraphEdge{a(i), a(i + 1), -1});
      edges.push_back(GraphEdge{b(i), b(i + 1), -1});
    }
  }
  std::vector<int32_t> finals{a(n), b(n)};
  if (additional != nullptr) {
    std::vector<std::string> names;
    for (const auto& property : properties) names.push_back(property.first);
    const ExprId member = g.seq({key_not_in(names), whitespace(), g.byte(':'), whitespace(),
                                 value_at(*additional, child_path(path, "additionalProperties"))});
    edges.push_back(GraphEdge{a(n), y, -1});
    edges.push_back(GraphEdge{b(n), y, separator});
    edges.push_back(GraphEdge{c, y, separator});
    edges.push_back(GraphEdge{y, c, member});
    finals.push_back(c);
  }
  const ExprId members = g.graph(3 * n + 4, std::move(edges), std::move(finals));
  return g.seq({g.byte('{'), whitespace(), members, whitespace(), g.byte('}')});
}

ExprId JsonSchemaCompiler::array(const Json& schema, const std::string& path) {
  Grammar& g = grammar_;
  static const Json kAnything = true;
  std::vector<const Json*> prefix;
  const Json* items = &kAnything;
  bool items_given = false;
  if (const auto tuple = schema.find("prefixItems"); tuple != schema.end()) {
    if (!tuple->is_array()) raise(ErrorCode::kInvalidArgument, "'prefixItems' at {} must be a list", where(path));
    for (const Json& item : *tuple) prefix.push_back(&item);
  }
  if (const auto given = schema.find("items"); given != schema.end()) {
    if (given->is_array()) {
      // Draft-07 tuples: items is the prefix, additionalItems the rest.
      for (const Json& item : *given) prefix.push_back(&item);
      const auto rest = schema.find("additionalItems");
      items = rest != schema.end() ? &*rest : &kAnything;
      items_given = rest != schema.end();
    } else {
      items = &*given;
      items_given = true;
    }
  }
  if (!prefix.empty() && !items_given && options_.strict) items = nullptr;
  if (items != nullptr && *items == Json(false)) items = nullptr;
  const auto k = static_cast<int64_t>(prefix.size());
  const int64_t min = count_member(schema, "minItems", path, options_.max_repetition).value_or(0);
  std::optional<int64_t> max = count_member(schema, "maxItems", path, options_.max_repetition);
  if (items == nullptr) max = std::min(max.value_or(k), k);
  if (max && *max < min)
    raise(ErrorCode::kUnsupported, "the array at {} can hold no allowed number of items", where(path));
  const auto element = [&](int64_t i) {
    const Json& item_schema = i < k ? *prefix[static_cast<size_t>(i)] : *items;
    const std::string item_path =
        i < k ? child_path(child_path(path, "prefixItems"), std::to_string(i)) : child_path(path, "items");
    return value_at(item_schema, item_path);
  };
  // The tail items' expression is instantiated once per counted position: share a large one as a rule.
  const int64_t chain = max ? *max : std::max(k, min);
  const int64_t tail_copies = std::max<int64_t>(chain - k, 0) + (max ? 0 : 1);
  ExprId tail = -1;
  if (items != nullptr && tail_copies > 0) {
    tail = element(k);
    if (tail_copies > 1 && expr_size(g, tail, 1 << 20) * tail_copies > 20000) {
      const RuleId rule = g.add_rule("items " + where(path));
      g.set_body(rule, tail);
      tail = g.ref(rule);
    }
  }
  // Nodes n_0..n_chain (after i elements), X_i (about to write element i), and the loop's X.
  const auto count = static_cast<int32_t>(chain);
  const auto node = [](int64_t i) { return static_cast<int32_t>(i); };
  const auto before = [count](int64_t i) { return count + 1 + static_cast<int32_t>(i); };
  int32_t num_nodes = 2 * count + 1;
  std::vector<GraphEdge> edges;
  const ExprId separator = g.seq({whitespace(), g.byte(','), whitespace()});
  for (int64_t i = 0; i < chain; ++i) {
    edges.push_back(GraphEdge{node(i), before(i), i == 0 ? -1 : separator});
    edges.push_back(GraphEdge{before(i), node(i + 1), i < k ? element(i) : tail});
  }
  std::vector<int32_t> finals;
  for (int64_t i = min; i <= chain; ++i) finals.push_back(node(i));
  if (!max) {
    const int32_t loop = num_nodes++;
    if (chain == 0) {
      const int32_t one = num_nodes++;
      edges.push_back(GraphEdge{node(0), loop, -1});
      edges.push_back(GraphEdge{loop, one, tail});
      edges.push_back(GraphEdge{one, loop, separator});
      finals.push_back(one);
    } else {
      edges.push_back(GraphEdge{node(chain), loop, separator});
      edges.push_back(GraphEdge{loop, node(chain), tail});
    }
  }
  const ExprId elements = g.graph(num_nodes, std::move(edges), std::move(finals));
  return g.seq({g.byte('['), whitespace(), elements, whitespace(), g.byte(']')});
}

ExprId JsonSchemaCompiler::integer(const Json& schema, const std::string& path) {
  std::optional<double> lo = number_member(schema, "minimum", path);
  std::optional<double> hi = number_member(schema, "maximum", path);
  bool lo_exclusive = false;
  bool hi_exclusive = false;
  // exclusiveMinimum is a number (draft 6+) or a flag on minimum (draft 4).
  if (const auto e = schema.find("exclusiveMinimum"); e != schema.end()) {
    if (e->is_boolean()) {
      lo_exclusive = e->get<bool>();
    } else {
      const double value = number_member(schema, "exclusiveMinimum", path).value();
      if (!lo || value >= *lo) {
        lo = value;
        lo_exclusive = true;
      }
    }
  }
  if (const auto e = schema.find("exclusiveMaximum"); e != schema.end()) {
    if (e->is_boolean()) {
      hi_exclusive = e->get<bool>();
    } else {
      const double value = number_member(schema, "exclusiveMaximum", path).value();
      if (!hi || value <= *hi) {
        hi = value;
        hi_exclusive = true;
      }
    }
  }
  constexpr double kLimit = 9.2e18;  // within int64
  std::optional<int64_t> low;
  std::optional<int64_t> high;
  if (lo && *lo > -kLimit) {
    const double v = lo_exclusive ? std::floor(*lo) + 1 : std::ceil(*lo);
    if (v > kLimit) raise(ErrorCode::kUnsupported, "minimum at {} is out of range", where(path));
    low = static_cast<int64_t>(v);
  }
  if (hi && *hi < kLimit) {
    const double v = hi_exclusive ? std::ceil(*hi) - 1 : std::floor(*hi);
    if (v < -kLimit) raise(ErrorCode::kUnsupported, "maximum at {} is out of range", where(path));
    high = static_cast<int64_t>(v);
  }
  if (low && high && *low > *high)
    raise(ErrorCode::kUnsupported, "no integer lies between the bounds at {}", where(path));
  return integer_range(grammar_, low, high);
}

ExprId JsonSchemaCompiler::number(const Json& schema, const std::string& path) {
  Grammar& g = grammar_;
  bool non_negative = false;
  const bool bounded = schema.contains("minimum") || schema.contains("maximum") ||
                       schema.contains("exclusiveMinimum") || schema.contains("exclusiveMaximum");
  if (bounded) {
    const std::optional<double> lo = schema.contains("minimum") && schema["minimum"].is_number()
                                         ? std::optional<double>(schema["minimum"].get<double>())
                                         : std::nullopt;
    if (lo && *lo == 0 && !schema.contains("maximum") && !schema.contains("exclusiveMinimum") &&
        !schema.contains("exclusiveMaximum")) {
      non_negative = true;
    } else {
      raise(ErrorCode::kUnsupported,
            "unsupported bounds on type number at {} (numbers support minimum 0; integers support any bounds)",
            where(path));
    }
  }
  const ExprId digit = g.bytes(ByteSet::range('0', '9'));
  const ExprId integral = g.alt({g.byte('0'), g.seq({g.bytes(ByteSet::range('1', '9')), g.star(digit)})});
  const ExprId fraction = g.optional(g.seq({g.byte('.'), g.plus(digit)}));
  // Exponents of at most two digits keep every number within what JSON parsers read as a double.
  const ExprId exponent = g.optional(
      g.seq({g.bytes(ByteSet::of_chars("eE")), g.optional(g.bytes(ByteSet::of_chars("+-"))), g.repeat(digit, 1, 2)}));
  if (non_negative) return g.seq({integral, fraction, exponent});
  return g.seq({g.optional(g.byte('-')), integral, fraction, exponent});
}

Grammar json_schema_grammar(const Json& schema, const JsonSchemaOptions& options) {
  Grammar grammar;
  JsonSchemaCompiler compiler(grammar, options);
  compiler.set_root(schema);
  const RuleId root = grammar.add_rule("root");
  // The root may be referenced as "#" from inside itself.
  const ExprId body = compiler.value(schema, "");
  grammar.set_body(root, body);
  grammar.set_root(root);
  return grammar;
}

Grammar json_object_grammar(const JsonSchemaOptions& options) {
  Grammar grammar;
  JsonSchemaCompiler compiler(grammar, options);
  const RuleId root = grammar.add_rule("root");
  grammar.set_body(root, compiler.any_object());
  grammar.set_root(root);
  return grammar;
}

}  // namespace metrale::grammar
