#include "server/request_fields.h"

#include <fmt/format.h>

#include <cmath>
#include <limits>

namespace metrale::server::request_fields {

const char* type_name(const json& value) {
  switch (value.type()) {
    case json::value_t::null: return "null";
    case json::value_t::boolean: return "boolean";
    case json::value_t::string: return "string";
    case json::value_t::array: return "array";
    case json::value_t::object: return "object";
    case json::value_t::number_float: return "number";
    case json::value_t::number_integer:
    case json::value_t::number_unsigned: return "integer";
    default: return "value";
  }
}

ApiError wrong_type(const std::string& param, const char* expected, const json& got) {
  return invalid_request(fmt::format("'{}' must be {}, got {}", param, expected, type_name(got)), param);
}

const json* field(const json& object, const std::string& key) {
  const auto it = object.find(key);
  if (it == object.end() || it->is_null()) return nullptr;
  return &*it;
}

std::optional<bool> get_bool(const json& object, const std::string& key) {
  const json* value = field(object, key);
  if (value == nullptr) return std::nullopt;
  if (!value->is_boolean()) throw wrong_type(key, "a boolean", *value);
  return value->get<bool>();
}

std::optional<double> get_number(const json& object, const std::string& key) {
  const json* value = field(object, key);
  if (value == nullptr) return std::nullopt;
  if (!value->is_number()) throw wrong_type(key, "a number", *value);
  return value->get<double>();
}

std::optional<std::string> get_string(const json& object, const std::string& key, const std::string& param) {
  const json* value = field(object, key);
  if (value == nullptr) return std::nullopt;
  if (!value->is_string()) throw wrong_type(param, "a string", *value);
  return value->get<std::string>();
}

std::optional<std::string> get_string(const json& object, const std::string& key) {
  return get_string(object, key, key);
}

int64_t as_integer(const json& value, const std::string& param) {
  if (value.is_number_integer()) return value.get<int64_t>();
  if (value.is_number_unsigned()) {
    const auto unsigned_value = value.get<uint64_t>();
    if (unsigned_value > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      throw invalid_request(fmt::format("'{}' is too large", param), param);
    return static_cast<int64_t>(unsigned_value);
  }
  if (value.is_number_float()) {
    const double number = value.get<double>();
    if (std::isfinite(number) && std::floor(number) == number && std::fabs(number) < 9.0e15)
      return static_cast<int64_t>(number);
  }
  throw wrong_type(param, "an integer", value);
}

std::optional<int64_t> get_integer(const json& object, const std::string& key) {
  const json* value = field(object, key);
  if (value == nullptr) return std::nullopt;
  return as_integer(*value, key);
}

}  // namespace metrale::server::request_fields
