// Sets of Unicode characters and their byte-level encodings: as UTF-8 (raw text), or as they appear
// inside a JSON string (escaped where JSON requires it). The grammar engine works on bytes; this is
// where characters become bytes.
#pragma once

#include <cstdint>
#include <string_view>
#include <utility>
#include <vector>

#include "text/grammar/grammar.h"

namespace metrale::grammar {

// A set of code points as sorted, disjoint, non-adjacent inclusive ranges. Surrogates (U+D800..DFFF)
// are never members: they are not characters of UTF-8 text.
class CharSet {
 public:
  static constexpr char32_t kMax = 0x10FFFF;

  CharSet() = default;
  static CharSet all();
  static CharSet of(char32_t c) { return range(c, c); }
  static CharSet range(char32_t lo, char32_t hi);

  void add(char32_t lo, char32_t hi);
  void add(const CharSet& other);
  CharSet complement() const;
  CharSet minus(const CharSet& other) const { return intersect(other.complement()); }
  CharSet intersect(const CharSet& other) const;
  bool contains(char32_t c) const;
  bool empty() const { return ranges_.empty(); }
  const std::vector<std::pair<char32_t, char32_t>>& ranges() const { return ranges_; }

 private:
  std::vector<std::pair<char32_t, char32_t>> ranges_;
};

enum class StringEncoding : uint8_t {
  kJson,  // inside a JSON string: '"', '\' and control characters escaped; escapes also accepted for '/'
  kRaw,   // the UTF-8 bytes as they are
};

// One character of `set`, encoded. For kJson, a set holding every character also accepts \uXXXX
// escapes of any code unit; smaller sets accept \u00XX only for the control characters they hold.
ExprId encoded_char(Grammar& grammar, const CharSet& set, StringEncoding encoding);

// The UTF-8 encodings of the characters of `set` (empty set: an expression that matches nothing is
// not expressible, so callers must not pass one).
ExprId utf8_chars(Grammar& grammar, const CharSet& set);

// A literal string, encoded (JSON escaping as JSON.stringify writes it, without the quotes).
ExprId encoded_literal(Grammar& grammar, std::string_view utf8, StringEncoding encoding);

// Any string of characters, encoded (kRaw: UTF-8 text without NUL; kJson: the contents of a JSON
// string, escapes included), whose bytes contain none of `forbidden` (non-empty strings).
ExprId text_avoiding(Grammar& grammar, const std::vector<std::string_view>& forbidden,
                     StringEncoding encoding = StringEncoding::kRaw);

}  // namespace metrale::grammar
