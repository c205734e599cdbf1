// Tokens of a chat template, as @huggingface/jinja's lexer produces them with the options
// transformers.js uses (trim_blocks and lstrip_blocks on, one trailing newline dropped, the
// transformers-specific {% generation %} tags removed), plus {% raw %} blocks.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace metrale::text::jinja {

enum class TokenType : uint8_t {
  kText,
  kNumericLiteral,
  kStringLiteral,
  kIdentifier,
  kEquals,
  kOpenParen,
  kCloseParen,
  kOpenStatement,
  kCloseStatement,
  kOpenExpression,
  kCloseExpression,
  kOpenSquareBracket,
  kCloseSquareBracket,
  kOpenCurlyBracket,
  kCloseCurlyBracket,
  kComma,
  kDot,
  kColon,
  kPipe,
  kAdditiveOperator,        // + - ~
  kMultiplicativeOperator,  // * / // %
  kExponentiationOperator,  // **
  kComparisonOperator,      // < > <= >= == !=
  kUnaryOperator,           // a lone + or - before an operand
  kComment,
};

const char* token_type_name(TokenType type);

struct Token {
  TokenType type;
  std::string value;
  uint32_t offset;  // byte offset of the token in the original template source
};

// Where an offset of the source lies, 1-based, columns counted in code points.
struct SourcePosition {
  uint32_t line;
  uint32_t column;
};
SourcePosition position_of(std::string_view source, uint32_t offset);

// Throws kInvalidArgument with "line L:C" for a lexical error.
std::vector<Token> tokenize(std::string_view source);

}  // namespace metrale::text::jinja
