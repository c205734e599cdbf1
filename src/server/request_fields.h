// Typed readers of the fields of a request's JSON objects, shared by the Chat/Completions parser and
// the Responses API: a field that is absent or null reads as nullopt; any other type than the one
// asked is a 400 invalid_request_error naming the field (`param`, the field's path in the request,
// defaults to its key).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "server/openai_protocol.h"

namespace metrale::server::request_fields {

using json = nlohmann::ordered_json;

// "null", "boolean", "string", "array", "object", "number" or "integer".
const char* type_name(const json& value);
ApiError wrong_type(const std::string& param, const char* expected, const json& got);

// The field `key` of `object`, nullptr when it is absent or null.
const json* field(const json& object, const std::string& key);

std::optional<bool> get_bool(const json& object, const std::string& key);
std::optional<double> get_number(const json& object, const std::string& key);
std::optional<std::string> get_string(const json& object, const std::string& key, const std::string& param);
std::optional<std::string> get_string(const json& object, const std::string& key);
std::optional<int64_t> get_integer(const json& object, const std::string& key);
// An integer-valued number: 2.0 reads as 2 (some clients send every number as a float), 2.5 and
// integers beyond int64 are a 400.
int64_t as_integer(const json& value, const std::string& param);

}  // namespace metrale::server::request_fields
