// The Responses API's output side: the typed event sequence of one generation and the final response
// object. Every sequence is replayed through a re-implementation of what the official client does
// with the events (accumulate a snapshot from response.created on), and the snapshot must equal the
// final response: the events and the non-streaming response cannot drift apart.
#include "server/response_events.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace metrale::server {
namespace {

using json = nlohmann::ordered_json;

ResponsesRequest request_with_tools() {
  const json tools = json::parse(R"([
    {"type": "function", "name": "weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
    {"type": "function", "name": "time", "parameters": {"type": "object"}}])");
  return parse_responses_request({{"input", "x"}, {"tools", tools}}, SamplingParams{});
}

ResponseEventBuilder make_builder(std::optional<ToolCallFormat> format = std::nullopt, int32_t max_calls = 0) {
  const ResponsesRequest request = request_with_tools();
  const ResponseIdentity identity{"resp_0123456789abcdef01234567", 1700000000, "demo"};
  ToolCallParserOptions parser;
  parser.id_seed = 7;
  parser.max_calls = max_calls;
  return ResponseEventBuilder(response_object(identity, request), format,
                              tool_definitions_from_openai(chat_tools(request.tools)), parser);
}

// What the openai client's accumulateResponse does with each event (lib/responses/ResponseAccumulator).
class ClientSnapshot {
 public:
  void apply(const json& event) {
    const std::string type = event["type"];
    EXPECT_EQ(event["sequence_number"], next_sequence_++) << type;
    if (type == "response.created") {
      ASSERT_TRUE(snapshot_.is_null()) << "response.created twice";
      snapshot_ = event["response"];
      return;
    }
    ASSERT_FALSE(snapshot_.is_null()) << type << " before response.created";
    if (type == "response.in_progress" || type == "response.completed" || type == "response.incomplete" ||
        type == "response.failed") {
      snapshot_ = event["response"];
      terminal_ = type;
      return;
    }
    ASSERT_TRUE(event.contains("output_index")) << type;
    const size_t index = event["output_index"];
    if (type == "response.output_item.added") {
      ASSERT_EQ(index, snapshot_["output"].size()) << "items are added in order";
      snapshot_["output"].push_back(event["item"]);
      return;
    }
    ASSERT_LT(index, snapshot_["output"].size()) << type;
    json& item = snapshot_["output"][index];
    if (type == "response.output_item.done") {
      item = event["item"];
    } else if (type == "response.content_part.added") {
      item["content"].push_back(event["part"]);
    } else if (type == "response.content_part.done") {
      item["content"].at(event["content_index"].get<size_t>()) = event["part"];
    } else if (type == "response.output_text.delta" || type == "response.reasoning_text.delta") {
      EXPECT_EQ(item["type"], type == "response.output_text.delta" ? "message" : "reasoning");
      json& part = item["content"].at(event["content_index"].get<size_t>());
      part["text"] = part["text"].get<std::string>() + event["delta"].get<std::string>();
    } else if (type == "response.output_text.done" || type == "response.reasoning_text.done") {
      json& part = item["content"].at(event["content_index"].get<size_t>());
      EXPECT_EQ(part["text"], event["text"]) << "the done text is the deltas joined";
    } else if (type == "response.function_call_arguments.delta") {
      EXPECT_EQ(item["type"], "function_call");
      item["arguments"] = item["arguments"].get<std::string>() + event["delta"].get<std::string>();
    } else if (type == "response.function_call_arguments.done") {
      EXPECT_EQ(item["arguments"], event["arguments"]) << "the done arguments are the deltas joined";
      EXPECT_EQ(item["name"], event["name"]);
    } else {
      ADD_FAILURE() << "unexpected event " << type;
    }
  }
  const json& snapshot() const { return snapshot_; }
  const std::string& terminal() const { return terminal_; }

 private:
  json snapshot_;
  std::string terminal_;
  int64_t next_sequence_ = 0;
};

struct Generated {
  std::vector<json> events;
  json response;
};

// Feeds (reasoning, content) pieces, then finishes; checks the client's snapshot against the response.
Generated run(ResponseEventBuilder builder, const std::vector<std::pair<std::string, std::string>>& pieces,
              const std::string& finish_reason = "stop") {
  Generated result;
  const auto keep = [&](std::vector<json> events) {
    for (json& event : events) result.events.push_back(std::move(event));
  };
  keep(builder.start());
  for (const auto& [reasoning, content] : pieces) keep(builder.feed(reasoning, content));
  keep(builder.finish(finish_reason, ResponseUsage{10, 5, 2}));
  EXPECT_TRUE(builder.finished());
  result.response = builder.response();
  ClientSnapshot client;
  for (const json& event : result.events) client.apply(event);
  EXPECT_EQ(client.snapshot(), result.response);
  return result;
}

std::vector<std::string> types(const Generated& run) {
  std::vector<std::string> out;
  for (const json& event : run.events) out.push_back(event["type"]);
  return out;
}

// Splits text into pieces of `size` bytes (a streamed generation).
std::vector<std::pair<std::string, std::string>> pieces_of(const std::string& text, size_t size) {
  std::vector<std::pair<std::string, std::string>> pieces;
  for (size_t i = 0; i < text.size(); i += size) pieces.emplace_back("", text.substr(i, size));
  return pieces;
}

TEST(ResponseEvents, TextStreamsAsOneMessage) {
  const Generated result = run(make_builder(), {{"", "Hello"}, {"", ", "}, {"", "world"}});
  const std::vector<std::string> expected = {"response.created",           "response.in_progress",
                                             "response.output_item.added", "response.content_part.added",
                                             "response.output_text.delta", "response.output_text.delta",
                                             "response.output_text.delta", "response.output_text.done",
                                             "response.content_part.done", "response.output_item.done",
                                             "response.completed"};
  EXPECT_EQ(types(result), expected);
  const json& response = result.response;
  EXPECT_EQ(response["status"], "completed");
  EXPECT_EQ(response["object"], "response");
  ASSERT_EQ(response["output"].size(), 1u);
  const json& message = response["output"][0];
  EXPECT_EQ(message["type"], "message");
  EXPECT_EQ(message["role"], "assistant");
  EXPECT_EQ(message["status"], "completed");
  EXPECT_EQ(message["content"][0]["type"], "output_text");
  EXPECT_EQ(message["content"][0]["text"], "Hello, world");
  EXPECT_EQ(response["usage"]["input_tokens"], 10);
  EXPECT_EQ(response["usage"]["output_tokens"], 5);
  EXPECT_EQ(response["usage"]["total_tokens"], 15);
  EXPECT_EQ(response["usage"]["output_tokens_details"]["reasoning_tokens"], 2);
  EXPECT_TRUE(response.contains("completed_at"));
  // The created event shows the response before any output.
  EXPECT_EQ(result.events[0]["response"]["status"], "in_progress");
  EXPECT_TRUE(result.events[0]["response"]["output"].empty());
}

TEST(ResponseEvents, ReasoningThenAnswer) {
  const Generated result = run(make_builder(), {{"Let me ", ""}, {"think.", ""}, {"", "\n\n"}, {"", "Yes."}});
  const json& output = result.response["output"];
  ASSERT_EQ(output.size(), 2u) << output.dump(1);
  EXPECT_EQ(output[0]["type"], "reasoning");
  EXPECT_EQ(output[0]["content"][0], json({{"type", "reasoning_text"}, {"text", "Let me think."}}));
  EXPECT_EQ(output[1]["type"], "message");
  // The whitespace between the reasoning and the answer opens no message and is not part of it.
  EXPECT_EQ(output[1]["content"][0]["text"], "Yes.");
  EXPECT_NE(output[0]["id"], output[1]["id"]);
}

TEST(ResponseEvents, WhitespaceAloneMakesNoMessage) {
  const Generated result = run(make_builder(), {{"", " \n"}, {"", "\t"}});
  EXPECT_TRUE(result.response["output"].empty());
  EXPECT_EQ(result.response["status"], "completed");
}

TEST(ResponseEvents, ToolCallsBecomeFunctionCallItems) {
  const std::string text =
      "Checking.<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n"
      "<tool_call>\n{\"name\": \"time\", \"arguments\": {}}\n</tool_call>";
  for (const size_t size : {size_t{1}, size_t{3}, size_t{7}, text.size()}) {
    SCOPED_TRACE(size);
    const Generated result = run(make_builder(ToolCallFormat::kHermes), pieces_of(text, size));
    const json& output = result.response["output"];
    ASSERT_EQ(output.size(), 3u) << output.dump(1);
    EXPECT_EQ(output[0]["type"], "message");
    EXPECT_EQ(output[0]["content"][0]["text"], "Checking.");
    EXPECT_EQ(output[1]["type"], "function_call");
    EXPECT_EQ(output[1]["name"], "weather");
    EXPECT_EQ(json::parse(output[1]["arguments"].get<std::string>()), json({{"city", "Paris"}}));
    EXPECT_EQ(output[1]["call_id"].get<std::string>().rfind("call_", 0), 0u);
    EXPECT_EQ(output[1]["id"].get<std::string>().rfind("fc_", 0), 0u);
    EXPECT_EQ(output[1]["status"], "completed");
    EXPECT_EQ(output[2]["name"], "time");
    EXPECT_EQ(json::parse(output[2]["arguments"].get<std::string>()), json::object());
    EXPECT_NE(output[1]["call_id"], output[2]["call_id"]);
  }
}

TEST(ResponseEvents, ParallelToolCallsFalseKeepsOneFunctionCall) {
  const std::string text =
      "Checking.<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n"
      "<tool_call>\n{\"name\": \"time\", \"arguments\": {}}\n</tool_call>";
  for (const size_t size : {size_t{1}, size_t{5}, text.size()}) {
    SCOPED_TRACE(size);
    const Generated result = run(make_builder(ToolCallFormat::kHermes, /*max_calls=*/1), pieces_of(text, size));
    const json& output = result.response["output"];
    ASSERT_EQ(output.size(), 2u) << output.dump(1);
    EXPECT_EQ(output[0]["type"], "message");
    EXPECT_EQ(output[0]["content"][0]["text"], "Checking.");
    EXPECT_EQ(output[1]["type"], "function_call");
    EXPECT_EQ(output[1]["name"], "weather");
    EXPECT_EQ(result.response["status"], "completed");
  }
}

TEST(ResponseEvents, MalformedCallStaysText) {
  const std::string text = "<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": </tool_call>";
  const Generated result = run(make_builder(ToolCallFormat::kHermes), pieces_of(text, 4));
  const json& output = result.response["output"];
  ASSERT_EQ(output.size(), 1u) << output.dump(1);
  EXPECT_EQ(output[0]["type"], "message");
  EXPECT_EQ(output[0]["content"][0]["text"], text);
}

TEST(ResponseEvents, WithoutAParserCallsAreText) {
  const std::string text = "<tool_call>\n{\"name\": \"time\", \"arguments\": {}}\n</tool_call>";
  const Generated result = run(make_builder(), pieces_of(text, 5));
  ASSERT_EQ(result.response["output"].size(), 1u);
  EXPECT_EQ(result.response["output"][0]["content"][0]["text"], text);
}

TEST(ResponseEvents, LengthEndsIncomplete) {
  const Generated result = run(make_builder(), {{"", "cut"}}, "length");
  EXPECT_EQ(result.events.back()["type"], "response.incomplete");
  EXPECT_EQ(result.response["status"], "incomplete");
  EXPECT_EQ(result.response["incomplete_details"], json({{"reason", "max_output_tokens"}}));
  EXPECT_EQ(result.response["output"][0]["status"], "incomplete");
}

TEST(ResponseEvents, EngineErrorEndsFailed) {
  const Generated result = run(make_builder(), {{"", "partial"}}, "error");
  EXPECT_EQ(result.events.back()["type"], "response.failed");
  EXPECT_EQ(result.response["status"], "failed");
  EXPECT_EQ(result.response["error"]["code"], "server_error");
}

TEST(ResponseEvents, FeedAfterFinishIsIgnored) {
  ResponseEventBuilder builder = make_builder();
  builder.start();
  builder.finish("stop", {});
  EXPECT_TRUE(builder.feed("", "late").empty());
  EXPECT_TRUE(builder.finish("stop", {}).empty());
  EXPECT_TRUE(builder.output().empty());
}

TEST(ResponseEvents, ResponseObjectEchoesTheRequest) {
  const ResponsesRequest request = parse_responses_request({{"input", "x"},
                                                            {"instructions", "I"},
                                                            {"max_output_tokens", 9},
                                                            {"temperature", 0.5},
                                                            {"store", false},
                                                            {"previous_response_id", "resp_1"},
                                                            {"metadata", {{"k", "v"}}},
                                                            {"tool_choice", "none"}},
                                                           SamplingParams{});
  const json object = response_object({"resp_2", 5, "demo"}, request);
  EXPECT_EQ(object["id"], "resp_2");
  EXPECT_EQ(object["created_at"], 5);
  EXPECT_EQ(object["model"], "demo");
  EXPECT_EQ(object["instructions"], "I");
  EXPECT_EQ(object["max_output_tokens"], 9);
  EXPECT_EQ(object["temperature"], 0.5);
  EXPECT_EQ(object["store"], false);
  EXPECT_EQ(object["previous_response_id"], "resp_1");
  EXPECT_EQ(object["metadata"], json({{"k", "v"}}));
  EXPECT_EQ(object["tool_choice"], "none");
  EXPECT_EQ(object["text"]["format"], json({{"type", "text"}}));
  EXPECT_TRUE(object["usage"].is_null());
}

}  // namespace
}  // namespace metrale::server
