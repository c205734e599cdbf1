#include "text/tool_calls/argument_types.h"

#include <string>

namespace metrale::text::tool_calls {
namespace {

using Json = nlohmann::ordered_json;
using OrderedJson = nlohmann::ordered_json;

// Bounds the $ref chains and nesting followed (a recursive schema ends in kTypeAny).
constexpr int kMaxDepth = 32;

uint8_t type_bit(std::string_view name) {
  if (name == "string") return kTypeString;
  if (name == "number") return static_cast<uint8_t>(kTypeNumber | kTypeInteger);
  if (name == "integer") return kTypeInteger;
  if (name == "boolean") return kTypeBoolean;
  if (name == "null") return kTypeNull;
  if (name == "object") return kTypeObject;
  if (name == "array") return kTypeArray;
  return kTypeAny;
}

template <typename AnyJson>
uint8_t value_type(const AnyJson& value) {
  switch (value.type()) {
    case nlohmann::detail::value_t::string:
      return kTypeString;
    case nlohmann::detail::value_t::number_integer:
    case nlohmann::detail::value_t::number_unsigned:
      return kTypeInteger;
    case nlohmann::detail::value_t::number_float:
      return kTypeNumber;
    case nlohmann::detail::value_t::boolean:
      return kTypeBoolean;
    case nlohmann::detail::value_t::null:
      return kTypeNull;
    case nlohmann::detail::value_t::object:
      return kTypeObject;
    case nlohmann::detail::value_t::array:
      return kTypeArray;
    default:
      return kTypeAny;
  }
}

const Json* resolve_ref(const std::string& ref, const Json& root) {
  for (std::string_view prefix : {"#/$defs/", "#/definitions/"}) {
    if (ref.rfind(prefix, 0) != 0) continue;
    const std::string key(prefix.substr(2, prefix.size() - 3));
    const auto defs = root.find(key);
    if (defs == root.end() || !defs->is_object()) return nullptr;
    const auto target = defs->find(ref.substr(prefix.size()));
    return target == defs->end() ? nullptr : &*target;
  }
  if (ref == "#") return &root;
  return nullptr;
}

uint8_t types_at(const Json& schema, const Json& root, int depth) {
  if (depth > kMaxDepth || !schema.is_object()) return kTypeAny;
  if (const auto ref = schema.find("$ref"); ref != schema.end() && ref->is_string()) {
    const Json* target = resolve_ref(ref->get<std::string>(), root);
    return target == nullptr ? kTypeAny : types_at(*target, root, depth + 1);
  }
  if (const auto type = schema.find("type"); type != schema.end()) {
    if (type->is_string()) return type_bit(type->get<std::string>());
    if (type->is_array()) {
      uint8_t bits = 0;
      for (const Json& entry : *type) bits |= entry.is_string() ? type_bit(entry.get<std::string>()) : kTypeAny;
      return bits == 0 ? kTypeAny : bits;
    }
  }
  if (const auto constant = schema.find("const"); constant != schema.end()) return value_type(*constant);
  if (const auto values = schema.find("enum"); values != schema.end() && values->is_array() && !values->empty()) {
    uint8_t bits = 0;
    for (const Json& value : *values) bits |= value_type(value);
    return bits;
  }
  for (const char* key : {"anyOf", "oneOf", "allOf"}) {
    const auto branches = schema.find(key);
    if (branches == schema.end() || !branches->is_array() || branches->empty()) continue;
    uint8_t bits = 0;
    for (const Json& branch : *branches) bits |= types_at(branch, root, depth + 1);
    return bits;
  }
  if (schema.contains("properties")) return kTypeObject;
  if (schema.contains("items") || schema.contains("prefixItems")) return kTypeArray;
  return kTypeAny;
}

std::string_view trim_view(std::string_view text) {
  const auto is_space = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; };
  while (!text.empty() && is_space(text.front())) text.remove_prefix(1);
  while (!text.empty() && is_space(text.back())) text.remove_suffix(1);
  return text;
}

bool admits(uint8_t types, const OrderedJson& value) {
  const uint8_t bit = value_type(value);
  // An integer is also a number; a float with an integral value is not an integer (JSON Schema says
  // it is, but the parsed text "1.0" is better kept as written).
  return (types & bit) != 0 || (bit == kTypeInteger && (types & kTypeNumber) != 0);
}

}  // namespace

uint8_t schema_types(const Json& schema, const Json& root) {
  return types_at(schema, root, 0);
}

OrderedJson typed_value(std::string_view text, uint8_t types) {
  if (types == kTypeString || types == kTypeAny || types == 0) return OrderedJson(std::string(text));
  const std::string_view trimmed = trim_view(text);
  OrderedJson parsed = OrderedJson::parse(trimmed.begin(), trimmed.end(), nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded()) {
    if (trimmed == "True" || trimmed == "False") parsed = (trimmed == "True");
    if (trimmed == "None") parsed = nullptr;
  }
  if (!parsed.is_discarded() && admits(types, parsed)) return parsed;
  if ((types & kTypeString) != 0 || parsed.is_discarded()) return OrderedJson(std::string(text));
  return parsed;
}

std::string dump_compact(const OrderedJson& value) {
  return value.dump(-1, ' ', /*ensure_ascii=*/false, nlohmann::json::error_handler_t::replace);
}

}  // namespace metrale::text::tool_calls
