// Tool calls in a model's generated text: one parser per published format, incremental (the server
// streams its deltas) and non-streaming (parse_tool_calls) from the same state machine, so the
// concatenation of the streamed deltas always equals the non-streaming result.
//
// The parser sees the answer only: the reasoning parser runs first and a call written inside
// <think>...</think> stays reasoning (see OutputParser in text/tool_calls/output_parser.h).
//
// Formats (docs/structured_outputs.md has examples of each):
//   kHermes       Qwen3, Qwen2.5, Hermes: <tool_call>{"name": N, "arguments": {...}}</tool_call>
//   kQwen3Coder   Qwen3.5, Qwen3-Coder: <tool_call><function=N><parameter=K>V</parameter>...</function></tool_call>
//   kGlm45        GLM-4.5 / 4.6 / 4.7 / 5: <tool_call>N<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>
//   kDeepSeekV3   DeepSeek-V3 / R1: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>N
//                 ```json {...} ```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
//   kDeepSeekV31  DeepSeek-V3.1: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>N<｜tool▁sep｜>{...}<｜tool▁call▁end｜>...
//   kDeepSeekV32  DeepSeek-V3.2 (DSML): <｜DSML｜function_calls><｜DSML｜invoke name="N"><｜DSML｜parameter
//                 name="K" string="true|false">V</｜DSML｜parameter>...</｜DSML｜invoke></｜DSML｜function_calls>
// In the XML-like formats (kQwen3Coder, kGlm45, and kDeepSeekV32 without a string="..." attribute) a
// value is typed by the tool's JSON schema: a parameter whose schema allows only strings stays the text as
// written; any other is parsed as JSON (booleans also as True/False), falling back to the text.
//
// Rules that hold for every format:
// - A call is emitted once its closing marker has arrived and it parsed; until then its text is held
//   back. A call that does not parse (bad JSON, an unknown function when tools are given, stray text
//   inside the markup), or that is still open when the output ends, comes back as content, byte for
//   byte: nothing the model wrote is dropped except the whitespace that separates calls from the text
//   around them, and the calls past ToolCallParserOptions::max_calls.
// - Content streams as it arrives, except a possible partial start marker at the end of a piece and
//   whitespace that may turn out to precede a call.
// - Calls are numbered from 0 in order (parallel calls); ids are "call_" + 24 characters derived from
//   ToolCallParserOptions::id_seed and the index, so a request's ids are reproducible.
// - No exception leaves feed() or finish(): an internal failure turns the held text into content.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace metrale {

enum class ToolCallFormat : uint8_t {
  kHermes,
  kQwen3Coder,
  kGlm45,
  kDeepSeekV3,
  kDeepSeekV31,
  kDeepSeekV32,
};

// The canonical name of a format ("hermes", "qwen3_coder", "glm45", "deepseek_v3", "deepseek_v31",
// "deepseek_v32"), as `--tool-call-parser` takes it.
std::string_view tool_call_format_name(ToolCallFormat format);
// A format from its name or an alias ("qwen3", "qwen3_xml", "qwen3.5", "glm4_moe", "glm47", ...);
// nullopt when the name is unknown. tool_call_format_names() lists the canonical names.
std::optional<ToolCallFormat> tool_call_format_from_name(std::string_view name);
const std::vector<std::string_view>& tool_call_format_names();

// Picks the parser for a model: the chat template's own tool-call markup decides when it has any
// (it is what the model was told to write); otherwise the config's model_type. nullopt: no known
// format (the server then returns tool calls as plain content).
std::optional<ToolCallFormat> select_tool_call_format(std::string_view model_type, std::string_view chat_template);

// A function tool as the request declares it.
struct ToolDefinition {
  std::string name;
  nlohmann::ordered_json parameters = nlohmann::ordered_json::object();  // its JSON schema ({} when absent)
};

// The function tools of an OpenAI `tools` array ([{type: "function", function: {name, parameters}}]);
// kInvalidArgument naming the entry when one is malformed. Tools of other types are skipped.
std::vector<ToolDefinition> tool_definitions_from_openai(const nlohmann::ordered_json& tools);

struct ToolCall {
  std::string id;
  std::string name;
  std::string arguments;  // a JSON object, compact, keys in the order written
};

// One piece of a streamed call, shaped as OpenAI's delta.tool_calls[]: the first piece of a call
// carries its id and name (arguments empty), later pieces only argument text.
struct ToolCallDelta {
  int32_t index = 0;
  std::string id;
  std::string name;
  std::string arguments;
};

struct ToolParseDelta {
  std::string content;
  std::vector<ToolCallDelta> tool_calls;
  bool empty() const { return content.empty() && tool_calls.empty(); }
};

struct ToolParseResult {
  std::string content;
  std::vector<ToolCall> tool_calls;
};

struct ToolCallParserOptions {
  uint64_t id_seed = 0;  // the server passes a per-request random value
  // At most this many calls are emitted (0: no limit). A call past the limit that parses is dropped
  // whole, with the whitespace around it (parallel_tool_calls: false keeps the first call, as vLLM
  // does); one that does not parse is content, as always.
  int32_t max_calls = 0;
};

class ToolCallParser {
 public:
  // `tools` name the functions a call may use (empty: any name) and type the XML formats' values.
  ToolCallParser(ToolCallFormat format, std::vector<ToolDefinition> tools, ToolCallParserOptions options = {});
  ~ToolCallParser();
  ToolCallParser(ToolCallParser&&) noexcept;
  ToolCallParser& operator=(ToolCallParser&&) noexcept;

  // Feeds the next piece of the answer; returns what can be attributed so far.
  ToolParseDelta feed(std::string_view text) noexcept;
  // The end of the output: whatever is held back is attributed (an open call becomes content).
  ToolParseDelta finish() noexcept;

  int32_t num_calls() const;  // calls emitted so far (finish_reason "tool_calls" when > 0)

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// The whole output at once: feed(text) + finish(), with the deltas merged.
ToolParseResult parse_tool_calls(ToolCallFormat format, const std::vector<ToolDefinition>& tools, std::string_view text,
                                 ToolCallParserOptions options = {});

// Merges streamed deltas into a result (what a client does with the chunks).
void merge_tool_parse_delta(ToolParseResult& result, const ToolParseDelta& delta);

// Entry point for a libFuzzer target: byte 0 picks the format, byte 1 seeds the chunking, the rest is
// the text. Parses it streamed and at once and aborts if the two disagree. Always returns 0.
int fuzz_tool_call_parser(const uint8_t* data, size_t size);

}  // namespace metrale
