// /v1/responses bodies and the output built from a model's text: the parser answers every body with
// a request or an ApiError (4xx, a well-formed error body), its conversation translates into chat
// messages the template can take, and the event builder, fed any text in any pieces (tool-call
// markup included), numbers its events from 0 without a gap and ends with exactly one terminal event
// whose response holds the output items the stream added.
//
// Input: one byte of options (bit 0: the Hermes tool-call parser; bits 1-3: the piece size), the
// request body, a NUL, then the generated text.
#include <cstdint>
#include <string>

#include "core/error.h"
#include "fuzz_input.h"
#include "server/response_events.h"
#include "server/responses_api.h"
#include "text/jinja_value.h"

namespace {

using metrale::Error;
using metrale::ErrorCode;
using namespace metrale::server;
using json = nlohmann::ordered_json;

void check_events(const ResponsesRequest& request, bool tool_parser, size_t piece, std::string_view text) {
  const ResponseIdentity identity{"resp_000000000000000000000000", 0, "m"};
  std::optional<metrale::ToolCallFormat> format;
  if (tool_parser) format = metrale::ToolCallFormat::kHermes;
  std::vector<metrale::ToolDefinition> tools;
  try {
    tools = metrale::tool_definitions_from_openai(chat_tools(request.tools));
  } catch (const Error& e) {
    FUZZ_CHECK(e.code() == ErrorCode::kInvalidArgument, e.what());
    return;
  }
  metrale::ToolCallParserOptions parser;
  parser.id_seed = 1;
  ResponseEventBuilder builder(response_object(identity, request), format, std::move(tools), parser);
  std::vector<json> events = builder.start();
  for (size_t at = 0; at < text.size(); at += piece) {
    // Alternate reasoning and content pieces, as a reasoning model's output splits.
    const std::string chunk(text.substr(at, piece));
    for (json& event : (at / piece) % 3 == 0 ? builder.feed(chunk, "") : builder.feed("", chunk))
      events.push_back(std::move(event));
  }
  for (json& event : builder.finish("stop", {})) events.push_back(std::move(event));
  size_t added = 0;
  size_t terminal = 0;
  for (size_t i = 0; i < events.size(); ++i) {
    FUZZ_CHECK(events[i]["sequence_number"] == i, events[i].dump());
    const std::string type = events[i]["type"];
    if (type == "response.output_item.added") ++added;
    if (type == "response.completed") ++terminal;
    FUZZ_CHECK(nlohmann::json::accept(dump_json(events[i])));
  }
  FUZZ_CHECK(terminal == 1 && events.back()["type"] == "response.completed");
  FUZZ_CHECK(builder.response()["output"].size() == added);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  metrale::fuzz::FuzzInput input(data, size);
  const uint8_t options = input.byte();
  const std::string_view body = input.until('\0');
  const std::string_view text = input.rest();
  const metrale::SamplingParams defaults;
  const ProtocolLimits limits;
  try {
    const json parsed = parse_json_body(body, limits);
    const ResponsesRequest request = parse_responses_request(parsed, defaults, limits);
    FUZZ_CHECK(request.input_items.is_array() && request.input_items.size() <= limits.max_messages);
    FUZZ_CHECK(request.tools.size() <= limits.max_tools);
    if (request.params.max_tokens) FUZZ_CHECK(*request.params.max_tokens >= 1);
    const ChatRequest chat = to_chat_request(request, request.input_items);
    FUZZ_CHECK(chat.messages.is_array());
    try {
      metrale::text::jinja::Value::from_json(chat.messages);
      metrale::text::jinja::Value::from_json(chat.tools);
    } catch (const Error& e) {
      FUZZ_CHECK(e.code() == ErrorCode::kInvalidArgument, e.what());
    }
    check_events(request, (options & 1) != 0, size_t{1} + ((options >> 1) & 7), text);
  } catch (const ApiError& e) {
    FUZZ_CHECK(e.status() >= 400 && e.status() < 500, e.what());
    FUZZ_CHECK(nlohmann::json::accept(dump_json(error_body(e))));
  }
  return 0;
}
