// The OpenAI Responses API (POST /v1/responses), request side: a request body parsed and validated
// into a ResponsesRequest, its input items normalized, and the conversation translated into the chat
// request the rest of the server generates from (ChatRequest of server/openai_protocol.h). Pure (no
// engine, no tokenizer), like openai_protocol.h.
//
// Items (the Responses API's unit of conversation) map onto chat messages:
//   message {role, content}               -> {role, content} (developer -> system; parts joined)
//   reasoning {content | summary}         -> reasoning_content of the next assistant message
//   function_call {call_id, name, args}   -> tool_calls[] of an assistant message (consecutive calls,
//                                            and a call right after an assistant message, share one)
//   function_call_output {call_id, output}-> {role: "tool", tool_call_id, content}
// `instructions` becomes a leading system message; instructions of a previous response are not
// carried over (the API's rule), its items are.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "server/openai_protocol.h"

namespace metrale::server {

// text.format. The constraint itself is the grammar engine's (text/grammar/): the endpoint hands
// it to StructuredOutputs as a chat response_format (constraint_spec in responses_endpoint.cpp).
struct ResponseTextFormat {
  enum class Kind : uint8_t { kText, kJsonObject, kJsonSchema };
  Kind kind = Kind::kText;
  std::string name;  // kJsonSchema: the schema's name (required by the API)
  std::string description;
  nlohmann::ordered_json schema;  // kJsonSchema: the JSON schema, an object
  bool strict = false;
};

// tool_choice: "auto" | "none" | "required" | {type: "function", name}.
struct ResponseToolChoice {
  enum class Mode : uint8_t { kAuto, kNone, kRequired, kFunction };
  Mode mode = Mode::kAuto;
  std::string function;  // kFunction: the function the call must use
};

struct ResponsesRequest {
  // model, sampling (temperature, top_p), max_tokens (from max_output_tokens), stream, stop (a
  // metrale extension); n is 1.
  GenerationParams params;
  std::optional<std::string> instructions;
  // This request's input, normalized: an array of items, each with its "type" (messages' content a
  // list of parts). Stored with the response so that a later previous_response_id replays them.
  nlohmann::ordered_json input_items = nlohmann::ordered_json::array();
  // The function tools, Responses shape ({type: "function", name, description, parameters, strict}).
  nlohmann::ordered_json tools = nlohmann::ordered_json::array();
  ResponseToolChoice tool_choice;
  ResponseTextFormat text_format;
  std::optional<std::string> previous_response_id;
  bool store = true;
  bool parallel_tool_calls = true;
  // Echoed in the response object as sent (or their defaults).
  nlohmann::ordered_json metadata = nlohmann::ordered_json::object();
  nlohmann::ordered_json reasoning;  // null or {effort, summary}
  nlohmann::ordered_json text;       // the request's `text` object ({format, verbosity})
  nlohmann::ordered_json tool_choice_json = "auto";
  std::optional<double> temperature;
  std::optional<double> top_p;
  std::optional<std::string> user;
  std::optional<std::string> safety_identifier;
  std::optional<std::string> prompt_cache_key;
  std::optional<std::string> service_tier;
};

// Parses and validates a /v1/responses body. `defaults` are the sampling values for fields the
// request does not set. Throws ApiError 400 naming the field: wrong types, values out of range, and
// every field or value this server does not implement (built-in tools, background mode,
// conversations, prompt templates, item references, images and files, top_logprobs, truncation
// "auto", include values), so that nothing a client asks for is silently ignored.
ResponsesRequest parse_responses_request(const nlohmann::ordered_json& body, const SamplingParams& defaults,
                                         const ProtocolLimits& limits = {});

// The chat request for a conversation: `history` (the items of the previous responses, oldest first,
// outputs included; an array) followed by the request's input items, the request's instructions in
// front. tool_choice "none" leaves the tools out of the prompt.
ChatRequest to_chat_request(const ResponsesRequest& request, const nlohmann::ordered_json& history);

// The chat-completions form of the request's function tools ([{type, function: {name, ...}}]), as
// the chat template and the tool-call parsers take them.
nlohmann::ordered_json chat_tools(const nlohmann::ordered_json& response_tools);

}  // namespace metrale::server
