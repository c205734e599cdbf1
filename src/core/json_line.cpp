#include "core/json_line.h"

#include <fmt/format.h>

#include <cmath>
#include <ctime>

namespace metrale {
namespace {

constexpr const char* kLevelNames[] = {"debug", "info", "warn", "error"};

// The length of the UTF-8 sequence at text[i], or 0 when it is not a valid one.
size_t utf8_sequence(std::string_view text, size_t i) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(text[k]); };
  const unsigned char lead = byte(i);
  size_t length = 0;
  uint32_t code = 0;
  if (lead < 0x80) return 1;
  if (lead >= 0xC2 && lead <= 0xDF) {
    length = 2;
    code = lead & 0x1F;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    length = 3;
    code = lead & 0x0F;
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    length = 4;
    code = lead & 0x07;
  } else {
    return 0;
  }
  if (i + length > text.size()) return 0;
  for (size_t k = 1; k < length; ++k) {
    if ((byte(i + k) & 0xC0) != 0x80) return 0;
    code = (code << 6) | (byte(i + k) & 0x3F);
  }
  // Overlong forms, surrogates and code points beyond U+10FFFF.
  if ((length == 3 && code < 0x800) || (length == 4 && (code < 0x10000 || code > 0x10FFFF))) return 0;
  if (code >= 0xD800 && code <= 0xDFFF) return 0;
  return length;
}

}  // namespace

std::string json_quote(std::string_view text) {
  std::string out = "\"";
  out.reserve(text.size() + 2);
  for (size_t i = 0; i < text.size();) {
    const char c = text[i];
    const auto u = static_cast<unsigned char>(c);
    if (u >= 0x80) {
      const size_t length = utf8_sequence(text, i);
      if (length == 0) {
        out += "\\ufffd";
        ++i;
      } else {
        out.append(text.substr(i, length));
        i += length;
      }
      continue;
    }
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (u < 0x20 || u == 0x7F) {
          out += fmt::format("\\u{:04x}", u);
        } else {
          out += c;
        }
    }
    ++i;
  }
  out += '"';
  return out;
}

std::string utc_timestamp(std::chrono::system_clock::time_point time) {
  const auto millis = std::chrono::duration_cast<std::chrono::milliseconds>(time.time_since_epoch()).count();
  const std::time_t seconds = static_cast<std::time_t>(millis / 1000);
  std::tm parts{};
  gmtime_r(&seconds, &parts);
  return fmt::format("{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:03}Z", parts.tm_year + 1900, parts.tm_mon + 1,
                     parts.tm_mday, parts.tm_hour, parts.tm_min, parts.tm_sec, static_cast<int>(millis % 1000));
}

JsonLine::JsonLine(LogLevel level, std::chrono::system_clock::time_point time) {
  text_ = "{\"ts\":" + json_quote(utc_timestamp(time)) + ",\"level\":\"" + kLevelNames[static_cast<int>(level)] + "\"";
}

void JsonLine::key(std::string_view name) {
  text_ += ',';
  text_ += json_quote(name);
  text_ += ':';
}

JsonLine& JsonLine::add(std::string_view name, std::string_view value) {
  key(name);
  text_ += json_quote(value);
  return *this;
}

JsonLine& JsonLine::add_int(std::string_view name, int64_t value) {
  key(name);
  text_ += std::to_string(value);
  return *this;
}

JsonLine& JsonLine::add_number(std::string_view name, double value) {
  key(name);
  text_ += std::isfinite(value) ? fmt::format("{}", value) : std::string("null");
  return *this;
}

JsonLine& JsonLine::add_bool(std::string_view name, bool value) {
  key(name);
  text_ += value ? "true" : "false";
  return *this;
}

std::string JsonLine::finish() {
  std::string line = std::move(text_);
  line += "}\n";
  text_.clear();
  return line;
}

}  // namespace metrale
