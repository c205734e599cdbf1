// The grammar of "a valid call of these tools" in a model's tool-call format, for tool_choice
// "required" and a named function: the output is one call (or several, when parallel calls are
// allowed and no function is named) and nothing else; each call names a declared function and its
// arguments match that function's parameter schema. What the grammar produces, the tool-call parser
// of the same format (text/tool_calls/tool_call_parser.h) reads back as exactly those calls.
//
// Per format (the whitespace inside the markup is what the chat templates write):
//   kHermes       <tool_call>\n{"name": "F", "arguments": ARGS}\n</tool_call>   (JSON flexible inside)
//   kQwen3Coder   <tool_call>\n<function=F>\n<parameter=K>\nV\n</parameter>\n...</function>\n</tool_call>
//   kGlm45        <tool_call>F\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>\n...</tool_call>
//   kDeepSeekV3
//   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>F\n```json\nARGS\n```<｜tool▁call▁end｜>...
//   kDeepSeekV31
//   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>F<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
//   kDeepSeekV32  <｜DSML｜function_calls>\n<｜DSML｜invoke name="F">\n<｜DSML｜parameter name="K"
//   string="true|false">V
//                 </｜DSML｜parameter>\n...</｜DSML｜invoke>\n</｜DSML｜function_calls>
// In the XML-like formats the parameters come in the schema's order (required ones always, optional
// ones may be left out), a string-only parameter as raw text that cannot contain the closing markup,
// any other as JSON.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "text/grammar/grammar.h"
#include "text/grammar/json_schema.h"
#include "text/tool_calls/tool_call_parser.h"

namespace metrale::grammar {

struct ToolCallGrammarOptions {
  std::optional<std::string> function;  // tool_choice naming a function: exactly one call of it
  bool parallel = true;                 // parallel_tool_calls: more than one call may follow
  JsonSchemaOptions json;
};

// kInvalidArgument when there are no tools or the named function is not one of them; kUnsupported
// (naming the tool) for a parameter schema outside the supported subset.
Grammar tool_call_grammar(ToolCallFormat format, const std::vector<ToolDefinition>& tools,
                          const ToolCallGrammarOptions& options = {});

}  // namespace metrale::grammar
