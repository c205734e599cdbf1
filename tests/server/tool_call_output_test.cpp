// Tool calls in chat choices (server/choice_output.h + the OpenAI JSON of openai_protocol.h): for
// every format, the streamed chunks merged as a client merges them equal the non-streaming message
// exactly; parallel calls, calls after a reasoning block, a call inside the reasoning block,
// malformed calls returned as content, and finish_reason "tool_calls".
#include <gtest/gtest.h>

#include <random>

#include "server/choice_output.h"
#include "server/openai_protocol.h"
#include "text/tiny_tokenizer.h"

namespace metrale::server {
namespace {

using json = nlohmann::ordered_json;

std::vector<ToolDefinition> weather_tools() {
  const json tools = json::parse(R"([
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
      "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object",
      "properties": {"zone": {"type": "string"}}}}}])");
  return tool_definitions_from_openai(tools);
}

struct FormatCase {
  ToolCallFormat format;
  std::string text;  // content then two calls
};

// Two calls per format, written as the formats' documentation shows (docs/structured_outputs.md).
std::vector<FormatCase> format_cases() {
  return {
      {ToolCallFormat::kHermes,
       "Checking.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 2}}\n"
       "</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"zone\": \"CET\"}}\n</tool_call>"},
      {ToolCallFormat::kQwen3Coder,
       "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n"
       "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n<parameter=zone>\nCET\n</parameter>\n"
       "</function>\n</tool_call>"},
      {ToolCallFormat::kGlm45,
       "Checking.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n"
       "<arg_value>2</arg_value>\n</tool_call><tool_call>get_time\n<arg_key>zone</arg_key>\n<arg_value>CET</arg_value>\n"
       "</tool_call>"},
      {ToolCallFormat::kDeepSeekV3,
       "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
       "{\"city\": \"Paris\", \"days\": 2}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n"
       "```json\n{\"zone\": \"CET\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"},
      {ToolCallFormat::kDeepSeekV31,
       "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Paris\", \"days\": 2}"
       "<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{\"zone\": \"CET\"}<｜tool▁call▁end｜>"
       "<｜tool▁calls▁end｜>"},
      {ToolCallFormat::kDeepSeekV32,
       "Checking.<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"city\" "
       "string=\"true\">Paris</｜DSML｜parameter>\n<｜DSML｜parameter name=\"days\" string=\"false\">2</｜DSML｜parameter>\n"
       "</｜DSML｜invoke>\n<｜DSML｜invoke name=\"get_time\">\n<｜DSML｜parameter name=\"zone\" string=\"true\">CET"
       "</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>"},
  };
}

// What a client (the openai SDK's stream helper) builds from chat chunks: content and reasoning
// concatenated, tool calls merged by index (id, type and name from the first piece, arguments
// concatenated), the last finish_reason.
json merge_chunks(const std::vector<json>& chunks) {
  json message = {{"role", "assistant"}, {"content", ""}};
  json calls = json::array();
  std::string finish;
  for (const json& chunk : chunks) {
    const json& choice = chunk["choices"][0];
    const json& delta = choice["delta"];
    if (delta.contains("content")) message["content"] = message["content"].get<std::string>() + delta["content"].get<std::string>();
    if (delta.contains("reasoning_content")) {
      const std::string before = message.contains("reasoning_content") ? message["reasoning_content"].get<std::string>() : "";
      message["reasoning_content"] = before + delta["reasoning_content"].get<std::string>();
      message["reasoning"] = message["reasoning_content"];
    }
    for (const json& piece : delta.value("tool_calls", json::array())) {
      const size_t index = piece["index"].get<size_t>();
      if (index == calls.size()) {
        EXPECT_TRUE(piece.contains("id") && piece["function"].contains("name")) << piece.dump();
        calls.push_back({{"id", piece["id"]},
                         {"type", piece["type"]},
                         {"function", {{"name", piece["function"]["name"]}, {"arguments", ""}}}});
      }
      EXPECT_LT(index, calls.size()) << "tool call indices must arrive in order";
      if (index >= calls.size()) continue;
      json& function = calls[index]["function"];
      function["arguments"] = function["arguments"].get<std::string>() + piece["function"]["arguments"].get<std::string>();
    }
    if (!choice["finish_reason"].is_null()) finish = choice["finish_reason"].get<std::string>();
  }
  if (!calls.empty()) {
    if (message["content"] == "") message["content"] = nullptr;
    message["tool_calls"] = std::move(calls);
  }
  return json{{"message", message}, {"finish_reason", finish}};
}

class ToolCallOutputTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_.write("tokenizer.json",
               testing::tiny_tokenizer_json(false, {{"<think>", false}, {"</think>", false}, {"<|end|>", true}}).dump());
    tokenizer_ = std::make_unique<Tokenizer>(Tokenizer::from_dir(dir_.path()));
  }

  ChoiceOptions options(ToolCallFormat format, bool reasoning = false) const {
    ChoiceOptions choice;
    choice.reasoning = reasoning;
    choice.tool_format = format;
    choice.tools = weather_tools();
    choice.tool_id_seed = 77;
    return choice;
  }

  // Streams `text` (ending with EOS) through a choice: returns (merged chunks, whole response).
  std::pair<json, json> run(const std::string& text, const ChoiceOptions& choice) const {
    ChoiceOutput output(*tokenizer_, choice);
    std::vector<int32_t> ids = tokenizer_->encode(text);
    ids.push_back(*tokenizer_->token_to_id("<|end|>"));
    const ResponseMeta meta{"chatcmpl-1", 1, "tiny"};
    std::vector<json> chunks;
    ChoiceText opening;
    opening.first = true;
    chunks.push_back(chat_chunk(meta, opening, false));
    for (size_t i = 0; i < ids.size(); ++i) {
      SampledToken token;
      token.token = ids[i];
      const bool last = i + 1 == ids.size();
      const ChoiceText delta = output.on_token(token, last ? FinishReason::kStop : FinishReason::kNone, SteadyClock::now());
      if (!delta.text.empty() || !delta.reasoning.empty() || !delta.tool_calls.empty() || !delta.finish_reason.empty())
        chunks.push_back(chat_chunk(meta, delta, false));
    }
    const json whole = chat_response(meta, {output.accumulated()}, Usage{1, 1})["choices"][0];
    return {merge_chunks(chunks), json{{"message", whole["message"]}, {"finish_reason", whole["finish_reason"]}}};
  }

  testing::TempDir dir_;
  std::unique_ptr<Tokenizer> tokenizer_;
};

TEST_F(ToolCallOutputTest, StreamedChunksMergeIntoTheWholeResponseForEveryFormat) {
  for (const FormatCase& test : format_cases()) {
    SCOPED_TRACE(std::string(tool_call_format_name(test.format)));
    const auto [streamed, whole] = run(test.text, options(test.format));
    EXPECT_EQ(streamed.dump(), whole.dump());
    EXPECT_EQ(whole["finish_reason"], "tool_calls");
    const json& message = whole["message"];
    EXPECT_EQ(message["content"], "Checking.");
    ASSERT_EQ(message["tool_calls"].size(), 2u) << message.dump();
    const json& first = message["tool_calls"][0];
    EXPECT_EQ(first["type"], "function");
    EXPECT_EQ(first["function"]["name"], "get_weather");
    EXPECT_EQ(json::parse(first["function"]["arguments"].get<std::string>()), json::parse(R"({"city":"Paris","days":2})"));
    EXPECT_EQ(first["id"].get<std::string>().rfind("call_", 0), 0u);
    const json& second = message["tool_calls"][1];
    EXPECT_EQ(second["function"]["name"], "get_time");
    EXPECT_EQ(json::parse(second["function"]["arguments"].get<std::string>()), json::parse(R"({"zone":"CET"})"));
    EXPECT_NE(first["id"], second["id"]);
    // The same text parsed at once gives the same calls.
    const ToolParseResult at_once = parse_tool_calls(test.format, weather_tools(), test.text, {77});
    ASSERT_EQ(at_once.tool_calls.size(), 2u);
    EXPECT_EQ(at_once.tool_calls[0].arguments, first["function"]["arguments"].get<std::string>());
    EXPECT_EQ(at_once.tool_calls[0].id, first["id"].get<std::string>());
  }
}

TEST_F(ToolCallOutputTest, CallsAfterReasoningAreCallsAndCallsInsideStayReasoning) {
  const std::string text =
      "<think>maybe <tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call> first</think>\n\n"
      "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>";
  const auto [streamed, whole] = run(text, options(ToolCallFormat::kHermes, /*reasoning=*/true));
  EXPECT_EQ(streamed.dump(), whole.dump());
  const json& message = whole["message"];
  ASSERT_EQ(message["tool_calls"].size(), 1u) << message.dump();
  EXPECT_EQ(message["tool_calls"][0]["function"]["name"], "get_weather");
  EXPECT_NE(message["reasoning_content"].get<std::string>().find("<tool_call>"), std::string::npos);
  EXPECT_EQ(whole["finish_reason"], "tool_calls");
}

TEST_F(ToolCallOutputTest, MalformedCallsComeBackAsContent) {
  const std::string bad_json = "Here: <tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": }\n</tool_call>";
  const std::string unknown = "<tool_call>\n{\"name\": \"launch\", \"arguments\": {}}\n</tool_call>";
  const std::string unclosed = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}";
  for (const std::string& text : {bad_json, unknown, unclosed}) {
    SCOPED_TRACE(text);
    const auto [streamed, whole] = run(text, options(ToolCallFormat::kHermes));
    EXPECT_EQ(streamed.dump(), whole.dump());
    EXPECT_FALSE(whole["message"].contains("tool_calls"));
    EXPECT_EQ(whole["message"]["content"], text);
    EXPECT_EQ(whole["finish_reason"], "stop");
  }
}

TEST_F(ToolCallOutputTest, ParallelToolCallsFalseKeepsTheFirstCallForEveryFormat) {
  for (const FormatCase& test : format_cases()) {
    SCOPED_TRACE(std::string(tool_call_format_name(test.format)));
    ChoiceOptions choice = options(test.format);
    choice.max_tool_calls = 1;
    const auto [streamed, whole] = run(test.text, choice);
    EXPECT_EQ(streamed.dump(), whole.dump());
    EXPECT_EQ(whole["finish_reason"], "tool_calls");
    const json& message = whole["message"];
    EXPECT_EQ(message["content"], "Checking.");
    ASSERT_EQ(message["tool_calls"].size(), 1u) << message.dump();
    EXPECT_EQ(message["tool_calls"][0]["function"]["name"], "get_weather");
  }
}

TEST_F(ToolCallOutputTest, WithoutAToolFormatCallsArePlainContent) {
  const std::string text = format_cases()[0].text;
  ChoiceOptions plain;
  const auto [streamed, whole] = run(text, plain);
  EXPECT_EQ(streamed.dump(), whole.dump());
  EXPECT_EQ(whole["message"]["content"], text);
  EXPECT_EQ(whole["finish_reason"], "stop");
}

}  // namespace
}  // namespace metrale::server
