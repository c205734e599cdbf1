// The interpreter behind render() (text/jinja_interpreter.h), shared by its two files (internal):
// jinja_interpreter.cpp runs statements and evaluates expressions (globals and macros included);
// jinja_filters.cpp holds the filters, the tests, the methods of strings, arrays and objects, and the
// string helpers they use.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "text/jinja_interpreter.h"

namespace metrale::text::jinja::detail {

// A failure located in the template; converted to metrale::Error at the top of render().
struct TemplateFailure {
  std::string message;
  uint32_t offset;
};

enum class Flow : uint8_t { kNormal, kBreak, kContinue };

// The code points of `text`, each as its UTF-8 bytes.
std::vector<std::string> code_points(std::string_view text);

class Interpreter {
 public:
  Interpreter(std::string_view source, const RenderContext& context) : source_(source), context_(context) {}

  std::string run(const std::vector<NodePtr>& program);

 private:
  struct DepthGuard;

  [[noreturn]] void fail(std::string message) const { throw TemplateFailure{std::move(message), current_offset_}; }

  void check_size(const std::string& text) const {
    if (text.size() > context_.limits.max_string_bytes) {
      fail(fmt::format("string longer than {} bytes", context_.limits.max_string_bytes));
    }
  }
  Value make_string(std::string text) const {
    check_size(text);
    return Value::string(std::move(text));
  }

  // ---------------------------------------------------------------- globals (jinja_interpreter.cpp)
  void install_globals(Env& env);

  // ---------------------------------------------------------------- statements
  Flow exec_block(const std::vector<NodePtr>& statements, Env& env, std::string& out);
  void append_output(std::string& out, std::string_view text) const;
  Flow exec(const Node& node, Env& env, std::string& out);
  void bind_target(const Node& target, const Value& value, Env& env);
  void exec_set(const Node& node, Env& env);
  void exec_for(const Node& node, Env& env, std::string& out);

  // ---------------------------------------------------------------- macros
  static void collect_special_names(const Node& node, bool& kwargs, bool& varargs);
  void bind_macro_arguments(const std::string& display_name, const std::vector<NodePtr>& parameters,
                            const std::vector<NodePtr>& body, CallArgs& args, Env& scope);
  void define_macro(const Node& node, Env& env);
  Value exec_call_block(const Node& node, Env& env);

  // ---------------------------------------------------------------- expressions
  CallArgs evaluate_arguments(const std::vector<NodePtr>& arguments, Env& env);
  Value evaluate(const Node& node, Env& env);
  Value evaluate_member(const Node& node, Env& env);
  std::optional<int64_t> slice_bound(const Node* node, Env& env, const char* what);
  Value evaluate_slice(const Value& object, const Node& slice, Env& env);
  Value evaluate_unary(const Node& node, Env& env);
  Value arithmetic(const std::string& op, const Value& left, const Value& right);
  Value evaluate_binary(const Node& node, Env& env);
  static std::string concat_text(const Value& value);

  // ---------------------------------------------------------------- tests (jinja_filters.cpp)
  bool run_test(const std::string& name, const Value& operand, const Value* argument);

  // ---------------------------------------------------------------- builtins (methods)
  Value builtin(const Value& object, const std::string& name);
  Value string_builtin(const Value& self, const std::string& name);
  Value string_replace(const std::string& text, CallArgs& args);
  Value object_items(const Value& self);
  Value object_builtin(const Value& self, const std::string& name);
  static Value argument(const CallArgs& args, size_t index, std::string_view keyword, Value fallback);
  int compare_values(const Value& a, const Value& b, bool case_sensitive);
  static Value attribute_path(const Value& item, const std::string& path);

  // ---------------------------------------------------------------- filters
  Value apply_filter(const Value& operand, const Node& filter, Env& env);
  Value json_filter(const Value& operand, const CallArgs* args);
  Value join_filter(const Value& operand, const CallArgs* args);
  Value indent_filter(const std::string& text, const CallArgs* args);
  Value sort_filter(const Value& operand, const CallArgs* args);
  Value select_attribute_filter(const Value& operand, const std::string& name, const Node& filter, Env& env);
  Value select_filter(const Value& operand, const std::string& name, const CallArgs* args);
  Value map_filter(const Value& operand, const CallArgs* args, Env& env);
  Value apply_named_filter(const Value& operand, const std::string& name, const CallArgs* args, const Node* filter,
                           Env& env);
  // The filters of one operand type, dispatched from apply_named_filter.
  Value array_value_filter(const Value& operand, const std::string& name, const CallArgs* args, const Node* filter,
                           Env& env);
  Value string_value_filter(const Value& operand, const std::string& name, const CallArgs* args);
  Value numeric_value_filter(const Value& operand, const std::string& name, const CallArgs* args);
  Value object_value_filter(const Value& operand, const std::string& name, const CallArgs* args, Env& env);
  static Value parse_number(const std::string& text, bool integer, const Value& fallback);

  std::string_view source_;
  const RenderContext& context_;
  uint32_t current_offset_ = 0;
  int depth_ = 0;
  int64_t steps_ = 0;
};

}  // namespace metrale::text::jinja::detail
