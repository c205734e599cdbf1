// Request parsing and validation, error bodies, response and SSE chunk shapes of the OpenAI wire
// format.
#include "server/openai_protocol.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

namespace metrale::server {
namespace {

using json = nlohmann::ordered_json;

SamplingParams defaults() {
  SamplingParams params;
  params.temperature = 0.6f;
  params.top_p = 0.95f;
  params.top_k = 20;
  return params;
}

// Expects `parse` to throw an ApiError with the status and param.
template <typename Parse>
void expect_api_error(Parse parse, int status, const std::string& param, const std::string& fragment = {}) {
  try {
    parse();
    ADD_FAILURE() << "no error; expected " << status << " on '" << param << "'";
  } catch (const ApiError& error) {
    EXPECT_EQ(error.status(), status) << error.what();
    EXPECT_EQ(error.param(), param) << error.what();
    if (!fragment.empty()) {
      EXPECT_NE(std::string(error.what()).find(fragment), std::string::npos) << error.what();
    }
  }
}

void expect_completion_error(const json& body, const std::string& param, const std::string& fragment = {}) {
  expect_api_error([&] { parse_completion_request(body, defaults()); }, 400, param, fragment);
}

void expect_chat_error(const json& body, const std::string& param, const std::string& fragment = {}) {
  expect_api_error([&] { parse_chat_request(body, defaults()); }, 400, param, fragment);
}

TEST(OpenAiProtocol, CompletionDefaultsComeFromTheModel) {
  const CompletionRequest request = parse_completion_request(json{{"prompt", "hello"}}, defaults());
  ASSERT_EQ(request.text_prompts.size(), 1u);
  EXPECT_EQ(request.text_prompts[0], "hello");
  EXPECT_TRUE(request.token_prompts.empty());
  const GenerationParams& params = request.params;
  EXPECT_EQ(params.n, 1);
  EXPECT_FALSE(params.max_tokens.has_value());
  EXPECT_FLOAT_EQ(params.sampling.temperature, 0.6f);
  EXPECT_FLOAT_EQ(params.sampling.top_p, 0.95f);
  EXPECT_EQ(params.sampling.top_k, 20);
  EXPECT_FALSE(params.sampling.seed.has_value());
  EXPECT_FALSE(params.logprobs.has_value());
  EXPECT_FALSE(params.stream);
  EXPECT_TRUE(params.skip_special_tokens);
  EXPECT_FALSE(request.echo);
}

TEST(OpenAiProtocol, CompletionFieldsOverrideDefaults) {
  const json body = json::parse(R"({
    "model": "m", "prompt": ["a", "b"], "n": 3, "max_tokens": 7, "temperature": 0, "top_p": 0.5, "top_k": -1,
    "min_p": 0.1, "presence_penalty": 1.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2, "seed": 42,
    "stop": ["x", "yz"], "stop_token_ids": [3, 4], "ignore_eos": true, "skip_special_tokens": false,
    "stream": true, "stream_options": {"include_usage": true}, "logprobs": 2, "echo": true, "user": "ignored",
    "best_of": 3, "logit_bias": {}, "return_token_ids": true})");
  const CompletionRequest request = parse_completion_request(body, defaults());
  EXPECT_EQ(request.text_prompts, (std::vector<std::string>{"a", "b"}));
  const GenerationParams& params = request.params;
  EXPECT_EQ(params.model, "m");
  EXPECT_EQ(params.n, 3);
  EXPECT_EQ(params.max_tokens, 7);
  EXPECT_EQ(params.sampling.temperature, 0.0f);
  EXPECT_FLOAT_EQ(params.sampling.top_p, 0.5f);
  EXPECT_EQ(params.sampling.top_k, -1);
  EXPECT_FLOAT_EQ(params.sampling.min_p, 0.1f);
  EXPECT_FLOAT_EQ(params.sampling.presence_penalty, 1.5f);
  EXPECT_FLOAT_EQ(params.sampling.frequency_penalty, -0.5f);
  EXPECT_FLOAT_EQ(params.sampling.repetition_penalty, 1.2f);
  EXPECT_EQ(params.sampling.seed, 42u);
  EXPECT_EQ(params.stop, (std::vector<std::string>{"x", "yz"}));
  EXPECT_EQ(params.stop_token_ids, (std::vector<int32_t>{3, 4}));
  EXPECT_TRUE(params.ignore_eos);
  EXPECT_FALSE(params.skip_special_tokens);
  EXPECT_TRUE(params.stream);
  EXPECT_TRUE(params.include_usage);
  EXPECT_EQ(params.logprobs, 2);
  EXPECT_TRUE(request.echo);
  EXPECT_TRUE(params.return_token_ids);
  EXPECT_NO_THROW(params.sampling.validate());
  EXPECT_FALSE(parse_completion_request(json{{"prompt", "a"}}, defaults()).params.return_token_ids);
  EXPECT_THROW(parse_completion_request(json{{"prompt", "a"}, {"return_token_ids", 1}}, defaults()), ApiError);
}

TEST(OpenAiProtocol, PromptForms) {
  EXPECT_EQ(parse_completion_request(json{{"prompt", {1, 2, 3}}}, defaults()).token_prompts,
            (std::vector<std::vector<int32_t>>{{1, 2, 3}}));
  EXPECT_EQ(parse_completion_request(json{{"prompt", {{1, 2}, {3}}}}, defaults()).token_prompts,
            (std::vector<std::vector<int32_t>>{{1, 2}, {3}}));
  EXPECT_EQ(parse_completion_request(json{{"prompt", {1.0, 2.0}}}, defaults()).token_prompts,
            (std::vector<std::vector<int32_t>>{{1, 2}}));
  EXPECT_EQ(parse_completion_request(json{{"prompt", ""}}, defaults()).text_prompts, (std::vector<std::string>{""}));
  expect_completion_error(json{{"max_tokens", 3}}, "prompt", "required");
  expect_completion_error(json{{"prompt", nullptr}}, "prompt");
  expect_completion_error(json{{"prompt", 5}}, "prompt");
  expect_completion_error(json{{"prompt", json::array()}}, "prompt");
  expect_completion_error(json{{"prompt", {"a", 1}}}, "prompt");
  expect_completion_error(json{{"prompt", {{1}, "a"}}}, "prompt");
  expect_completion_error(json{{"prompt", {{1}, json::array()}}}, "prompt");
  expect_completion_error(json{{"prompt", {1, -2}}}, "prompt", "out of range");
  expect_completion_error(json{{"prompt", {1, 1.5}}}, "prompt", "integer");
  expect_completion_error(json{{"prompt", {1, 4294967296LL}}}, "prompt", "out of range");
}

TEST(OpenAiProtocol, WrongTypesNameTheField) {
  expect_completion_error(json{{"prompt", "x"}, {"max_tokens", "10"}}, "max_tokens", "integer");
  expect_completion_error(json{{"prompt", "x"}, {"max_tokens", 2.5}}, "max_tokens", "integer");
  expect_completion_error(json{{"prompt", "x"}, {"temperature", "hot"}}, "temperature", "number");
  expect_completion_error(json{{"prompt", "x"}, {"stream", 1}}, "stream", "boolean");
  expect_completion_error(json{{"prompt", "x"}, {"n", true}}, "n", "integer");
  expect_completion_error(json{{"prompt", "x"}, {"model", 3}}, "model", "string");
  expect_completion_error(json{{"prompt", "x"}, {"stop", 3}}, "stop");
  expect_completion_error(json{{"prompt", "x"}, {"stop", {"a", 3}}}, "stop");
  expect_completion_error(json{{"prompt", "x"}, {"stop_token_ids", 3}}, "stop_token_ids");
  expect_completion_error(json{{"prompt", "x"}, {"stream_options", "yes"}}, "stream_options");
  expect_completion_error(json{{"prompt", "x"}, {"logprobs", true}}, "logprobs", "integer");
  expect_completion_error(json{{"prompt", "x"}, {"seed", "1"}}, "seed");
  expect_completion_error(json{{"prompt", "x"}, {"echo", "no"}}, "echo");
}

TEST(OpenAiProtocol, RangesAreChecked) {
  const json base = {{"prompt", "x"}};
  const auto with = [&](const char* key, json value) {
    json body = base;
    body[key] = std::move(value);
    return body;
  };
  expect_completion_error(with("max_tokens", 0), "max_tokens", "at least 1");
  expect_completion_error(with("max_tokens", -1), "max_tokens");
  expect_completion_error(with("n", 0), "n");
  expect_completion_error(with("n", 129), "n");
  EXPECT_EQ(parse_completion_request(with("n", 128), defaults()).params.n, 128);
  expect_completion_error(with("temperature", -0.1), "temperature");
  expect_completion_error(with("top_p", 0), "top_p");
  expect_completion_error(with("top_p", 1.01), "top_p");
  expect_completion_error(with("top_k", -2), "top_k");
  expect_completion_error(with("min_p", 1.5), "min_p");
  expect_completion_error(with("presence_penalty", 2.5), "presence_penalty");
  expect_completion_error(with("frequency_penalty", -3), "frequency_penalty");
  expect_completion_error(with("repetition_penalty", 0), "repetition_penalty");
  expect_completion_error(with("logprobs", 21), "logprobs");
  expect_completion_error(with("logprobs", -1), "logprobs");
  expect_completion_error(with("stop", ""), "stop", "empty");
  expect_completion_error(with("stop", json(std::vector<std::string>(17, "s"))), "stop", "16");
  expect_completion_error(with("best_of", 2), "best_of");
  expect_completion_error(with("logit_bias", {{"5", 300}}), "logit_bias");
  expect_completion_error(with("logit_bias", {{"five", 1}}), "logit_bias");
  expect_completion_error(with("logit_bias", {{"-3", 1}}), "logit_bias");
  expect_completion_error(with("logit_bias", json::array()), "logit_bias");
  expect_completion_error(with("response_format", {{"type", "yaml"}}), "response_format.type");
  expect_completion_error(with("response_format", {{"type", "json_schema"}}), "response_format.json_schema");
  expect_completion_error(with("suffix", "tail"), "suffix");
  ProtocolLimits limits;
  limits.max_n = 4;
  expect_api_error([&] { parse_completion_request(with("n", 5), defaults(), limits); }, 400, "n");
}

TEST(OpenAiProtocol, MalformedBodies) {
  expect_api_error([] { parse_json_body("{\"prompt\": "); }, 400, "", "not valid JSON");
  expect_api_error([] { parse_json_body("[1]"); }, 400, "", "object");
  expect_api_error([] { parse_json_body(""); }, 400, "");
  // Key order is kept (templates print tool definitions as sent).
  const json body = parse_json_body(R"({"z": 1, "a": 2})");
  EXPECT_EQ(body.begin().key(), "z");
}

TEST(OpenAiProtocol, ChatRequest) {
  const json body = json::parse(R"({
    "messages": [{"role": "system", "content": "s"},
                 {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                 {"role": "assistant", "content": null, "tool_calls": [{"id": "1"}]}],
    "max_tokens": 9, "max_completion_tokens": 5, "logprobs": true, "top_logprobs": 3,
    "tools": [{"type": "function", "function": {"name": "f"}}],
    "chat_template_kwargs": {"enable_thinking": false}, "add_generation_prompt": false})");
  const ChatRequest request = parse_chat_request(body, defaults());
  ASSERT_EQ(request.messages.size(), 3u);
  EXPECT_EQ(request.messages[1]["content"], "ab");
  EXPECT_EQ(request.messages[2]["content"], "");  // null: templates read the content as a string
  EXPECT_EQ(request.messages[2]["tool_calls"][0]["id"], "1");
  EXPECT_EQ(request.params.max_tokens, 5);  // max_completion_tokens wins
  EXPECT_EQ(request.params.logprobs, 3);
  EXPECT_EQ(request.tools.size(), 1u);
  EXPECT_EQ(request.chat_template_kwargs["enable_thinking"], false);
  EXPECT_FALSE(request.add_generation_prompt);

  const ChatRequest plain = parse_chat_request(json::parse(R"({"messages": [{"role": "user", "content": "x"}],
    "logprobs": false, "tools": []})"), defaults());
  EXPECT_FALSE(plain.params.logprobs.has_value());
  EXPECT_TRUE(plain.tools.is_null());
  EXPECT_TRUE(plain.add_generation_prompt);
  EXPECT_EQ(parse_chat_request(json::parse(R"({"messages": [{"role": "user", "content": "x"}], "logprobs": true})"),
                               defaults())
                .params.logprobs,
            0);

  expect_chat_error(json{{"model", "m"}}, "messages", "required");
  expect_chat_error(json{{"messages", "hi"}}, "messages");
  expect_chat_error(json{{"messages", json::array()}}, "messages");
  expect_chat_error(json{{"messages", {1}}}, "messages[0]");
  expect_chat_error(json{{"messages", {{{"content", "x"}}}}}, "messages[0].role");
  expect_chat_error(json::parse(R"({"messages": [{"role": "user", "content": 5}]})"), "messages[0].content");
  expect_chat_error(json::parse(R"({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})"),
                    "messages[0].content", "text");
  expect_chat_error(json::parse(R"({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})"),
                    "top_logprobs", "logprobs");
  expect_chat_error(json::parse(R"({"messages": [{"role": "user", "content": "x"}], "logprobs": true,
    "top_logprobs": 21})"), "top_logprobs");
  expect_chat_error(json::parse(R"({"messages": [{"role": "user", "content": "x"}], "tools": {}})"), "tools");
  expect_chat_error(json::parse(R"({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": 1})"),
                    "chat_template_kwargs");
  expect_chat_error(json::parse(R"({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0})"),
                    "max_completion_tokens");
}

TEST(OpenAiProtocol, ErrorBody) {
  const json body = error_body(ApiError(429, "rate_limit_error", "busy", "", "queue_full"));
  ASSERT_TRUE(body.contains("error"));
  EXPECT_EQ(body["error"]["message"], "busy");
  EXPECT_EQ(body["error"]["type"], "rate_limit_error");
  EXPECT_TRUE(body["error"]["param"].is_null());
  EXPECT_EQ(body["error"]["code"], "queue_full");
  const json invalid = error_body(invalid_request("bad n", "n"));
  EXPECT_EQ(invalid["error"]["param"], "n");
  EXPECT_TRUE(invalid["error"]["code"].is_null());
  EXPECT_EQ(invalid["error"]["type"], "invalid_request_error");
}

ChoiceText sample_choice() {
  ChoiceText choice;
  choice.index = 1;
  choice.text = "hi";
  choice.has_logprobs = true;
  LogprobEntry entry;
  entry.chosen = {"h", "h", -0.25f};
  entry.top = {{"h", "h", -0.25f}, {"\xEF\xBF\xBD", "\xE2", -std::numeric_limits<float>::infinity()}};
  entry.text_offset = 3;
  choice.logprobs.push_back(entry);
  choice.finish_reason = "length";
  return choice;
}

TEST(OpenAiProtocol, CompletionResponse) {
  const ResponseMeta meta{"cmpl-1", 1700000000, "tiny"};
  const json response = completion_response(meta, {sample_choice()}, Usage{4, 2});
  EXPECT_EQ(response["id"], "cmpl-1");
  EXPECT_EQ(response["object"], "text_completion");
  EXPECT_EQ(response["created"], 1700000000);
  EXPECT_EQ(response["model"], "tiny");
  const json& choice = response["choices"][0];
  EXPECT_EQ(choice["index"], 1);
  EXPECT_EQ(choice["text"], "hi");
  EXPECT_EQ(choice["finish_reason"], "length");
  EXPECT_EQ(choice["logprobs"]["tokens"], json({"h"}));
  EXPECT_EQ(choice["logprobs"]["token_logprobs"], json({-0.25}));
  EXPECT_EQ(choice["logprobs"]["text_offset"], json({3}));
  EXPECT_EQ(choice["logprobs"]["top_logprobs"][0]["h"], -0.25);
  EXPECT_EQ(choice["logprobs"]["top_logprobs"][0]["\xEF\xBF\xBD"], -9999.0);  // -inf is not JSON
  EXPECT_EQ(response["usage"], json({{"prompt_tokens", 4}, {"completion_tokens", 2}, {"total_tokens", 6}}));
  ChoiceText no_logprobs;
  EXPECT_TRUE(completion_response(meta, {no_logprobs}, Usage{})["choices"][0]["logprobs"].is_null());
  EXPECT_TRUE(completion_response(meta, {no_logprobs}, Usage{})["choices"][0]["finish_reason"].is_null());
}

TEST(OpenAiProtocol, ChatResponse) {
  ChoiceText choice = sample_choice();
  choice.reasoning = "think";
  const json response = chat_response(ResponseMeta{"chatcmpl-1", 1, "tiny"}, {choice}, Usage{1, 1});
  EXPECT_EQ(response["object"], "chat.completion");
  const json& message = response["choices"][0]["message"];
  EXPECT_EQ(message["role"], "assistant");
  EXPECT_EQ(message["content"], "hi");
  EXPECT_EQ(message["reasoning_content"], "think");
  EXPECT_EQ(message["reasoning"], "think");
  const json& content = response["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(content.size(), 1u);
  EXPECT_EQ(content[0]["token"], "h");
  EXPECT_EQ(content[0]["bytes"], json({104}));
  EXPECT_EQ(content[0]["top_logprobs"][1]["bytes"], json({0xE2}));
  EXPECT_EQ(content[0]["top_logprobs"][1]["logprob"], -9999.0);
  ChoiceText plain;
  plain.text = "x";
  EXPECT_FALSE(chat_response(ResponseMeta{}, {plain}, Usage{})["choices"][0]["message"].contains("reasoning_content"));
}

TEST(OpenAiProtocol, StreamingChunks) {
  const ResponseMeta meta{"chatcmpl-2", 5, "tiny"};
  ChoiceText opening;
  opening.first = true;
  const json first = chat_chunk(meta, opening, /*usage_field=*/true);
  EXPECT_EQ(first["object"], "chat.completion.chunk");
  EXPECT_EQ(first["choices"][0]["delta"], json({{"role", "assistant"}, {"content", ""}}));
  EXPECT_TRUE(first["choices"][0]["finish_reason"].is_null());
  EXPECT_TRUE(first.contains("usage") && first["usage"].is_null());
  ChoiceText reasoning;
  reasoning.reasoning = "r";
  const json reasoning_chunk = chat_chunk(meta, reasoning, /*usage_field=*/false);
  EXPECT_FALSE(reasoning_chunk.contains("usage"));
  EXPECT_FALSE(reasoning_chunk["choices"][0]["delta"].contains("content"));
  EXPECT_EQ(reasoning_chunk["choices"][0]["delta"]["reasoning_content"], "r");
  ChoiceText last;
  last.finish_reason = "stop";
  EXPECT_EQ(chat_chunk(meta, last, false)["choices"][0]["delta"], json::object());
  EXPECT_EQ(chat_chunk(meta, last, false)["choices"][0]["finish_reason"], "stop");

  const json text = completion_chunk(ResponseMeta{"cmpl-2", 5, "tiny"}, sample_choice(), false);
  EXPECT_EQ(text["object"], "text_completion");
  EXPECT_EQ(text["choices"][0]["text"], "hi");
  EXPECT_EQ(text["choices"][0]["index"], 1);

  const json usage = usage_chunk(meta, /*chat=*/true, Usage{3, 4});
  EXPECT_EQ(usage["choices"], json::array());
  EXPECT_EQ(usage["usage"]["total_tokens"], 7);
}

TEST(OpenAiProtocol, TokenIdsOnlyWhenAskedFor) {
  ChoiceText choice = sample_choice();
  EXPECT_FALSE(completion_response(ResponseMeta{}, {choice}, Usage{})["choices"][0].contains("token_ids"));
  EXPECT_FALSE(chat_response(ResponseMeta{}, {choice}, Usage{}).contains("prompt_token_ids"));
  EXPECT_FALSE(completion_chunk(ResponseMeta{}, choice, false)["choices"][0].contains("token_ids"));
  choice.has_token_ids = true;
  choice.token_ids = {5, 6};
  choice.prompt_token_ids = {1, 2, 3};
  const json completion = completion_response(ResponseMeta{}, {choice}, Usage{});
  EXPECT_EQ(completion["choices"][0]["token_ids"], json({5, 6}));
  EXPECT_EQ(completion["choices"][0]["prompt_token_ids"], json({1, 2, 3}));
  const json chat = chat_response(ResponseMeta{}, {choice}, Usage{});
  EXPECT_EQ(chat["prompt_token_ids"], json({1, 2, 3}));  // once, at the top
  EXPECT_EQ(chat["choices"][0]["token_ids"], json({5, 6}));
  EXPECT_FALSE(chat["choices"][0].contains("prompt_token_ids"));
  // Streams: the first chunk of a choice carries the prompt's ids, later ones only their own.
  EXPECT_EQ(completion_chunk(ResponseMeta{}, choice, false)["choices"][0]["prompt_token_ids"], json({1, 2, 3}));
  EXPECT_EQ(chat_chunk(ResponseMeta{}, choice, false)["prompt_token_ids"], json({1, 2, 3}));
  choice.prompt_token_ids.clear();
  const json later = completion_chunk(ResponseMeta{}, choice, false);
  EXPECT_EQ(later["choices"][0]["token_ids"], json({5, 6}));
  EXPECT_FALSE(later["choices"][0].contains("prompt_token_ids"));
  EXPECT_FALSE(chat_chunk(ResponseMeta{}, choice, false).contains("prompt_token_ids"));
  // A chunk without tokens still says token_ids: [] (the end of a choice).
  choice.token_ids.clear();
  EXPECT_EQ(chat_chunk(ResponseMeta{}, choice, false)["choices"][0]["token_ids"], json::array());
}

TEST(OpenAiProtocol, SseFraming) {
  const std::string event = sse_event(json{{"a", "b\nc"}});
  EXPECT_EQ(event, "data: {\"a\":\"b\\nc\"}\n\n");  // one line: newlines in text are escaped
  EXPECT_EQ(sse_done(), "data: [DONE]\n\n");
  // Invalid UTF-8 never breaks the framing.
  const std::string invalid = sse_event(json{{"t", std::string("\xFF")}});
  EXPECT_EQ(invalid.rfind("data: ", 0), 0u);
  EXPECT_EQ(invalid.substr(invalid.size() - 2), "\n\n");
  EXPECT_NO_THROW({
    const json parsed = json::parse(invalid.substr(6));
    EXPECT_TRUE(parsed.is_object());
  });
}

TEST(OpenAiProtocol, ModelsAndIds) {
  const json models = models_response("tiny", 7, 1024);
  EXPECT_EQ(models["object"], "list");
  EXPECT_EQ(models["data"][0]["id"], "tiny");
  EXPECT_EQ(models["data"][0]["object"], "model");
  EXPECT_EQ(models["data"][0]["max_model_len"], 1024);
  const std::string a = make_response_id("cmpl-"), b = make_response_id("cmpl-");
  EXPECT_EQ(a.rfind("cmpl-", 0), 0u);
  EXPECT_EQ(a.size(), 5u + 24u);
  EXPECT_NE(a, b);
}

}  // namespace
}  // namespace metrale::server

namespace metrale::server {
namespace {

TEST(OpenAiProtocol, ToolChoiceResponseFormatAndLogitBias) {
  const auto chat = [](const std::string& extra) {
    return parse_chat_request(json::parse(R"({"messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])" + extra + "}"),
                              SamplingParams{});
  };
  EXPECT_EQ(chat("").tool_choice.mode, ToolChoiceMode::kAuto);
  EXPECT_EQ(chat(R"(, "tool_choice": "none")").tool_choice.mode, ToolChoiceMode::kNone);
  EXPECT_EQ(chat(R"(, "tool_choice": "required")").tool_choice.mode, ToolChoiceMode::kRequired);
  const ChatRequest named = chat(R"(, "tool_choice": {"type": "function", "function": {"name": "f"}},
                                     "parallel_tool_calls": false)");
  EXPECT_EQ(named.tool_choice.mode, ToolChoiceMode::kFunction);
  EXPECT_EQ(named.tool_choice.function, "f");
  EXPECT_FALSE(named.parallel_tool_calls);
  ASSERT_EQ(named.tool_definitions.size(), 1u);
  EXPECT_EQ(named.tool_definitions[0].name, "f");
  expect_api_error([&] { chat(R"(, "tool_choice": {"type": "function", "function": {"name": "g"}})"); }, 400,
                   "tool_choice", "'g'");
  expect_api_error([&] { chat(R"(, "tool_choice": "sometimes")"); }, 400, "tool_choice");
  expect_api_error(
      [] {
        parse_chat_request(json::parse(R"({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"})"),
                           SamplingParams{});
      },
      400, "tool_choice");

  const ChatRequest schema = chat(R"(, "response_format": {"type": "json_schema",
      "json_schema": {"name": "p", "strict": true, "schema": {"type": "object"}}}, "logit_bias": {"7": -100, "9": 2.5})");
  EXPECT_EQ(schema.params.response_format.type, ResponseFormatType::kJsonSchema);
  EXPECT_EQ(schema.params.response_format.name, "p");
  EXPECT_TRUE(schema.params.response_format.strict);
  EXPECT_EQ(schema.params.response_format.schema, json::parse(R"({"type": "object"})"));
  const std::vector<std::pair<int32_t, float>> bias = {{7, -100.0f}, {9, 2.5f}};
  EXPECT_EQ(schema.params.sampling.logit_bias, bias);
  EXPECT_EQ(chat(R"(, "response_format": {"type": "json_object"})").params.response_format.type,
            ResponseFormatType::kJsonObject);
  EXPECT_EQ(chat(R"(, "response_format": {"type": "text"})").params.response_format.type, ResponseFormatType::kText);

  // An assistant turn's arguments string becomes the object the templates read.
  const ChatRequest turn = parse_chat_request(json::parse(R"({"messages": [{"role": "user", "content": "x"},
      {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
        "function": {"name": "f", "arguments": "{\"a\": 1}"}}, {"id": "call_2", "type": "function",
        "function": {"name": "f", "arguments": "not json"}}]},
      {"role": "tool", "tool_call_id": "call_1", "content": "42"}]})"),
                                              SamplingParams{});
  EXPECT_EQ(turn.messages[1]["tool_calls"][0]["function"]["arguments"], json::parse(R"({"a": 1})"));
  EXPECT_EQ(turn.messages[1]["tool_calls"][1]["function"]["arguments"], "not json");
  EXPECT_EQ(turn.messages[2]["content"], "42");
}

}  // namespace
}  // namespace metrale::server
