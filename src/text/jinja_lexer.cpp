#include "text/jinja_lexer.h"

#include <array>
#include <utility>

#include "core/error.h"
#include "text/jinja_value.h"
#include "text/utf8.h"

namespace metrale::text::jinja {

const char* token_type_name(TokenType type) {
  switch (type) {
    case TokenType::kText: return "Text";
    case TokenType::kNumericLiteral: return "NumericLiteral";
    case TokenType::kStringLiteral: return "StringLiteral";
    case TokenType::kIdentifier: return "Identifier";
    case TokenType::kEquals: return "Equals";
    case TokenType::kOpenParen: return "OpenParen";
    case TokenType::kCloseParen: return "CloseParen";
    case TokenType::kOpenStatement: return "OpenStatement";
    case TokenType::kCloseStatement: return "CloseStatement";
    case TokenType::kOpenExpression: return "OpenExpression";
    case TokenType::kCloseExpression: return "CloseExpression";
    case TokenType::kOpenSquareBracket: return "OpenSquareBracket";
    case TokenType::kCloseSquareBracket: return "CloseSquareBracket";
    case TokenType::kOpenCurlyBracket: return "OpenCurlyBracket";
    case TokenType::kCloseCurlyBracket: return "CloseCurlyBracket";
    case TokenType::kComma: return "Comma";
    case TokenType::kDot: return "Dot";
    case TokenType::kColon: return "Colon";
    case TokenType::kPipe: return "Pipe";
    case TokenType::kAdditiveOperator: return "AdditiveBinaryOperator";
    case TokenType::kMultiplicativeOperator: return "MultiplicativeBinaryOperator";
    case TokenType::kExponentiationOperator: return "ExponentiationBinaryOperator";
    case TokenType::kComparisonOperator: return "ComparisonBinaryOperator";
    case TokenType::kUnaryOperator: return "UnaryOperator";
    case TokenType::kComment: return "Comment";
  }
  return "?";
}

SourcePosition position_of(std::string_view source, uint32_t offset) {
  SourcePosition position{1, 1};
  size_t pos = 0;
  while (pos < source.size() && pos < offset) {
    if (source[pos] == '\n') {
      ++position.line;
      position.column = 1;
      ++pos;
      continue;
    }
    decode_code_point(source, pos);
    ++position.column;
  }
  return position;
}

namespace {

// Template text after preprocessing, with the source offset of every byte (and of the end).
struct MappedText {
  std::string text;
  std::vector<uint32_t> origin;
};

// Copies the text, dropping the bytes for which `drop` is true.
MappedText drop_bytes(const MappedText& in, const std::vector<bool>& drop) {
  MappedText out;
  out.text.reserve(in.text.size());
  out.origin.reserve(in.origin.size());
  for (size_t i = 0; i < in.text.size(); ++i) {
    if (drop[i]) continue;
    out.text += in.text[i];
    out.origin.push_back(in.origin[i]);
  }
  out.origin.push_back(in.origin.back());
  return out;
}

size_t space_length_at(std::string_view text, size_t pos) {
  if (pos >= text.size()) return 0;
  size_t next = pos;
  return is_js_space(decode_code_point(text, next)) ? next - pos : 0;
}

bool is_line_terminator_before(std::string_view text, size_t pos) {
  if (pos == 0) return true;
  const char c = text[pos - 1];
  if (c == '\n' || c == '\r') return true;
  // U+2028 / U+2029 end a line for JavaScript's multiline `^` too.
  return pos >= 3 && text.substr(pos - 3, 2) == "\xE2\x80" &&
         (text[pos - 1] == '\xA8' || text[pos - 1] == '\xA9');
}

// @huggingface/jinja's preprocess() with trim_blocks and lstrip_blocks.
MappedText preprocess(std::string_view source) {
  MappedText mapped;
  mapped.text.assign(source);
  mapped.origin.resize(source.size() + 1);
  for (size_t i = 0; i <= source.size(); ++i) mapped.origin[i] = static_cast<uint32_t>(i);
  if (!mapped.text.empty() && mapped.text.back() == '\n') {
    mapped.text.pop_back();
    mapped.origin.erase(mapped.origin.end() - 2);
  }
  {  // lstrip_blocks: /^[ \t]*({[#%-])/gm -> "$1"
    const std::string& t = mapped.text;
    std::vector<bool> drop(t.size(), false);
    for (size_t i = 0; i < t.size(); ++i) {
      if (!is_line_terminator_before(t, i)) continue;
      size_t j = i;
      while (j < t.size() && (t[j] == ' ' || t[j] == '\t')) ++j;
      if (j + 1 < t.size() && t[j] == '{' && (t[j + 1] == '#' || t[j + 1] == '%' || t[j + 1] == '-')) {
        for (size_t k = i; k < j; ++k) drop[k] = true;
      }
    }
    mapped = drop_bytes(mapped, drop);
  }
  {  // trim_blocks: /([#%-]})\n/g -> "$1"
    const std::string& t = mapped.text;
    std::vector<bool> drop(t.size(), false);
    for (size_t i = 0; i + 2 < t.size();) {
      if ((t[i] == '#' || t[i] == '%' || t[i] == '-') && t[i + 1] == '}' && t[i + 2] == '\n') {
        drop[i + 2] = true;
        i += 3;
      } else {
        ++i;
      }
    }
    mapped = drop_bytes(mapped, drop);
  }
  {  // /(\s*){%(-?)\s*(?:end)?generation\s*(-?)%}(\s*)/gs -> (lstrip ? "" : before) + (rstrip ? "" : after)
    const std::string& t = mapped.text;
    std::vector<bool> drop(t.size(), false);
    size_t previous_end = 0;
    for (size_t open = t.find("{%"); open != std::string::npos; open = t.find("{%", open + 1)) {
      if (open < previous_end) continue;
      size_t p = open + 2;
      const bool lstrip = p < t.size() && t[p] == '-';
      if (lstrip) ++p;
      while (size_t n = space_length_at(t, p)) p += n;
      if (t.compare(p, 3, "end") == 0 && t.compare(p + 3, 10, "generation") == 0) p += 3;
      if (t.compare(p, 10, "generation") != 0) continue;
      p += 10;
      while (size_t n = space_length_at(t, p)) p += n;
      const bool rstrip = p < t.size() && t[p] == '-';
      if (rstrip) ++p;
      if (t.compare(p, 2, "%}") != 0) continue;
      p += 2;
      size_t before = open;
      while (before > previous_end) {
        size_t start = before - 1;
        while (start > previous_end && (static_cast<uint8_t>(t[start]) & 0xC0) == 0x80) --start;
        if (space_length_at(t, start) != before - start) break;
        before = start;
      }
      size_t after = p;
      while (size_t n = space_length_at(t, after)) after += n;
      for (size_t k = open; k < p; ++k) drop[k] = true;
      if (lstrip) {
        for (size_t k = before; k < open; ++k) drop[k] = true;
      }
      if (rstrip) {
        for (size_t k = p; k < after; ++k) drop[k] = true;
      }
      previous_end = after;
    }
    mapped = drop_bytes(mapped, drop);
  }
  return mapped;
}

bool is_word(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
}

bool is_digit(char c) { return c >= '0' && c <= '9'; }

struct MappingRule {
  std::string_view text;
  TokenType type;
};

constexpr std::array<MappingRule, 29> kMappingTable{{
    {"{%", TokenType::kOpenStatement},
    {"%}", TokenType::kCloseStatement},
    {"{{", TokenType::kOpenExpression},
    {"}}", TokenType::kCloseExpression},
    {"(", TokenType::kOpenParen},
    {")", TokenType::kCloseParen},
    {"{", TokenType::kOpenCurlyBracket},
    {"}", TokenType::kCloseCurlyBracket},
    {"[", TokenType::kOpenSquareBracket},
    {"]", TokenType::kCloseSquareBracket},
    {",", TokenType::kComma},
    {".", TokenType::kDot},
    {":", TokenType::kColon},
    {"|", TokenType::kPipe},
    {"<=", TokenType::kComparisonOperator},
    {">=", TokenType::kComparisonOperator},
    {"==", TokenType::kComparisonOperator},
    {"!=", TokenType::kComparisonOperator},
    {"<", TokenType::kComparisonOperator},
    {">", TokenType::kComparisonOperator},
    {"+", TokenType::kAdditiveOperator},
    {"-", TokenType::kAdditiveOperator},
    {"~", TokenType::kAdditiveOperator},
    {"**", TokenType::kExponentiationOperator},
    {"*", TokenType::kMultiplicativeOperator},
    {"//", TokenType::kMultiplicativeOperator},
    {"/", TokenType::kMultiplicativeOperator},
    {"%", TokenType::kMultiplicativeOperator},
    {"=", TokenType::kEquals},
}};

class Lexer {
 public:
  Lexer(std::string_view source, MappedText mapped) : source_(source), mapped_(std::move(mapped)), src_(mapped_.text) {}

  std::vector<Token> run() {
    while (cursor_ < src_.size()) step();
    return std::move(tokens_);
  }

 private:
  [[noreturn]] void fail(size_t at, const std::string& message) const {
    const uint32_t offset = mapped_.origin[std::min(at, mapped_.origin.size() - 1)];
    const SourcePosition position = position_of(source_, offset);
    raise(ErrorCode::kInvalidArgument, "chat template: syntax error at line {}:{}: {}", position.line,
          position.column, message);
  }

  char at(size_t pos) const { return pos < src_.size() ? src_[pos] : '\0'; }
  bool starts(std::string_view text) const { return src_.compare(cursor_, text.size(), text) == 0; }
  void push(TokenType type, std::string value, size_t start) {
    tokens_.push_back(Token{type, std::move(value), mapped_.origin[start]});
  }
  TokenType last_type(bool& has_last) const {
    has_last = !tokens_.empty();
    return has_last ? tokens_.back().type : TokenType::kText;
  }

  // consumeWhile of the reference lexer for whitespace: it fails when the input ends inside a tag.
  void skip_tag_whitespace() {
    while (size_t n = space_length_at(src_, cursor_)) {
      cursor_ += n;
      if (cursor_ >= src_.size()) fail(cursor_, "Unexpected end of input");
    }
  }

  std::string consume_digits() {
    std::string digits;
    while (is_digit(at(cursor_))) {
      digits += src_[cursor_++];
      if (cursor_ >= src_.size()) fail(cursor_, "Unexpected end of input");
    }
    return digits;
  }

  void strip_trailing_whitespace() {
    if (tokens_.empty() || tokens_.back().type != TokenType::kText) return;
    std::string& value = tokens_.back().value;
    value.resize(js_trim_end(value).size());
    if (value.empty()) tokens_.pop_back();
  }

  void skip_leading_whitespace() {
    while (size_t n = space_length_at(src_, cursor_)) cursor_ += n;
  }

  // {% raw %}...{% endraw %}: the body is text, uninterpreted. Returns false when the tag at the
  // cursor is not a raw tag.
  bool try_raw_block() {
    size_t p = cursor_ + 2;
    const bool strip_before = at(p) == '-';
    if (strip_before) ++p;
    while (size_t n = space_length_at(src_, p)) p += n;
    if (src_.compare(p, 3, "raw") != 0 || is_word(at(p + 3))) return false;
    p += 3;
    while (size_t n = space_length_at(src_, p)) p += n;
    const bool strip_after_open = at(p) == '-';
    if (strip_after_open) ++p;
    if (src_.compare(p, 2, "%}") != 0) return false;
    p += 2;
    if (strip_before) strip_trailing_whitespace();
    size_t body_start = p;
    if (strip_after_open) {
      while (size_t n = space_length_at(src_, body_start)) body_start += n;
    }
    for (size_t search = src_.find("{%", body_start); search != std::string::npos; search = src_.find("{%", search + 2)) {
      size_t q = search + 2;
      const bool strip_before_close = at(q) == '-';
      if (strip_before_close) ++q;
      while (size_t n = space_length_at(src_, q)) q += n;
      if (src_.compare(q, 6, "endraw") != 0 || is_word(at(q + 6))) continue;
      q += 6;
      while (size_t n = space_length_at(src_, q)) q += n;
      const bool strip_after_close = at(q) == '-';
      if (strip_after_close) ++q;
      if (src_.compare(q, 2, "%}") != 0) continue;
      std::string body = src_.substr(body_start, search - body_start);
      if (strip_before_close) body.resize(js_trim_end(body).size());
      if (!body.empty()) push(TokenType::kText, std::move(body), body_start);
      // An empty comment keeps the lexer in "text next" state, as after a closing tag.
      push(TokenType::kComment, "", search);
      cursor_ = q + 2;
      if (strip_after_close) skip_leading_whitespace();
      return true;
    }
    fail(cursor_, "Missing {% endraw %}");
  }

  void step() {
    bool has_last = false;
    const TokenType last = last_type(has_last);
    if (!has_last || last == TokenType::kCloseStatement || last == TokenType::kCloseExpression ||
        last == TokenType::kComment) {
      const size_t start = cursor_;
      while (cursor_ < src_.size() &&
             !(src_[cursor_] == '{' && (at(cursor_ + 1) == '%' || at(cursor_ + 1) == '{' || at(cursor_ + 1) == '#'))) {
        ++cursor_;
      }
      if (cursor_ > start) {
        push(TokenType::kText, src_.substr(start, cursor_ - start), start);
        return;
      }
    }

    if (starts("{#")) {
      const size_t start = cursor_;
      cursor_ += 2;
      const bool strip_before = at(cursor_) == '-';
      if (strip_before) ++cursor_;
      std::string comment;
      while (at(cursor_) != '#' || at(cursor_ + 1) != '}') {
        if (cursor_ + 2 >= src_.size()) fail(start, "Missing end of comment tag");
        comment += src_[cursor_++];
      }
      const bool strip_after = !comment.empty() && comment.back() == '-';
      if (strip_after) comment.pop_back();
      if (strip_before) strip_trailing_whitespace();
      push(TokenType::kComment, std::move(comment), start);
      cursor_ += 2;
      if (strip_after) skip_leading_whitespace();
      return;
    }

    if (starts("{%") && try_raw_block()) return;

    if (starts("{%-")) {
      strip_trailing_whitespace();
      push(TokenType::kOpenStatement, "{%", cursor_);
      cursor_ += 3;
      return;
    }
    if (starts("{{-")) {
      strip_trailing_whitespace();
      push(TokenType::kOpenExpression, "{{", cursor_);
      curly_depth_ = 0;
      cursor_ += 3;
      return;
    }

    skip_tag_whitespace();

    if (starts("-%}")) {
      push(TokenType::kCloseStatement, "%}", cursor_);
      cursor_ += 3;
      skip_leading_whitespace();
      return;
    }
    if (starts("-}}")) {
      push(TokenType::kCloseExpression, "}}", cursor_);
      cursor_ += 3;
      skip_leading_whitespace();
      return;
    }

    const char c = at(cursor_);
    if (c == '-' || c == '+') {
      bool has_previous = false;
      const TokenType previous = last_type(has_previous);
      if (!has_previous || previous == TokenType::kText) fail(cursor_, std::string("Unexpected character: ") + c);
      const bool binary = previous == TokenType::kIdentifier || previous == TokenType::kNumericLiteral ||
                          previous == TokenType::kStringLiteral || previous == TokenType::kCloseParen ||
                          previous == TokenType::kCloseSquareBracket;
      if (!binary) {
        const size_t start = cursor_;
        ++cursor_;
        std::string number = consume_digits();
        if (!number.empty() && at(cursor_) == '.' && is_digit(at(cursor_ + 1))) {
          ++cursor_;
          number += "." + consume_digits();
        }
        push(number.empty() ? TokenType::kUnaryOperator : TokenType::kNumericLiteral, std::string(1, c) + number,
             start);
        return;
      }
    }

    for (const MappingRule& rule : kMappingTable) {
      if (rule.text == "}}" && curly_depth_ > 0) continue;
      if (!starts(rule.text)) continue;
      push(rule.type, std::string(rule.text), cursor_);
      if (rule.type == TokenType::kOpenExpression) {
        curly_depth_ = 0;
      } else if (rule.type == TokenType::kOpenCurlyBracket) {
        ++curly_depth_;
      } else if (rule.type == TokenType::kCloseCurlyBracket) {
        --curly_depth_;
      }
      cursor_ += rule.text.size();
      return;
    }

    if (c == '\'' || c == '"') {
      const size_t start = cursor_;
      ++cursor_;
      std::string value;
      while (at(cursor_) != c) {
        if (cursor_ >= src_.size()) fail(start, "Unexpected end of input");
        if (src_[cursor_] == '\\') {
          ++cursor_;
          if (cursor_ >= src_.size()) fail(start, "Unexpected end of input");
          const char escaped = src_[cursor_++];
          if (escaped == 'x' || escaped == 'u') {
            const size_t length = escaped == 'x' ? 2 : 4;
            const std::string hex = src_.substr(cursor_, length);
            if (hex.size() != length || hex.find_first_not_of("0123456789abcdefABCDEF") != std::string::npos) {
              fail(cursor_, "Invalid hexadecimal escape sequence: \\" + std::string(1, escaped) + hex);
            }
            append_utf8(value, static_cast<char32_t>(std::stoul(hex, nullptr, 16)));
            cursor_ += length;
            continue;
          }
          switch (escaped) {
            case 'n': value += '\n'; break;
            case 't': value += '\t'; break;
            case 'r': value += '\r'; break;
            case 'b': value += '\b'; break;
            case 'f': value += '\f'; break;
            case 'v': value += '\v'; break;
            case '\'': value += '\''; break;
            case '"': value += '"'; break;
            case '\\': value += '\\'; break;
            default: fail(cursor_ - 1, std::string("Unexpected escaped character: ") + escaped);
          }
          continue;
        }
        value += src_[cursor_++];
        if (cursor_ >= src_.size()) fail(start, "Unexpected end of input");
      }
      ++cursor_;
      push(TokenType::kStringLiteral, std::move(value), start);
      return;
    }

    if (is_digit(c)) {
      const size_t start = cursor_;
      std::string number = consume_digits();
      if (!(tokens_.back().type == TokenType::kDot) && at(cursor_) == '.' && is_digit(at(cursor_ + 1))) {
        ++cursor_;
        number += "." + consume_digits();
      }
      push(TokenType::kNumericLiteral, std::move(number), start);
      return;
    }
    if (is_word(c)) {
      const size_t start = cursor_;
      std::string word;
      while (is_word(at(cursor_))) {
        word += src_[cursor_++];
        if (cursor_ >= src_.size()) fail(cursor_, "Unexpected end of input");
      }
      push(TokenType::kIdentifier, std::move(word), start);
      return;
    }
    size_t end = cursor_;
    decode_code_point(src_, end);
    fail(cursor_, "Unexpected character: " + src_.substr(cursor_, end - cursor_));
  }

  std::string_view source_;
  MappedText mapped_;
  const std::string& src_;
  size_t cursor_ = 0;
  int curly_depth_ = 0;
  std::vector<Token> tokens_;
};

}  // namespace

std::vector<Token> tokenize(std::string_view source) {
  return Lexer(source, preprocess(source)).run();
}

}  // namespace metrale::text::jinja
