// Unicode normalization as HF tokenizers computes it.
//
// HF normalizes with the unicode-normalization-alignments crate, whose tables are those of Unicode
// 9.0; utf8proc's are newer. Unicode's stability policy makes the difference simple: the
// normalization data of a code point never changes once it is assigned, so Unicode 9.0
// normalization is today's with every code point assigned after 9.0 treated as unassigned, that
// is, as a starter with no decomposition that composes with nothing. Such a code point stays as it
// is and nothing reorders or composes across it, so it splits the text into runs that utf8proc
// can normalize independently.
//
// Speed comes from normalization boundaries: a code point with canonical combining class 0 whose
// quick check is Yes starts a boundary (the text before it and from it on normalize
// independently), and a run of such code points is left as it is. Only the short regions around
// the other code points (marks, composites, Hangul jamo, ...) go through utf8proc.
#include "text/normalizer.h"

#include <utf8proc.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <memory>
#include <span>

#include "core/error.h"
#include "text/json_util.h"
#include "text/utf8.h"

namespace metrale::text {

namespace {

#include "text/unicode9_normalization.inc"

bool in_ranges(std::span<const CodePointRange> ranges, char32_t cp) {
  const auto it = std::upper_bound(ranges.begin(), ranges.end(), cp,
                                   [](char32_t value, const CodePointRange& range) { return value < range.first; });
  return it != ranges.begin() && cp < std::prev(it)->end;
}

std::span<const CodePointRange> unstable_ranges(UnicodeForm form) {
  switch (form) {
    case UnicodeForm::kNfc: return kUnstableNfc;
    case UnicodeForm::kNfd: return kUnstableNfd;
    case UnicodeForm::kNfkc: return kUnstableNfkc;
    case UnicodeForm::kNfkd: return kUnstableNfkd;
  }
  return {};
}

// Whether a normalization boundary precedes `cp` under Unicode 9.0 (see the file comment). The
// tables hold only Unicode 9.0 code points, so later ones are stable, as they must be.
bool is_stable(char32_t cp, std::span<const CodePointRange> unstable) { return !in_ranges(unstable, cp); }

void collect_forms(const json::Json& spec, std::vector<UnicodeForm>& forms) {
  if (spec.is_null()) return;
  const std::string type = json::type_of(spec, "normalizer");
  if (type == "Sequence") {
    const json::Json* children = json::member(spec, "normalizers");
    if (children == nullptr) raise(ErrorCode::kBadFormat, "normalizer Sequence: missing \"normalizers\"");
    for (const auto& child : json::array(*children, "normalizers")) collect_forms(child, forms);
  } else if (type == "NFC") {
    forms.push_back(UnicodeForm::kNfc);
  } else if (type == "NFD") {
    forms.push_back(UnicodeForm::kNfd);
  } else if (type == "NFKC") {
    forms.push_back(UnicodeForm::kNfkc);
  } else if (type == "NFKD") {
    forms.push_back(UnicodeForm::kNfkd);
  } else {
    raise(ErrorCode::kUnsupported, "normalizer type '{}' is not supported (supported: NFC, NFD, NFKC, NFKD, Sequence)",
          type);
  }
}

struct FreeDeleter {
  void operator()(utf8proc_uint8_t* pointer) const { std::free(pointer); }
};

// utf8proc's normalization, with its own (newer) tables, appended to `out`.
void append_utf8proc_normalized(std::string_view text, UnicodeForm form, std::string& out) {
  int options = UTF8PROC_STABLE;
  switch (form) {
    case UnicodeForm::kNfc: options |= UTF8PROC_COMPOSE; break;
    case UnicodeForm::kNfd: options |= UTF8PROC_DECOMPOSE; break;
    case UnicodeForm::kNfkc: options |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT; break;
    case UnicodeForm::kNfkd: options |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT; break;
  }
  utf8proc_uint8_t* output = nullptr;
  // An explicit length (no UTF8PROC_NULLTERM), so NUL bytes inside the text are ordinary characters.
  const utf8proc_ssize_t length =
      utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()), static_cast<utf8proc_ssize_t>(text.size()),
                   &output, static_cast<utf8proc_option_t>(options));
  const std::unique_ptr<utf8proc_uint8_t, FreeDeleter> owned(output);
  if (length < 0) raise(ErrorCode::kInternal, "utf8proc normalization failed: {}", utf8proc_errmsg(length));
  out.append(reinterpret_cast<const char*>(owned.get()), static_cast<size_t>(length));
}

// Normalizes a region with Unicode 9.0 semantics: code points assigned later split it into runs
// that utf8proc normalizes, and are copied as they are.
void append_region_normalized(std::string_view region, UnicodeForm form, std::string& out) {
  size_t run_begin = 0;
  size_t pos = 0;
  while (pos < region.size()) {
    const size_t start = pos;
    const char32_t cp = next_code_point(region, pos);
    if (assigned_in_unicode9(cp)) continue;
    if (start > run_begin) append_utf8proc_normalized(region.substr(run_begin, start - run_begin), form, out);
    out.append(region.substr(start, pos - start));
    run_begin = pos;
  }
  if (run_begin < region.size()) append_utf8proc_normalized(region.substr(run_begin), form, out);
}

// Position of the first code point at or after `pos` that is not stable, or text.size().
size_t find_unstable(std::string_view text, size_t pos, std::span<const CodePointRange> unstable) {
  while (pos < text.size()) {
    // ASCII is stable in every form: skip it eight bytes at a time.
    uint64_t word;
    if (pos + 8 <= text.size() && (std::memcpy(&word, text.data() + pos, 8), (word & 0x8080808080808080ull) == 0)) {
      pos += 8;
      continue;
    }
    if (static_cast<uint8_t>(text[pos]) < 0x80) {
      ++pos;
      continue;
    }
    size_t next = pos;
    if (!is_stable(next_code_point(text, next), unstable)) return pos;
    pos = next;
  }
  return pos;
}

// Normalizes `text` into `out` (cleared) if some code point is unstable; returns false, leaving
// `out` alone, when the text is already normalized for certain.
bool normalize_form(std::string_view text, UnicodeForm form, std::string& out) {
  const auto unstable = unstable_ranges(form);
  size_t unstable_at = find_unstable(text, 0, unstable);
  if (unstable_at == text.size()) return false;
  out.clear();
  out.reserve(text.size() + 16);
  size_t copied = 0;  // text[0, copied) is in `out`
  while (unstable_at < text.size()) {
    // The region to normalize starts at the boundary before the unstable code point: at the
    // (stable) code point just before it, which a mark may combine with. Everything from `copied`
    // to there is stable.
    size_t region_begin = unstable_at;
    if (region_begin > copied) {
      --region_begin;
      while (region_begin > copied && (static_cast<uint8_t>(text[region_begin]) & 0xC0) == 0x80) --region_begin;
    }
    // ... and ends before the next stable code point.
    size_t region_end = unstable_at;
    while (region_end < text.size()) {
      size_t next = region_end;
      if (is_stable(next_code_point(text, next), unstable)) break;
      region_end = next;
    }
    out.append(text.substr(copied, region_begin - copied));
    append_region_normalized(text.substr(region_begin, region_end - region_begin), form, out);
    copied = region_end;
    unstable_at = find_unstable(text, region_end, unstable);
  }
  out.append(text.substr(copied));
  return true;
}

}  // namespace

bool assigned_in_unicode9(char32_t code_point) { return in_ranges(kAssignedInUnicode9, code_point); }

std::string normalize_unicode(std::string_view text, UnicodeForm form) {
  std::string out;
  if (!normalize_form(text, form, out)) return std::string(text);
  return out;
}

Normalizer Normalizer::from_json(const nlohmann::json& spec) {
  Normalizer normalizer;
  collect_forms(spec, normalizer.forms_);
  return normalizer;
}

std::string_view Normalizer::normalize(std::string_view text, std::string& buffer) const {
  std::string_view current = text;
  std::string next;
  for (const UnicodeForm form : forms_) {
    if (!normalize_form(current, form, next)) continue;
    buffer.swap(next);
    current = buffer;
  }
  return current;
}

}  // namespace metrale::text
