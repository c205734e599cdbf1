// An Oniguruma regular expression, the engine Hugging Face tokenizers uses for its Split and
// ByteLevel pre-tokenizers. Patterns from tokenizer.json are compiled as HF compiles them (UTF-8,
// ONIG_OPTION_NONE, ONIG_SYNTAX_DEFAULT), so `\s`, `\p{L}` and lookarounds mean exactly what
// they mean to the reference implementation. One difference is bridged: Debian's Oniguruma has
// Unicode 14.0 tables and HF's Unicode 16.0, so General_Category escapes are widened to the
// Unicode 16.0 sets first (update_unicode_categories).
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

struct re_pattern_buffer;  // Oniguruma's regex_t (OnigRegexType)

namespace metrale::text {

// A half-open byte range [begin, end) inside some text.
struct ByteRange {
  size_t begin;
  size_t end;
};

// Rewrites the General_Category escapes of an Oniguruma pattern (\p{L}, \pN, \P{Symbol},
// \p{^Lu}, ...) so that they match the Unicode 16.0 sets of HF's Oniguruma rather than the Unicode
// 14.0 sets of Debian's: \p{X} becomes [\p{X}<added>&&[^<removed>]] (a nested class, valid inside
// and outside classes). Other escapes are copied unchanged.
std::string update_unicode_categories(std::string_view pattern);

class Regex {
 public:
  // Compiles `pattern` after update_unicode_categories(). Throws metrale::Error(kBadFormat) with
  // Oniguruma's message when it does not compile.
  explicit Regex(std::string_view pattern);

  // Appends the successive non-overlapping matches in `text` (valid UTF-8). Like the `onig` crate's
  // find_iter that HF uses: an empty match right where the previous match ended is skipped.
  // `text` is searched as a whole string: lookarounds cannot see past its ends.
  // Thread-safe: a compiled Oniguruma pattern may be searched concurrently.
  void find_all(std::string_view text, std::vector<ByteRange>& matches) const;

  const std::string& pattern() const { return pattern_; }

 private:
  struct Deleter {
    void operator()(re_pattern_buffer* regex) const;
  };
  std::string pattern_;
  std::unique_ptr<re_pattern_buffer, Deleter> regex_;
};

}  // namespace metrale::text
