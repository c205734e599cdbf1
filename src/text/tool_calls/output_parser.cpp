#include "text/tool_calls/output_parser.h"

namespace metrale {

void OutputParser::route_content(OutputDelta& delta, std::string_view content) {
  if (!tool_calls_) {
    delta.content.append(content);
    return;
  }
  if (content.empty()) return;
  ToolParseDelta parsed = tool_calls_->feed(content);
  delta.content += parsed.content;
  for (ToolCallDelta& call : parsed.tool_calls) delta.tool_calls.push_back(std::move(call));
}

OutputDelta OutputParser::feed(std::string_view text) {
  OutputDelta delta;
  if (!reasoning_) {
    route_content(delta, text);
    return delta;
  }
  ReasoningDelta split = reasoning_->feed(text);
  delta.reasoning = std::move(split.reasoning);
  route_content(delta, split.content);
  return delta;
}

OutputDelta OutputParser::finish() {
  OutputDelta delta;
  if (reasoning_) {
    ReasoningDelta split = reasoning_->finish();
    delta.reasoning = std::move(split.reasoning);
    route_content(delta, split.content);
  }
  if (tool_calls_) {
    ToolParseDelta parsed = tool_calls_->finish();
    delta.content += parsed.content;
    for (ToolCallDelta& call : parsed.tool_calls) delta.tool_calls.push_back(std::move(call));
  }
  return delta;
}

}  // namespace metrale
