// A JSON Schema validator for the subset the grammar engine supports, written independently of it for
// the tests: a constrained random walk must always produce an instance this accepts. Strict mode as
// the engine's default: an object with properties and no additionalProperties admits no other keys,
// prefixItems without items no other items. oneOf means exactly one branch.
#pragma once

#include <cmath>
#include <nlohmann/json.hpp>
#include <regex>
#include <string>

#include "text/grammar/pattern.h"

namespace metrale::grammar::testing {

class SchemaValidator {
 public:
  using Json = nlohmann::ordered_json;

  explicit SchemaValidator(const Json& root) : root_(root) {}

  // "" when `instance` is valid, else why not.
  std::string check(const Json& instance) const { return check(instance, root_, "", 0); }

 private:
  static size_t code_points(const std::string& text) {
    size_t count = 0;
    for (unsigned char c : text) count += (c & 0xC0) != 0x80;
    return count;
  }

  const Json& resolve(const std::string& ref) const {
    const Json* at = &root_;
    size_t pos = 1;
    while (pos < ref.size()) {
      const size_t next = std::min(ref.find('/', pos + 1), ref.size());
      const std::string token = ref.substr(pos + 1, next - pos - 1);
      at = at->is_array() ? &(*at)[std::stoul(token)] : &(*at)[token];
      pos = next;
    }
    return *at;
  }

  static bool has_type(const Json& value, const std::string& type) {
    if (type == "object") return value.is_object();
    if (type == "array") return value.is_array();
    if (type == "string") return value.is_string();
    if (type == "boolean") return value.is_boolean();
    if (type == "null") return value.is_null();
    if (type == "number") return value.is_number();
    if (type == "integer") {
      return value.is_number_integer() || value.is_number_unsigned() ||
             (value.is_number_float() && std::floor(value.get<double>()) == value.get<double>());
    }
    return false;
  }

  std::string check(const Json& value, const Json& schema, const std::string& path, int depth) const {
    if (depth > 200) return path + ": too deep";
    if (schema.is_boolean()) return schema.get<bool>() ? "" : path + ": false schema";
    if (schema.contains("$ref")) {
      if (std::string why = check(value, resolve(schema["$ref"].get<std::string>()), path, depth + 1); !why.empty())
        return why;
    }
    if (schema.contains("const") && value != schema["const"]) return path + ": not the const";
    if (schema.contains("enum")) {
      bool found = false;
      for (const Json& option : schema["enum"]) found = found || option == value;
      if (!found) return path + ": not in the enum";
    }
    if (schema.contains("anyOf")) {
      bool any = false;
      for (const Json& branch : schema["anyOf"]) any = any || check(value, branch, path, depth + 1).empty();
      if (!any) return path + ": no anyOf branch matches";
    }
    if (schema.contains("oneOf")) {
      int matches = 0;
      for (const Json& branch : schema["oneOf"]) matches += check(value, branch, path, depth + 1).empty();
      if (matches != 1) return path + ": " + std::to_string(matches) + " oneOf branches match";
    }
    if (schema.contains("allOf")) {
      for (const Json& branch : schema["allOf"]) {
        if (std::string why = check(value, branch, path, depth + 1); !why.empty()) return why;
      }
    }
    if (schema.contains("type")) {
      bool ok = schema.value("nullable", false) && value.is_null();
      if (schema["type"].is_string()) {
        ok = ok || has_type(value, schema["type"].get<std::string>());
      } else {
        for (const Json& type : schema["type"]) ok = ok || has_type(value, type.get<std::string>());
      }
      if (!ok) return path + ": wrong type";
    }
    if (value.is_object()) return check_object(value, schema, path, depth);
    if (value.is_array()) return check_array(value, schema, path, depth);
    if (value.is_string()) return check_string(value.get<std::string>(), schema, path);
    if (value.is_number()) return check_number(value, schema, path);
    return "";
  }

  std::string check_object(const Json& value, const Json& schema, const std::string& path, int depth) const {
    const Json properties = schema.value("properties", Json::object());
    for (const Json& name : schema.value("required", Json::array())) {
      if (!value.contains(name.get<std::string>())) return path + ": missing " + name.get<std::string>();
    }
    for (const auto& [key, member] : value.items()) {
      if (properties.contains(key)) {
        if (std::string why = check(member, properties[key], path + "/" + key, depth + 1); !why.empty()) return why;
        continue;
      }
      const bool declared_required = [&] {
        for (const Json& name : schema.value("required", Json::array())) {
          if (name == key) return true;
        }
        return false;
      }();
      if (declared_required) continue;
      if (schema.contains("additionalProperties")) {
        if (std::string why = check(member, schema["additionalProperties"], path + "/" + key, depth + 1); !why.empty())
          return why;
      } else if (!properties.empty()) {
        return path + ": unexpected key " + key;
      }
    }
    return "";
  }

  std::string check_array(const Json& value, const Json& schema, const std::string& path, int depth) const {
    if (schema.contains("minItems") && value.size() < schema["minItems"].get<size_t>()) return path + ": too few items";
    if (schema.contains("maxItems") && value.size() > schema["maxItems"].get<size_t>())
      return path + ": too many items";
    const Json prefix = schema.value("prefixItems", Json::array());
    for (size_t i = 0; i < value.size(); ++i) {
      const std::string at = path + "/" + std::to_string(i);
      if (i < prefix.size()) {
        if (std::string why = check(value[i], prefix[i], at, depth + 1); !why.empty()) return why;
      } else if (schema.contains("items")) {
        if (std::string why = check(value[i], schema["items"], at, depth + 1); !why.empty()) return why;
      } else if (!prefix.empty()) {
        return at + ": an item past the tuple";
      }
    }
    return "";
  }

  static std::string check_string(const std::string& text, const Json& schema, const std::string& path) {
    const size_t length = code_points(text);
    if (schema.contains("minLength") && length < schema["minLength"].get<size_t>()) return path + ": too short";
    if (schema.contains("maxLength") && length > schema["maxLength"].get<size_t>()) return path + ": too long";
    std::string regex;
    if (schema.contains("pattern")) regex = schema["pattern"].get<std::string>();
    if (schema.contains("format")) regex = std::string(format_pattern(schema["format"].get<std::string>()));
    if (!regex.empty() && !std::regex_search(text, std::regex(regex, std::regex::ECMAScript))) {
      return path + ": \"" + text + "\" does not match " + regex;
    }
    return "";
  }

  static std::string check_number(const Json& value, const Json& schema, const std::string& path) {
    const double v = value.get<double>();
    if (schema.contains("minimum") && v < schema["minimum"].get<double>()) return path + ": below minimum";
    if (schema.contains("maximum") && v > schema["maximum"].get<double>()) return path + ": above maximum";
    if (schema.contains("exclusiveMinimum") && v <= schema["exclusiveMinimum"].get<double>())
      return path + ": not above exclusiveMinimum";
    if (schema.contains("exclusiveMaximum") && v >= schema["exclusiveMaximum"].get<double>())
      return path + ": not below exclusiveMaximum";
    return "";
  }

  const Json& root_;
};

}  // namespace metrale::grammar::testing
