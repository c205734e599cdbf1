#include "text/jinja_interpreter.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>

#include "core/error.h"
#include "text/jinja_interpreter_internal.h"

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

namespace detail {

namespace {

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
      case 'Y':
        out += std::to_string(local.tm_year + 1900);
        break;
      case 'm':
        out += pad2(local.tm_mon + 1);
        break;
      case 'd':
        out += pad2(local.tm_mday);
        break;
      case 'b':
        out += std::string(kMonths[local.tm_mon]).substr(0, 3);
        break;
      case 'B':
        out += kMonths[local.tm_mon];
        break;
      case 'H':
        out += pad2(local.tm_hour);
        break;
      case 'M':
        out += pad2(local.tm_min);
        break;
      case '%':
        out += '%';
        break;
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

}  // namespace

struct Interpreter::DepthGuard {
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

std::string Interpreter::run(const std::vector<NodePtr>& program) {
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
    raise(ErrorCode::kInvalidArgument, "chat template: line {}:{}: {}", position.line, position.column, error.what());
  }
  return out;
}

// ---------------------------------------------------------------- globals
void Interpreter::install_globals(Env& env) {
  env.set("namespace", Value::function([this](CallArgs& args, Env&) {
            if (args.positional.size() > 1)
              fail(fmt::format("namespace expected at most 1 argument, got {}", args.positional.size()));
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
              if (arg.kind() != ValueKind::kInt)
                fail(fmt::format("range() arguments must be integers, got {}", arg.type_name()));
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
            if (args.positional.empty() || !args.positional[0].is_string())
              fail("strftime_now() expects a format string");
            const std::time_t now =
                context_.now.value_or(std::chrono::system_clock::to_time_t(std::chrono::system_clock::now()));
            return Value::string(strftime_subset(now, args.positional[0].as_string()));
          }));
}

// ---------------------------------------------------------------- statements
Flow Interpreter::exec_block(const std::vector<NodePtr>& statements, Env& env, std::string& out) {
  for (const NodePtr& statement : statements) {
    const Flow flow = exec(*statement, env, out);
    if (flow != Flow::kNormal) return flow;
  }
  return Flow::kNormal;
}

void Interpreter::append_output(std::string& out, std::string_view text) const {
  out.append(text);
  check_size(out);
}

Flow Interpreter::exec(const Node& node, Env& env, std::string& out) {
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

void Interpreter::bind_target(const Node& target, const Value& value, Env& env) {
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

void Interpreter::exec_set(const Node& node, Env& env) {
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
    if (target.flag || target.b->kind != NodeKind::kIdentifier)
      fail("Cannot assign to member with non-identifier property");
    object.mutable_object().set(target.b->text, std::move(value));
    return;
  }
  fail("Invalid left-hand side of an assignment");
}

void Interpreter::exec_for(const Node& node, Env& env, std::string& out) {
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
void Interpreter::collect_special_names(const Node& node, bool& kwargs, bool& varargs) {
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

void Interpreter::bind_macro_arguments(const std::string& display_name, const std::vector<NodePtr>& parameters,
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

void Interpreter::define_macro(const Node& node, Env& env) {
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

Value Interpreter::exec_call_block(const Node& node, Env& env) {
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
  if (callee.kind() != ValueKind::kFunction)
    fail(fmt::format("Cannot call something that is not a function: got {}", callee.type_name()));
  Env call_env{&env, {}};
  call_env.set("caller", std::move(caller));
  return callee.as_function()(args, call_env);
}

// ---------------------------------------------------------------- expressions
CallArgs Interpreter::evaluate_arguments(const std::vector<NodePtr>& arguments, Env& env) {
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

Value Interpreter::evaluate(const Node& node, Env& env) {
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

Value Interpreter::evaluate_member(const Node& node, Env& env) {
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
    if (!property.is_string())
      fail(fmt::format("Cannot access property with non-string: got {}", property.type_name()));
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

std::optional<int64_t> Interpreter::slice_bound(const Node* node, Env& env, const char* what) {
  if (node == nullptr) return std::nullopt;
  const Value value = evaluate(*node, env);
  if (value.is_undefined()) return std::nullopt;
  if (value.kind() != ValueKind::kInt) fail(fmt::format("Slice {} must be numeric or undefined", what));
  return value.as_int();
}

Value Interpreter::evaluate_slice(const Value& object, const Node& slice, Env& env) {
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
  for (int64_t i : slice_indices(static_cast<int64_t>(chars.size()), start, stop, step))
    out += chars[static_cast<size_t>(i)];
  return Value::string(std::move(out));
}

Value Interpreter::evaluate_unary(const Node& node, Env& env) {
  const Value argument = evaluate(*node.a, env);
  current_offset_ = node.offset;
  if (node.text == "not") return Value::boolean(!argument.truthy());
  const int sign = node.text == "-" ? -1 : 1;
  if (argument.kind() == ValueKind::kFloat) return Value::floating(sign * argument.as_number());
  if (argument.kind() == ValueKind::kInt) return Value::integer(sign * argument.as_int());
  if (argument.kind() == ValueKind::kBool) return Value::integer(sign * (argument.as_bool() ? 1 : 0));
  fail(fmt::format("Unknown operator \"{}\" for {}", node.text, argument.type_name()));
}

Value Interpreter::arithmetic(const std::string& op, const Value& left, const Value& right) {
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

Value Interpreter::evaluate_binary(const Node& node, Env& env) {
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
std::string Interpreter::concat_text(const Value& value) {
  if (value.is_undefined()) return "";
  if (value.is_null()) return "None";
  return value.js_string();
}

}  // namespace detail

std::string render(const std::vector<NodePtr>& program, std::string_view source, const RenderContext& context) {
  return detail::Interpreter(source, context).run(program);
}

}  // namespace metrale::text::jinja