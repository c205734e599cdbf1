#include <utf8proc.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <functional>

#include "core/error.h"
#include "text/jinja_interpreter_internal.h"
#include "text/utf8.h"

namespace metrale::text::jinja::detail {

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

namespace {

std::string map_code_points(std::string_view text, const std::function<char32_t(char32_t)>& map) {
  std::string out;
  out.reserve(text.size());
  size_t pos = 0;
  while (pos < text.size()) append_utf8(out, map(decode_code_point(text, pos)));
  return out;
}

std::string to_upper(std::string_view text) {
  return map_code_points(
      text, [](char32_t c) { return static_cast<char32_t>(utf8proc_toupper(static_cast<utf8proc_int32_t>(c))); });
}

std::string to_lower(std::string_view text) {
  return map_code_points(
      text, [](char32_t c) { return static_cast<char32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(c))); });
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
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&#34;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

}  // namespace

// ---------------------------------------------------------------- tests
bool Interpreter::run_test(const std::string& name, const Value& operand, const Value* argument) {
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
Value Interpreter::builtin(const Value& object, const std::string& name) {
  if (object.is_string()) return string_builtin(object, name);
  if (object.is_array()) {
    if (name == "length") return Value::integer(static_cast<int64_t>(object.as_array().size()));
    return Value();
  }
  if (object.is_object()) return object_builtin(object, name);
  return Value();
}

Value Interpreter::string_builtin(const Value& self, const std::string& name) {
  const std::string text = self.as_string();
  if (name == "length") return Value::integer(utf16_length(text));
  const auto method = [](auto body) { return Value::function(body); };
  if (name == "upper") return method([text](CallArgs&, Env&) { return Value::string(to_upper(text)); });
  if (name == "lower") return method([text](CallArgs&, Env&) { return Value::string(to_lower(text)); });
  // As in the reference library, strip/lstrip/rstrip ignore their argument and trim whitespace.
  if (name == "strip") {
    return method([text](CallArgs&, Env&) { return Value::string(std::string(js_trim_end(js_trim_start(text)))); });
  }
  if (name == "lstrip")
    return method([text](CallArgs&, Env&) { return Value::string(std::string(js_trim_start(text))); });
  if (name == "rstrip")
    return method([text](CallArgs&, Env&) { return Value::string(std::string(js_trim_end(text))); });
  if (name == "title") return method([text](CallArgs&, Env&) { return Value::string(title_case(text)); });
  if (name == "capitalize") return method([text](CallArgs&, Env&) { return Value::string(capitalize(text)); });
  if (name == "startswith" || name == "endswith") {
    const bool starts = name == "startswith";
    return method([this, text, starts, name](CallArgs& args, Env&) {
      if (args.positional.empty()) fail(name + "() requires at least one argument");
      const auto matches = [&](const std::string& affix) {
        return starts
                   ? text.compare(0, affix.size(), affix) == 0 && text.size() >= affix.size()
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

Value Interpreter::string_replace(const std::string& text, CallArgs& args) {
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

Value Interpreter::object_items(const Value& self) {
  std::vector<Value> items;
  for (const auto& [key, value] : self.as_object().entries) items.push_back(Value::array({Value::string(key), value}));
  return Value::array(std::move(items));
}

Value Interpreter::object_builtin(const Value& self, const std::string& name) {
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

Value Interpreter::argument(const CallArgs& args, size_t index, std::string_view keyword, Value fallback) {
  if (index < args.positional.size()) return args.positional[index];
  if (const Value* value = args.find_keyword(keyword)) return *value;
  return fallback;
}

int Interpreter::compare_values(const Value& a, const Value& b, bool case_sensitive) {
  if (a.is_null() && b.is_null()) return 0;
  if (a.is_null() || b.is_null()) fail(fmt::format("Cannot compare {} with {}", a.type_name(), b.type_name()));
  if (a.is_undefined() && b.is_undefined()) return 0;
  if (a.is_undefined() || b.is_undefined())
    fail(fmt::format("Cannot compare {} with {}", a.type_name(), b.type_name()));
  const auto numeric_like = [](const Value& v) { return v.is_number() || v.kind() == ValueKind::kBool; };
  if (numeric_like(a) && numeric_like(b)) {
    const double x = a.as_number();
    const double y = b.as_number();
    return x < y ? -1 : x > y ? 1 : 0;
  }
  if (a.kind() != b.kind())
    fail(fmt::format("Cannot compare different types: {} and {}", a.type_name(), b.type_name()));
  if (a.is_string()) {
    const std::string x = case_sensitive ? a.as_string() : to_lower(a.as_string());
    const std::string y = case_sensitive ? b.as_string() : to_lower(b.as_string());
    return x < y ? -1 : x > y ? 1 : 0;
  }
  fail(fmt::format("Cannot compare type: {}", a.type_name()));
}

Value Interpreter::attribute_path(const Value& item, const std::string& path) {
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
Value Interpreter::apply_filter(const Value& operand, const Node& filter, Env& env) {
  if (filter.kind == NodeKind::kCall) {
    if (filter.a->kind != NodeKind::kIdentifier) fail("Unknown filter");
    CallArgs args = evaluate_arguments(filter.list_a, env);
    return apply_named_filter(operand, filter.a->text, &args, &filter, env);
  }
  return apply_named_filter(operand, filter.text, nullptr, &filter, env);
}

Value Interpreter::json_filter(const Value& operand, const CallArgs* args) {
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

Value Interpreter::join_filter(const Value& operand, const CallArgs* args) {
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

Value Interpreter::indent_filter(const std::string& text, const CallArgs* args) {
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

Value Interpreter::sort_filter(const Value& operand, const CallArgs* args) {
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
  const std::string path = attribute.is_null()     ? ""
                           : attribute.is_string() ? attribute.as_string()
                                                   : attribute.js_string();
  std::vector<Value> items = operand.as_array();
  std::stable_sort(items.begin(), items.end(), [&](const Value& a, const Value& b) {
    const Value x = attribute.is_null() ? a : attribute_path(a, path);
    const Value y = attribute.is_null() ? b : attribute_path(b, path);
    const int result = compare_values(x, y, case_sensitive.as_bool());
    return reverse.as_bool() ? result > 0 : result < 0;
  });
  return Value::array(std::move(items));
}

Value Interpreter::select_attribute_filter(const Value& operand, const std::string& name, const Node& filter,
                                           Env& env) {
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

Value Interpreter::select_filter(const Value& operand, const std::string& name, const CallArgs* args) {
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

Value Interpreter::map_filter(const Value& operand, const CallArgs* args, Env& env) {
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
    for (const Value& item : operand.as_array())
      mapped.push_back(apply_named_filter(item, filter_node.text, nullptr, &filter_node, env));
    return Value::array(std::move(mapped));
  }
  fail("`map` expressions without `attribute` set are not supported");
}

Value Interpreter::apply_named_filter(const Value& operand, const std::string& name, const CallArgs* args,
                                      const Node* filter, Env& env) {
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
  if (operand.is_array()) return array_value_filter(operand, name, args, filter, env);
  if (operand.is_string()) return string_value_filter(operand, name, args);
  if (operand.is_number()) return numeric_value_filter(operand, name, args);
  if (operand.is_object()) return object_value_filter(operand, name, args, env);
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

Value Interpreter::array_value_filter(const Value& operand, const std::string& name, const CallArgs* args,
                                      const Node* filter, Env& env) {
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

Value Interpreter::string_value_filter(const Value& operand, const std::string& name, const CallArgs* args) {
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
  if (name == "int" || name == "float")
    return parse_number(text, name == "int", name == "int" ? Value::integer(0) : Value::floating(0.0));
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

Value Interpreter::numeric_value_filter(const Value& operand, const std::string& name, const CallArgs* args) {
  const bool is_int = operand.kind() == ValueKind::kInt;
  if (name == "abs")
    return is_int ? Value::integer(std::llabs(operand.as_int())) : Value::floating(std::fabs(operand.as_number()));
  if (name == "int") return is_int ? operand : Value::integer(static_cast<int64_t>(std::floor(operand.as_number())));
  if (name == "float") return Value::floating(operand.as_number());
  if (name == "string") return Value::string(operand.display());
  if (name == "round") {
    const Value precision = args != nullptr ? argument(*args, 0, "precision", Value::integer(0)) : Value::integer(0);
    const double scale =
        std::pow(10.0, precision.kind() == ValueKind::kInt ? static_cast<double>(precision.as_int()) : 0.0);
    return Value::floating(std::round(operand.as_number() * scale) / scale);
  }
  fail(fmt::format("Unknown NumericValue filter: {}", name));
}

Value Interpreter::object_value_filter(const Value& operand, const std::string& name, const CallArgs* args, Env& env) {
  if (name == "items") return object_items(operand);
  if (name == "length" || name == "count")
    return Value::integer(static_cast<int64_t>(operand.as_object().entries.size()));
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

Value Interpreter::parse_number(const std::string& text, bool integer, const Value& fallback) {
  if (integer) {
    const auto value = js_parse_int(text);
    return value ? Value::integer(*value) : fallback;
  }
  const auto value = js_parse_float(text);
  return value ? Value::floating(*value) : fallback;
}

}  // namespace metrale::text::jinja::detail
