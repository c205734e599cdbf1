#include "text/jinja_interpreter.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <set>
#include <utf8proc.h>

#include "core/error.h"
#include "text/utf8.h"

namespace metrale::text::jinja {

const Value* Env::lookup(std::string_view name) const {
  for (const Env* env = this; env != nullptr; env = env->parent) {
    for (const auto& [key, value] : env->variables) {
      if (key == name) return &value;
    }
  }
  return nullptr;
}

void Env::set(std::string_view name, Value value) {
  for (auto& [key, existing] : variables) {
    if (key == name) {
      existing = std::move(value);
      return;
    }
  }
  variables.emplace_back(std::string(name), std::move(value));
}

namespace {

// A failure located in the template; converted to metrale::Error at the top of render().
struct TemplateFailure {
  std::string message;
  uint32_t offset;
};

enum class Flow : uint8_t { kNormal, kBreak, kContinue };

std::vector<std::string> code_points(std::string_view text) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t start = pos;
    decode_code_point(text, pos);
    out.emplace_back(text.substr(start, pos - start));
  }
  return out;
}

std::string map_code_points(std::string_view text, const std::function<char32_t(char32_t)>& map) {
  std::string out;
  out.reserve(text.size());
  size_t pos = 0;
  while (pos < text.size()) append_utf8(out, map(decode_code_point(text, pos)));
  return out;
}

std::string to_upper(std::string_view text) {
  return map_code_points(text, [](char32_t c) { return static_cast<char32_t>(utf8proc_toupper(static_cast<utf8proc_int32_t>(c))); });
}

std::string to_lower(std::string_view text) {
  return map_code_points(text, [](char32_t c) { return static_cast<char32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(c))); });
}

bool is_ascii_word(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
}

// JavaScript's value.replace(/\b\w/g, toUpperCase): ASCII word starts are capitalised, nothing else
// changes.
std::string title_case(std::string_view text) {
  std::string out(text);
  for (size_t i = 0; i < out.size(); ++i) {
    if (is_ascii_word(out[i]) && (i == 0 || !is_ascii_word(out[i - 1])) && out[i] >= 'a' && out[i] <= 'z') {
      out[i] = static_cast<char>(out[i] - 'a' + 'A');
    }
  }
  return out;
}

std::string capitalize(std::string_view text) {
  if (text.empty()) return "";
  size_t pos = 0;
  decode_code_point(text, pos);
  return to_upper(text.substr(0, pos)) + std::string(text.substr(pos));
}

std::vector<std::string> split_string(std::string_view text, std::string_view separator) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (true) {
    const size_t found = text.find(separator, start);
    if (found == std::string_view::npos) break;
    parts.emplace_back(text.substr(start, found - start));
    start = found + separator.size();
  }
  parts.emplace_back(text.substr(start));
  return parts;
}

// JavaScript's parseInt(text, 10); nullopt for NaN.
std::optional<int64_t> js_parse_int(std::string_view text) {
  text = js_trim_start(text);
  size_t pos = 0;
  bool negative = false;
  if (pos < text.size() && (text[pos] == '+' || text[pos] == '-')) negative = text[pos++] == '-';
  const size_t digits_start = pos;
  int64_t value = 0;
  while (pos < text.size() && text[pos] >= '0' && text[pos] <= '9') {
    value = value * 10 + (text[pos] - '0');
    ++pos;
    if (value > (int64_t{1} << 53)) break;
  }
  if (pos == digits_start) return std::nullopt;
  return negative ? -value : value;
}

// JavaScript's parseFloat(text); nullopt for NaN.
std::optional<double> js_parse_float(std::string_view text) {
  const std::string trimmed(js_trim_start(text));
  if (trimmed.rfind("Infinity", 0) == 0 || trimmed.rfind("+Infinity", 0) == 0) return HUGE_VAL;
  if (trimmed.rfind("-Infinity", 0) == 0) return -HUGE_VAL;
  // The longest prefix that is a decimal literal: sign, digits, fraction, exponent.
  size_t pos = 0;
  if (pos < trimmed.size() && (trimmed[pos] == '+' || trimmed[pos] == '-')) ++pos;
  size_t mantissa_digits = 0;
  while (pos < trimmed.size() && std::isdigit(static_cast<unsigned char>(trimmed[pos]))) ++pos, ++mantissa_digits;
  if (pos < trimmed.size() && trimmed[pos] == '.') {
    ++pos;
    while (pos < trimmed.size() && std::isdigit(static_cast<unsigned char>(trimmed[pos]))) ++pos, ++mantissa_digits;
  }
  if (mantissa_digits == 0) return std::nullopt;
  if (pos < trimmed.size() && (trimmed[pos] == 'e' || trimmed[pos] == 'E')) {
    size_t exponent = pos + 1;
    if (exponent < trimmed.size() && (trimmed[exponent] == '+' || trimmed[exponent] == '-')) ++exponent;
    if (exponent < trimmed.size() && std::isdigit(static_cast<unsigned char>(trimmed[exponent]))) {
      pos = exponent;
      while (pos < trimmed.size() && std::isdigit(static_cast<unsigned char>(trimmed[pos]))) ++pos;
    }
  }
  return std::strtod(trimmed.substr(0, pos).c_str(), nullptr);
}

std::string html_escape(std::string_view text) {
  std::string out;
  for (char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&#34;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

std::string strftime_subset(std::time_t time, std::string_view format) {
  std::tm local{};
  localtime_r(&time, &local);
  static constexpr const char* kMonths[] = {"January", "February", "March",     "April",   "May",      "June",
                                            "July",    "August",   "September", "October", "November", "December"};
  const auto pad2 = [](int n) { return fmt::format("{:02d}", n); };
  std::string out;
  for (size_t i = 0; i < format.size(); ++i) {
    if (format[i] != '%' || i + 1 >= format.size()) {
      out += format[i];
      continue;
    }
    const char spec = format[i + 1];
    switch (spec) {
      case 'Y': out += std::to_string(local.tm_year + 1900); break;
      case 'm': out += pad2(local.tm_mon + 1); break;
      case 'd': out += pad2(local.tm_mday); break;
      case 'b': out += std::string(kMonths[local.tm_mon]).substr(0, 3); break;
      case 'B': out += kMonths[local.tm_mon]; break;
      case 'H': out += pad2(local.tm_hour); break;
      case 'M': out += pad2(local.tm_min); break;
      case '%': out += '%'; break;
      default:
        // @huggingface/jinja leaves other directives as written.
        out += '%';
        out += spec;
    }
    ++i;
  }
  return out;
}

// Python-style slicing as @huggingface/jinja's slice() does it.
std::vector<int64_t> slice_indices(int64_t length, std::optional<int64_t> start_opt, std::optional<int64_t> stop_opt,
                                   std::optional<int64_t> step_opt) {
  const int64_t step = step_opt.value_or(1);
  const int64_t direction = step > 0 ? 1 : step < 0 ? -1 : 0;
  int64_t start = 0;
  int64_t stop = 0;
  if (direction >= 0) {
    start = start_opt.value_or(0);
    start = start < 0 ? std::max<int64_t>(length + start, 0) : std::min(start, length);
    stop = stop_opt.value_or(length);
    stop = stop < 0 ? std::max<int64_t>(length + stop, 0) : std::min(stop, length);
  } else {
    start = start_opt.value_or(length - 1);
    start = start < 0 ? std::max<int64_t>(length + start, -1) : std::min(start, length - 1);
    stop = stop_opt.value_or(-1);
    stop = stop < -1 ? std::max<int64_t>(length + stop, -1) : std::min(stop, length - 1);
  }
  std::vector<int64_t> indices;
  if (direction == 0) return indices;
  for (int64_t i = start; direction * i < direction * stop; i += step) indices.push_back(i);
  return indices;
}

class Interpreter {
 public:
  Interpreter(std::string_view source, const RenderContext& context) : source_(source), context_(context) {}

  std::string run(const std::vector<NodePtr>& program) {
    Env globals;
    install_globals(globals);
    for (const auto& [name, value] : context_.variables) globals.set(name, value);
    std::string out;
    try {
      exec_block(program, globals, out);
    } catch (const TemplateFailure& failure) {
      const SourcePosition position = position_of(source_, failure.offset);
      raise(ErrorCode::kInvalidArgument, "chat template: line {}:{}: {}", position.line, position.column,
            failure.message);
    } catch (const Error& error) {
      const SourcePosition position = position_of(source_, current_offset_);
      raise(ErrorCode::kInvalidArgument, "chat template: line {}:{}: {}", position.line, position.column,
            error.what());
    }
    return out;
  }

 private:
  struct DepthGuard {
    DepthGuard(Interpreter& interpreter, const Node& node) : interpreter_(interpreter) {
      interpreter_.current_offset_ = node.offset;
      if (++interpreter_.depth_ > interpreter_.context_.limits.max_depth) {
        interpreter_.fail("template nesting or macro recursion too deep");
      }
      if (++interpreter_.steps_ > interpreter_.context_.limits.max_steps) {
        interpreter_.fail("template evaluation exceeded its step budget");
      }
    }
    ~DepthGuard() { --interpreter_.depth_; }
    DepthGuard(const DepthGuard&) = delete;
    DepthGuard& operator=(const DepthGuard&) = delete;
    Interpreter& interpreter_;
  };

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

  // ---------------------------------------------------------------- globals
  void install_globals(Env& env) {
    env.set("namespace", Value::function([this](CallArgs& args, Env&) {
      if (args.positional.size() > 1) fail(fmt::format("namespace expected at most 1 argument, got {}", args.positional.size()));
      Object entries;
      if (args.positional.size() == 1) {
        const Value& source = args.positional[0];
        if (source.is_object()) {
          for (const auto& [key, value] : source.as_object().entries) entries.set(key, value);
        } else if (source.is_array()) {
          for (const Value& pair : source.as_array()) {
            if (!pair.is_array() || pair.as_array().size() != 2 || !pair.as_array()[0].is_string()) {
              fail("namespace expected an object or an iterable of [key, value] pairs");
            }
            entries.set(pair.as_array()[0].as_string(), pair.as_array()[1]);
          }
        } else {
          fail(fmt::format("'{}' object is not iterable", source.type_name()));
        }
      }
      for (auto& [key, value] : args.keyword) entries.set(key, value);
      return Value::object(std::move(entries), /*is_namespace=*/true);
    }));
    env.set("false", Value::boolean(false));
    env.set("true", Value::boolean(true));
    env.set("none", Value::null());
    env.set("False", Value::boolean(false));
    env.set("True", Value::boolean(true));
    env.set("None", Value::null());
    env.set("raise_exception", Value::function([this](CallArgs& args, Env&) -> Value {
      std::string message = args.positional.empty() ? "" : args.positional[0].display();
      throw TemplateFailure{"raise_exception: " + message, current_offset_};
    }));
    env.set("range", Value::function([this](CallArgs& args, Env&) {
      std::vector<int64_t> bounds;
      for (const Value& arg : args.positional) {
        if (arg.kind() != ValueKind::kInt) fail(fmt::format("range() arguments must be integers, got {}", arg.type_name()));
        bounds.push_back(arg.as_int());
      }
      if (bounds.empty() || bounds.size() > 3) fail("range() takes 1 to 3 arguments");
      const int64_t start = bounds.size() == 1 ? 0 : bounds[0];
      const int64_t stop = bounds.size() == 1 ? bounds[0] : bounds[1];
      const int64_t step = bounds.size() == 3 ? bounds[2] : 1;
      if (step == 0) fail("range() step must not be zero");
      std::vector<Value> items;
      for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
        if (static_cast<int64_t>(items.size()) >= context_.limits.max_range) {
          fail(fmt::format("range() longer than {} elements", context_.limits.max_range));
        }
        items.push_back(Value::integer(i));
      }
      steps_ += static_cast<int64_t>(items.size());
      return Value::array(std::move(items));
    }));
    env.set("strftime_now", Value::function([this](CallArgs& args, Env&) {
      if (args.positional.empty() || !args.positional[0].is_string()) fail("strftime_now() expects a format string");
      const std::time_t now = context_.now.value_or(std::chrono::system_clock::to_time_t(std::chrono::system_clock::now()));
      return Value::string(strftime_subset(now, args.positional[0].as_string()));
    }));
  }

  // ---------------------------------------------------------------- statements
  Flow exec_block(const std::vector<NodePtr>& statements, Env& env, std::string& out) {
    for (const NodePtr& statement : statements) {
      const Flow flow = exec(*statement, env, out);
      if (flow != Flow::kNormal) return flow;
    }
    return Flow::kNormal;
  }

  void append_output(std::string& out, std::string_view text) const {
    out.append(text);
    check_size(out);
  }

  Flow exec(const Node& node, Env& env, std::string& out) {
    DepthGuard guard(*this, node);
    switch (node.kind) {
      case NodeKind::kText:
        append_output(out, node.text);
        return Flow::kNormal;
      case NodeKind::kComment:
      case NodeKind::kMacro:
        if (node.kind == NodeKind::kMacro) define_macro(node, env);
        return Flow::kNormal;
      case NodeKind::kIf:
        return exec_block(evaluate(*node.a, env).truthy() ? node.list_a : node.list_b, env, out);
      case NodeKind::kFor:
        exec_for(node, env, out);
        return Flow::kNormal;
      case NodeKind::kSet:
        exec_set(node, env);
        return Flow::kNormal;
      case NodeKind::kBreak:
        return Flow::kBreak;
      case NodeKind::kContinue:
        return Flow::kContinue;
      case NodeKind::kCallBlock:
        append_output(out, exec_call_block(node, env).display());
        return Flow::kNormal;
      case NodeKind::kFilterBlock: {
        std::string body;
        exec_block(node.list_a, env, body);
        const Value result = apply_filter(Value::string(std::move(body)), *node.a, env);
        if (!result.is_null() && !result.is_undefined()) append_output(out, result.display());
        return Flow::kNormal;
      }
      default: {
        const Value value = evaluate(node, env);
        if (!value.is_null() && !value.is_undefined()) append_output(out, value.display());
        return Flow::kNormal;
      }
    }
  }

  void bind_target(const Node& target, const Value& value, Env& env) {
    if (target.kind == NodeKind::kIdentifier) {
      env.set(target.text, value);
      return;
    }
    if (!value.is_array()) fail(fmt::format("Cannot unpack non-iterable type: {}", value.type_name()));
    const auto& items = value.as_array();
    if (items.size() != target.list_a.size()) {
      fail(fmt::format("Too {} items to unpack", target.list_a.size() > items.size() ? "few" : "many"));
    }
    for (size_t i = 0; i < items.size(); ++i) {
      if (target.list_a[i]->kind != NodeKind::kIdentifier) fail("Cannot unpack to a non-identifier");
      env.set(target.list_a[i]->text, items[i]);
    }
  }

  void exec_set(const Node& node, Env& env) {
    Value value;
    if (node.b) {
      value = evaluate(*node.b, env);
    } else {
      std::string body;
      exec_block(node.list_a, env, body);
      value = Value::string(std::move(body));
    }
    const Node& target = *node.a;
    if (target.kind == NodeKind::kIdentifier || target.kind == NodeKind::kTuple) {
      bind_target(target, value, env);
      return;
    }
    if (target.kind == NodeKind::kMember) {
      const Value object = evaluate(*target.a, env);
      if (object.kind() != ValueKind::kNamespace) fail("cannot assign attribute on non-namespace object");
      if (target.flag || target.b->kind != NodeKind::kIdentifier) fail("Cannot assign to member with non-identifier property");
      object.mutable_object().set(target.b->text, std::move(value));
      return;
    }
    fail("Invalid left-hand side of an assignment");
  }

  void exec_for(const Node& node, Env& env, std::string& out) {
    Env scope{&env, {}};
    const Node* test = nullptr;
    Value iterable;
    if (node.b->kind == NodeKind::kSelect) {
      iterable = evaluate(*node.b->a, scope);
      test = node.b->b.get();
    } else {
      iterable = evaluate(*node.b, scope);
    }
    std::vector<Value> keys_or_chars;
    const std::vector<Value>* source = nullptr;
    if (iterable.is_array()) {
      source = &iterable.as_array();
    } else if (iterable.is_object()) {
      for (const auto& entry : iterable.as_object().entries) keys_or_chars.push_back(Value::string(entry.first));
      source = &keys_or_chars;
    } else if (iterable.is_string()) {
      for (std::string& c : code_points(iterable.as_string())) keys_or_chars.push_back(Value::string(std::move(c)));
      source = &keys_or_chars;
    } else if (iterable.is_undefined()) {
      source = &keys_or_chars;
    } else {
      fail(fmt::format("Expected iterable or object type in for loop: got {}", iterable.type_name()));
    }
    std::vector<const Value*> items;
    items.reserve(source->size());
    for (const Value& item : *source) {
      if (test != nullptr) {
        Env loop_scope{&scope, {}};
        bind_target(*node.a, item, loop_scope);
        if (!evaluate(*test, loop_scope).truthy()) continue;
      }
      items.push_back(&item);
    }
    bool no_iteration = true;
    const int64_t count = static_cast<int64_t>(items.size());
    for (int64_t i = 0; i < count; ++i) {
      if (++steps_ > context_.limits.max_steps) fail("template evaluation exceeded its step budget");
      Object loop;
      loop.entries.reserve(9);
      loop.entries.emplace_back("index", Value::integer(i + 1));
      loop.entries.emplace_back("index0", Value::integer(i));
      loop.entries.emplace_back("revindex", Value::integer(count - i));
      loop.entries.emplace_back("revindex0", Value::integer(count - i - 1));
      loop.entries.emplace_back("first", Value::boolean(i == 0));
      loop.entries.emplace_back("last", Value::boolean(i == count - 1));
      loop.entries.emplace_back("length", Value::integer(count));
      loop.entries.emplace_back("previtem", i > 0 ? *items[static_cast<size_t>(i - 1)] : Value());
      loop.entries.emplace_back("nextitem", i < count - 1 ? *items[static_cast<size_t>(i + 1)] : Value());
      scope.set("loop", Value::object(std::move(loop)));
      bind_target(*node.a, *items[static_cast<size_t>(i)], scope);
      // As in @huggingface/jinja, an iteration left by break/continue contributes no output.
      const size_t mark = out.size();
      const Flow flow = exec_block(node.list_a, scope, out);
      if (flow == Flow::kContinue) {
        out.resize(mark);
        continue;
      }
      if (flow == Flow::kBreak) {
        out.resize(mark);
        break;
      }
      no_iteration = false;
    }
    if (no_iteration) exec_block(node.list_b, scope, out);
  }

  // ---------------------------------------------------------------- macros
  static void collect_special_names(const Node& node, bool& kwargs, bool& varargs) {
    if (node.kind == NodeKind::kIdentifier) {
      kwargs = kwargs || node.text == "kwargs";
      varargs = varargs || node.text == "varargs";
    }
    if (node.kind == NodeKind::kFilter) {
      collect_special_names(*node.a, kwargs, varargs);
      if (node.b->kind == NodeKind::kCall) {
        for (const NodePtr& child : node.b->list_a) collect_special_names(*child, kwargs, varargs);
      }
      return;
    }
    if (node.kind == NodeKind::kMember) {
      collect_special_names(*node.a, kwargs, varargs);
      if (node.flag) collect_special_names(*node.b, kwargs, varargs);
      return;
    }
    for (const Node* child : {node.a.get(), node.b.get(), node.c.get()}) {
      if (child != nullptr) collect_special_names(*child, kwargs, varargs);
    }
    for (const auto* list : {&node.list_a, &node.list_b}) {
      for (const NodePtr& child : *list) collect_special_names(*child, kwargs, varargs);
    }
  }

  void bind_macro_arguments(const std::string& display_name, const std::vector<NodePtr>& parameters,
                            const std::vector<NodePtr>& body, CallArgs& args, Env& scope) {
    bool uses_kwargs = false;
    bool uses_varargs = false;
    for (const NodePtr& statement : body) collect_special_names(*statement, uses_kwargs, uses_varargs);
    auto keyword = args.keyword;
    std::vector<const Node*> pending_defaults;
    for (size_t i = 0; i < parameters.size(); ++i) {
      const Node& parameter = *parameters[i];
      const std::string& name = parameter.text;
      std::optional<Value> value;
      if (i < args.positional.size()) value = args.positional[i];
      if (!value) {
        for (auto it = keyword.begin(); it != keyword.end(); ++it) {
          if (it->first == name) {
            value = it->second;
            keyword.erase(it);
            break;
          }
        }
      }
      if (!value && parameter.kind == NodeKind::kKeywordArgument) pending_defaults.push_back(&parameter);
      scope.set(name, value.value_or(Value()));
    }
    if (uses_kwargs) {
      Object remaining;
      for (auto& [key, value] : keyword) remaining.set(key, value);
      scope.set("kwargs", Value::object(std::move(remaining)));
    } else if (!keyword.empty()) {
      fail(fmt::format("macro {} takes no keyword argument '{}'", display_name, keyword.front().first));
    }
    if (uses_varargs) {
      std::vector<Value> rest;
      for (size_t i = parameters.size(); i < args.positional.size(); ++i) rest.push_back(args.positional[i]);
      scope.set("varargs", Value::array(std::move(rest)));
    } else if (args.positional.size() > parameters.size()) {
      fail(fmt::format("macro {} takes not more than {} argument(s)", display_name, parameters.size()));
    }
    for (const Node* parameter : pending_defaults) scope.set(parameter->text, evaluate(*parameter->a, scope));
  }

  void define_macro(const Node& node, Env& env) {
    const Node* macro = &node;
    env.set(node.text, Value::function([this, macro](CallArgs& args, Env& caller_env) {
      // The body sees the caller's scope (dynamic scoping, as @huggingface/jinja does).
      Env scope{&caller_env, {}};
      bind_macro_arguments("'" + macro->text + "'", macro->list_b, macro->list_a, args, scope);
      std::string out;
      exec_block(macro->list_a, scope, out);
      return Value::string(std::move(out));
    }));
  }

  Value exec_call_block(const Node& node, Env& env) {
    const Node* block = &node;
    Value caller = Value::function([this, block, &env](CallArgs& args, Env&) {
      Env scope{&env, {}};
      bind_macro_arguments("None", block->list_b, block->list_a, args, scope);
      std::string out;
      exec_block(block->list_a, scope, out);
      return Value::string(std::move(out));
    });
    CallArgs args = evaluate_arguments(node.a->list_a, env);
    const Value callee = evaluate(*node.a->a, env);
    if (callee.kind() != ValueKind::kFunction) fail(fmt::format("Cannot call something that is not a function: got {}", callee.type_name()));
    Env call_env{&env, {}};
    call_env.set("caller", std::move(caller));
    return callee.as_function()(args, call_env);
  }

  // ---------------------------------------------------------------- expressions
  CallArgs evaluate_arguments(const std::vector<NodePtr>& arguments, Env& env) {
    CallArgs args;
    for (const NodePtr& argument : arguments) {
      if (argument->kind == NodeKind::kSpread) {
        const Value value = evaluate(*argument->a, env);
        if (!value.is_array()) fail(fmt::format("Cannot unpack non-iterable type: {}", value.type_name()));
        for (const Value& item : value.as_array()) args.positional.push_back(item);
      } else if (argument->kind != NodeKind::kKeywordArgument && argument->kind != NodeKind::kKeywordSpread) {
        args.positional.push_back(evaluate(*argument, env));
      }
    }
    const auto add_keyword = [&](const std::string& key, Value value) {
      if (args.find_keyword(key) != nullptr) fail(fmt::format("Got multiple values for keyword argument '{}'", key));
      args.keyword.emplace_back(key, std::move(value));
    };
    for (const NodePtr& argument : arguments) {
      if (argument->kind == NodeKind::kKeywordArgument) {
        add_keyword(argument->text, evaluate(*argument->a, env));
      } else if (argument->kind == NodeKind::kKeywordSpread) {
        const Value value = evaluate(*argument->a, env);
        if (!value.is_object()) fail(fmt::format("Argument after ** must be a mapping, not {}", value.type_name()));
        for (const auto& [key, item] : value.as_object().entries) add_keyword(key, item);
      }
    }
    return args;
  }

  Value evaluate(const Node& node, Env& env) {
    DepthGuard guard(*this, node);
    switch (node.kind) {
      case NodeKind::kInteger:
        return Value::integer(node.int_value);
      case NodeKind::kFloat:
        return Value::floating(node.float_value);
      case NodeKind::kString:
      case NodeKind::kText:
        return Value::string(node.text);
      case NodeKind::kIdentifier: {
        const Value* value = env.lookup(node.text);
        return value != nullptr ? *value : Value();
      }
      case NodeKind::kArray:
      case NodeKind::kTuple: {
        std::vector<Value> items;
        items.reserve(node.list_a.size());
        for (const NodePtr& item : node.list_a) items.push_back(evaluate(*item, env));
        return Value::array(std::move(items), node.kind == NodeKind::kTuple);
      }
      case NodeKind::kObject: {
        Object object;
        for (size_t i = 0; i < node.list_a.size(); ++i) {
          const Value key = evaluate(*node.list_a[i], env);
          if (!key.is_string()) fail(fmt::format("Object keys must be strings: got {}", key.type_name()));
          object.set(key.as_string(), evaluate(*node.list_b[i], env));
        }
        return Value::object(std::move(object));
      }
      case NodeKind::kMember:
        return evaluate_member(node, env);
      case NodeKind::kCall: {
        CallArgs args = evaluate_arguments(node.list_a, env);
        const Value callee = evaluate(*node.a, env);
        current_offset_ = node.offset;
        if (callee.kind() != ValueKind::kFunction) {
          fail(fmt::format("Cannot call something that is not a function: got {}", callee.type_name()));
        }
        return callee.as_function()(args, env);
      }
      case NodeKind::kBinary:
        return evaluate_binary(node, env);
      case NodeKind::kUnary:
        return evaluate_unary(node, env);
      case NodeKind::kFilter: {
        const Value operand = evaluate(*node.a, env);
        current_offset_ = node.offset;
        return apply_filter(operand, *node.b, env);
      }
      case NodeKind::kTest: {
        const Value operand = evaluate(*node.a, env);
        current_offset_ = node.offset;
        const bool result = run_test(node.text, operand, nullptr);
        return Value::boolean(node.flag ? !result : result);
      }
      case NodeKind::kSelect:
        if (!evaluate(*node.b, env).truthy()) return Value();
        return evaluate(*node.a, env);
      case NodeKind::kTernary:
        return evaluate(*node.a, env).truthy() ? evaluate(*node.b, env) : evaluate(*node.c, env);
      default:
        fail("this statement cannot be used as an expression");
    }
  }

  Value evaluate_member(const Node& node, Env& env) {
    const Value object = evaluate(*node.a, env);
    Value property;
    if (node.flag) {
      if (node.b->kind == NodeKind::kSlice) return evaluate_slice(object, *node.b, env);
      property = evaluate(*node.b, env);
    } else if (node.b->kind == NodeKind::kInteger) {
      property = Value::integer(node.b->int_value);
    } else {
      property = Value::string(node.b->text);
    }
    current_offset_ = node.offset;
    if (object.is_attribute_container()) {
      if (!property.is_string()) fail(fmt::format("Cannot access property with non-string: got {}", property.type_name()));
      if (const Value* value = object.as_object().find(property.as_string())) return *value;
      if (object.is_object()) return builtin(object, property.as_string());
      return Value();
    }
    if (object.is_array() || object.is_string()) {
      if (property.kind() == ValueKind::kInt) {
        if (object.is_array()) {
          const auto& items = object.as_array();
          int64_t index = property.as_int();
          if (index < 0) index += static_cast<int64_t>(items.size());
          if (index < 0 || index >= static_cast<int64_t>(items.size())) return Value();
          return items[static_cast<size_t>(index)];
        }
        const std::vector<std::string> chars = code_points(object.as_string());
        int64_t index = property.as_int();
        if (index < 0) index += static_cast<int64_t>(chars.size());
        if (index < 0 || index >= static_cast<int64_t>(chars.size())) return Value();
        return Value::string(chars[static_cast<size_t>(index)]);
      }
      if (property.is_string()) return builtin(object, property.as_string());
      fail(fmt::format("Cannot access property with non-string/non-number: got {}", property.type_name()));
    }
    if (!property.is_string()) fail(fmt::format("Cannot access property with non-string: got {}", property.type_name()));
    return Value();
  }

  std::optional<int64_t> slice_bound(const Node* node, Env& env, const char* what) {
    if (node == nullptr) return std::nullopt;
    const Value value = evaluate(*node, env);
    if (value.is_undefined()) return std::nullopt;
    if (value.kind() != ValueKind::kInt) fail(fmt::format("Slice {} must be numeric or undefined", what));
    return value.as_int();
  }

  Value evaluate_slice(const Value& object, const Node& slice, Env& env) {
    if (!object.is_array() && !object.is_string()) fail("Slice object must be an array or string");
    const auto start = slice_bound(slice.a.get(), env, "start");
    const auto stop = slice_bound(slice.b.get(), env, "stop");
    const auto step = slice_bound(slice.c.get(), env, "step");
    if (object.is_array()) {
      const auto& items = object.as_array();
      std::vector<Value> out;
      for (int64_t i : slice_indices(static_cast<int64_t>(items.size()), start, stop, step)) {
        out.push_back(items[static_cast<size_t>(i)]);
      }
      return Value::array(std::move(out));
    }
    const std::vector<std::string> chars = code_points(object.as_string());
    std::string out;
    for (int64_t i : slice_indices(static_cast<int64_t>(chars.size()), start, stop, step)) out += chars[static_cast<size_t>(i)];
    return Value::string(std::move(out));
  }

  Value evaluate_unary(const Node& node, Env& env) {
    const Value argument = evaluate(*node.a, env);
    current_offset_ = node.offset;
    if (node.text == "not") return Value::boolean(!argument.truthy());
    const int sign = node.text == "-" ? -1 : 1;
    if (argument.kind() == ValueKind::kFloat) return Value::floating(sign * argument.as_number());
    if (argument.kind() == ValueKind::kInt) return Value::integer(sign * argument.as_int());
    if (argument.kind() == ValueKind::kBool) return Value::integer(sign * (argument.as_bool() ? 1 : 0));
    fail(fmt::format("Unknown operator \"{}\" for {}", node.text, argument.type_name()));
  }

  Value arithmetic(const std::string& op, const Value& left, const Value& right) {
    const bool is_float = left.kind() == ValueKind::kFloat || right.kind() == ValueKind::kFloat;
    const double a = left.as_number();
    const double b = right.as_number();
    if (op == "/") {
      if (b == 0) fail("division by zero");
      return Value::floating(a / b);
    }
    if (op == "//") {
      if (b == 0) fail("integer division or modulo by zero");
      const double result = std::floor(a / b);
      return is_float ? Value::floating(result) : Value::integer(static_cast<int64_t>(result));
    }
    if (op == "%") {
      if (b == 0) fail("integer division or modulo by zero");
      if (is_float) return Value::floating(std::fmod(a, b));
      return Value::integer(left.as_int() % right.as_int());
    }
    if (!is_float) {
      int64_t result = 0;
      const int64_t x = left.as_int();
      const int64_t y = right.as_int();
      const bool overflow = op == "+"   ? __builtin_add_overflow(x, y, &result)
                            : op == "-" ? __builtin_sub_overflow(x, y, &result)
                                        : __builtin_mul_overflow(x, y, &result);
      if (!overflow) return Value::integer(result);
    }
    // Float operands, or an integer result beyond int64 (JavaScript would lose precision instead).
    return Value::floating(op == "+" ? a + b : op == "-" ? a - b : a * b);
  }

  Value evaluate_binary(const Node& node, Env& env) {
    const Value left = evaluate(*node.a, env);
    const std::string& op = node.text;
    if (op == "and") return left.truthy() ? evaluate(*node.b, env) : left;
    if (op == "or") return left.truthy() ? left : evaluate(*node.b, env);
    const Value right = evaluate(*node.b, env);
    current_offset_ = node.offset;
    if (op == "==") return Value::boolean(left.loose_equals(right));
    if (op == "!=") return Value::boolean(!left.loose_equals(right));
    const bool is_membership = op == "in" || op == "not in";
    if (left.is_undefined() || right.is_undefined()) {
      if (right.is_undefined() && is_membership) return Value::boolean(op == "not in");
      // Python Jinja's Undefined concatenates as "" (the reference library throws here).
      if (op == "~") return make_string(left.is_undefined() ? concat_text(right) : concat_text(left));
      fail(fmt::format("Cannot perform operation {} on undefined values", op));
    }
    if (left.is_null() || right.is_null()) {
      if (op == "~") return make_string(concat_text(left) + concat_text(right));
      if (is_membership && right.is_array()) {
        bool member = false;
        for (const Value& item : right.as_array()) member = member || item.strict_equals(left);
        return Value::boolean(op == "in" ? member : !member);
      }
      fail("Cannot perform operation on null values");
    }
    if (op == "~") return make_string(left.js_string() + right.js_string());
    const auto numeric_like = [](const Value& v) { return v.is_number() || v.kind() == ValueKind::kBool; };
    if (op == "**" && numeric_like(left) && numeric_like(right)) {
      const double a = left.as_number();
      const double b = right.as_number();
      if (a == 0 && b < 0) fail("0.0 cannot be raised to a negative power");
      const double result = std::pow(a, b);
      if (!std::isfinite(result)) fail("Exponentiation result is not a finite real number");
      const bool is_float = left.kind() == ValueKind::kFloat || right.kind() == ValueKind::kFloat || b < 0;
      return is_float ? Value::floating(result) : Value::integer(static_cast<int64_t>(result));
    }
    if (left.is_number() && right.is_number()) {
      if (op == "+" || op == "-" || op == "*" || op == "/" || op == "//" || op == "%") {
        return arithmetic(op, left, right);
      }
      const double a = left.as_number();
      const double b = right.as_number();
      if (op == "<") return Value::boolean(a < b);
      if (op == ">") return Value::boolean(a > b);
      if (op == "<=") return Value::boolean(a <= b);
      if (op == ">=") return Value::boolean(a >= b);
    } else if (left.is_array() && right.is_array()) {
      if (op == "+") {
        std::vector<Value> items = left.as_array();
        items.insert(items.end(), right.as_array().begin(), right.as_array().end());
        return Value::array(std::move(items));
      }
    } else if (right.is_array()) {
      if (is_membership) {
        bool member = false;
        for (const Value& item : right.as_array()) member = member || item.strict_equals(left);
        return Value::boolean(op == "in" ? member : !member);
      }
    }
    if ((left.is_string() || right.is_string()) && op == "+") return make_string(left.js_string() + right.js_string());
    if (left.is_string() && right.is_string()) {
      if (is_membership) {
        const bool member = right.as_string().find(left.as_string()) != std::string::npos;
        return Value::boolean(op == "in" ? member : !member);
      }
      // String ordering (the reference library throws; Python compares code points).
      const int compare = left.as_string().compare(right.as_string());
      if (op == "<") return Value::boolean(compare < 0);
      if (op == ">") return Value::boolean(compare > 0);
      if (op == "<=") return Value::boolean(compare <= 0);
      if (op == ">=") return Value::boolean(compare >= 0);
    }
    if (left.is_string() && right.is_object() && is_membership) {
      const bool member = right.as_object().find(left.as_string()) != nullptr;
      return Value::boolean(op == "in" ? member : !member);
    }
    fail(fmt::format("Unknown operator \"{}\" between {} and {}", op, left.type_name(), right.type_name()));
  }

  // `~` with none/undefined, Python style.
  static std::string concat_text(const Value& value) {
    if (value.is_undefined()) return "";
    if (value.is_null()) return "None";
    return value.js_string();
  }

  // ---------------------------------------------------------------- tests
  bool run_test(const std::string& name, const Value& operand, const Value* argument) {
    const ValueKind kind = operand.kind();
    if (name == "boolean") return kind == ValueKind::kBool;
    if (name == "callable") return kind == ValueKind::kFunction;
    if (name == "odd" || name == "even") {
      if (kind != ValueKind::kInt) fail(fmt::format("cannot {} on {}", name, operand.type_name()));
      return (operand.as_int() % 2 != 0) == (name == "odd");
    }
    if (name == "false") return kind == ValueKind::kBool && !operand.as_bool();
    if (name == "true") return kind == ValueKind::kBool && operand.as_bool();
    if (name == "none") return kind == ValueKind::kNull;
    if (name == "string") return kind == ValueKind::kString;
    if (name == "number") return operand.is_number();
    if (name == "integer") return kind == ValueKind::kInt;
    if (name == "float") return kind == ValueKind::kFloat;
    if (name == "iterable") return kind == ValueKind::kArray || kind == ValueKind::kString;
    if (name == "mapping") return kind == ValueKind::kObject;
    if (name == "sequence") return operand.is_array() || kind == ValueKind::kObject || kind == ValueKind::kString;
    if (name == "lower") return kind == ValueKind::kString && operand.as_string() == to_lower(operand.as_string());
    if (name == "upper") return kind == ValueKind::kString && operand.as_string() == to_upper(operand.as_string());
    if (name == "defined") return kind != ValueKind::kUndefined;
    if (name == "undefined") return kind == ValueKind::kUndefined;
    if (name == "equalto" || name == "eq") {
      const Value missing;
      return operand.strict_equals(argument != nullptr ? *argument : missing);
    }
    fail(fmt::format("Unknown test: {}", name));
  }

  // ---------------------------------------------------------------- builtins (methods)
  Value builtin(const Value& object, const std::string& name) {
    if (object.is_string()) return string_builtin(object, name);
    if (object.is_array()) {
      if (name == "length") return Value::integer(static_cast<int64_t>(object.as_array().size()));
      return Value();
    }
    if (object.is_object()) return object_builtin(object, name);
    return Value();
  }

  Value string_builtin(const Value& self, const std::string& name) {
    const std::string text = self.as_string();
    if (name == "length") return Value::integer(utf16_length(text));
    const auto method = [](auto body) { return Value::function(body); };
    if (name == "upper") return method([text](CallArgs&, Env&) { return Value::string(to_upper(text)); });
    if (name == "lower") return method([text](CallArgs&, Env&) { return Value::string(to_lower(text)); });
    // As in the reference library, strip/lstrip/rstrip ignore their argument and trim whitespace.
    if (name == "strip") {
      return method([text](CallArgs&, Env&) { return Value::string(std::string(js_trim_end(js_trim_start(text)))); });
    }
    if (name == "lstrip") return method([text](CallArgs&, Env&) { return Value::string(std::string(js_trim_start(text))); });
    if (name == "rstrip") return method([text](CallArgs&, Env&) { return Value::string(std::string(js_trim_end(text))); });
    if (name == "title") return method([text](CallArgs&, Env&) { return Value::string(title_case(text)); });
    if (name == "capitalize") return method([text](CallArgs&, Env&) { return Value::string(capitalize(text)); });
    if (name == "startswith" || name == "endswith") {
      const bool starts = name == "startswith";
      return method([this, text, starts, name](CallArgs& args, Env&) {
        if (args.positional.empty()) fail(name + "() requires at least one argument");
        const auto matches = [&](const std::string& affix) {
          return starts ? text.compare(0, affix.size(), affix) == 0 && text.size() >= affix.size()
                        : text.size() >= affix.size() && text.compare(text.size() - affix.size(), affix.size(), affix) == 0;
        };
        const Value& pattern = args.positional[0];
        if (pattern.is_string()) return Value::boolean(matches(pattern.as_string()));
        if (pattern.is_array()) {
          for (const Value& item : pattern.as_array()) {
            if (!item.is_string()) fail(name + "() tuple elements must be strings");
            if (matches(item.as_string())) return Value::boolean(true);
          }
          return Value::boolean(false);
        }
        fail(name + "() argument must be a string or tuple of strings");
      });
    }
    if (name == "split") {
      return method([this, text](CallArgs& args, Env&) {
        Value separator = args.positional.size() > 0 ? args.positional[0] : Value::null();
        if (const Value* keyword = args.find_keyword("sep")) separator = *keyword;
        Value max_split = args.positional.size() > 1 ? args.positional[1] : Value::integer(-1);
        if (const Value* keyword = args.find_keyword("maxsplit")) max_split = *keyword;
        if (!separator.is_string() && !separator.is_null()) fail("sep argument must be a string or null");
        if (max_split.kind() != ValueKind::kInt) fail("maxsplit argument must be a number");
        const int64_t limit = max_split.as_int();
        std::vector<Value> parts;
        if (separator.is_null()) {
          // Runs of whitespace separate; no empty strings at the ends.
          std::string_view rest = js_trim_start(text);
          while (!rest.empty()) {
            if (limit != -1 && static_cast<int64_t>(parts.size()) >= limit) {
              parts.push_back(Value::string(std::string(rest)));
              break;
            }
            size_t pos = 0;
            size_t end = 0;
            while (pos < rest.size()) {
              size_t next = pos;
              if (is_js_space(decode_code_point(rest, next))) break;
              pos = next;
            }
            end = pos;
            parts.push_back(Value::string(std::string(rest.substr(0, end))));
            rest = js_trim_start(rest.substr(end));
          }
        } else {
          if (separator.as_string().empty()) fail("empty separator");
          std::vector<std::string> pieces = split_string(text, separator.as_string());
          if (limit != -1 && static_cast<int64_t>(pieces.size()) > limit) {
            std::string tail;
            for (size_t i = static_cast<size_t>(limit); i < pieces.size(); ++i) {
              if (i > static_cast<size_t>(limit)) tail += separator.as_string();
              tail += pieces[i];
            }
            pieces.resize(static_cast<size_t>(limit));
            pieces.push_back(std::move(tail));
          }
          for (std::string& piece : pieces) parts.push_back(Value::string(std::move(piece)));
        }
        return Value::array(std::move(parts));
      });
    }
    if (name == "replace") {
      return method([this, text](CallArgs& args, Env&) { return string_replace(text, args); });
    }
    return Value();
  }

  Value string_replace(const std::string& text, CallArgs& args) {
    if (args.positional.size() < 2) fail("replace() requires at least two arguments");
    const Value& old_value = args.positional[0];
    const Value& new_value = args.positional[1];
    if (!old_value.is_string() || !new_value.is_string()) fail("replace() arguments must be strings");
    Value count = args.positional.size() > 2 ? args.positional[2] : Value::null();
    if (const Value* keyword = args.find_keyword("count")) count = *keyword;
    if (count.kind() != ValueKind::kInt && !count.is_null()) fail("replace() count argument must be a number or null");
    int64_t remaining = count.is_null() || count.as_int() < 0 ? INT64_MAX : count.as_int();
    const std::string& from = old_value.as_string();
    const std::string& to = new_value.as_string();
    std::string out;
    if (from.empty()) {
      // An empty pattern matches before every code point and at the end.
      size_t pos = 0;
      while (pos <= text.size()) {
        if (remaining > 0) {
          out += to;
          --remaining;
        }
        if (pos == text.size()) break;
        const size_t start = pos;
        decode_code_point(text, pos);
        out.append(text, start, pos - start);
      }
      return make_string(std::move(out));
    }
    size_t start = 0;
    while (remaining > 0) {
      const size_t found = text.find(from, start);
      if (found == std::string::npos) break;
      out.append(text, start, found - start);
      out += to;
      start = found + from.size();
      --remaining;
      check_size(out);
    }
    out.append(text, start, std::string::npos);
    return make_string(std::move(out));
  }

  Value object_items(const Value& self) {
    std::vector<Value> items;
    for (const auto& [key, value] : self.as_object().entries) items.push_back(Value::array({Value::string(key), value}));
    return Value::array(std::move(items));
  }

  Value object_builtin(const Value& self, const std::string& name) {
    if (name == "get") {
      return Value::function([this, self](CallArgs& args, Env&) {
        if (args.positional.empty() || !args.positional[0].is_string()) {
          fail(fmt::format("Object key must be a string: got {}",
                           args.positional.empty() ? "UndefinedValue" : args.positional[0].type_name()));
        }
        if (const Value* value = self.as_object().find(args.positional[0].as_string())) return *value;
        if (args.positional.size() > 1) return args.positional[1];
        if (const Value* keyword = args.find_keyword("default")) return *keyword;
        return Value::null();
      });
    }
    if (name == "items") return Value::function([this, self](CallArgs&, Env&) { return object_items(self); });
    if (name == "keys") {
      return Value::function([self](CallArgs&, Env&) {
        std::vector<Value> keys;
        for (const auto& entry : self.as_object().entries) keys.push_back(Value::string(entry.first));
        return Value::array(std::move(keys));
      });
    }
    if (name == "values") {
      return Value::function([self](CallArgs&, Env&) {
        std::vector<Value> values;
        for (const auto& entry : self.as_object().entries) values.push_back(entry.second);
        return Value::array(std::move(values));
      });
    }
    if (name == "dictsort") {
      return Value::function([this, self](CallArgs& args, Env&) {
        const Value case_sensitive = argument(args, 0, "case_sensitive", Value::boolean(false));
        const Value by = argument(args, 1, "by", Value::string("key"));
        const Value reverse = argument(args, 2, "reverse", Value::boolean(false));
        if (case_sensitive.kind() != ValueKind::kBool) fail("case_sensitive must be a boolean");
        if (!by.is_string() || (by.as_string() != "key" && by.as_string() != "value")) {
          fail("by must be either 'key' or 'value'");
        }
        if (reverse.kind() != ValueKind::kBool) fail("reverse must be a boolean");
        std::vector<Value> items = object_items(self).as_array();
        const size_t index = by.as_string() == "key" ? 0 : 1;
        std::stable_sort(items.begin(), items.end(), [&](const Value& a, const Value& b) {
          const int result = compare_values(a.as_array()[index], b.as_array()[index], case_sensitive.as_bool());
          return reverse.as_bool() ? result > 0 : result < 0;
        });
        return Value::array(std::move(items));
      });
    }
    return Value();
  }

  static Value argument(const CallArgs& args, size_t index, std::string_view keyword, Value fallback) {
    if (index < args.positional.size()) return args.positional[index];
    if (const Value* value = args.find_keyword(keyword)) return *value;
    return fallback;
  }

  int compare_values(const Value& a, const Value& b, bool case_sensitive) {
    if (a.is_null() && b.is_null()) return 0;
    if (a.is_null() || b.is_null()) fail(fmt::format("Cannot compare {} with {}", a.type_name(), b.type_name()));
    if (a.is_undefined() && b.is_undefined()) return 0;
    if (a.is_undefined() || b.is_undefined()) fail(fmt::format("Cannot compare {} with {}", a.type_name(), b.type_name()));
    const auto numeric_like = [](const Value& v) { return v.is_number() || v.kind() == ValueKind::kBool; };
    if (numeric_like(a) && numeric_like(b)) {
      const double x = a.as_number();
      const double y = b.as_number();
      return x < y ? -1 : x > y ? 1 : 0;
    }
    if (a.kind() != b.kind()) fail(fmt::format("Cannot compare different types: {} and {}", a.type_name(), b.type_name()));
    if (a.is_string()) {
      const std::string x = case_sensitive ? a.as_string() : to_lower(a.as_string());
      const std::string y = case_sensitive ? b.as_string() : to_lower(b.as_string());
      return x < y ? -1 : x > y ? 1 : 0;
    }
    fail(fmt::format("Cannot compare type: {}", a.type_name()));
  }

  static Value attribute_path(const Value& item, const std::string& path) {
    Value value = item;
    for (const std::string& part : split_string(path, ".")) {
      if (value.is_attribute_container()) {
        const Value* found = value.as_object().find(part);
        value = found != nullptr ? *found : Value();
      } else if (value.is_array()) {
        const auto index = js_parse_int(part);
        if (!index || *index < 0 || *index >= static_cast<int64_t>(value.as_array().size())) return Value();
        value = value.as_array()[static_cast<size_t>(*index)];
      } else {
        return Value();
      }
    }
    return value;
  }

  // ---------------------------------------------------------------- filters
  Value apply_filter(const Value& operand, const Node& filter, Env& env) {
    if (filter.kind == NodeKind::kCall) {
      if (filter.a->kind != NodeKind::kIdentifier) fail("Unknown filter");
      CallArgs args = evaluate_arguments(filter.list_a, env);
      return apply_named_filter(operand, filter.a->text, &args, &filter, env);
    }
    return apply_named_filter(operand, filter.text, nullptr, &filter, env);
  }

  Value json_filter(const Value& operand, const CallArgs* args) {
    Value::JsonOptions options;
    std::pair<std::string, std::string> separators;
    if (args != nullptr) {
      if (const Value* indent = args->find_keyword("indent")) {
        if (indent->kind() != ValueKind::kInt && !indent->is_null()) fail("If set, indent must be a number");
        options.indent = indent->is_null() ? 0 : static_cast<int>(std::clamp<int64_t>(indent->as_int(), 0, 64));
      }
      if (const Value* ensure_ascii = args->find_keyword("ensure_ascii")) {
        if (ensure_ascii->kind() != ValueKind::kBool) fail("If set, ensure_ascii must be a boolean");
        options.ensure_ascii = ensure_ascii->as_bool();
      }
      if (const Value* sort_keys = args->find_keyword("sort_keys")) {
        if (sort_keys->kind() != ValueKind::kBool) fail("If set, sort_keys must be a boolean");
        options.sort_keys = sort_keys->as_bool();
      }
      if (const Value* value = args->find_keyword("separators"); value != nullptr && !value->is_null()) {
        if (!value->is_array() || value->as_array().size() != 2 || !value->as_array()[0].is_string() ||
            !value->as_array()[1].is_string()) {
          fail("separators must be a tuple of two strings");
        }
        separators = {value->as_array()[0].as_string(), value->as_array()[1].as_string()};
        options.separators = &separators;
      }
    }
    return make_string(operand.to_json(options));
  }

  Value join_filter(const Value& operand, const CallArgs* args) {
    std::string separator;
    if (args != nullptr) {
      const Value value = argument(*args, 0, "separator", Value::string(""));
      if (!value.is_string()) fail("separator must be a string");
      separator = value.as_string();
    }
    std::vector<std::string> parts;
    if (operand.is_string()) {
      parts = code_points(operand.as_string());
    } else if (operand.is_array()) {
      for (const Value& item : operand.as_array()) {
        parts.push_back(item.is_null() || item.is_undefined() ? "" : item.js_string());
      }
    } else if (!operand.is_undefined()) {
      fail(fmt::format("Cannot apply filter \"join\" to type: {}", operand.type_name()));
    }
    std::string out;
    for (size_t i = 0; i < parts.size(); ++i) {
      if (i > 0) out += separator;
      out += parts[i];
      check_size(out);
    }
    return Value::string(std::move(out));
  }

  Value indent_filter(const std::string& text, const CallArgs* args) {
    Value width = Value::integer(4);
    Value first = Value::boolean(false);
    Value blank = Value::boolean(false);
    if (args != nullptr) {
      width = argument(*args, 0, "width", width);
      first = argument(*args, 1, "first", first);
      blank = argument(*args, 2, "blank", blank);
    }
    std::string indent;
    if (width.kind() == ValueKind::kInt) {
      indent.assign(static_cast<size_t>(std::clamp<int64_t>(width.as_int(), 0, 1024)), ' ');
    } else if (width.is_string()) {
      indent = width.as_string();
    } else {
      fail("width must be a number");
    }
    const std::vector<std::string> lines = split_string(text, "\n");
    std::string out;
    for (size_t i = 0; i < lines.size(); ++i) {
      if (i > 0) out += '\n';
      if (!((!first.truthy() && i == 0) || (!blank.truthy() && lines[i].empty()))) out += indent;
      out += lines[i];
      check_size(out);
    }
    return Value::string(std::move(out));
  }

  Value sort_filter(const Value& operand, const CallArgs* args) {
    Value reverse = Value::boolean(false);
    Value case_sensitive = Value::boolean(false);
    Value attribute = Value::null();
    if (args != nullptr) {
      reverse = argument(*args, 0, "reverse", reverse);
      case_sensitive = argument(*args, 1, "case_sensitive", case_sensitive);
      attribute = argument(*args, 2, "attribute", attribute);
    }
    if (reverse.kind() != ValueKind::kBool) fail("reverse must be a boolean");
    if (case_sensitive.kind() != ValueKind::kBool) fail("case_sensitive must be a boolean");
    if (!attribute.is_string() && attribute.kind() != ValueKind::kInt && !attribute.is_null()) {
      fail("attribute must be a string, integer, or null");
    }
    const std::string path = attribute.is_null() ? "" : attribute.is_string() ? attribute.as_string() : attribute.js_string();
    std::vector<Value> items = operand.as_array();
    std::stable_sort(items.begin(), items.end(), [&](const Value& a, const Value& b) {
      const Value x = attribute.is_null() ? a : attribute_path(a, path);
      const Value y = attribute.is_null() ? b : attribute_path(b, path);
      const int result = compare_values(x, y, case_sensitive.as_bool());
      return reverse.as_bool() ? result > 0 : result < 0;
    });
    return Value::array(std::move(items));
  }

  Value select_attribute_filter(const Value& operand, const std::string& name, const Node& filter, Env& env) {
    const bool select = name == "selectattr";
    for (const Value& item : operand.as_array()) {
      if (!item.is_attribute_container()) fail(fmt::format("`{}` can only be applied to array of objects", name));
    }
    for (const NodePtr& argument_node : filter.list_a) {
      if (argument_node->kind != NodeKind::kString) fail(fmt::format("arguments of `{}` must be strings", name));
    }
    if (filter.list_a.empty()) fail(fmt::format("`{}` needs an attribute name", name));
    const std::string attribute = evaluate(*filter.list_a[0], env).as_string();
    std::optional<std::string> test;
    Value test_argument;
    if (filter.list_a.size() > 1) test = evaluate(*filter.list_a[1], env).as_string();
    if (filter.list_a.size() > 2) test_argument = evaluate(*filter.list_a[2], env);
    std::vector<Value> kept;
    for (const Value& item : operand.as_array()) {
      const Value* value = item.as_object().find(attribute);
      bool result = false;
      if (value != nullptr) result = test ? run_test(*test, *value, &test_argument) : value->truthy();
      if (result == select) kept.push_back(item);
    }
    return Value::array(std::move(kept));
  }

  Value select_filter(const Value& operand, const std::string& name, const CallArgs* args) {
    const bool select = name == "select";
    std::vector<Value> kept;
    std::optional<std::string> test;
    Value test_argument;
    if (args != nullptr && !args->positional.empty()) {
      if (!args->positional[0].is_string()) fail(fmt::format("the test of `{}` must be a string", name));
      test = args->positional[0].as_string();
      if (args->positional.size() > 1) test_argument = args->positional[1];
    }
    for (const Value& item : operand.as_array()) {
      const bool result = test ? run_test(*test, item, &test_argument) : item.truthy();
      if (result == select) kept.push_back(item);
    }
    return Value::array(std::move(kept));
  }

  Value map_filter(const Value& operand, const CallArgs* args, Env& env) {
    if (args == nullptr) fail("`map` needs an attribute or a filter name");
    if (const Value* attribute = args->find_keyword("attribute")) {
      if (!attribute->is_string()) fail("attribute must be a string");
      const Value* fallback = args->find_keyword("default");
      std::vector<Value> mapped;
      for (const Value& item : operand.as_array()) {
        if (!item.is_attribute_container()) fail("items in map must be an object");
        Value value = attribute_path(item, attribute->as_string());
        if (value.is_undefined() && fallback != nullptr) value = *fallback;
        mapped.push_back(std::move(value));
      }
      return Value::array(std::move(mapped));
    }
    if (!args->positional.empty() && args->positional[0].is_string()) {
      // map('filter', ...): apply a filter without arguments to each item.
      Node filter_node;
      filter_node.kind = NodeKind::kIdentifier;
      filter_node.text = args->positional[0].as_string();
      filter_node.offset = current_offset_;
      std::vector<Value> mapped;
      for (const Value& item : operand.as_array()) mapped.push_back(apply_named_filter(item, filter_node.text, nullptr, &filter_node, env));
      return Value::array(std::move(mapped));
    }
    fail("`map` expressions without `attribute` set are not supported");
  }

  Value apply_named_filter(const Value& operand, const std::string& name, const CallArgs* args, const Node* filter, Env& env) {
    if (name == "safe") return operand;
    if (name == "tojson") return json_filter(operand, args);
    if (name == "default" || name == "d") {
      Value fallback = Value::string("");
      Value boolean = Value::boolean(false);
      if (args != nullptr) {
        if (!args->positional.empty()) fallback = args->positional[0];
        boolean = argument(*args, 1, "boolean", boolean);
      }
      if (boolean.kind() != ValueKind::kBool) fail("`default` filter flag must be a boolean");
      if (operand.is_undefined() || (boolean.as_bool() && !operand.truthy())) return fallback;
      return operand;
    }
    if (args != nullptr) {
      if (name == "join") return join_filter(operand, args);
      if (name == "int" || name == "float") {
        const Value fallback = argument(*args, 0, "default", name == "int" ? Value::integer(0) : Value::floating(0.0));
        if (operand.is_string()) return parse_number(operand.as_string(), name == "int", fallback);
        if (operand.is_number()) return operand;
      }
    }
    if (operand.is_array()) {
      if (name == "list") return operand;
      if (name == "first") return operand.as_array().empty() ? Value() : operand.as_array().front();
      if (name == "last") return operand.as_array().empty() ? Value() : operand.as_array().back();
      if (name == "length" || name == "count") return Value::integer(static_cast<int64_t>(operand.as_array().size()));
      if (name == "reverse") {
        std::vector<Value> items(operand.as_array().rbegin(), operand.as_array().rend());
        return Value::array(std::move(items));
      }
      if (name == "sort") return sort_filter(operand, args);
      if (name == "join") return join_filter(operand, args);
      if (name == "string") return make_string(operand.display());
      if (name == "unique") {
        std::vector<Value> unique;
        for (const Value& item : operand.as_array()) {
          bool seen = false;
          for (const Value& kept : unique) seen = seen || kept.strict_equals(item);
          if (!seen) unique.push_back(item);
        }
        return Value::array(std::move(unique));
      }
      if (name == "selectattr" || name == "rejectattr") {
        return select_attribute_filter(operand, name, *filter, env);
      }
      if (name == "select" || name == "reject") return select_filter(operand, name, args);
      if (name == "map") return map_filter(operand, args, env);
      fail(fmt::format("Unknown ArrayValue filter: {}", name));
    }
    if (operand.is_string()) {
      const std::string& text = operand.as_string();
      if (name == "length" || name == "count") return Value::integer(utf16_length(text));
      if (name == "upper") return Value::string(to_upper(text));
      if (name == "lower") return Value::string(to_lower(text));
      if (name == "title") return Value::string(title_case(text));
      if (name == "capitalize") return Value::string(capitalize(text));
      if (name == "trim") return Value::string(std::string(js_trim_end(js_trim_start(text))));
      if (name == "indent") return indent_filter(text, args);
      if (name == "string") return operand;
      if (name == "join") return join_filter(operand, args);
      if (name == "int" || name == "float") return parse_number(text, name == "int", name == "int" ? Value::integer(0) : Value::floating(0.0));
      if (name == "replace") {
        CallArgs empty;
        return string_replace(text, args != nullptr ? const_cast<CallArgs&>(*args) : empty);
      }
      if (name == "escape" || name == "e") return Value::string(html_escape(text));
      if (name == "list") {
        std::vector<Value> chars;
        for (std::string& c : code_points(text)) chars.push_back(Value::string(std::move(c)));
        return Value::array(std::move(chars));
      }
      if (name == "first" || name == "last") {
        const std::vector<std::string> chars = code_points(text);
        if (chars.empty()) return Value();
        return Value::string(name == "first" ? chars.front() : chars.back());
      }
      if (name == "reverse") {
        std::vector<std::string> chars = code_points(text);
        std::string out;
        for (auto it = chars.rbegin(); it != chars.rend(); ++it) out += *it;
        return Value::string(std::move(out));
      }
      fail(fmt::format("Unknown StringValue filter: {}", name));
    }
    if (operand.is_number()) {
      const bool is_int = operand.kind() == ValueKind::kInt;
      if (name == "abs") return is_int ? Value::integer(std::llabs(operand.as_int())) : Value::floating(std::fabs(operand.as_number()));
      if (name == "int") return is_int ? operand : Value::integer(static_cast<int64_t>(std::floor(operand.as_number())));
      if (name == "float") return Value::floating(operand.as_number());
      if (name == "string") return Value::string(operand.display());
      if (name == "round") {
        const Value precision = args != nullptr ? argument(*args, 0, "precision", Value::integer(0)) : Value::integer(0);
        const double scale = std::pow(10.0, precision.kind() == ValueKind::kInt ? static_cast<double>(precision.as_int()) : 0.0);
        return Value::floating(std::round(operand.as_number() * scale) / scale);
      }
      fail(fmt::format("Unknown NumericValue filter: {}", name));
    }
    if (operand.is_object()) {
      if (name == "items") return object_items(operand);
      if (name == "length" || name == "count") return Value::integer(static_cast<int64_t>(operand.as_object().entries.size()));
      if (name == "string") return make_string(operand.display());
      if (name == "list") {
        CallArgs no_args;
        return builtin(operand, "keys").as_function()(no_args, env);
      }
      const Value method = object_builtin(operand, name);
      if (method.kind() == ValueKind::kFunction) {
        CallArgs call_args = args != nullptr ? *args : CallArgs{};
        return method.as_function()(call_args, env);
      }
      fail(fmt::format("Unknown ObjectValue filter: {}", name));
    }
    if (operand.kind() == ValueKind::kBool) {
      if (name == "bool") return operand;
      if (name == "int") return Value::integer(operand.as_bool() ? 1 : 0);
      if (name == "float") return Value::floating(operand.as_bool() ? 1.0 : 0.0);
      if (name == "string") return Value::string(operand.as_bool() ? "true" : "false");
      fail(fmt::format("Unknown BooleanValue filter: {}", name));
    }
    if (operand.is_undefined()) {
      // Python Jinja's Undefined: empty string, empty sequence.
      if (name == "length" || name == "count") return Value::integer(0);
      if (name == "string" || name == "trim" || name == "upper" || name == "lower" || name == "join" ||
          name == "escape" || name == "e" || name == "indent" || name == "title" || name == "capitalize") {
        return Value::string("");
      }
      if (name == "list" || name == "items" || name == "sort" || name == "reverse" || name == "unique") {
        return Value::array({});
      }
      if (name == "first" || name == "last") return Value();
    }
    if (operand.is_null() && name == "string") return Value::string("None");
    fail(fmt::format("Cannot apply filter \"{}\" to type: {}", name, operand.type_name()));
  }

  static Value parse_number(const std::string& text, bool integer, const Value& fallback) {
    if (integer) {
      const auto value = js_parse_int(text);
      return value ? Value::integer(*value) : fallback;
    }
    const auto value = js_parse_float(text);
    return value ? Value::floating(*value) : fallback;
  }

  std::string_view source_;
  const RenderContext& context_;
  uint32_t current_offset_ = 0;
  int depth_ = 0;
  int64_t steps_ = 0;
};

}  // namespace

std::string render(const std::vector<NodePtr>& program, std::string_view source, const RenderContext& context) {
  return Interpreter(source, context).run(program);
}

}  // namespace metrale::text::jinja
