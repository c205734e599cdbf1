// The tokenizer.json normalizers metrale supports: the four Unicode normalization forms (through
// utf8proc, restricted to Unicode 9.0 like HF), alone or in a Sequence; an empty Sequence or null
// means no normalization.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace metrale::text {

enum class UnicodeForm { kNfc, kNfd, kNfkc, kNfkd };

class Normalizer {
 public:
  Normalizer() = default;  // the identity
  // Parses the "normalizer" object of tokenizer.json (null allowed); throws kUnsupported for
  // normalizer types other than NFC, NFD, NFKC, NFKD and Sequence, kBadFormat when malformed.
  static Normalizer from_json(const nlohmann::json& spec);

  bool is_identity() const { return forms_.empty(); }

  // Returns the normalized text: `text` itself when normalization leaves it unchanged (the common
  // case, decided by a quick check without copying), else a view of `buffer`, which it fills.
  // `text` must be valid UTF-8 and must not alias `buffer`.
  std::string_view normalize(std::string_view text, std::string& buffer) const;

 private:
  std::vector<UnicodeForm> forms_;  // applied in order
};

// One Unicode normalization form of valid UTF-8 text, as HF tokenizers computes it: with the
// character tables of Unicode 9.0 (see normalizer.cpp).
std::string normalize_unicode(std::string_view text, UnicodeForm form);

// Whether `code_point` was assigned in Unicode 9.0.
bool assigned_in_unicode9(char32_t code_point);

}  // namespace metrale::text
