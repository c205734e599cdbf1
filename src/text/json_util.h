// Small helpers for reading tokenizer.json and tokenizer_config.json with nlohmann::json: absent
// and null members are treated alike, and a value of the wrong type raises kBadFormat naming the
// key. (They go through object_t/array_t directly, which also keeps GCC's -Wnull-dereference
// quiet about nlohmann's iterators.)
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace metrale::text::json {

using Json = nlohmann::json;

// The member `key` of `object`; nullptr when `object` is not an object, lacks it, or it is null.
const Json* member(const Json& object, std::string_view key);

// The elements of an array (kBadFormat naming `what` if `value` is not an array).
const Json::array_t& array(const Json& value, std::string_view what);
// The members of an object (kBadFormat naming `what` if `value` is not an object).
const Json::object_t& object(const Json& value, std::string_view what);

bool boolean(const Json& object, std::string_view key, bool fallback);
std::optional<std::string> string(const Json& object, std::string_view key);
// The member "type" of a component spec, which must be a string.
std::string type_of(const Json& spec, std::string_view what);

}  // namespace metrale::text::json
