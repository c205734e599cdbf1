// UTF-8 scanning with the exact error semantics of Rust's String::from_utf8_lossy, which Hugging
// Face tokenizers applies after byte-level decoding: every maximal ill-formed subpart (Unicode
// "substitution of maximal subparts", chapter 3.9) becomes one U+FFFD.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace metrale::text {

// A half-open range of code points, the element of the generated Unicode tables (*.inc).
struct CodePointRange {
  char32_t first;
  char32_t end;  // one past the last
};

inline constexpr std::string_view kReplacementCharacter = "\xEF\xBF\xBD";  // U+FFFD

// What the bytes at the front of a buffer hold.
enum class Utf8Status : uint8_t {
  kValid,       // a well-formed sequence of `length` bytes
  kInvalid,     // an ill-formed maximal subpart of `length` bytes (>= 1): one U+FFFD
  kIncomplete,  // all remaining `length` bytes are a proper prefix of a well-formed sequence
};

struct Utf8Sequence {
  Utf8Status status;
  uint8_t length;
  char32_t code_point;  // meaningful for kValid only
};

// Classifies the sequence starting at bytes[0]; `bytes` must not be empty.
Utf8Sequence scan_utf8(std::string_view bytes);

// Decodes one well-formed code point at `bytes[pos]` and advances `pos`. The caller guarantees the
// input is valid UTF-8 (the tokenizer sanitises its input first).
inline char32_t next_code_point(std::string_view bytes, size_t& pos) {
  const auto byte = [&](size_t i) { return static_cast<uint8_t>(bytes[i]); };
  const uint8_t lead = byte(pos);
  if (lead < 0x80) {
    pos += 1;
    return lead;
  }
  if (lead < 0xE0) {
    const char32_t cp = (char32_t(lead & 0x1F) << 6) | (byte(pos + 1) & 0x3F);
    pos += 2;
    return cp;
  }
  if (lead < 0xF0) {
    const char32_t cp = (char32_t(lead & 0x0F) << 12) | (char32_t(byte(pos + 1) & 0x3F) << 6) | (byte(pos + 2) & 0x3F);
    pos += 3;
    return cp;
  }
  const char32_t cp = (char32_t(lead & 0x07) << 18) | (char32_t(byte(pos + 1) & 0x3F) << 12) |
                      (char32_t(byte(pos + 2) & 0x3F) << 6) | (byte(pos + 3) & 0x3F);
  pos += 4;
  return cp;
}

// Length in bytes of the UTF-8 sequence introduced by a (valid) lead byte.
inline size_t utf8_sequence_length(uint8_t lead) {
  return lead < 0x80 ? 1 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : 4;
}

void append_utf8(std::string& out, char32_t code_point);

bool is_valid_utf8(std::string_view bytes);

// Rust's String::from_utf8_lossy: valid sequences are copied, each maximal ill-formed subpart (and
// a truncated sequence at the end) becomes U+FFFD.
std::string to_valid_utf8_lossy(std::string_view bytes);

// Appends to `out` the longest prefix of `bytes` that can be emitted now without knowing what
// follows: valid sequences as they are and ill-formed subparts as U+FFFD. Returns how many bytes
// were consumed; the rest (at most 3 bytes) is an incomplete sequence that more bytes may complete.
size_t append_complete_utf8(std::string_view bytes, std::string& out);

}  // namespace metrale::text
