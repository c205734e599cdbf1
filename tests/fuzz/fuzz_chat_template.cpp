// The chat-template interpreter on hostile templates: lexing, parsing and rendering end in output
// or a kInvalidArgument error (with the step, depth, string and range limits a fuzzer can reach in
// milliseconds); no other exception, no crash, no unbounded recursion.
//   input: template \0 messages as JSON (optional; a short conversation otherwise)
#include <cstdint>

#include "core/error.h"
#include "fuzz_input.h"
#include "text/jinja_interpreter.h"
#include "text/jinja_lexer.h"
#include "text/jinja_parser.h"
#include "text/utf8.h"

namespace {

using metrale::text::jinja::Value;

Value conversation(std::string_view json_text) {
  nlohmann::ordered_json messages;
  if (!json_text.empty() && nlohmann::ordered_json::accept(json_text)) messages = nlohmann::ordered_json::parse(json_text);
  if (!messages.is_array()) {
    messages = nlohmann::ordered_json::array(
        {{{"role", "system"}, {"content", "Be brief."}},
         {{"role", "user"}, {"content", "Hi <think>"}},
         {{"role", "assistant"}, {"content", "Hello"}, {"reasoning_content", "greet"},
          {"tool_calls", {{{"function", {{"name", "f"}, {"arguments", {{"a", 1}}}}}}}}}});
  }
  return Value::from_json(messages);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  metrale::fuzz::FuzzInput input(data, size);
  const std::string source = metrale::text::to_valid_utf8_lossy(input.until('\0'));
  const std::string_view messages = input.take(1 << 16);
  try {
    const auto program = metrale::text::jinja::parse(metrale::text::jinja::tokenize(source), source);
    metrale::text::jinja::RenderContext context;
    context.now = 1700000000;
    context.limits.max_steps = 100'000;
    context.limits.max_string_bytes = size_t{1} << 20;
    context.limits.max_range = 10'000;
    context.variables.emplace_back("messages", conversation(messages));
    context.variables.emplace_back("add_generation_prompt", Value::boolean(true));
    context.variables.emplace_back("tools", Value::null());
    context.variables.emplace_back("bos_token", Value::string("<s>"));
    context.variables.emplace_back("eos_token", Value::string("</s>"));
    const std::string output = metrale::text::jinja::render(program, source, context);
    FUZZ_CHECK(output.size() <= context.limits.max_string_bytes);
  } catch (const metrale::Error& e) {
    FUZZ_CHECK(e.code() == metrale::ErrorCode::kInvalidArgument, e.what());
  }
  return 0;
}
