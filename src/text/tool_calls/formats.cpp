#include "text/tool_calls/formats.h"

#include <utility>

#include "text/tool_calls/argument_types.h"

namespace metrale::text::tool_calls {
namespace {

using OrderedJson = nlohmann::ordered_json;

// The markers as the models' tokenizers spell them (fullwidth bars U+FF5C, U+2581 for spaces).
constexpr Markers kHermesMarkers{"", "", "<tool_call>", "</tool_call>"};
constexpr Markers kDeepSeekMarkers{"<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                                   "<｜tool▁call▁end｜>"};
constexpr Markers kDsmlMarkers{"<｜DSML｜function_calls>", "</｜DSML｜function_calls>", "<｜DSML｜invoke",
                               "</｜DSML｜invoke>"};
constexpr std::string_view kDeepSeekSeparator = "<｜tool▁sep｜>";
constexpr std::string_view kDsmlParameter = "<｜DSML｜parameter";
constexpr std::string_view kDsmlParameterEnd = "</｜DSML｜parameter>";

bool is_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r';
}

std::string_view trim(std::string_view text) {
  while (!text.empty() && is_space(text.front())) text.remove_prefix(1);
  while (!text.empty() && is_space(text.back())) text.remove_suffix(1);
  return text;
}

// A function name as the formats write it: non-empty, no whitespace and no markup characters.
bool plausible_name(std::string_view name) {
  if (name.empty() || name.size() > 256) return false;
  for (char c : name) {
    if (is_space(c) || c == '<' || c == '>' || c == '"' || c == '{' || c == '}') return false;
  }
  return true;
}

// Reads a body from left to right.
class Cursor {
 public:
  explicit Cursor(std::string_view text) : text_(text) {}
  void skip_space() {
    while (!text_.empty() && is_space(text_.front())) text_.remove_prefix(1);
  }
  bool done() const { return text_.empty(); }
  bool peek(std::string_view token) const { return text_.substr(0, token.size()) == token; }
  bool take(std::string_view token) {
    if (!peek(token)) return false;
    text_.remove_prefix(token.size());
    return true;
  }
  // The text up to the first `stop` (consumed with it); nullopt when `stop` never comes.
  std::optional<std::string_view> until(std::string_view stop) {
    const size_t at = text_.find(stop);
    if (at == std::string_view::npos) return std::nullopt;
    const std::string_view before = text_.substr(0, at);
    text_.remove_prefix(at + stop.size());
    return before;
  }
  std::string_view rest() const { return text_; }
  void advance(size_t n) { text_.remove_prefix(n); }

 private:
  std::string_view text_;
};

std::optional<ParsedCall> finish_call(std::string name, const OrderedJson& arguments, const ToolIndex& tools) {
  if (!plausible_name(name) || !arguments.is_object()) return std::nullopt;
  if (!tools.empty() && tools.find(name) == nullptr) return std::nullopt;
  return ParsedCall{std::move(name), dump_compact(arguments)};
}

// A JSON object written as text; a JSON string holding an object's text also counts.
std::optional<OrderedJson> json_object(std::string_view text) {
  text = trim(text);
  OrderedJson value = OrderedJson::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (value.is_string()) {
    const std::string inner = value.get<std::string>();
    value = OrderedJson::parse(inner, nullptr, /*allow_exceptions=*/false);
  }
  if (value.is_discarded() || !value.is_object()) return std::nullopt;
  return value;
}

// {"name": N, "arguments": {...}} ("parameters" is taken for "arguments"; absent means {}).
std::optional<ParsedCall> parse_hermes(std::string_view body, const ToolIndex& tools) {
  const std::optional<OrderedJson> call = json_object(body);
  if (!call) return std::nullopt;
  const auto name = call->find("name");
  if (name == call->end() || !name->is_string()) return std::nullopt;
  auto arguments = call->find("arguments");
  if (arguments == call->end()) arguments = call->find("parameters");
  if (arguments == call->end()) return finish_call(name->get<std::string>(), OrderedJson::object(), tools);
  if (arguments->is_string()) {
    const std::optional<OrderedJson> inner = json_object(arguments->get<std::string>());
    if (!inner) return std::nullopt;
    return finish_call(name->get<std::string>(), *inner, tools);
  }
  return finish_call(name->get<std::string>(), *arguments, tools);
}

// Strips the newline the templates write after an opening tag and before a closing one.
std::string_view strip_one_newline(std::string_view value) {
  if (!value.empty() && value.front() == '\n') value.remove_prefix(1);
  if (!value.empty() && value.back() == '\n') value.remove_suffix(1);
  return value;
}

// <function=N> (<parameter=K>\nV\n</parameter>)* </function>. A parameter whose closing tag is
// missing ends at the next parameter or at </function>; a missing </function> is tolerated.
std::optional<ParsedCall> parse_qwen3_coder(std::string_view body, const ToolIndex& tools) {
  Cursor cursor(body);
  cursor.skip_space();
  if (!cursor.take("<function=")) return std::nullopt;
  const std::optional<std::string_view> name = cursor.until(">");
  if (!name) return std::nullopt;
  const std::string function(trim(*name));
  OrderedJson arguments = OrderedJson::object();
  while (true) {
    cursor.skip_space();
    if (cursor.done()) break;
    if (cursor.take("</function>")) {
      cursor.skip_space();
      if (!cursor.done()) return std::nullopt;
      break;
    }
    if (!cursor.take("<parameter=")) return std::nullopt;
    const std::optional<std::string_view> key = cursor.until(">");
    if (!key || trim(*key).empty()) return std::nullopt;
    const std::string_view rest = cursor.rest();
    size_t end = rest.size();
    size_t skip = 0;
    for (std::string_view stop : {"</parameter>", "<parameter=", "</function>"}) {
      const size_t at = rest.find(stop);
      if (at < end) {
        end = at;
        skip = stop == "</parameter>" ? stop.size() : 0;
      }
    }
    const std::string parameter(trim(*key));
    arguments[parameter] =
        typed_value(strip_one_newline(rest.substr(0, end)), tools.parameter_types(function, parameter));
    cursor.advance(end + skip);
  }
  return finish_call(function, arguments, tools);
}

// N (<arg_key>K</arg_key> <arg_value>V</arg_value>)*; values exactly as written.
std::optional<ParsedCall> parse_glm45(std::string_view body, const ToolIndex& tools) {
  const size_t first = body.find("<arg_key>");
  const std::string function(trim(body.substr(0, first)));
  Cursor cursor(first == std::string_view::npos ? std::string_view() : body.substr(first));
  OrderedJson arguments = OrderedJson::object();
  while (true) {
    cursor.skip_space();
    if (cursor.done()) break;
    if (!cursor.take("<arg_key>")) return std::nullopt;
    const std::optional<std::string_view> key = cursor.until("</arg_key>");
    if (!key || trim(*key).empty()) return std::nullopt;
    cursor.skip_space();
    if (!cursor.take("<arg_value>")) return std::nullopt;
    const std::optional<std::string_view> value = cursor.until("</arg_value>");
    if (!value) return std::nullopt;
    const std::string parameter(trim(*key));
    arguments[parameter] = typed_value(*value, tools.parameter_types(function, parameter));
  }
  return finish_call(function, arguments, tools);
}

// N<｜tool▁sep｜>{...}
std::optional<ParsedCall> parse_deepseek_v31(std::string_view body, const ToolIndex& tools) {
  const size_t separator = body.find(kDeepSeekSeparator);
  if (separator == std::string_view::npos) return std::nullopt;
  const std::optional<OrderedJson> arguments = json_object(body.substr(separator + kDeepSeekSeparator.size()));
  if (!arguments) return std::nullopt;
  return finish_call(std::string(trim(body.substr(0, separator))), *arguments, tools);
}

// function<｜tool▁sep｜>N\n```json\n{...}\n```
std::optional<ParsedCall> parse_deepseek_v3(std::string_view body, const ToolIndex& tools) {
  const size_t separator = body.find(kDeepSeekSeparator);
  if (separator == std::string_view::npos || trim(body.substr(0, separator)) != "function") return std::nullopt;
  std::string_view rest = body.substr(separator + kDeepSeekSeparator.size());
  const size_t newline = rest.find('\n');
  if (newline == std::string_view::npos) return std::nullopt;
  const std::string function(trim(rest.substr(0, newline)));
  rest = trim(rest.substr(newline + 1));
  if (rest.substr(0, 7) == "```json") {
    rest.remove_prefix(7);
  } else if (rest.substr(0, 3) == "```") {
    rest.remove_prefix(3);
  }
  rest = trim(rest);
  if (rest.size() >= 3 && rest.substr(rest.size() - 3) == "```") rest.remove_suffix(3);
  const std::optional<OrderedJson> arguments = json_object(rest);
  if (!arguments) return std::nullopt;
  return finish_call(function, *arguments, tools);
}

// The value of attribute `name` ( name="value"), consumed from the cursor.
std::optional<std::string_view> take_attribute(Cursor& cursor, std::string_view name) {
  cursor.skip_space();
  if (!cursor.take(name) || !cursor.take("=\"")) return std::nullopt;
  return cursor.until("\"");
}

//  name="N"> then either (<｜DSML｜parameter name="K" string="true|false">V</｜DSML｜parameter>)* or a
// JSON object. string="true": V as written; string="false": V as JSON; no attribute: by the schema.
std::optional<ParsedCall> parse_dsml(std::string_view body, const ToolIndex& tools) {
  Cursor cursor(body);
  const std::optional<std::string_view> name = take_attribute(cursor, "name");
  cursor.skip_space();
  if (!name || !cursor.take(">")) return std::nullopt;
  const std::string function(trim(*name));
  cursor.skip_space();
  if (cursor.peek("{")) {
    const std::optional<OrderedJson> arguments = json_object(cursor.rest());
    if (!arguments) return std::nullopt;
    return finish_call(function, *arguments, tools);
  }
  OrderedJson arguments = OrderedJson::object();
  while (true) {
    cursor.skip_space();
    if (cursor.done()) break;
    if (!cursor.take(kDsmlParameter)) return std::nullopt;
    const std::optional<std::string_view> key = take_attribute(cursor, "name");
    if (!key || trim(*key).empty()) return std::nullopt;
    cursor.skip_space();
    std::optional<std::string_view> is_string;
    if (cursor.peek("string")) {
      is_string = take_attribute(cursor, "string");
      if (!is_string || (*is_string != "true" && *is_string != "false")) return std::nullopt;
      cursor.skip_space();
    }
    if (!cursor.take(">")) return std::nullopt;
    const std::optional<std::string_view> value = cursor.until(kDsmlParameterEnd);
    if (!value) return std::nullopt;
    const std::string parameter(trim(*key));
    uint8_t types = tools.parameter_types(function, parameter);
    if (is_string) types = *is_string == "true" ? kTypeString : static_cast<uint8_t>(types & ~kTypeString);
    arguments[parameter] = typed_value(*value, types == 0 ? static_cast<uint8_t>(kTypeAny & ~kTypeString) : types);
  }
  return finish_call(function, arguments, tools);
}

}  // namespace

const Markers& markers_of(ToolCallFormat format) {
  switch (format) {
    case ToolCallFormat::kHermes:
    case ToolCallFormat::kQwen3Coder:
    case ToolCallFormat::kGlm45:
      return kHermesMarkers;
    case ToolCallFormat::kDeepSeekV3:
    case ToolCallFormat::kDeepSeekV31:
      return kDeepSeekMarkers;
    case ToolCallFormat::kDeepSeekV32:
      return kDsmlMarkers;
  }
  return kHermesMarkers;
}

const ToolDefinition* ToolIndex::find(std::string_view name) const {
  for (const ToolDefinition& tool : tools_) {
    if (tool.name == name) return &tool;
  }
  return nullptr;
}

uint8_t ToolIndex::parameter_types(std::string_view tool, std::string_view parameter) const {
  const ToolDefinition* definition = find(tool);
  if (definition == nullptr || !definition->parameters.is_object()) return kTypeAny;
  const auto properties = definition->parameters.find("properties");
  if (properties == definition->parameters.end() || !properties->is_object()) return kTypeAny;
  const auto schema = properties->find(std::string(parameter));
  if (schema == properties->end()) return kTypeAny;
  return schema_types(*schema, definition->parameters);
}

std::optional<ParsedCall> parse_call_body(ToolCallFormat format, std::string_view body, const ToolIndex& tools) {
  switch (format) {
    case ToolCallFormat::kHermes:
      return parse_hermes(body, tools);
    case ToolCallFormat::kQwen3Coder:
      return parse_qwen3_coder(body, tools);
    case ToolCallFormat::kGlm45:
      return parse_glm45(body, tools);
    case ToolCallFormat::kDeepSeekV3:
      return parse_deepseek_v3(body, tools);
    case ToolCallFormat::kDeepSeekV31:
      return parse_deepseek_v31(body, tools);
    case ToolCallFormat::kDeepSeekV32:
      return parse_dsml(body, tools);
  }
  return std::nullopt;
}

}  // namespace metrale::text::tool_calls
