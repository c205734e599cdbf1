#include "text/utf8.h"

#include <cstring>

namespace metrale::text {

namespace {

// The range of the second byte allowed after each lead byte (Unicode table 3-7, "Well-Formed
// UTF-8 Byte Sequences"); the third and fourth bytes are always 80..BF.
struct LeadRule {
  uint8_t length;       // 0: not a lead byte
  uint8_t second_low;
  uint8_t second_high;
};

constexpr LeadRule lead_rule(uint8_t lead) {
  if (lead < 0x80) return {1, 0, 0};
  if (lead < 0xC2) return {0, 0, 0};  // continuation bytes and the overlong leads C0, C1
  if (lead < 0xE0) return {2, 0x80, 0xBF};
  if (lead == 0xE0) return {3, 0xA0, 0xBF};  // no overlongs
  if (lead == 0xED) return {3, 0x80, 0x9F};  // no surrogates
  if (lead < 0xF0) return {3, 0x80, 0xBF};
  if (lead == 0xF0) return {4, 0x90, 0xBF};  // no overlongs
  if (lead < 0xF4) return {4, 0x80, 0xBF};
  if (lead == 0xF4) return {4, 0x80, 0x8F};  // nothing above U+10FFFF
  return {0, 0, 0};
}

}  // namespace

Utf8Sequence scan_utf8(std::string_view bytes) {
  const auto byte = [&](size_t i) { return static_cast<uint8_t>(bytes[i]); };
  const uint8_t lead = byte(0);
  const LeadRule rule = lead_rule(lead);
  if (rule.length == 0) return {Utf8Status::kInvalid, 1, 0};
  if (rule.length == 1) return {Utf8Status::kValid, 1, lead};
  // Walk the continuation bytes; the first one out of range ends a maximal subpart.
  for (uint8_t i = 1; i < rule.length; ++i) {
    if (i >= bytes.size()) return {Utf8Status::kIncomplete, i, 0};
    const uint8_t low = i == 1 ? rule.second_low : 0x80;
    const uint8_t high = i == 1 ? rule.second_high : 0xBF;
    if (byte(i) < low || byte(i) > high) return {Utf8Status::kInvalid, i, 0};
  }
  size_t pos = 0;
  const char32_t cp = next_code_point(bytes, pos);
  return {Utf8Status::kValid, rule.length, cp};
}

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

namespace {

// Skips the ASCII run at `pos` eight bytes at a time; most text is mostly ASCII.
size_t skip_ascii(std::string_view bytes, size_t pos) {
  while (pos + 8 <= bytes.size()) {
    uint64_t word;
    std::memcpy(&word, bytes.data() + pos, sizeof word);
    if ((word & 0x8080808080808080ull) != 0) break;
    pos += 8;
  }
  while (pos < bytes.size() && static_cast<uint8_t>(bytes[pos]) < 0x80) ++pos;
  return pos;
}

}  // namespace

bool is_valid_utf8(std::string_view bytes) {
  size_t pos = 0;
  while (true) {
    pos = skip_ascii(bytes, pos);
    if (pos == bytes.size()) return true;
    const Utf8Sequence seq = scan_utf8(bytes.substr(pos));
    if (seq.status != Utf8Status::kValid) return false;
    pos += seq.length;
  }
}

size_t append_complete_utf8(std::string_view bytes, std::string& out) {
  size_t pos = 0;
  while (pos < bytes.size()) {
    const size_t ascii_end = skip_ascii(bytes, pos);
    out.append(bytes.data() + pos, ascii_end - pos);
    pos = ascii_end;
    if (pos == bytes.size()) break;
    const Utf8Sequence seq = scan_utf8(bytes.substr(pos));
    if (seq.status == Utf8Status::kIncomplete) break;
    if (seq.status == Utf8Status::kValid) {
      out.append(bytes.data() + pos, seq.length);
    } else {
      out.append(kReplacementCharacter);
    }
    pos += seq.length;
  }
  return pos;
}

std::string to_valid_utf8_lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  const size_t consumed = append_complete_utf8(bytes, out);
  // A truncated sequence at the very end is one maximal subpart.
  if (consumed < bytes.size()) out.append(kReplacementCharacter);
  return out;
}

}  // namespace metrale::text
