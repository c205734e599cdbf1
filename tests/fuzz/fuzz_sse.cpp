// The SSE writer and the response JSON: whatever text a choice carries (invalid UTF-8, control
// characters, "\n\n", non-finite logprobs), every chunk is one well-formed event, "data: <json>\n\n",
// whose JSON parses back (valid UTF-8), and error bodies are JSON too.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "fuzz_input.h"
#include "server/openai_protocol.h"

namespace {

using namespace metrale::server;

float logprob_of(metrale::fuzz::FuzzInput& input) {
  const uint8_t kind = input.byte();
  if (kind % 8 == 0) return -std::numeric_limits<float>::infinity();
  if (kind % 8 == 1) return std::numeric_limits<float>::quiet_NaN();
  return -static_cast<float>(input.byte()) / 16.0f;
}

void check_event(const std::string& event) {
  FUZZ_CHECK(event.rfind("data: ", 0) == 0, event);
  FUZZ_CHECK(event.size() >= 8 && event.compare(event.size() - 2, 2, "\n\n") == 0, event);
  const std::string_view payload(event.data() + 6, event.size() - 8);
  FUZZ_CHECK(payload.find('\n') == std::string_view::npos, "a newline inside an event");
  FUZZ_CHECK(nlohmann::json::accept(payload), event);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  metrale::fuzz::FuzzInput input(data, size);
  const uint8_t flags = input.byte();
  ResponseMeta meta;
  meta.id = std::string(input.until('\0'));
  meta.model = std::string(input.until('\0'));
  meta.created = flags;
  ChoiceText delta;
  delta.index = input.byte();
  delta.text = std::string(input.until('\0'));
  delta.reasoning = std::string(input.until('\0'));
  delta.finish_reason = (flags & 2) ? std::string(input.until('\0')) : std::string();
  delta.first = (flags & 4) != 0;
  delta.has_logprobs = (flags & 8) != 0;
  const size_t entries = input.byte() % 8;
  for (size_t i = 0; delta.has_logprobs && i < entries; ++i) {
    LogprobEntry entry;
    entry.chosen.token = std::string(input.until('\0'));
    entry.chosen.bytes = entry.chosen.token;
    entry.chosen.logprob = logprob_of(input);
    for (size_t j = input.byte() % 4; j > 0; --j) {
      TokenAlternative alternative{std::string(input.until('\0')), "", logprob_of(input)};
      alternative.bytes = alternative.token;
      entry.top.push_back(std::move(alternative));
    }
    entry.text_offset = input.byte();
    delta.logprobs.push_back(std::move(entry));
  }
  const bool usage_field = (flags & 16) != 0;
  check_event(sse_event(completion_chunk(meta, delta, usage_field)));
  check_event(sse_event(chat_chunk(meta, delta, usage_field)));
  check_event(sse_event(usage_chunk(meta, (flags & 32) != 0, Usage{flags, static_cast<int64_t>(size)})));
  FUZZ_CHECK(sse_done() == "data: [DONE]\n\n");
  const std::vector<ChoiceText> choices = {delta, delta};
  FUZZ_CHECK(nlohmann::json::accept(dump_json(completion_response(meta, choices, Usage{}))));
  FUZZ_CHECK(nlohmann::json::accept(dump_json(chat_response(meta, choices, Usage{}))));
  const ApiError error(400, "invalid_request_error", delta.text, delta.reasoning, meta.model);
  check_event(sse_event(error_body(error)));
  return 0;
}
