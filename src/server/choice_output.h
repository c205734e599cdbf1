// The text side of one choice: the generated token ids of one engine request become the text a
// client sees. Tokens go through the incremental detokenizer, then the stop-string matcher, then
// (chat) the <think> reasoning splitter and the tool-call parser (text/tool_calls/output_parser.h);
// logprobs are rendered as token text on the way. A choice that made tool calls finishes with
// "tool_calls" instead of "stop".
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "engine/async_engine.h"
#include "server/openai_protocol.h"
#include "server/stop_strings.h"
#include "text/reasoning_parser.h"
#include "text/tokenizer.h"
#include "text/tool_calls/output_parser.h"

namespace metrale::server {

struct ChoiceOptions {
  int32_t index = 0;
  std::vector<std::string> stop;
  bool skip_special_tokens = true;
  std::optional<int32_t> logprobs;   // alternatives reported per token; absent: no logprobs
  bool reasoning = false;            // split <think> reasoning from the content (chat)
  bool starts_in_reasoning = false;  // the prompt opened the think block
  int64_t text_offset = 0;           // code points before the generated text (the echoed prompt)
  // Tool calls parsed from the answer (chat with tools): the format, the declared tools, and the
  // seed of the call ids.
  std::optional<ToolCallFormat> tool_format;
  std::vector<ToolDefinition> tools;
  uint64_t tool_id_seed = 0;
  int32_t max_tool_calls = 0;  // 0: any number; 1 for parallel_tool_calls: false (later calls dropped)
  // return_token_ids: deltas carry the generated ids, the first one (and the accumulated choice)
  // the prompt's.
  bool return_token_ids = false;
  std::vector<int32_t> prompt_token_ids;
};

// The string finish_reason of the OpenAI API for an engine finish ("stop", "length", "abort").
std::string finish_reason_string(FinishReason reason);

// Code points in UTF-8 text.
int64_t count_code_points(std::string_view text);

class ChoiceOutput {
 public:
  ChoiceOutput(const Tokenizer& tokenizer, ChoiceOptions options);

  // One generated token; `finish` is the engine's verdict on it. Returns what the client may see
  // now (possibly nothing; finish_reason set when the choice ends here). Tokens after the choice
  // has ended (e.g. by a stop string, while its abort is on its way) are ignored.
  ChoiceText on_token(const SampledToken& token, FinishReason finish, SteadyClock::time_point time);
  // The prompt's logprobs (echo with logprobs: Request::prompt_logprobs), `prompt` its token ids:
  // their entries lead the next delta's logprobs, with text offsets from the start of the prompt.
  void on_prompt_logprobs(std::span<const int32_t> prompt, const std::vector<SampledToken>& logprobs);
  // The choice ends without a token: aborted by the engine, or the server gives up on it.
  ChoiceText on_end(FinishReason reason);
  // The engine failed: the choice ends with finish_reason "error".
  ChoiceText on_error();

  bool finished() const { return !finish_reason_.empty(); }
  // The choice ended on a stop string while its engine request still runs: the caller cancels it.
  bool stopped_by_string() const { return stop_.matched(); }
  const std::string& finish_reason() const { return finish_reason_; }
  int64_t num_tokens() const { return num_tokens_; }
  const std::optional<SteadyClock::time_point>& first_token_time() const { return first_token_; }
  const std::optional<SteadyClock::time_point>& last_token_time() const { return last_token_; }
  // Everything emitted so far, as one choice (for non-streaming responses).
  const ChoiceText& accumulated() const { return accumulated_; }

 private:
  TokenAlternative render(int32_t token, float logprob) const;
  // Routes released text through the reasoning splitter into `delta`; `final` flushes it.
  void emit(std::string text, bool final, ChoiceText& delta);
  void accumulate(const ChoiceText& delta);
  // "tool_calls" for a choice that stopped after making calls.
  std::string final_reason(const std::string& reason) const;
  // The text released when the output ends: the detokenizer's and the stop matcher's remainders.
  std::string end_of_text();
  ChoiceText end(const std::string& finish_reason);

  Tokenizer tokenizer_;
  ChoiceOptions options_;
  IncrementalDetokenizer detokenizer_;
  StopStringMatcher stop_;
  OutputParser output_;
  int64_t num_tokens_ = 0;
  int64_t code_points_ = 0;  // of the detokenized text so far, for text_offset
  std::string finish_reason_;
  std::optional<SteadyClock::time_point> first_token_;
  std::optional<SteadyClock::time_point> last_token_;
  ChoiceText accumulated_;
  std::vector<LogprobEntry> prompt_entries_;  // waiting for the next delta
};

}  // namespace metrale::server
