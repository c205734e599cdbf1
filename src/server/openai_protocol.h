// The OpenAI wire format: request bodies of /v1/completions and /v1/chat/completions parsed and
// validated into typed requests, OpenAI-style error bodies, and the JSON of responses and SSE chunks.
// Everything here is pure (no engine, no tokenizer, no sockets) so it can be unit-tested alone.
// JSON is nlohmann::ordered_json throughout: request objects keep the client's key order (a chat
// template's tojson must print tool definitions as sent) and responses keep the OpenAI field order.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/sampler.h"
#include "text/tool_calls/tool_call_parser.h"

namespace metrale::server {

// An error answered to the client: HTTP status plus the body {"error": {message, type, param, code}}.
class ApiError : public std::runtime_error {
 public:
  ApiError(int status, std::string type, std::string message, std::string param = {}, std::string code = {})
      : std::runtime_error(std::move(message)),
        status_(status),
        type_(std::move(type)),
        param_(std::move(param)),
        code_(std::move(code)) {}
  int status() const { return status_; }
  const std::string& type() const { return type_; }
  const std::string& param() const { return param_; }  // "" when no single field is at fault
  const std::string& code() const { return code_; }    // "" when none

 private:
  int status_;
  std::string type_;
  std::string param_;
  std::string code_;
};

// 400 invalid_request_error naming the field at fault.
ApiError invalid_request(std::string message, std::string param = {});

nlohmann::ordered_json error_body(const ApiError& error);

// Limits the parser enforces (beyond what the engine validates). The body itself is bounded by
// the transport (TransportLimits::max_body_bytes); these bound what is handed to the chat template
// and the tokenizer within it.
struct ProtocolLimits {
  int32_t max_n = 128;                // choices per prompt
  int32_t max_stop_strings = 16;
  size_t max_stop_bytes = 1024;       // per stop string
  int32_t max_top_logprobs = SamplingParams::kMaxTopLogprobs;
  size_t max_json_depth = 64;         // nesting of the request body
  size_t max_messages = 4096;
  size_t max_tools = 1024;
  size_t max_template_kwargs = 256;   // keys of chat_template_kwargs
};

// response_format: free text, any JSON object, or JSON matching a schema (constrained decoding).
enum class ResponseFormatType : uint8_t { kText, kJsonObject, kJsonSchema };
struct ResponseFormat {
  ResponseFormatType type = ResponseFormatType::kText;
  std::string name;                 // json_schema.name
  nlohmann::ordered_json schema;    // json_schema.schema ({} when absent: any JSON value)
  bool strict = false;              // json_schema.strict
};
// Parses a chat/completions response_format ({type: "text" | "json_object" | "json_schema",
// json_schema: {name, schema, strict}}); 400 naming `param` when malformed.
ResponseFormat parse_response_format(const nlohmann::ordered_json& value, const std::string& param);

// tool_choice: "auto" (the model decides; calls are parsed), "none" (the tools are left out of the
// prompt and no calls are parsed), "required" (at least one call, constrained; exactly one with
// parallel_tool_calls false) or a named function (exactly one call of it, constrained).
// parallel_tool_calls false also keeps only the first parsed call under "auto".
enum class ToolChoiceMode : uint8_t { kAuto, kNone, kRequired, kFunction };
struct ToolChoice {
  ToolChoiceMode mode = ToolChoiceMode::kAuto;
  std::string function;  // kFunction: its name
};

// What both endpoints share.
struct GenerationParams {
  std::string model;                  // "" when the request names none
  int32_t n = 1;
  std::optional<int64_t> max_tokens;  // absent: the rest of the context
  SamplingParams sampling;            // defaults (the model's generation_config) overridden by the request
  std::vector<std::string> stop;
  std::vector<int32_t> stop_token_ids;
  bool ignore_eos = false;
  bool skip_special_tokens = true;
  bool stream = false;
  bool include_usage = false;         // stream_options.include_usage
  // Top alternatives reported per token; absent: no logprobs at all (0: only the chosen token's).
  std::optional<int32_t> logprobs;
  ResponseFormat response_format;     // constrained decoding of the output (server/structured_output.h)
  // vLLM's return_token_ids: the prompt's and the output's token ids beside the text, so that a
  // client can continue a conversation with the exact tokens the server saw (multi-turn benchmarks).
  bool return_token_ids = false;
};

struct CompletionRequest {
  GenerationParams params;
  // Exactly one of the two is non-empty; each entry is one prompt (n choices each).
  std::vector<std::string> text_prompts;
  std::vector<std::vector<int32_t>> token_prompts;
  bool echo = false;  // with logprobs: the prompt's tokens get logprob entries too (legacy shape)
};

struct ChatRequest {
  GenerationParams params;
  nlohmann::ordered_json messages;  // array of {role, content: string, ...}; content parts flattened to text
  nlohmann::ordered_json tools;     // null or an array, passed to the template
  std::vector<ToolDefinition> tool_definitions;  // the function tools of `tools`
  ToolChoice tool_choice;           // kAuto by default; "required"/named need tools
  bool parallel_tool_calls = true;
  nlohmann::ordered_json chat_template_kwargs = nlohmann::ordered_json::object();
  bool add_generation_prompt = true;
};

// Parse and validate a request body. `defaults` are the sampling values for fields the request does
// not set. Throw ApiError (400) naming the field on a wrong type or a value out of range.
CompletionRequest parse_completion_request(const nlohmann::ordered_json& body, const SamplingParams& defaults,
                                           const ProtocolLimits& limits = {});
ChatRequest parse_chat_request(const nlohmann::ordered_json& body, const SamplingParams& defaults,
                               const ProtocolLimits& limits = {});
// The list of token ids in body[key] (required); 400 naming `key` otherwise.
std::vector<int32_t> token_ids_field(const nlohmann::ordered_json& body, const std::string& key);
// Parses a body as JSON; throws ApiError 400 on malformed JSON, a number out of range (1e400), a
// nesting deeper than limits.max_json_depth (checked before parsing) or a body that is not an object.
nlohmann::ordered_json parse_json_body(std::string_view body, const ProtocolLimits& limits = {});

// One token's logprob entry, with the token already rendered as text.
struct TokenAlternative {
  std::string token;  // the token's text (U+FFFD for a partial UTF-8 character)
  std::string bytes;  // the token's raw bytes
  float logprob = 0.0f;
};
struct LogprobEntry {
  TokenAlternative chosen;
  bool has_logprob = true;  // false: the first prompt token of an echo (nothing predicts it): null
  std::vector<TokenAlternative> top;
  int64_t text_offset = 0;  // completions: code points of the choice's text before this token
};

// A piece of one choice: a streaming delta or, accumulated, a whole choice.
struct ChoiceText {
  int32_t index = 0;
  std::string text;       // content
  std::string reasoning;  // chat: reasoning_content
  // chat: tool calls; in a delta the pieces of this chunk, accumulated the whole calls (pieces of
  // one index merged: id and name from the first, arguments concatenated).
  std::vector<ToolCallDelta> tool_calls;
  bool has_logprobs = false;
  std::vector<LogprobEntry> logprobs;
  std::string finish_reason;  // "" while unfinished
  bool first = false;         // chat streaming: the first delta carries the role
  // return_token_ids: the generated token ids (in a delta, those of this chunk; the token that
  // stopped the output by EOS or a stop token id included), and the prompt's, which a stream sends
  // with the choice's first token (completions: on the choice; chat: at the top of the chunk).
  bool has_token_ids = false;
  std::vector<int32_t> token_ids;
  std::vector<int32_t> prompt_token_ids;
};

struct Usage {
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;
};

struct ResponseMeta {
  std::string id;       // "cmpl-..." or "chatcmpl-..."
  int64_t created = 0;  // unix seconds
  std::string model;
};

// Responses (non-streaming).
nlohmann::ordered_json completion_response(const ResponseMeta& meta, const std::vector<ChoiceText>& choices, const Usage& usage);
nlohmann::ordered_json chat_response(const ResponseMeta& meta, const std::vector<ChoiceText>& choices, const Usage& usage);
// Streaming chunks. `usage_field`: the request asked for usage, so every chunk carries "usage": null.
nlohmann::ordered_json completion_chunk(const ResponseMeta& meta, const ChoiceText& delta, bool usage_field);
nlohmann::ordered_json chat_chunk(const ResponseMeta& meta, const ChoiceText& delta, bool usage_field);
// The last chunk before [DONE] when include_usage: no choices, the usage of the whole request.
nlohmann::ordered_json usage_chunk(const ResponseMeta& meta, bool chat, const Usage& usage);
nlohmann::ordered_json models_response(const std::string& model, int64_t created, int64_t max_model_len);

// SSE framing: one "data: <json>\n\n" event; the terminating "data: [DONE]\n\n".
std::string sse_event(const nlohmann::ordered_json& data);
std::string sse_done();
// JSON text of a value, invalid UTF-8 replaced (never throws on text).
std::string dump_json(const nlohmann::ordered_json& value);

// A random id with the given prefix ("cmpl-" + 24 hex digits).
std::string make_response_id(std::string_view prefix);

}  // namespace metrale::server
