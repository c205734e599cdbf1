// Evaluates a parsed chat template (text/jinja_parser.h) with @huggingface/jinja's semantics, where
// that library renders successfully. Where it would throw, this interpreter is more forgiving in the
// direction of Python Jinja's default Undefined (an undefined value iterates as empty, has length 0,
// and concatenates as ""), so templates that rely on Python's leniency still render.
//
// Hostile templates are bounded: nesting (macro recursion included), the total number of evaluation
// steps and the size of any string are limited, and breaching a limit is a kInvalidArgument error.
#pragma once

#include <ctime>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "text/jinja_parser.h"
#include "text/jinja_value.h"

namespace metrale::text::jinja {

// A scope: variables set here shadow those of the parents.
struct Env {
  Env* parent = nullptr;
  std::vector<std::pair<std::string, Value>> variables;

  const Value* lookup(std::string_view name) const;
  void set(std::string_view name, Value value);
};

struct RenderLimits {
  int max_depth = 192;                          // nested statements, expressions and macro calls
  int64_t max_steps = 5'000'000;                // evaluated nodes and loop iterations (about a second)
  size_t max_string_bytes = size_t{64} << 20;  // any string, the output included
  int64_t max_range = 1'000'000;                // elements of one range()
};

struct RenderContext {
  // The variables of the template (messages, tools, ...), set over the built-in globals.
  std::vector<std::pair<std::string, Value>> variables;
  // The time strftime_now() formats (local time); the current time when absent.
  std::optional<std::time_t> now;
  RenderLimits limits;
};

// Renders the program; throws kInvalidArgument with the line and column of the failing node.
// `source` is the template text the program was parsed from (for positions).
std::string render(const std::vector<NodePtr>& program, std::string_view source, const RenderContext& context);

}  // namespace metrale::text::jinja
