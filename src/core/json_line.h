// One JSON object on one line: the records of --log-format json. {"ts": UTC time with milliseconds,
// "level", then the fields in the order added}. Strings are escaped as JSON requires, and bytes that
// are not UTF-8 become U+FFFD, so that every line parses whatever a message holds (paths, model
// names). core needs no JSON library for it.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>

#include "core/log_level.h"

namespace metrale {

class JsonLine {
 public:
  explicit JsonLine(LogLevel level, std::chrono::system_clock::time_point time = std::chrono::system_clock::now());

  JsonLine& add(std::string_view key, std::string_view value);
  JsonLine& add_int(std::string_view key, int64_t value);
  JsonLine& add_number(std::string_view key, double value);  // NaN and infinities as null
  JsonLine& add_bool(std::string_view key, bool value);
  // The line, closed and ending in a newline.
  std::string finish();

 private:
  void key(std::string_view name);
  std::string text_;
};

// `text` as a JSON string literal, quotes included.
std::string json_quote(std::string_view text);
// "2026-12-02T05:41:07.123Z"
std::string utc_timestamp(std::chrono::system_clock::time_point time);

}  // namespace metrale
