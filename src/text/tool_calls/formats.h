// The markup of each tool-call format and the parsers of one call's body (internal to the tool-call
// parser; text/tool_calls/tool_call_parser.h describes the formats).
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "text/tool_calls/tool_call_parser.h"

namespace metrale::text::tool_calls {

// A call is call_begin BODY call_end. Formats that group their calls wrap them in section_begin ...
// section_end (whitespace allowed between the calls); the others write the calls one after another.
struct Markers {
  std::string_view section_begin;  // "" when the format has no section
  std::string_view section_end;
  std::string_view call_begin;
  std::string_view call_end;
};
const Markers& markers_of(ToolCallFormat format);

// The declared tools, looked up by name.
class ToolIndex {
 public:
  explicit ToolIndex(std::vector<ToolDefinition> tools) : tools_(std::move(tools)) {}
  bool empty() const { return tools_.empty(); }
  const ToolDefinition* find(std::string_view name) const;
  // The JSON types (argument_types.h bits) the tool's schema admits for `parameter`; kTypeAny when
  // the tool or the parameter is not described.
  uint8_t parameter_types(std::string_view tool, std::string_view parameter) const;

 private:
  std::vector<ToolDefinition> tools_;
};

struct ParsedCall {
  std::string name;
  std::string arguments;  // compact JSON object
};

// Parses the text between call_begin and call_end; nullopt when it is not a well-formed call (or
// names a function missing from a non-empty `tools`).
std::optional<ParsedCall> parse_call_body(ToolCallFormat format, std::string_view body, const ToolIndex& tools);

}  // namespace metrale::text::tool_calls
