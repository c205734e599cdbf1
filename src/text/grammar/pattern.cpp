#include "text/grammar/pattern.h"

#include <string>

#include <fmt/format.h>

#include "core/error.h"
#include "text/utf8.h"

namespace metrale::grammar {
namespace {

constexpr int32_t kMaxRepeat = 10000;

CharSet digits() {
  return CharSet::range('0', '9');
}
CharSet word_chars() {
  CharSet set = CharSet::range('a', 'z');
  set.add('A', 'Z');
  set.add('0', '9');
  set.add('_', '_');
  return set;
}
CharSet space_chars() {
  CharSet set;
  for (char32_t c : {U' ', U'\t', U'\n', U'\r', U'\f', U'\v', U'\u00a0', U'\u1680', U'\u2028', U'\u2029', U'\u202f',
                     U'\u205f', U'\u3000', U'\ufeff'}) {
    set.add(c, c);
  }
  set.add(0x2000, 0x200a);
  return set;
}
CharSet dot_chars() {
  CharSet set = CharSet::of('\n');
  set.add('\r', '\r');
  set.add(0x2028, 0x2029);
  return set.complement();
}

class PatternParser {
 public:
  PatternParser(Grammar& grammar, std::string_view pattern, StringEncoding encoding, const CharSet& allowed)
      : grammar_(grammar), pattern_(pattern), encoding_(encoding), allowed_(allowed) {}

  ExprId parse() {
    std::vector<ExprId> branches;
    while (true) {
      branches.push_back(top_branch());
      if (done()) break;
      if (peek() != '|') fail("unbalanced ')'");
      ++at_;
    }
    return grammar_.alt(std::move(branches));
  }

 private:
  [[noreturn]] void fail(std::string_view what) const {
    raise(ErrorCode::kUnsupported, "pattern \"{}\": {} (at offset {})", pattern_, what, at_);
  }
  bool done() const { return at_ >= pattern_.size(); }
  char peek() const { return pattern_[at_]; }

  ExprId any_text() { return grammar_.star(chars(CharSet::all())); }

  ExprId chars(const CharSet& set) {
    const CharSet restricted = set.intersect(allowed_);
    if (restricted.empty()) fail("a character class that matches no allowed character");
    return encoded_char(grammar_, restricted, encoding_);
  }

  // A top-level branch, with its anchors.
  ExprId top_branch() {
    bool anchored_start = false;
    if (!done() && peek() == '^') {
      anchored_start = true;
      ++at_;
    }
    std::vector<ExprId> items;
    if (!anchored_start) items.push_back(any_text());
    bool anchored_end = false;
    while (!done() && peek() != '|' && peek() != ')') {
      if (peek() == '$') {
        ++at_;
        if (!done() && peek() != '|' && peek() != ')') fail("'$' before the end of a branch");
        if (!done() && peek() == ')') fail("'$' inside a group");
        anchored_end = true;
        break;
      }
      items.push_back(quantified());
    }
    if (!anchored_end) items.push_back(any_text());
    return grammar_.seq(std::move(items));
  }

  ExprId alternation() {
    std::vector<ExprId> branches;
    while (true) {
      std::vector<ExprId> items;
      while (!done() && peek() != '|' && peek() != ')') {
        if (peek() == '^' || peek() == '$') fail("anchors are supported only at the ends of the pattern");
        items.push_back(quantified());
      }
      branches.push_back(grammar_.seq(std::move(items)));
      if (done() || peek() == ')') break;
      ++at_;  // '|'
    }
    return grammar_.alt(std::move(branches));
  }

  ExprId quantified() {
    const ExprId atom_expr = atom();
    if (done()) return atom_expr;
    int32_t min = 1;
    int32_t max = 1;
    const char c = peek();
    if (c == '*') {
      min = 0;
      max = -1;
      ++at_;
    } else if (c == '+') {
      min = 1;
      max = -1;
      ++at_;
    } else if (c == '?') {
      min = 0;
      max = 1;
      ++at_;
    } else if (c == '{') {
      const size_t saved = at_;
      if (!braces(min, max)) {
        at_ = saved;  // a literal '{' (Annex B)
        return atom_expr;
      }
    } else {
      return atom_expr;
    }
    if (!done() && peek() == '?') ++at_;  // lazy: the same language
    if (!done() && (peek() == '*' || peek() == '+' || (peek() == '{' && min != max)))
      fail("a quantifier on a quantifier");
    return grammar_.repeat(atom_expr, min, max);
  }

  // {n}, {n,}, {n,m}; false when the text is not a quantifier.
  bool braces(int32_t& min, int32_t& max) {
    ++at_;
    const auto number = [&](int32_t& value) {
      const size_t start = at_;
      int64_t v = 0;
      while (!done() && peek() >= '0' && peek() <= '9') {
        v = std::min<int64_t>(v * 10 + (peek() - '0'), int64_t{kMaxRepeat} + 1);
        ++at_;
      }
      value = static_cast<int32_t>(v);
      return at_ > start;
    };
    if (!number(min)) return false;
    max = min;
    if (!done() && peek() == ',') {
      ++at_;
      if (!number(max)) max = -1;
    }
    if (done() || peek() != '}') return false;
    ++at_;
    if (min > kMaxRepeat || max > kMaxRepeat) fail("a repetition count above 10000");
    if (max != -1 && max < min) fail("a repetition {n,m} with m < n");
    return true;
  }

  ExprId atom() {
    const char c = peek();
    switch (c) {
      case '(':
        return group();
      case '[':
        return chars(char_class());
      case '.':
        ++at_;
        return chars(dot_chars());
      case '\\':
        return chars(escape(/*in_class=*/false));
      case ')':
        fail("unbalanced ')'");
      case '*':
      case '+':
      case '?':
        fail("a quantifier with nothing to repeat");
      case '^':
      case '$':
        fail("anchors are supported only at the ends of the pattern");
      default:
        return chars(CharSet::of(literal_char()));
    }
  }

  char32_t literal_char() {
    const text::Utf8Sequence sequence = text::scan_utf8(pattern_.substr(at_));
    if (sequence.status != text::Utf8Status::kValid) fail("invalid UTF-8");
    at_ += sequence.length;
    return sequence.code_point;
  }

  ExprId group() {
    ++at_;  // '('
    if (!done() && peek() == '?') {
      const std::string_view rest = pattern_.substr(at_);
      if (rest.starts_with("?:")) {
        at_ += 2;
      } else if (rest.starts_with("?<") && !rest.starts_with("?<=") && !rest.starts_with("?<!")) {
        const size_t close = pattern_.find('>', at_);
        if (close == std::string_view::npos) fail("an unterminated group name");
        at_ = close + 1;
      } else if (rest.starts_with("?=") || rest.starts_with("?!") || rest.starts_with("?<")) {
        fail("lookaround assertions are not supported");
      } else {
        fail("group flags are not supported");
      }
    }
    const ExprId inner = alternation();
    if (done() || peek() != ')') fail("an unterminated group");
    ++at_;
    return inner;
  }

  CharSet char_class() {
    ++at_;  // '['
    bool negated = false;
    if (!done() && peek() == '^') {
      negated = true;
      ++at_;
    }
    CharSet set;
    while (true) {
      if (done()) fail("an unterminated character class");
      if (peek() == ']') {
        ++at_;
        break;
      }
      CharSet item;
      char32_t lo = 0;
      bool single = false;
      if (peek() == '\\') {
        item = escape(/*in_class=*/true);
        if (item.ranges().size() == 1 && item.ranges()[0].first == item.ranges()[0].second) {
          lo = item.ranges()[0].first;
          single = true;
        }
      } else {
        lo = literal_char();
        item = CharSet::of(lo);
        single = true;
      }
      // A range a-b (a '-' before ']' is a literal).
      if (single && at_ + 1 < pattern_.size() && peek() == '-' && pattern_[at_ + 1] != ']') {
        ++at_;
        char32_t hi = 0;
        if (peek() == '\\') {
          const CharSet end = escape(/*in_class=*/true);
          if (end.ranges().size() != 1 || end.ranges()[0].first != end.ranges()[0].second)
            fail("a class range ending in a class");
          hi = end.ranges()[0].first;
        } else {
          hi = literal_char();
        }
        if (hi < lo) fail("a class range out of order");
        item = CharSet::range(lo, hi);
      }
      set.add(item);
    }
    return negated ? set.complement() : set;
  }

  uint32_t hex(size_t digits) {
    uint32_t value = 0;
    for (size_t i = 0; i < digits; ++i) {
      if (done()) fail("a truncated escape");
      const char c = peek();
      int d = -1;
      if (c >= '0' && c <= '9') d = c - '0';
      if (c >= 'a' && c <= 'f') d = c - 'a' + 10;
      if (c >= 'A' && c <= 'F') d = c - 'A' + 10;
      if (d < 0) fail("a bad hexadecimal escape");
      value = value * 16 + static_cast<uint32_t>(d);
      ++at_;
    }
    return value;
  }

  CharSet escape(bool in_class) {
    ++at_;  // '\'
    if (done()) fail("a trailing backslash");
    const char c = peek();
    ++at_;
    switch (c) {
      case 'd':
        return digits();
      case 'D':
        return digits().complement();
      case 'w':
        return word_chars();
      case 'W':
        return word_chars().complement();
      case 's':
        return space_chars();
      case 'S':
        return space_chars().complement();
      case 't':
        return CharSet::of('\t');
      case 'n':
        return CharSet::of('\n');
      case 'r':
        return CharSet::of('\r');
      case 'f':
        return CharSet::of('\f');
      case 'v':
        return CharSet::of('\v');
      case '0':
        return CharSet::of(0);
      case 'b':
        if (in_class) return CharSet::of('\b');
        fail("word boundaries (\\b) are not supported");
      case 'B':
        fail("word boundaries (\\B) are not supported");
      case 'x':
        return CharSet::of(hex(2));
      case 'u':
        if (!done() && peek() == '{') {
          ++at_;
          uint32_t value = 0;
          size_t count = 0;
          while (!done() && peek() != '}') {
            value = value * 16 + hex(1);
            if (++count > 6) fail("a bad \\u{...} escape");
          }
          if (done()) fail("an unterminated \\u{...} escape");
          ++at_;
          return CharSet::of(value);
        }
        return CharSet::of(hex(4));
      case 'p':
      case 'P':
        fail("Unicode property escapes (\\p{...}) are not supported");
      case 'k':
        fail("named backreferences are not supported");
      case 'c':
        fail("control escapes (\\c) are not supported");
      default:
        if (c >= '1' && c <= '9') fail("backreferences are not supported");
        if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) fail("an unknown escape");
        --at_;
        return CharSet::of(literal_char());
    }
  }

  Grammar& grammar_;
  std::string_view pattern_;
  StringEncoding encoding_;
  CharSet allowed_;
  size_t at_ = 0;
};

}  // namespace

ExprId pattern_expr(Grammar& grammar, std::string_view pattern, StringEncoding encoding, const CharSet& allowed) {
  return PatternParser(grammar, pattern, encoding, allowed).parse();
}

std::string_view format_pattern(std::string_view format) {
  // RFC 3339 (date-time, date, time), RFC 4122 (uuid); email and uri are simplified forms of RFC 5321
  // and RFC 3986 that every valid address of the common shapes matches.
  static constexpr std::string_view kDate = R"(\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01]))";
  static constexpr std::string_view kTime =
      R"(([01]\d|2[0-3]):[0-5]\d:([0-5]\d|60)(\.\d+)?([Zz]|[+-]([01]\d|2[0-3]):[0-5]\d))";
  if (format == "date") {
    static const std::string pattern = fmt::format("^{}$", kDate);
    return pattern;
  }
  if (format == "time") {
    static const std::string pattern = fmt::format("^{}$", kTime);
    return pattern;
  }
  if (format == "date-time") {
    static const std::string pattern = fmt::format("^{}[Tt]{}$", kDate, kTime);
    return pattern;
  }
  if (format == "uuid") return R"(^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$)";
  if (format == "ipv4") return R"(^((25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)$)";
  if (format == "email") return R"(^[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(\.[A-Za-z0-9-]+)+$)";
  if (format == "hostname") {
    return R"(^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$)";
  }
  if (format == "uri") return R"(^[A-Za-z][A-Za-z0-9+.-]*:[A-Za-z0-9\-._~:/?#\[\]@!$&'()*+,;=%]+$)";
  return "";
}

}  // namespace metrale::grammar
