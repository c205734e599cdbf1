// Small string and file helpers shared by every floor.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace metrale {

std::vector<std::string> split(std::string_view text, char separator);
std::string trim(std::string_view text);
bool starts_with(std::string_view text, std::string_view prefix);
bool ends_with(std::string_view text, std::string_view suffix);

// Parses "1,2,3" (whitespace allowed) into integers; throws kInvalidArgument naming `what` on error.
std::vector<int64_t> parse_int_list(std::string_view text, std::string_view what);

// Reads a whole file; throws kNotFound with the path when it cannot be opened.
std::string read_file(const std::filesystem::path& path);

// Whether `given` equals `secret`, in a time that depends only on secret's length (API keys: the
// position of the first wrong byte must not show in the response time).
bool constant_time_equals(std::string_view given, std::string_view secret);

// Formats a byte count as "1.5 GiB".
std::string format_bytes(uint64_t bytes);

}  // namespace metrale
