#include "text/json_util.h"

#include "core/error.h"

namespace metrale::text::json {

const Json* member(const Json& object, std::string_view key) {
  if (!object.is_object()) return nullptr;
  const auto& members = object.get_ref<const Json::object_t&>();
  const auto it = members.find(key);
  if (it == members.end() || it->second.is_null()) return nullptr;
  return &it->second;
}

const Json::array_t& array(const Json& value, std::string_view what) {
  if (!value.is_array()) raise(ErrorCode::kBadFormat, "{} must be an array", what);
  return value.get_ref<const Json::array_t&>();
}

const Json::object_t& object(const Json& value, std::string_view what) {
  if (!value.is_object()) raise(ErrorCode::kBadFormat, "{} must be an object", what);
  return value.get_ref<const Json::object_t&>();
}

bool boolean(const Json& object, std::string_view key, bool fallback) {
  const Json* value = member(object, key);
  if (value == nullptr) return fallback;
  if (!value->is_boolean()) raise(ErrorCode::kBadFormat, "\"{}\" must be a boolean", key);
  return value->get<bool>();
}

std::optional<std::string> string(const Json& object, std::string_view key) {
  const Json* value = member(object, key);
  if (value == nullptr) return std::nullopt;
  if (!value->is_string()) raise(ErrorCode::kBadFormat, "\"{}\" must be a string", key);
  return value->get<std::string>();
}

std::string type_of(const Json& spec, std::string_view what) {
  const Json* type = member(spec, "type");
  if (type == nullptr || !type->is_string()) raise(ErrorCode::kBadFormat, "{}: expected an object with a string \"type\"", what);
  return type->get<std::string>();
}

}  // namespace metrale::text::json
