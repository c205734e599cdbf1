#include "text/jinja_value.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <limits>

#include "core/error.h"
#include "text/utf8.h"

namespace metrale::text::jinja {

const Value* CallArgs::find_keyword(std::string_view name) const {
  for (const auto& [key, value] : keyword) {
    if (key == name) return &value;
  }
  return nullptr;
}

const Value* Object::find(std::string_view key) const {
  for (const auto& entry : entries) {
    if (entry.first == key) return &entry.second;
  }
  return nullptr;
}

Value* Object::find(std::string_view key) {
  for (auto& entry : entries) {
    if (entry.first == key) return &entry.second;
  }
  return nullptr;
}

void Object::set(std::string key, Value value) {
  const uint32_t nested = value.depth() + 1;
  if (nested > Value::kMaxDepth)
    raise(ErrorCode::kInvalidArgument, "a value nested deeper than {} levels", Value::kMaxDepth);
  depth = std::max(depth, nested);
  if (Value* existing = find(key)) {
    *existing = std::move(value);
    return;
  }
  entries.emplace_back(std::move(key), std::move(value));
}

Value Value::null() {
  Value v;
  v.kind_ = ValueKind::kNull;
  return v;
}

Value Value::boolean(bool value) {
  Value v;
  v.kind_ = ValueKind::kBool;
  v.bool_ = value;
  return v;
}

Value Value::integer(int64_t value) {
  Value v;
  v.kind_ = ValueKind::kInt;
  v.int_ = value;
  return v;
}

Value Value::floating(double value) {
  Value v;
  v.kind_ = ValueKind::kFloat;
  v.float_ = value;
  return v;
}

Value Value::string(std::string value) {
  Value v;
  v.kind_ = ValueKind::kString;
  v.string_ = std::make_shared<const std::string>(std::move(value));
  return v;
}

Value Value::array(std::vector<Value> items, bool tuple) {
  uint32_t deepest = 0;
  for (const Value& item : items) deepest = std::max(deepest, item.depth());
  if (deepest + 1 > kMaxDepth) raise(ErrorCode::kInvalidArgument, "a value nested deeper than {} levels", kMaxDepth);
  Value v;
  v.kind_ = tuple ? ValueKind::kTuple : ValueKind::kArray;
  v.array_ = std::make_shared<const std::vector<Value>>(std::move(items));
  v.array_depth_ = deepest + 1;
  return v;
}

Value Value::object(Object object, bool is_namespace) {
  uint32_t deepest = 0;
  for (const auto& entry : object.entries) deepest = std::max(deepest, entry.second.depth());
  if (deepest + 1 > kMaxDepth) raise(ErrorCode::kInvalidArgument, "a value nested deeper than {} levels", kMaxDepth);
  object.depth = deepest + 1;
  Value v;
  v.kind_ = is_namespace ? ValueKind::kNamespace : ValueKind::kObject;
  v.object_ = std::make_shared<Object>(std::move(object));
  return v;
}

uint32_t Value::depth() const {
  switch (kind_) {
    case ValueKind::kArray:
    case ValueKind::kTuple:
      return array_depth_;
    case ValueKind::kObject:
    case ValueKind::kNamespace:
      return object_->depth;
    default:
      return 0;
  }
}

Value Value::function(Function function) {
  Value v;
  v.kind_ = ValueKind::kFunction;
  v.function_ = std::make_shared<const Function>(std::move(function));
  return v;
}

namespace {

// JavaScript orders an object's own "array index" keys (canonical decimal integers below 2^32 - 1)
// first, ascending, then the other keys in insertion order.
bool is_array_index_key(const std::string& key, uint32_t& index) {
  if (key.empty() || key.size() > 10 || (key.size() > 1 && key[0] == '0')) return false;
  uint64_t value = 0;
  for (char c : key) {
    if (c < '0' || c > '9') return false;
    value = value * 10 + static_cast<uint64_t>(c - '0');
  }
  if (value >= 0xFFFFFFFFull) return false;
  index = static_cast<uint32_t>(value);
  return true;
}

Value number_from_double(double value) {
  // JSON.parse yields doubles; @huggingface/jinja makes the integral ones IntegerValues.
  if (std::isfinite(value) && value == std::floor(value) && std::fabs(value) < 9.2e18) {
    return Value::integer(static_cast<int64_t>(value));
  }
  return Value::floating(value);
}

}  // namespace

namespace {

Value value_from_json(const nlohmann::ordered_json& json, size_t depth) {
  switch (json.type()) {
    case nlohmann::ordered_json::value_t::null:
      return Value::null();
    case nlohmann::ordered_json::value_t::boolean:
      return Value::boolean(json.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer:
      return number_from_double(static_cast<double>(json.get<int64_t>()));
    case nlohmann::ordered_json::value_t::number_unsigned:
      return number_from_double(static_cast<double>(json.get<uint64_t>()));
    case nlohmann::ordered_json::value_t::number_float:
      return number_from_double(json.get<double>());
    case nlohmann::ordered_json::value_t::string:
      return Value::string(json.get<std::string>());
    default:
      break;
  }
  // One stack frame per level: a container nested deeper than the limit is refused, not recursed
  // into (a request's tools or chat_template_kwargs may nest tens of thousands of levels).
  if (depth >= Value::kMaxJsonDepth) {
    raise(ErrorCode::kInvalidArgument, "chat template input nested deeper than {} levels", Value::kMaxJsonDepth);
  }
  switch (json.type()) {
    case nlohmann::ordered_json::value_t::array: {
      std::vector<Value> items;
      items.reserve(json.size());
      for (const auto& item : json) items.push_back(value_from_json(item, depth + 1));
      return Value::array(std::move(items));
    }
    case nlohmann::ordered_json::value_t::object: {
      std::vector<std::pair<uint32_t, const std::string*>> index_keys;
      Object object;
      for (auto it = json.begin(); it != json.end(); ++it) {
        uint32_t index = 0;
        if (is_array_index_key(it.key(), index)) index_keys.emplace_back(index, &it.key());
      }
      std::sort(index_keys.begin(), index_keys.end());
      for (const auto& [index, key] : index_keys)
        object.entries.emplace_back(*key, value_from_json(json.at(*key), depth + 1));
      for (auto it = json.begin(); it != json.end(); ++it) {
        uint32_t index = 0;
        if (!is_array_index_key(it.key(), index)) object.entries.emplace_back(it.key(), value_from_json(it.value(), depth + 1));
      }
      return Value::object(std::move(object));
    }
    default:
      raise(ErrorCode::kInvalidArgument, "chat template: unsupported JSON value of type {}", json.type_name());
  }
}

}  // namespace

Value Value::from_json(const nlohmann::ordered_json& json) { return value_from_json(json, 0); }

double Value::as_number() const {
  switch (kind_) {
    case ValueKind::kInt:
      return static_cast<double>(int_);
    case ValueKind::kFloat:
      return float_;
    case ValueKind::kBool:
      return bool_ ? 1.0 : 0.0;
    default:
      return std::numeric_limits<double>::quiet_NaN();
  }
}

const std::string& Value::as_string() const {
  static const std::string kEmpty;
  return string_ ? *string_ : kEmpty;
}

const std::vector<Value>& Value::as_array() const {
  static const std::vector<Value> kEmpty;
  return array_ ? *array_ : kEmpty;
}

const Object& Value::as_object() const {
  static const Object kEmpty;
  return object_ ? *object_ : kEmpty;
}

Object& Value::mutable_object() const {
  METRALE_CHECK(object_ != nullptr, "not an object");
  return *object_;
}

const Function& Value::as_function() const {
  METRALE_CHECK(function_ != nullptr, "not a function");
  return *function_;
}

bool Value::truthy() const {
  switch (kind_) {
    case ValueKind::kUndefined:
    case ValueKind::kNull:
      return false;
    case ValueKind::kBool:
      return bool_;
    case ValueKind::kInt:
      return int_ != 0;
    case ValueKind::kFloat:
      return float_ != 0.0 && !std::isnan(float_);
    case ValueKind::kString:
      return !as_string().empty();
    case ValueKind::kArray:
    case ValueKind::kTuple:
      return !as_array().empty();
    case ValueKind::kObject:
      return !as_object().entries.empty();
    case ValueKind::kNamespace:
    case ValueKind::kFunction:
      return true;
  }
  return false;
}

std::string js_number_to_string(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "Infinity" : "-Infinity";
  if (value == 0) return "0";
  // The shortest round-trip digits, then ECMAScript Number::toString's layout.
  char buffer[64];
  const auto result = std::to_chars(buffer, buffer + sizeof(buffer), value, std::chars_format::scientific);
  std::string scientific(buffer, result.ptr);
  std::string sign;
  if (scientific[0] == '-') {
    sign = "-";
    scientific.erase(0, 1);
  }
  const size_t e = scientific.find('e');
  std::string digits = scientific.substr(0, e);
  digits.erase(std::remove(digits.begin(), digits.end(), '.'), digits.end());
  const int exponent = std::stoi(scientific.substr(e + 1));
  const int k = static_cast<int>(digits.size());
  const int n = exponent + 1;  // the decimal point sits after n digits
  std::string out = sign;
  if (k <= n && n <= 21) {
    out += digits + std::string(static_cast<size_t>(n - k), '0');
  } else if (0 < n && n <= 21) {
    out += digits.substr(0, static_cast<size_t>(n)) + "." + digits.substr(static_cast<size_t>(n));
  } else if (-6 < n && n <= 0) {
    out += "0." + std::string(static_cast<size_t>(-n), '0') + digits;
  } else {
    out += digits.substr(0, 1);
    if (k > 1) out += "." + digits.substr(1);
    out += (n - 1 >= 0 ? "e+" : "e-") + std::to_string(std::abs(n - 1));
  }
  return out;
}

char32_t decode_code_point(std::string_view text, size_t& pos) {
  const Utf8Sequence sequence = scan_utf8(text.substr(pos));
  if (sequence.status != Utf8Status::kValid) {
    pos += std::max<size_t>(1, sequence.length);
    return 0xFFFD;
  }
  pos += sequence.length;
  return sequence.code_point;
}

bool is_js_space(char32_t c) {
  switch (c) {
    case 0x09: case 0x0A: case 0x0B: case 0x0C: case 0x0D: case 0x20: case 0xA0: case 0x1680:
    case 0x2028: case 0x2029: case 0x202F: case 0x205F: case 0x3000: case 0xFEFF:
      return true;
    default:
      return c >= 0x2000 && c <= 0x200A;
  }
}

std::string_view js_trim_start(std::string_view text) {
  size_t pos = 0;
  while (pos < text.size()) {
    size_t next = pos;
    if (!is_js_space(decode_code_point(text, next))) break;
    pos = next;
  }
  return text.substr(pos);
}

std::string_view js_trim_end(std::string_view text) {
  size_t end = text.size();
  while (end > 0) {
    size_t start = end - 1;
    while (start > 0 && (static_cast<uint8_t>(text[start]) & 0xC0) == 0x80 && end - start < 4) --start;
    size_t pos = start;
    const char32_t c = decode_code_point(text, pos);
    if (pos != end || !is_js_space(c)) break;
    end = start;
  }
  return text.substr(0, end);
}

int64_t utf16_length(std::string_view text) {
  int64_t length = 0;
  size_t pos = 0;
  while (pos < text.size()) length += decode_code_point(text, pos) >= 0x10000 ? 2 : 1;
  return length;
}

void append_json_string(std::string& out, std::string_view text, bool ensure_ascii) {
  static constexpr char kHex[] = "0123456789abcdef";
  const auto append_unit = [&](uint32_t unit) {
    out += "\\u";
    for (int shift = 12; shift >= 0; shift -= 4) out += kHex[(unit >> shift) & 0xF];
  };
  out += '"';
  size_t pos = 0;
  while (pos < text.size()) {
    const unsigned char byte = static_cast<unsigned char>(text[pos]);
    if (byte < 0x80) {
      ++pos;
      switch (byte) {
        case '"': out += "\\\""; break;
        case '\\': out += "\\\\"; break;
        case '\b': out += "\\b"; break;
        case '\f': out += "\\f"; break;
        case '\n': out += "\\n"; break;
        case '\r': out += "\\r"; break;
        case '\t': out += "\\t"; break;
        default:
          if (byte < 0x20 || (ensure_ascii && byte == 0x7F)) {
            append_unit(byte);
          } else {
            out += static_cast<char>(byte);
          }
      }
      continue;
    }
    const size_t start = pos;
    const char32_t c = decode_code_point(text, pos);
    if (!ensure_ascii) {
      out.append(text.substr(start, pos - start));
    } else if (c >= 0x10000) {
      append_unit(0xD800 + ((c - 0x10000) >> 10));
      append_unit(0xDC00 + ((c - 0x10000) & 0x3FF));
    } else {
      append_unit(c);
    }
  }
  out += '"';
}

std::string Value::display() const {
  switch (kind_) {
    case ValueKind::kFloat:
      if (float_ == 0 && std::signbit(float_)) return "-0.0";
      if (std::isfinite(float_) && float_ == std::floor(float_) && std::fabs(float_) < 1e21) {
        return js_number_to_string(float_) + ".0";
      }
      return js_number_to_string(float_);
    case ValueKind::kArray:
    case ValueKind::kTuple:
    case ValueKind::kObject:
    case ValueKind::kNamespace: {
      JsonOptions options;
      options.undefined_as_null = false;
      return to_json(options);
    }
    case ValueKind::kUndefined:
      return "";
    case ValueKind::kNull:
      return "None";
    default:
      return js_string();
  }
}

std::string Value::js_string() const {
  switch (kind_) {
    case ValueKind::kUndefined:
      return "undefined";
    case ValueKind::kNull:
      return "null";
    case ValueKind::kBool:
      return bool_ ? "true" : "false";
    case ValueKind::kInt:
      return std::to_string(int_);
    case ValueKind::kFloat:
      return js_number_to_string(float_);
    case ValueKind::kString:
      return as_string();
    case ValueKind::kArray:
    case ValueKind::kTuple: {
      // Array.prototype.toString joins the elements' RuntimeValue.toString() with ",".
      std::string out;
      bool first = true;
      for (const Value& item : as_array()) {
        if (!first) out += ',';
        first = false;
        if (item.kind_ == ValueKind::kUndefined) {
          out += "undefined";
        } else if (item.kind_ == ValueKind::kNull) {
          out += "null";
        } else {
          out += item.display();
        }
      }
      return out;
    }
    case ValueKind::kObject:
    case ValueKind::kNamespace:
      return "[object Map]";
    case ValueKind::kFunction:
      return "[function]";
  }
  return "";
}

std::string Value::to_json(const JsonOptions& options) const {
  std::string out;
  append_json(out, options, 0);
  return out;
}

void Value::append_json(std::string& out, const JsonOptions& options, int depth) const {
  std::string item_separator = ", ";
  std::string key_separator = ": ";
  if (options.separators != nullptr) {
    item_separator = options.separators->first;
    key_separator = options.separators->second;
  } else if (options.indent > 0) {
    item_separator = ",";
  }
  switch (kind_) {
    case ValueKind::kUndefined:
      out += options.undefined_as_null ? "null" : "undefined";
      return;
    case ValueKind::kNull:
      out += "null";
      return;
    case ValueKind::kBool:
      out += bool_ ? "true" : "false";
      return;
    case ValueKind::kInt:
      out += std::to_string(int_);
      return;
    case ValueKind::kFloat:
      out += std::isfinite(float_) ? js_number_to_string(float_) : "null";
      return;
    case ValueKind::kString:
      append_json_string(out, as_string(), options.ensure_ascii);
      return;
    case ValueKind::kFunction:
      raise(ErrorCode::kInvalidArgument, "Cannot convert to JSON: FunctionValue");
    default:
      break;
  }
  if (depth > 512) raise(ErrorCode::kInvalidArgument, "tojson: value nested too deeply");
  const std::string indent = options.indent > 0 ? std::string(static_cast<size_t>(options.indent), ' ') : "";
  std::string base_padding = "\n";
  for (int i = 0; i < depth; ++i) base_padding += indent;
  const std::string child_padding = base_padding + indent;
  if (is_array()) {
    const auto& items = as_array();
    out += '[';
    for (size_t i = 0; i < items.size(); ++i) {
      if (i > 0) out += item_separator;
      if (options.indent > 0) out += child_padding;
      items[i].append_json(out, options, depth + 1);
    }
    if (options.indent > 0 && !items.empty()) out += base_padding;
    out += ']';
    return;
  }
  std::vector<const std::pair<std::string, Value>*> entries;
  for (const auto& entry : as_object().entries) entries.push_back(&entry);
  if (options.sort_keys) {
    std::stable_sort(entries.begin(), entries.end(), [](const auto* a, const auto* b) { return a->first < b->first; });
  }
  out += '{';
  for (size_t i = 0; i < entries.size(); ++i) {
    if (i > 0) out += item_separator;
    if (options.indent > 0) out += child_padding;
    append_json_string(out, entries[i]->first, options.ensure_ascii);
    out += key_separator;
    entries[i]->second.append_json(out, options, depth + 1);
  }
  if (options.indent > 0 && !entries.empty()) out += base_padding;
  out += '}';
}

const char* Value::type_name() const {
  switch (kind_) {
    case ValueKind::kUndefined: return "UndefinedValue";
    case ValueKind::kNull: return "NullValue";
    case ValueKind::kBool: return "BooleanValue";
    case ValueKind::kInt: return "IntegerValue";
    case ValueKind::kFloat: return "FloatValue";
    case ValueKind::kString: return "StringValue";
    case ValueKind::kArray: return "ArrayValue";
    case ValueKind::kTuple: return "TupleValue";
    case ValueKind::kObject: return "ObjectValue";
    case ValueKind::kNamespace: return "NamespaceValue";
    case ValueKind::kFunction: return "FunctionValue";
  }
  return "?";
}

bool Value::same_container(const Value& other) const {
  switch (kind_) {
    case ValueKind::kArray:
    case ValueKind::kTuple:
      return other.is_array() && array_ == other.array_;
    case ValueKind::kObject:
    case ValueKind::kNamespace:
      return other.object_ == object_ && other.kind_ == kind_;
    case ValueKind::kFunction:
      return other.kind_ == kind_ && other.function_ == function_;
    default:
      return false;
  }
}

namespace {

// JavaScript's ToNumber for a string: surrounding whitespace ignored, "" is 0, otherwise a decimal
// literal (or Infinity) or NaN.
double js_string_to_number(std::string_view text) {
  const std::string_view trimmed = js_trim_end(js_trim_start(text));
  if (trimmed.empty()) return 0.0;
  const std::string owned(trimmed);
  if (owned == "Infinity" || owned == "+Infinity") return std::numeric_limits<double>::infinity();
  if (owned == "-Infinity") return -std::numeric_limits<double>::infinity();
  char* end = nullptr;
  const double value = std::strtod(owned.c_str(), &end);
  if (end != owned.c_str() + owned.size() || owned.find_first_of("xXnN") != std::string::npos) {
    return std::numeric_limits<double>::quiet_NaN();
  }
  return value;
}

bool is_primitive_numeric(ValueKind kind) {
  return kind == ValueKind::kInt || kind == ValueKind::kFloat || kind == ValueKind::kBool ||
         kind == ValueKind::kString;
}

}  // namespace

bool Value::strict_equals(const Value& other) const {
  if (is_number() && other.is_number()) return as_number() == other.as_number();
  if (kind_ != other.kind_) return false;
  switch (kind_) {
    case ValueKind::kUndefined:
    case ValueKind::kNull:
      return true;
    case ValueKind::kBool:
      return bool_ == other.bool_;
    case ValueKind::kString:
      return as_string() == other.as_string();
    default:
      return same_container(other);
  }
}

bool Value::loose_equals(const Value& other) const {
  const bool nullish = kind_ == ValueKind::kUndefined || kind_ == ValueKind::kNull;
  const bool other_nullish = other.kind_ == ValueKind::kUndefined || other.kind_ == ValueKind::kNull;
  if (nullish || other_nullish) return nullish && other_nullish;
  if (kind_ == ValueKind::kString && other.kind_ == ValueKind::kString) return as_string() == other.as_string();
  if (kind_ == ValueKind::kBool && other.kind_ == ValueKind::kBool) return bool_ == other.bool_;
  if (is_primitive_numeric(kind_) && is_primitive_numeric(other.kind_)) {
    const double a = kind_ == ValueKind::kString ? js_string_to_number(as_string()) : as_number();
    const double b = other.kind_ == ValueKind::kString ? js_string_to_number(other.as_string()) : other.as_number();
    return a == b;
  }
  return same_container(other);
}

}  // namespace metrale::text::jinja
