// The Responses API, output side: the response object and the typed stream events of one
// generation, built from the text a ChoiceOutput releases (reasoning and content), with the content
// run through the model's tool-call parser. Pure (no engine, no sockets).
//
// Output items open in the order the model writes them: a reasoning item for the think block, a
// message item for the answer, a function_call item per tool call. Each item streams as
//   response.output_item.added
//   [response.content_part.added, response.{reasoning_text|output_text}.delta..., .done,
//    response.content_part.done]           (reasoning and message items)
//   [response.function_call_arguments.delta..., .done]   (function calls)
//   response.output_item.done
// between response.created + response.in_progress and the terminal event: response.completed,
// response.incomplete (max_output_tokens reached) or response.failed. Every event carries its
// sequence_number, from 0. The non-streaming response is the final response object.
//
// A message item opens at the first character of the answer that is not whitespace: the whitespace
// a model writes between its reasoning or its calls and the answer does not make an empty message.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "server/openai_protocol.h"
#include "server/responses_api.h"
#include "text/tool_calls/tool_call_parser.h"

namespace metrale::server {

struct ResponseIdentity {
  std::string id;          // "resp_..."
  int64_t created_at = 0;  // unix seconds
  std::string model;
};

// The response object before any output (status "in_progress"): every field the API defines, the
// request's settings echoed.
nlohmann::ordered_json response_object(const ResponseIdentity& identity, const ResponsesRequest& request);

struct ResponseUsage {
  int64_t input_tokens = 0;
  int64_t output_tokens = 0;
  int64_t reasoning_tokens = 0;  // output tokens that went to reasoning
};

class ResponseEventBuilder {
 public:
  // `base`: response_object(). `tool_format`: the model's tool-call format, or nullopt for none (the
  // answer is then all text); `tools` are the function tools the request declares; `parser` the
  // call ids' seed and the call limit (1 for parallel_tool_calls: false).
  ResponseEventBuilder(nlohmann::ordered_json base, std::optional<ToolCallFormat> tool_format,
                       std::vector<ToolDefinition> tools, ToolCallParserOptions parser);

  // response.created and response.in_progress.
  std::vector<nlohmann::ordered_json> start();
  // Text the model wrote: reasoning, then the answer (ChoiceText's reasoning and text fields).
  std::vector<nlohmann::ordered_json> feed(const std::string& reasoning, const std::string& content);
  // The generation ended with the OpenAI finish reason ("stop", "length", "abort", "error"): closes
  // the open item and ends the stream with response.completed, response.incomplete or response.failed.
  std::vector<nlohmann::ordered_json> finish(const std::string& finish_reason, const ResponseUsage& usage);

  bool finished() const { return finished_; }
  // The response object as it stands (whole once finished).
  const nlohmann::ordered_json& response() const { return response_; }
  // The output items completed so far.
  const nlohmann::ordered_json& output() const { return response_["output"]; }

 private:
  enum class Open : uint8_t { kNone, kReasoning, kMessage, kFunctionCall };

  nlohmann::ordered_json event(const char* type, nlohmann::ordered_json fields);
  void open_item(nlohmann::ordered_json item, Open kind, std::vector<nlohmann::ordered_json>& events);
  // `status`: the item's final status, "completed" or "incomplete" (the output was cut short).
  void close_item(std::vector<nlohmann::ordered_json>& events, const char* status = "completed");
  void add_reasoning(const std::string& text, std::vector<nlohmann::ordered_json>& events);
  void add_text(std::string text, std::vector<nlohmann::ordered_json>& events);
  void add_tool_calls(const ToolParseDelta& delta, std::vector<nlohmann::ordered_json>& events);
  void add_call_piece(const ToolCallDelta& piece, std::vector<nlohmann::ordered_json>& events);
  std::string item_id(const char* prefix);

  nlohmann::ordered_json response_;
  std::optional<ToolCallParser> tool_parser_;
  int64_t sequence_ = 0;
  std::string id_stem_;  // the response id's hex, shared by its items' ids
  int32_t items_made_ = 0;
  Open open_ = Open::kNone;
  nlohmann::ordered_json item_;  // the open item
  std::string text_;             // the open item's text (reasoning, message) or arguments
  int32_t open_call_index_ = -1;
  bool finished_ = false;
};

}  // namespace metrale::server
