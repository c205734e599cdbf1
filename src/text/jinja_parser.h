// The syntax tree of a chat template and its parser, which follows @huggingface/jinja's grammar and
// operator precedence (filters bind tighter than unary minus, `is` tests tighter than `*`, `a if b`
// without `else` is a select expression).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "text/jinja_lexer.h"

namespace metrale::text::jinja {

enum class NodeKind : uint8_t {
  // statements
  kText,        // literal template text (text)
  kComment,
  kIf,          // test = a, body = list_a, alternate = list_b
  kFor,         // loop variable = a, iterable = b (a kSelect when filtered), body = list_a, else = list_b
  kSet,         // assignee = a, value = b (null: block set with body list_a)
  kMacro,       // name in text, parameters = list_b, body = list_a
  kCallBlock,   // call = a (a kCall), caller parameters = list_b, body = list_a
  kFilterBlock, // filter = a (kIdentifier or kCall), body = list_a
  kBreak,
  kContinue,
  // expressions
  kInteger,     // int_value
  kFloat,       // float_value
  kString,      // text
  kIdentifier,  // text
  kArray,       // list_a
  kTuple,       // list_a
  kObject,      // keys = list_a, values = list_b
  kMember,      // object = a, property = b, flag = computed
  kCall,        // callee = a, arguments = list_a
  kBinary,      // text = operator, a, b
  kUnary,       // text = operator, a
  kFilter,      // operand = a, filter = b (kIdentifier or kCall)
  kTest,        // operand = a, text = test name, flag = negated
  kSelect,      // value = a, condition = b
  kTernary,     // condition = a, true = b, false = c
  kSlice,       // start = a, stop = b, step = c (each may be null)
  kKeywordArgument,  // text = name, value = a
  kSpread,           // *a
  kKeywordSpread,    // **a
};

struct Node;
using NodePtr = std::unique_ptr<Node>;

struct Node {
  NodeKind kind;
  uint32_t offset = 0;  // source offset, for error messages
  std::string text;
  int64_t int_value = 0;
  double float_value = 0.0;
  bool flag = false;
  NodePtr a, b, c;
  std::vector<NodePtr> list_a, list_b;
};

// Parses the tokens into the top-level statement list; throws kInvalidArgument with the line and
// column of the offending token. `source` is used only for positions in messages.
std::vector<NodePtr> parse(const std::vector<Token>& tokens, std::string_view source);

}  // namespace metrale::text::jinja
