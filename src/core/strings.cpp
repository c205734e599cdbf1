#include "core/strings.h"

#include <charconv>
#include <fstream>
#include <sstream>

#include "core/error.h"

namespace metrale {

std::vector<std::string> split(std::string_view text, char separator) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (true) {
    const size_t end = text.find(separator, start);
    parts.emplace_back(text.substr(start, end == std::string_view::npos ? std::string_view::npos : end - start));
    if (end == std::string_view::npos) break;
    start = end + 1;
  }
  return parts;
}

std::string trim(std::string_view text) {
  const auto is_space = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; };
  size_t begin = 0, end = text.size();
  while (begin < end && is_space(text[begin])) ++begin;
  while (end > begin && is_space(text[end - 1])) --end;
  return std::string(text.substr(begin, end - begin));
}

bool starts_with(std::string_view text, std::string_view prefix) { return text.substr(0, prefix.size()) == prefix; }
bool ends_with(std::string_view text, std::string_view suffix) {
  return text.size() >= suffix.size() && text.substr(text.size() - suffix.size()) == suffix;
}

std::vector<int64_t> parse_int_list(std::string_view text, std::string_view what) {
  std::vector<int64_t> values;
  const std::string stripped = trim(text);
  if (stripped.empty()) return values;
  for (const auto& part : split(stripped, ',')) {
    const std::string item = trim(part);
    int64_t value = 0;
    const auto [ptr, ec] = std::from_chars(item.data(), item.data() + item.size(), value);
    if (item.empty() || ec != std::errc() || ptr != item.data() + item.size()) {
      raise(ErrorCode::kInvalidArgument, "{}: '{}' is not an integer", what, item);
    }
    values.push_back(value);
  }
  return values;
}

bool constant_time_equals(std::string_view given, std::string_view secret) {
  // Every byte of the secret is visited whatever `given` holds; the differences are OR-ed, so no
  // branch depends on where they are.
  unsigned difference = given.size() == secret.size() ? 0u : 1u;
  for (size_t i = 0; i < secret.size(); ++i) {
    const auto expected = static_cast<unsigned char>(secret[i]);
    const auto got = i < given.size() ? static_cast<unsigned char>(given[i]) : static_cast<unsigned char>(~expected);
    difference |= static_cast<unsigned>(expected ^ got);
  }
  return difference == 0;
}

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) raise(ErrorCode::kNotFound, "cannot open {}", path.string());
  std::ostringstream buffer;
  buffer << in.rdbuf();
  return std::move(buffer).str();
}

std::string format_bytes(uint64_t bytes) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024.0 && unit < 4) {
    value /= 1024.0;
    ++unit;
  }
  if (unit == 0) return fmt::format("{:.0f} {}", value, kUnits[unit]);
  return fmt::format("{:.2f} {}", value, kUnits[unit]);
}

}  // namespace metrale
