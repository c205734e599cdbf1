// The values of the chat-template interpreter (text/chat_template.h). Their semantics follow
// @huggingface/jinja (the interpreter transformers.js uses), because the rendered prompt must be byte
// for byte what that library renders: numbers are JavaScript numbers when printed, booleans print
// "true"/"false", `none` prints nothing, containers print as JSON, and strings measure their length
// in UTF-16 code units. Strings are UTF-8 here.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace metrale::text::jinja {

class Value;
struct Env;

// The arguments of a call: positional values, then keyword arguments in the order written.
struct CallArgs {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keyword;
  const Value* find_keyword(std::string_view name) const;
};

// A callable: a macro, a global (range, namespace, raise_exception, ...) or a bound method ("x".upper).
// `caller_env` is the environment of the call site (macros see it: @huggingface/jinja scopes macro
// bodies dynamically).
using Function = std::function<Value(CallArgs& args, Env& caller_env)>;

enum class ValueKind : uint8_t {
  kUndefined,
  kNull,
  kBool,
  kInt,
  kFloat,
  kString,
  kArray,
  kTuple,      // an array written as a tuple literal; differs only in the `iterable` test
  kObject,     // a mapping with string keys in insertion order
  kNamespace,  // namespace(): a mutable attribute bag, not a mapping
  kFunction,
};

// An insertion-ordered string-keyed map. Linear lookup: chat objects have a handful of keys.
struct Object {
  std::vector<std::pair<std::string, Value>> entries;
  // Container levels below and including this one, as of the latest set() (namespaces change).
  uint32_t depth = 1;
  const Value* find(std::string_view key) const;
  Value* find(std::string_view key);
  // Throws kInvalidArgument when the value would nest the object deeper than Value::kMaxDepth.
  void set(std::string key, Value value);
};

class Value {
 public:
  Value() = default;
  static Value null();
  static Value boolean(bool value);
  static Value integer(int64_t value);
  static Value floating(double value);
  static Value string(std::string value);
  static Value array(std::vector<Value> items, bool tuple = false);
  static Value object(Object object, bool is_namespace = false);
  static Value function(Function function);
  // From JSON as JSON.parse + @huggingface/jinja's conversion see it: integral numbers become
  // integers, and objects list integer-like keys first (JavaScript property order). Throws
  // kInvalidArgument for containers nested deeper than kMaxJsonDepth.
  static constexpr size_t kMaxJsonDepth = 128;
  static Value from_json(const nlohmann::ordered_json& json);

  // Containers nest at most this deep, however a template builds them ({% set ns.x = [ns.x] %} in a
  // loop): destroying, copying and printing a value recurse once per level. array() and object()
  // throw kInvalidArgument beyond it.
  static constexpr uint32_t kMaxDepth = 256;
  // Container levels (0 for scalars).
  uint32_t depth() const;

  ValueKind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == ValueKind::kUndefined; }
  bool is_null() const { return kind_ == ValueKind::kNull; }
  bool is_string() const { return kind_ == ValueKind::kString; }
  bool is_number() const { return kind_ == ValueKind::kInt || kind_ == ValueKind::kFloat; }
  bool is_array() const { return kind_ == ValueKind::kArray || kind_ == ValueKind::kTuple; }
  bool is_object() const { return kind_ == ValueKind::kObject; }
  bool is_attribute_container() const { return kind_ == ValueKind::kObject || kind_ == ValueKind::kNamespace; }

  bool as_bool() const { return bool_; }
  int64_t as_int() const { return int_; }
  double as_number() const;  // int or float as double; bool as 0/1
  const std::string& as_string() const;
  const std::vector<Value>& as_array() const;
  const Object& as_object() const;
  Object& mutable_object() const;  // namespaces are mutable through every reference
  const Function& as_function() const;

  // Python/Jinja truthiness as @huggingface/jinja implements it.
  bool truthy() const;
  // The text `{{ value }}` renders (not called for none/undefined, which render nothing).
  std::string display() const;
  // The text JavaScript's String(value.value) gives, used by `~`, `+` and `join`.
  std::string js_string() const;
  // JSON.stringify-compatible output (the `tojson` filter). `indent` <= 0 means single-line.
  struct JsonOptions {
    int indent = 0;
    bool ensure_ascii = false;
    bool sort_keys = false;
    const std::pair<std::string, std::string>* separators = nullptr;
    bool undefined_as_null = true;
  };
  std::string to_json(const JsonOptions& options) const;
  const char* type_name() const;  // for error messages ("StringValue", ...)

  // JavaScript `==` on the underlying values (containers and functions compare by identity).
  bool loose_equals(const Value& other) const;
  // JavaScript `===` on the underlying values (`in` on arrays, unique, selectattr tests).
  bool strict_equals(const Value& other) const;
  bool same_container(const Value& other) const;

 private:
  void append_json(std::string& out, const JsonOptions& options, int depth) const;

  ValueKind kind_ = ValueKind::kUndefined;
  bool bool_ = false;
  int64_t int_ = 0;
  double float_ = 0.0;
  std::shared_ptr<const std::string> string_;
  std::shared_ptr<const std::vector<Value>> array_;
  std::shared_ptr<Object> object_;
  std::shared_ptr<const Function> function_;
  uint32_t array_depth_ = 0;  // arrays: 1 + the deepest item (objects keep theirs in Object::depth)
};

// JavaScript's Number.prototype.toString for a finite or non-finite double.
std::string js_number_to_string(double value);
// JSON.stringify of a string (escapes ", \, control characters; leaves other text as is).
void append_json_string(std::string& out, std::string_view text, bool ensure_ascii);
// Length in UTF-16 code units (JavaScript's String.length) of UTF-8 text.
int64_t utf16_length(std::string_view text);
// Whether the code point is JavaScript whitespace (\s, String.prototype.trim).
bool is_js_space(char32_t code_point);
// Decodes the code point at `pos` (U+FFFD for an ill-formed byte) and advances `pos`.
char32_t decode_code_point(std::string_view text, size_t& pos);
std::string_view js_trim_start(std::string_view text);
std::string_view js_trim_end(std::string_view text);

}  // namespace metrale::text::jinja
