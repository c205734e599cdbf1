// Typing the values of the XML-like tool-call formats by the tool's JSON schema: the model writes
// every parameter as text, and the schema says whether that text is a string or JSON.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string_view>

namespace metrale::text::tool_calls {

// The JSON types a schema admits, as a bit set.
inline constexpr uint8_t kTypeString = 1;
inline constexpr uint8_t kTypeNumber = 2;  // numbers that may have a fraction
inline constexpr uint8_t kTypeInteger = 4;
inline constexpr uint8_t kTypeBoolean = 8;
inline constexpr uint8_t kTypeNull = 16;
inline constexpr uint8_t kTypeObject = 32;
inline constexpr uint8_t kTypeArray = 64;
inline constexpr uint8_t kTypeAny = 127;

// The types `schema` admits, following type / enum / const / anyOf / oneOf / allOf and $ref into
// `root`'s $defs or definitions; kTypeAny when the schema does not say.
uint8_t schema_types(const nlohmann::ordered_json& schema, const nlohmann::ordered_json& root);

// The value a parameter written as `text` stands for. Only strings (or nothing known, kTypeAny):
// the text itself. Otherwise the text parsed as JSON when that gives an admitted type (True/False
// count as booleans, None as null); else the text as a string when strings are admitted; else the
// parsed JSON whatever its type; else the text.
nlohmann::ordered_json typed_value(std::string_view text, uint8_t types);

// A JSON value as compact text with non-ASCII characters as written (invalid UTF-8 replaced).
std::string dump_compact(const nlohmann::ordered_json& value);

}  // namespace metrale::text::tool_calls
