#include "text/jinja_parser.h"

#include <charconv>
#include <cstdlib>

#include "core/error.h"

namespace metrale::text::jinja {
namespace {

// Nesting deeper than this (statements or expressions) is rejected: it would only come from a
// hostile template and would otherwise risk the stack.
constexpr int kMaxNesting = 200;

class Parser {
 public:
  Parser(const std::vector<Token>& tokens, std::string_view source) : tokens_(tokens), source_(source) {}

  std::vector<NodePtr> run() {
    std::vector<NodePtr> program;
    while (current_ < tokens_.size()) program.push_back(parse_any());
    return program;
  }

 private:
  struct DepthGuard {
    explicit DepthGuard(Parser& parser) : parser_(parser) {
      if (++parser_.depth_ > kMaxNesting) parser_.fail("template nested too deeply");
    }
    ~DepthGuard() { --parser_.depth_; }
    DepthGuard(const DepthGuard&) = delete;
    DepthGuard& operator=(const DepthGuard&) = delete;
    Parser& parser_;
  };

  [[noreturn]] void fail(const std::string& message) const {
    const uint32_t offset = current_ < tokens_.size() ? tokens_[current_].offset
                            : tokens_.empty()         ? 0
                                                      : tokens_.back().offset;
    const SourcePosition position = position_of(source_, offset);
    raise(ErrorCode::kInvalidArgument, "chat template: syntax error at line {}:{}: {}", position.line,
          position.column, message);
  }

  const Token& peek(size_t ahead = 0) const {
    if (current_ + ahead >= tokens_.size()) {
      const_cast<Parser*>(this)->current_ = tokens_.size();
      fail("unexpected end of template");
    }
    return tokens_[current_ + ahead];
  }
  bool has(size_t ahead = 0) const { return current_ + ahead < tokens_.size(); }
  bool is(TokenType type) const { return has() && tokens_[current_].type == type; }
  bool is_identifier(std::string_view name, size_t ahead = 0) const {
    return has(ahead) && tokens_[current_ + ahead].type == TokenType::kIdentifier &&
           tokens_[current_ + ahead].value == name;
  }
  bool is_statement(std::initializer_list<std::string_view> names) const {
    if (!has(1) || tokens_[current_].type != TokenType::kOpenStatement ||
        tokens_[current_ + 1].type != TokenType::kIdentifier) {
      return false;
    }
    for (std::string_view name : names) {
      if (tokens_[current_ + 1].value == name) return true;
    }
    return false;
  }
  const Token& expect(TokenType type, std::string_view what) {
    if (!has()) fail(fmt::format("{}, got the end of the template", what));
    if (tokens_[current_].type != type) {
      fail(fmt::format("{}, got {} '{}'", what, token_type_name(tokens_[current_].type), tokens_[current_].value));
    }
    return tokens_[current_++];
  }
  void expect_identifier(std::string_view name) {
    if (!is_identifier(name)) fail(fmt::format("expected '{}'", name));
    ++current_;
  }
  // Statement bodies run until one of the closing tags; the end of the template is an error.
  std::vector<NodePtr> parse_body_until(std::initializer_list<std::string_view> closers, std::string_view opened) {
    std::vector<NodePtr> body;
    while (!is_statement(closers)) {
      if (!has()) fail(fmt::format("unclosed '{}' block", opened));
      body.push_back(parse_any());
    }
    return body;
  }

  NodePtr make(NodeKind kind, uint32_t offset) {
    auto node = std::make_unique<Node>();
    node->kind = kind;
    node->offset = offset;
    return node;
  }

  NodePtr parse_any() {
    DepthGuard guard(*this);
    const Token& token = peek();
    switch (token.type) {
      case TokenType::kComment:
        ++current_;
        return make(NodeKind::kComment, token.offset);
      case TokenType::kText: {
        auto node = make(NodeKind::kText, token.offset);
        node->text = token.value;
        ++current_;
        return node;
      }
      case TokenType::kOpenStatement:
        return parse_statement();
      case TokenType::kOpenExpression: {
        ++current_;
        NodePtr expression = parse_expression();
        expect(TokenType::kCloseExpression, "expected '}}'");
        return expression;
      }
      default:
        fail(fmt::format("unexpected {} '{}'", token_type_name(token.type), token.value));
    }
  }

  NodePtr parse_statement() {
    expect(TokenType::kOpenStatement, "expected '{%'");
    const Token& name_token = peek();
    if (name_token.type != TokenType::kIdentifier) {
      fail(fmt::format("unknown statement, got {}", token_type_name(name_token.type)));
    }
    const std::string name = name_token.value;
    const uint32_t offset = name_token.offset;
    ++current_;
    if (name == "set") return parse_set(offset);
    if (name == "if") {
      NodePtr node = parse_if(offset);
      expect(TokenType::kOpenStatement, "expected '{% endif %}'");
      expect_identifier("endif");
      expect(TokenType::kCloseStatement, "expected '%}'");
      return node;
    }
    if (name == "macro") {
      auto node = make(NodeKind::kMacro, offset);
      const Token& macro_name = expect(TokenType::kIdentifier, "expected a macro name");
      node->text = macro_name.value;
      node->list_b = parse_arguments(true);
      expect(TokenType::kCloseStatement, "expected '%}'");
      node->list_a = parse_body_until({"endmacro"}, "macro");
      expect(TokenType::kOpenStatement, "expected '{%'");
      expect_identifier("endmacro");
      expect(TokenType::kCloseStatement, "expected '%}'");
      return node;
    }
    if (name == "for") {
      NodePtr node = parse_for(offset);
      expect(TokenType::kOpenStatement, "expected '{% endfor %}'");
      expect_identifier("endfor");
      expect(TokenType::kCloseStatement, "expected '%}'");
      return node;
    }
    if (name == "call") {
      auto node = make(NodeKind::kCallBlock, offset);
      if (is(TokenType::kOpenParen)) node->list_b = parse_arguments(true);
      NodePtr callee = parse_primary();
      if (callee->kind != NodeKind::kIdentifier) fail("expected an identifier after 'call'");
      auto call = make(NodeKind::kCall, callee->offset);
      call->list_a = parse_arguments(false);
      call->a = std::move(callee);
      node->a = std::move(call);
      expect(TokenType::kCloseStatement, "expected '%}'");
      node->list_a = parse_body_until({"endcall"}, "call");
      expect(TokenType::kOpenStatement, "expected '{%'");
      expect_identifier("endcall");
      expect(TokenType::kCloseStatement, "expected '%}'");
      return node;
    }
    if (name == "break" || name == "continue") {
      expect(TokenType::kCloseStatement, "expected '%}'");
      return make(name == "break" ? NodeKind::kBreak : NodeKind::kContinue, offset);
    }
    if (name == "filter") {
      auto node = make(NodeKind::kFilterBlock, offset);
      NodePtr filter = parse_primary();
      if (filter->kind == NodeKind::kIdentifier && is(TokenType::kOpenParen)) filter = parse_call(std::move(filter));
      if (filter->kind != NodeKind::kIdentifier && filter->kind != NodeKind::kCall) fail("expected a filter name");
      node->a = std::move(filter);
      expect(TokenType::kCloseStatement, "expected '%}'");
      node->list_a = parse_body_until({"endfilter"}, "filter");
      expect(TokenType::kOpenStatement, "expected '{%'");
      expect_identifier("endfilter");
      expect(TokenType::kCloseStatement, "expected '%}'");
      return node;
    }
    --current_;
    fail(fmt::format("unknown statement '{}'", name));
  }

  NodePtr parse_set(uint32_t offset) {
    auto node = make(NodeKind::kSet, offset);
    node->a = parse_expression_sequence(false);
    if (is(TokenType::kEquals)) {
      ++current_;
      node->b = parse_expression_sequence(false);
    } else {
      expect(TokenType::kCloseStatement, "expected '=' or '%}'");
      node->list_a = parse_body_until({"endset"}, "set");
      expect(TokenType::kOpenStatement, "expected '{%'");
      expect_identifier("endset");
    }
    expect(TokenType::kCloseStatement, "expected '%}'");
    return node;
  }

  NodePtr parse_if(uint32_t offset) {
    DepthGuard guard(*this);
    auto node = make(NodeKind::kIf, offset);
    node->a = parse_expression();
    expect(TokenType::kCloseStatement, "expected '%}'");
    node->list_a = parse_body_until({"elif", "else", "endif"}, "if");
    if (is_statement({"elif"})) {
      const uint32_t elif_offset = tokens_[current_ + 1].offset;
      current_ += 2;
      node->list_b.push_back(parse_if(elif_offset));
    } else if (is_statement({"else"})) {
      current_ += 2;
      expect(TokenType::kCloseStatement, "expected '%}'");
      node->list_b = parse_body_until({"endif"}, "if");
    }
    return node;
  }

  NodePtr parse_for(uint32_t offset) {
    auto node = make(NodeKind::kFor, offset);
    node->a = parse_expression_sequence(true);
    if (node->a->kind != NodeKind::kIdentifier && node->a->kind != NodeKind::kTuple) {
      fail("expected an identifier or a tuple for the loop variable");
    }
    if (!is_identifier("in")) fail("expected 'in' after the loop variable");
    ++current_;
    node->b = parse_expression();
    expect(TokenType::kCloseStatement, "expected '%}'");
    node->list_a = parse_body_until({"endfor", "else"}, "for");
    if (is_statement({"else"})) {
      current_ += 2;
      expect(TokenType::kCloseStatement, "expected '%}'");
      node->list_b = parse_body_until({"endfor"}, "for");
    }
    return node;
  }

  NodePtr parse_expression_sequence(bool primary) {
    const uint32_t offset = peek().offset;
    NodePtr first = primary ? parse_primary() : parse_expression();
    if (!is(TokenType::kComma)) return first;
    auto tuple = make(NodeKind::kTuple, offset);
    tuple->list_a.push_back(std::move(first));
    while (is(TokenType::kComma)) {
      ++current_;
      tuple->list_a.push_back(primary ? parse_primary() : parse_expression());
    }
    return tuple;
  }

  NodePtr parse_expression() {
    DepthGuard guard(*this);
    return parse_if_expression();
  }

  NodePtr parse_if_expression() {
    NodePtr value = parse_logical_or();
    if (!is_identifier("if")) return value;
    const uint32_t offset = peek().offset;
    ++current_;
    NodePtr test = parse_logical_or();
    if (is_identifier("else")) {
      ++current_;
      auto node = make(NodeKind::kTernary, offset);
      node->a = std::move(test);
      node->b = std::move(value);
      node->c = parse_if_expression();
      return node;
    }
    auto node = make(NodeKind::kSelect, offset);
    node->a = std::move(value);
    node->b = std::move(test);
    return node;
  }

  NodePtr binary(std::string op, uint32_t offset, NodePtr left, NodePtr right) {
    auto node = make(NodeKind::kBinary, offset);
    node->text = std::move(op);
    node->a = std::move(left);
    node->b = std::move(right);
    return node;
  }

  NodePtr parse_logical_or() {
    NodePtr left = parse_logical_and();
    while (is_identifier("or")) {
      const uint32_t offset = tokens_[current_++].offset;
      left = binary("or", offset, std::move(left), parse_logical_and());
    }
    return left;
  }

  NodePtr parse_logical_and() {
    NodePtr left = parse_logical_not();
    while (is_identifier("and")) {
      const uint32_t offset = tokens_[current_++].offset;
      left = binary("and", offset, std::move(left), parse_logical_not());
    }
    return left;
  }

  NodePtr parse_logical_not() {
    if (!is_identifier("not")) return parse_comparison();
    DepthGuard guard(*this);
    auto node = make(NodeKind::kUnary, tokens_[current_++].offset);
    node->text = "not";
    node->a = parse_logical_not();
    return node;
  }

  NodePtr parse_comparison() {
    NodePtr left = parse_additive();
    while (true) {
      std::string op;
      uint32_t offset = 0;
      if (is_identifier("not") && is_identifier("in", 1)) {
        op = "not in";
        offset = tokens_[current_].offset;
        current_ += 2;
      } else if (is_identifier("in")) {
        op = "in";
        offset = tokens_[current_++].offset;
      } else if (is(TokenType::kComparisonOperator)) {
        op = tokens_[current_].value;
        offset = tokens_[current_++].offset;
      } else {
        break;
      }
      left = binary(std::move(op), offset, std::move(left), parse_additive());
    }
    return left;
  }

  NodePtr parse_additive() {
    NodePtr left = parse_multiplicative();
    while (is(TokenType::kAdditiveOperator)) {
      const Token& op = tokens_[current_++];
      left = binary(op.value, op.offset, std::move(left), parse_multiplicative());
    }
    return left;
  }

  NodePtr parse_multiplicative() {
    NodePtr left = parse_power();
    while (is(TokenType::kMultiplicativeOperator)) {
      const Token& op = tokens_[current_++];
      left = binary(op.value, op.offset, std::move(left), parse_power());
    }
    return left;
  }

  NodePtr parse_power() {
    NodePtr left = parse_test();
    while (is(TokenType::kExponentiationOperator)) {
      const Token& op = tokens_[current_++];
      left = binary(op.value, op.offset, std::move(left), parse_test());
    }
    return left;
  }

  NodePtr parse_test() {
    NodePtr operand = parse_filter_expression();
    while (is_identifier("is")) {
      const uint32_t offset = tokens_[current_++].offset;
      const bool negate = is_identifier("not");
      if (negate) ++current_;
      NodePtr test = parse_primary();
      if (test->kind != NodeKind::kIdentifier) fail("expected a test name after 'is'");
      auto node = make(NodeKind::kTest, offset);
      node->a = std::move(operand);
      node->text = test->text;
      node->flag = negate;
      operand = std::move(node);
    }
    return operand;
  }

  NodePtr parse_filter_expression() {
    NodePtr operand = parse_unary_sign();
    while (is(TokenType::kPipe)) {
      const uint32_t offset = tokens_[current_++].offset;
      NodePtr filter = parse_primary();
      if (filter->kind != NodeKind::kIdentifier) fail("expected a filter name after '|'");
      if (is(TokenType::kOpenParen)) filter = parse_call(std::move(filter));
      auto node = make(NodeKind::kFilter, offset);
      node->a = std::move(operand);
      node->b = std::move(filter);
      operand = std::move(node);
    }
    return operand;
  }

  NodePtr parse_unary_sign() {
    if (has() && (tokens_[current_].type == TokenType::kUnaryOperator ||
                  tokens_[current_].type == TokenType::kAdditiveOperator) &&
        (tokens_[current_].value == "-" || tokens_[current_].value == "+")) {
      DepthGuard guard(*this);
      auto node = make(NodeKind::kUnary, tokens_[current_].offset);
      node->text = tokens_[current_++].value;
      node->a = parse_unary_sign();
      return node;
    }
    NodePtr member = parse_member(parse_primary());
    if (is(TokenType::kOpenParen)) return parse_call(std::move(member));
    return member;
  }

  NodePtr parse_call(NodePtr callee) {
    DepthGuard guard(*this);
    auto node = make(NodeKind::kCall, callee->offset);
    node->list_a = parse_arguments(false);
    node->a = std::move(callee);
    NodePtr expression = parse_member(std::move(node));
    if (is(TokenType::kOpenParen)) expression = parse_call(std::move(expression));
    return expression;
  }

  // Call arguments, or (parameters = true) macro parameters with optional defaults.
  std::vector<NodePtr> parse_arguments(bool parameters) {
    expect(TokenType::kOpenParen, "expected '('");
    std::vector<NodePtr> arguments;
    bool saw_keyword = false;
    bool saw_spread = false;
    while (!is(TokenType::kCloseParen)) {
      if (!has()) fail("unclosed '('");
      const bool keyword_spread = is(TokenType::kExponentiationOperator);
      const bool positional_spread = is(TokenType::kMultiplicativeOperator) && tokens_[current_].value == "*";
      if (parameters && (keyword_spread || positional_spread)) fail("argument unpacking in a parameter list");
      if (keyword_spread) {
        auto node = make(NodeKind::kKeywordSpread, tokens_[current_++].offset);
        node->a = parse_expression();
        arguments.push_back(std::move(node));
        if (is(TokenType::kComma)) ++current_;
        if (!is(TokenType::kCloseParen)) fail("'**' must be applied to the final argument");
        break;
      }
      NodePtr argument;
      if (positional_spread) {
        if (saw_spread) fail("only one '*' argument unpacking is allowed");
        saw_spread = true;
        argument = make(NodeKind::kSpread, tokens_[current_++].offset);
        argument->a = parse_expression();
      } else {
        argument = parse_expression();
        if (is(TokenType::kEquals)) {
          ++current_;
          if (argument->kind != NodeKind::kIdentifier) fail("expected an identifier before '='");
          auto keyword = make(NodeKind::kKeywordArgument, argument->offset);
          keyword->text = argument->text;
          keyword->a = parse_expression();
          argument = std::move(keyword);
        }
        if (parameters && argument->kind != NodeKind::kIdentifier && argument->kind != NodeKind::kKeywordArgument) {
          fail("expected an identifier for a parameter");
        }
        if (argument->kind == NodeKind::kKeywordArgument) {
          saw_keyword = true;
        } else if (saw_keyword) {
          fail(parameters ? "non-default argument follows default argument"
                          : "positional arguments must come before keyword arguments");
        } else if (saw_spread) {
          fail("positional arguments must not follow '*' argument unpacking");
        }
      }
      arguments.push_back(std::move(argument));
      if (is(TokenType::kComma)) ++current_;
    }
    expect(TokenType::kCloseParen, "expected ')'");
    return arguments;
  }

  NodePtr parse_subscript() {
    std::vector<NodePtr> slices;
    bool is_slice = false;
    const uint32_t offset = peek().offset;
    while (!is(TokenType::kCloseSquareBracket)) {
      if (!has()) fail("unclosed '['");
      if (is(TokenType::kColon)) {
        slices.push_back(nullptr);
        ++current_;
        is_slice = true;
      } else {
        slices.push_back(parse_expression());
        if (is(TokenType::kColon)) {
          ++current_;
          is_slice = true;
        }
      }
    }
    if (slices.empty()) fail("expected an index or a slice in '[]'");
    if (!is_slice) return std::move(slices[0]);
    if (slices.size() > 3) fail("expected at most 3 parts in a slice");
    auto node = make(NodeKind::kSlice, offset);
    node->a = std::move(slices[0]);
    if (slices.size() > 1) node->b = std::move(slices[1]);
    if (slices.size() > 2) node->c = std::move(slices[2]);
    return node;
  }

  NodePtr parse_member(NodePtr object) {
    while (is(TokenType::kDot) || is(TokenType::kOpenSquareBracket)) {
      DepthGuard guard(*this);
      const Token& op = tokens_[current_++];
      auto node = make(NodeKind::kMember, op.offset);
      node->flag = op.type == TokenType::kOpenSquareBracket;
      if (node->flag) {
        node->b = parse_subscript();
        expect(TokenType::kCloseSquareBracket, "expected ']'");
      } else {
        node->b = parse_primary();
        if (node->b->kind != NodeKind::kIdentifier && node->b->kind != NodeKind::kInteger) {
          fail("expected an identifier or an integer after '.'");
        }
      }
      node->a = std::move(object);
      object = std::move(node);
    }
    return object;
  }

  NodePtr parse_primary() {
    DepthGuard guard(*this);
    const Token& token = peek();
    ++current_;
    switch (token.type) {
      case TokenType::kNumericLiteral: {
        if (token.value.find('.') != std::string::npos) {
          auto node = make(NodeKind::kFloat, token.offset);
          node->float_value = std::strtod(token.value.c_str(), nullptr);
          return node;
        }
        auto node = make(NodeKind::kInteger, token.offset);
        const char* begin = token.value.data();
        const char* end = begin + token.value.size();
        if (*begin == '+') ++begin;
        if (std::from_chars(begin, end, node->int_value).ec != std::errc()) {
          --current_;
          fail(fmt::format("integer literal out of range: {}", token.value));
        }
        return node;
      }
      case TokenType::kStringLiteral: {
        auto node = make(NodeKind::kString, token.offset);
        node->text = token.value;
        while (is(TokenType::kStringLiteral)) node->text += tokens_[current_++].value;
        return node;
      }
      case TokenType::kIdentifier: {
        auto node = make(NodeKind::kIdentifier, token.offset);
        node->text = token.value;
        return node;
      }
      case TokenType::kOpenParen: {
        NodePtr expression = parse_expression_sequence(false);
        expect(TokenType::kCloseParen, "expected ')'");
        return expression;
      }
      case TokenType::kOpenSquareBracket: {
        auto node = make(NodeKind::kArray, token.offset);
        while (!is(TokenType::kCloseSquareBracket)) {
          if (!has()) fail("unclosed '['");
          node->list_a.push_back(parse_expression());
          if (is(TokenType::kComma)) ++current_;
        }
        ++current_;
        return node;
      }
      case TokenType::kOpenCurlyBracket: {
        auto node = make(NodeKind::kObject, token.offset);
        while (!is(TokenType::kCloseCurlyBracket)) {
          if (!has()) fail("unclosed '{'");
          node->list_a.push_back(parse_expression());
          expect(TokenType::kColon, "expected ':' in a dict literal");
          node->list_b.push_back(parse_expression());
          if (is(TokenType::kComma)) ++current_;
        }
        ++current_;
        return node;
      }
      default:
        --current_;
        fail(fmt::format("unexpected {} '{}'", token_type_name(token.type), token.value));
    }
  }

  const std::vector<Token>& tokens_;
  std::string_view source_;
  size_t current_ = 0;
  int depth_ = 0;
};

}  // namespace

std::vector<NodePtr> parse(const std::vector<Token>& tokens, std::string_view source) {
  return Parser(tokens, source).run();
}

}  // namespace metrale::text::jinja
