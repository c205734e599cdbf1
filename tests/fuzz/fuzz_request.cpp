// OpenAI request bodies: parse_json_body and the two request parsers answer every input with a
// request or an ApiError (4xx, a well-formed error body); no other exception, no crash. Parsed
// requests hold what the limits allow, and their values convert for the chat template.
#include <cstdint>

#include "core/error.h"
#include "fuzz_input.h"
#include "server/openai_protocol.h"
#include "text/jinja_value.h"

namespace {

using metrale::Error;
using metrale::ErrorCode;
using namespace metrale::server;

void check_template_values(const ChatRequest& request) {
  try {
    metrale::text::jinja::Value::from_json(request.messages);
    metrale::text::jinja::Value::from_json(request.tools);
    metrale::text::jinja::Value::from_json(request.chat_template_kwargs);
  } catch (const Error& e) {
    FUZZ_CHECK(e.code() == ErrorCode::kInvalidArgument, e.what());
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  metrale::fuzz::FuzzInput input(data, size);
  const bool chat = (input.byte() & 1) != 0;
  const std::string_view body = input.rest();
  const metrale::SamplingParams defaults;
  const ProtocolLimits limits;
  try {
    const nlohmann::ordered_json json = parse_json_body(body, limits);
    FUZZ_CHECK(json.is_object());
    if (chat) {
      const ChatRequest request = parse_chat_request(json, defaults, limits);
      FUZZ_CHECK(!request.messages.empty() && request.messages.size() <= limits.max_messages);
      FUZZ_CHECK(request.params.n >= 1 && request.params.n <= limits.max_n);
      check_template_values(request);
    } else {
      const CompletionRequest request = parse_completion_request(json, defaults, limits);
      FUZZ_CHECK(request.text_prompts.empty() != request.token_prompts.empty());
      for (const auto& ids : request.token_prompts) {
        FUZZ_CHECK(!ids.empty());
        for (const int32_t id : ids) FUZZ_CHECK(id >= 0);
      }
      FUZZ_CHECK(request.params.n >= 1 && request.params.n <= limits.max_n);
      FUZZ_CHECK(request.params.stop.size() <= static_cast<size_t>(limits.max_stop_strings));
      if (request.params.max_tokens) FUZZ_CHECK(*request.params.max_tokens >= 1);
    }
  } catch (const ApiError& e) {
    FUZZ_CHECK(e.status() >= 400 && e.status() < 500, e.what());
    const std::string text = dump_json(error_body(e));
    FUZZ_CHECK(nlohmann::json::accept(text), text);
  }
  return 0;
}
