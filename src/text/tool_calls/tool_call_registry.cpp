// Format names, the parser selector, the OpenAI `tools` reader and the fuzzing entry point.
#include <array>
#include <cstdlib>
#include <utility>

#include "core/error.h"
#include "text/tool_calls/tool_call_parser.h"

namespace metrale {
namespace {

struct FormatName {
  std::string_view name;
  ToolCallFormat format;
};

// Canonical names first (the order of the enum), then aliases.
constexpr std::array kFormatNames{
    FormatName{"hermes", ToolCallFormat::kHermes},
    FormatName{"qwen3_coder", ToolCallFormat::kQwen3Coder},
    FormatName{"glm45", ToolCallFormat::kGlm45},
    FormatName{"deepseek_v3", ToolCallFormat::kDeepSeekV3},
    FormatName{"deepseek_v31", ToolCallFormat::kDeepSeekV31},
    FormatName{"deepseek_v32", ToolCallFormat::kDeepSeekV32},
    FormatName{"qwen3", ToolCallFormat::kHermes},
    FormatName{"qwen2.5", ToolCallFormat::kHermes},
    FormatName{"qwen3_json", ToolCallFormat::kHermes},
    FormatName{"qwen3_xml", ToolCallFormat::kQwen3Coder},
    FormatName{"qwen3.5", ToolCallFormat::kQwen3Coder},
    FormatName{"qwen3_5", ToolCallFormat::kQwen3Coder},
    FormatName{"glm4_moe", ToolCallFormat::kGlm45},
    FormatName{"glm47", ToolCallFormat::kGlm45},
    FormatName{"glm5", ToolCallFormat::kGlm45},
    FormatName{"deepseek_v3.1", ToolCallFormat::kDeepSeekV31},
    FormatName{"deepseek_v3.2", ToolCallFormat::kDeepSeekV32},
};
constexpr size_t kNumFormats = 6;

bool contains(std::string_view text, std::string_view part) {
  return text.find(part) != std::string_view::npos;
}

std::optional<ToolCallFormat> format_of_template(std::string_view chat_template) {
  if (contains(chat_template, "｜DSML｜")) return ToolCallFormat::kDeepSeekV32;
  if (contains(chat_template, "<｜tool▁call▁begin｜>")) {
    // DeepSeek-V3 writes "function<｜tool▁sep｜>NAME\n```json"; V3.1 drops the type and the fence.
    return contains(chat_template, "```json") ? ToolCallFormat::kDeepSeekV3 : ToolCallFormat::kDeepSeekV31;
  }
  if (contains(chat_template, "<arg_key>")) return ToolCallFormat::kGlm45;
  if (contains(chat_template, "<function=") && contains(chat_template, "<parameter="))
    return ToolCallFormat::kQwen3Coder;
  if (contains(chat_template, "<tool_call>")) return ToolCallFormat::kHermes;
  return std::nullopt;
}

std::optional<ToolCallFormat> format_of_model_type(std::string_view model_type) {
  if (model_type.ends_with("_text")) model_type.remove_suffix(5);
  if (model_type == "qwen3_5" || model_type == "qwen3_5_moe") return ToolCallFormat::kQwen3Coder;
  if (model_type.starts_with("qwen2") || model_type.starts_with("qwen3")) return ToolCallFormat::kHermes;
  if (model_type.starts_with("glm4") || model_type.starts_with("glm5")) return ToolCallFormat::kGlm45;
  if (model_type == "deepseek_v32") return ToolCallFormat::kDeepSeekV32;
  if (model_type == "deepseek_v3") return ToolCallFormat::kDeepSeekV31;
  return std::nullopt;
}

}  // namespace

std::string_view tool_call_format_name(ToolCallFormat format) {
  for (const FormatName& entry : kFormatNames) {
    if (entry.format == format) return entry.name;
  }
  return "unknown";
}

std::optional<ToolCallFormat> tool_call_format_from_name(std::string_view name) {
  for (const FormatName& entry : kFormatNames) {
    if (entry.name == name) return entry.format;
  }
  return std::nullopt;
}

const std::vector<std::string_view>& tool_call_format_names() {
  static const std::vector<std::string_view> names = [] {
    std::vector<std::string_view> list;
    for (size_t i = 0; i < kNumFormats; ++i) list.push_back(kFormatNames[i].name);
    return list;
  }();
  return names;
}

std::optional<ToolCallFormat> select_tool_call_format(std::string_view model_type, std::string_view chat_template) {
  if (std::optional<ToolCallFormat> format = format_of_template(chat_template)) return format;
  return format_of_model_type(model_type);
}

std::vector<ToolDefinition> tool_definitions_from_openai(const nlohmann::ordered_json& tools) {
  if (!tools.is_array()) raise(ErrorCode::kInvalidArgument, "tools must be a list");
  std::vector<ToolDefinition> definitions;
  for (size_t i = 0; i < tools.size(); ++i) {
    const nlohmann::ordered_json& tool = tools[i];
    if (!tool.is_object()) raise(ErrorCode::kInvalidArgument, "tools[{}] must be an object", i);
    const auto type = tool.find("type");
    if (type != tool.end() && (!type->is_string() || type->get<std::string>() != "function")) continue;
    const auto function = tool.find("function");
    if (function == tool.end() || !function->is_object()) {
      raise(ErrorCode::kInvalidArgument, "tools[{}].function must be an object", i);
    }
    const auto name = function->find("name");
    if (name == function->end() || !name->is_string() || name->get<std::string>().empty()) {
      raise(ErrorCode::kInvalidArgument, "tools[{}].function.name must be a non-empty string", i);
    }
    ToolDefinition definition;
    definition.name = name->get<std::string>();
    const auto parameters = function->find("parameters");
    if (parameters != function->end() && !parameters->is_null()) {
      if (!parameters->is_object()) {
        raise(ErrorCode::kInvalidArgument, "tools[{}].function.parameters must be an object", i);
      }
      definition.parameters = *parameters;
    }
    definitions.push_back(std::move(definition));
  }
  return definitions;
}

int fuzz_tool_call_parser(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const auto format = static_cast<ToolCallFormat>(data[0] % kNumFormats);
  uint32_t chunking = data[1] * 2654435761u + 1;
  const std::string_view text(reinterpret_cast<const char*>(data + 2), size - 2);
  static const std::vector<ToolDefinition> tools{ToolDefinition{
      std::string("f"),
      nlohmann::ordered_json::parse(
          R"({"type":"object","properties":{"s":{"type":"string"},"n":{"type":"integer"},"o":{"type":"object"}}})")}};
  const ToolParseResult whole = parse_tool_calls(format, tools, text);
  ToolCallParser parser(format, tools);
  ToolParseResult streamed;
  for (size_t at = 0; at < text.size();) {
    chunking = chunking * 1103515245u + 12345u;
    const size_t length = std::min<size_t>(text.size() - at, 1 + (chunking >> 16) % 8);
    merge_tool_parse_delta(streamed, parser.feed(text.substr(at, length)));
    at += length;
  }
  merge_tool_parse_delta(streamed, parser.finish());
  bool same = streamed.content == whole.content && streamed.tool_calls.size() == whole.tool_calls.size();
  for (size_t i = 0; same && i < whole.tool_calls.size(); ++i) {
    same = streamed.tool_calls[i].id == whole.tool_calls[i].id &&
           streamed.tool_calls[i].name == whole.tool_calls[i].name &&
           streamed.tool_calls[i].arguments == whole.tool_calls[i].arguments;
  }
  if (!same || whole.content.size() > text.size()) std::abort();
  return 0;
}

}  // namespace metrale
