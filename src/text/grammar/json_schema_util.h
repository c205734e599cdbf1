// Helpers shared by the files of JsonSchemaCompiler (internal).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>

namespace metrale::grammar::detail {

// A schema path for messages ("the root" for "").
std::string where(const std::string& path);

// The non-negative integer member `key` (minItems, maxLength, ...), at most `limit`; kInvalidArgument
// when it is not one, kUnsupported above the limit.
std::optional<int64_t> count_member(const nlohmann::ordered_json& schema, std::string_view key, const std::string& path,
                                    int32_t limit);

}  // namespace metrale::grammar::detail
