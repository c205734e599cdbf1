// The tool-call parsers read back what each fixture chat template writes for an assistant turn with
// tool calls: the template (tests/text/chat_templates/) picks the parser, renders two calls, and the
// parser must return exactly those calls.
#include <gtest/gtest.h>

#include <string>

#include "core/strings.h"
#include "text/chat_template.h"
#include "text/tool_calls/output_parser.h"

namespace metrale {
namespace {

using OrderedJson = nlohmann::ordered_json;

struct Case {
  std::string file;
  std::string bos;
  std::string eos;
  ToolCallFormat format;
  bool string_arguments;  // the template concatenates `arguments` as a string
  std::string start_marker;
};

OrderedJson tools_json() {
  return OrderedJson::parse(R"([
    {"type": "function", "function": {"name": "get_weather", "description": "Weather.", "parameters": {
      "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                        "flags": {"type": "object"}}}}},
    {"type": "function", "function": {"name": "search", "description": "Search.", "parameters": {
      "type": "object", "properties": {"query": {"type": "string"}}}}}
  ])");
}

OrderedJson calls_json(bool string_arguments) {
  OrderedJson first = OrderedJson::parse(R"({"city": "San José", "days": 3, "flags": {"metric": true}})");
  OrderedJson second = OrderedJson::parse(R"({"query": "two\nlines"})");
  const auto call = [&](const char* id, const char* name, OrderedJson arguments) {
    OrderedJson function = {{"name", name}};
    function["arguments"] = string_arguments ? OrderedJson(arguments.dump()) : arguments;
    return OrderedJson{{"id", id}, {"type", "function"}, {"function", function}};
  };
  return OrderedJson::array({call("call_1", "get_weather", first), call("call_2", "search", second)});
}

class ToolCallTemplate : public ::testing::TestWithParam<Case> {};

TEST_P(ToolCallTemplate, ParsesWhatTheTemplateWrites) {
  const Case& c = GetParam();
  const std::string source = read_file(std::string(METRALE_TEST_DATA_DIR) + "/text/chat_templates/" + c.file);
  ASSERT_EQ(select_tool_call_format("", source), c.format) << c.file;
  const ChatTemplate chat_template(source, c.bos, c.eos);

  ChatTemplateInputs turn;
  turn.tools = tools_json();
  turn.add_generation_prompt = false;
  turn.messages = OrderedJson::array({{{"role", "user"}, {"content", "Weather in San José, then search."}},
                                      {{"role", "assistant"},
                                       // DeepSeek's templates write calls only for a null content.
                                       {"content", c.string_arguments ? OrderedJson(nullptr) : OrderedJson("")},
                                       {"tool_calls", calls_json(c.string_arguments)}}});
  const std::string full = chat_template.render(turn);
  // The assistant's output: from its first call marker to its end-of-turn token (where the model
  // stops). What comes before the marker is the prompt (and an empty think block).
  const size_t user = full.rfind("then search.");
  ASSERT_NE(user, std::string::npos) << full;
  const size_t start = full.find(c.start_marker, user);
  ASSERT_NE(start, std::string::npos) << full;
  std::string output = full.substr(start);
  output = output.substr(0, output.find(c.eos));

  OutputParser parser(std::nullopt, ToolCallParser(c.format, tool_definitions_from_openai(tools_json())));
  OutputDelta result = parser.feed(output);
  OutputDelta last = parser.finish();
  result.content += last.content;
  for (ToolCallDelta& call : last.tool_calls) result.tool_calls.push_back(std::move(call));

  EXPECT_EQ(trim(result.content), "") << c.file << " output: " << output;
  ASSERT_EQ(result.tool_calls.size(), 4u) << c.file << " output: " << output;
  EXPECT_EQ(result.tool_calls[0].name, "get_weather");
  EXPECT_EQ(OrderedJson::parse(result.tool_calls[1].arguments),
            OrderedJson::parse(R"({"city": "San José", "days": 3, "flags": {"metric": true}})"))
      << c.file << " output: " << output;
  EXPECT_EQ(result.tool_calls[2].name, "search");
  EXPECT_EQ(OrderedJson::parse(result.tool_calls[3].arguments), OrderedJson::parse(R"({"query": "two\nlines"})"))
      << c.file << " output: " << output;
}

INSTANTIATE_TEST_SUITE_P(
    Fixtures, ToolCallTemplate,
    ::testing::Values(Case{"qwen3.jinja", "", "<|im_end|>", ToolCallFormat::kHermes, false, "<tool_call>"},
                      Case{"qwen3.5.jinja", "", "<|im_end|>", ToolCallFormat::kQwen3Coder, false, "<tool_call>"},
                      Case{"glm-4.6.jinja", "", "<|endoftext|>", ToolCallFormat::kGlm45, false, "<tool_call>"},
                      Case{"glm-4.5-llamacpp.jinja", "", "<|endoftext|>", ToolCallFormat::kGlm45, false, "<tool_call>"},
                      Case{"deepseek-v3.jinja", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
                           ToolCallFormat::kDeepSeekV3, true, "<｜tool▁calls▁begin｜>"},
                      Case{"deepseek-v3.1.jinja", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
                           ToolCallFormat::kDeepSeekV31, true, "<｜tool▁calls▁begin｜>"},
                      Case{"deepseek-v3.2.jinja", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
                           ToolCallFormat::kDeepSeekV31, true, "<｜tool▁calls▁begin｜>"}),
    [](const ::testing::TestParamInfo<Case>& param) {
      std::string name = param.param.file.substr(0, param.param.file.find(".jinja"));
      for (char& ch : name) {
        if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
      }
      return name;
    });

}  // namespace
}  // namespace metrale
