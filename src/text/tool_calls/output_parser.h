// The answer of a chat completion, split in order: the reasoning parser first (a tool call written
// inside <think>...</think> stays reasoning), then the tool-call parser on the content. Either stage
// may be absent. Streaming and non-streaming use the same object: feed() every piece, then finish().
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "text/reasoning_parser.h"
#include "text/tool_calls/tool_call_parser.h"

namespace metrale {

struct OutputDelta {
  std::string reasoning;
  std::string content;
  std::vector<ToolCallDelta> tool_calls;
  bool empty() const { return reasoning.empty() && content.empty() && tool_calls.empty(); }
};

class OutputParser {
 public:
  OutputParser(std::optional<ReasoningParser> reasoning, std::optional<ToolCallParser> tool_calls)
      : reasoning_(std::move(reasoning)), tool_calls_(std::move(tool_calls)) {}

  OutputDelta feed(std::string_view text);
  OutputDelta finish();

  int32_t num_tool_calls() const { return tool_calls_ ? tool_calls_->num_calls() : 0; }

 private:
  void route_content(OutputDelta& delta, std::string_view content);

  std::optional<ReasoningParser> reasoning_;
  std::optional<ToolCallParser> tool_calls_;
};

}  // namespace metrale
