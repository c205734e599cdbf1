#include "text/grammar/tool_call_grammar.h"

#include "core/error.h"
#include "text/tool_calls/argument_types.h"

namespace metrale::grammar {
namespace {

using Json = nlohmann::ordered_json;

// The declared properties of a tool's parameters, in order, with whether each is required.
struct Parameter {
  std::string name;
  const Json* schema;
  bool required;
};

std::vector<Parameter> parameters_of(const ToolDefinition& tool) {
  static const Json kAnything = true;
  std::vector<Parameter> list;
  const Json& schema = tool.parameters;
  if (!schema.is_object()) return list;
  std::vector<std::string> required;
  if (const auto names = schema.find("required"); names != schema.end() && names->is_array()) {
    for (const Json& name : *names) {
      if (name.is_string()) required.push_back(name.get<std::string>());
    }
  }
  const auto is_required = [&](const std::string& name) {
    return std::find(required.begin(), required.end(), name) != required.end();
  };
  if (const auto properties = schema.find("properties"); properties != schema.end() && properties->is_object()) {
    for (const auto& [name, property] : properties->items()) list.push_back({name, &property, is_required(name)});
  }
  for (const std::string& name : required) {
    if (std::none_of(list.begin(), list.end(), [&](const Parameter& p) { return p.name == name; })) {
      list.push_back({name, &kAnything, true});
    }
  }
  return list;
}

// Parameters in order, optional ones skippable: a chain of nodes with a bypass for each optional one.
ExprId parameter_sequence(Grammar& g, const std::vector<Parameter>& parameters, const std::vector<ExprId>& items) {
  const auto n = static_cast<int32_t>(parameters.size());
  std::vector<GraphEdge> edges;
  for (int32_t i = 0; i < n; ++i) {
    edges.push_back(GraphEdge{i, i + 1, items[static_cast<size_t>(i)]});
    if (!parameters[static_cast<size_t>(i)].required) edges.push_back(GraphEdge{i, i + 1, -1});
  }
  return g.graph(n + 1, std::move(edges), {n});
}

// The markup that ends or restarts a call when the parser reads it: no JSON string may contain it.
JsonSchemaOptions with_markup(ToolCallFormat format, JsonSchemaOptions options) {
  switch (format) {
    case ToolCallFormat::kHermes:
      options.forbidden_in_strings = {"<tool_call>", "</tool_call>"};
      break;
    case ToolCallFormat::kQwen3Coder:
      options.forbidden_in_strings = {"<tool_call>", "</tool_call>", "</parameter>", "<parameter=", "</function>"};
      break;
    case ToolCallFormat::kGlm45:
      options.forbidden_in_strings = {"<tool_call>", "</tool_call>", "</arg_value>"};
      break;
    case ToolCallFormat::kDeepSeekV3:
    case ToolCallFormat::kDeepSeekV31:
      options.forbidden_in_strings = {"<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"};
      break;
    case ToolCallFormat::kDeepSeekV32:
      options.forbidden_in_strings = {"<｜DSML｜function_calls>", "<｜DSML｜invoke", "</｜DSML｜invoke>",
                                      "</｜DSML｜parameter>"};
      break;
  }
  return options;
}

class ToolCallGrammarBuilder {
 public:
  ToolCallGrammarBuilder(ToolCallFormat format, const ToolCallGrammarOptions& options)
      : format_(format), options_(options), compiler_(grammar_, with_markup(format, options.json)) {}

  Grammar build(const std::vector<ToolDefinition>& tools) {
    std::vector<ExprId> calls;
    for (const ToolDefinition& tool : tools) {
      if (options_.function && tool.name != *options_.function) continue;
      compiler_.set_root(tool.parameters);
      try {
        calls.push_back(call(tool));
      } catch (const Error& e) {
        rethrow_with_context(e, "tool '{}'", tool.name);
      }
    }
    if (calls.empty()) {
      if (options_.function)
        raise(ErrorCode::kInvalidArgument, "tool_choice names '{}', which is not among the tools", *options_.function);
      raise(ErrorCode::kInvalidArgument, "a tool call is required but no function tools are given");
    }
    const ExprId one = grammar_.alt(std::move(calls));
    const bool many = options_.parallel && !options_.function;
    ExprId body = -1;
    switch (format_) {
      case ToolCallFormat::kDeepSeekV3:
      case ToolCallFormat::kDeepSeekV31:
        body = grammar_.seq(
            {special("<｜tool▁calls▁begin｜>"), many ? grammar_.plus(one) : one, special("<｜tool▁calls▁end｜>")});
        break;
      case ToolCallFormat::kDeepSeekV32:
        body = grammar_.seq({special("<｜DSML｜function_calls>"), grammar_.literal("\n"),
                             many ? grammar_.plus(one) : one, special("</｜DSML｜function_calls>")});
        break;
      default:
        body = many ? grammar_.seq({one, grammar_.star(grammar_.seq({grammar_.literal("\n"), one}))}) : one;
    }
    const RuleId root = grammar_.add_rule("tool_calls");
    grammar_.set_body(root, body);
    grammar_.set_root(root);
    return std::move(grammar_);
  }

 private:
  // A marker that may be one special token (DeepSeek's): allowed as that token, or as its text.
  ExprId special(const std::string& text) {
    grammar_.allow_special_token(text);
    return grammar_.literal(text);
  }

  ExprId json_arguments(const ToolDefinition& tool) {
    const Json& schema = tool.parameters;
    if (schema.is_object() && schema.empty()) return compiler_.any_object();
    return compiler_.value(schema, "");
  }

  // A parameter's value in an XML-like format and the closing markup after it: raw text for a
  // string-only schema, JSON otherwise.
  ExprId xml_value(const Parameter& parameter, const std::vector<std::string_view>& forbidden,
                   std::string_view suffix) {
    const std::string path = "/properties/" + parameter.name;
    if (compiler_.is_string_only(*parameter.schema))
      return compiler_.raw_string(*parameter.schema, path, forbidden, suffix);
    return grammar_.seq({compiler_.value(*parameter.schema, path), grammar_.literal(suffix)});
  }

  ExprId call(const ToolDefinition& tool) {
    Grammar& g = grammar_;
    const ExprId ws = compiler_.whitespace();
    switch (format_) {
      case ToolCallFormat::kHermes:
        return g.seq({g.literal("<tool_call>\n{"), ws, g.literal("\"name\""), ws, g.byte(':'), ws,
                      g.literal(text::tool_calls::dump_compact(Json(tool.name))), ws, g.byte(','), ws,
                      g.literal("\"arguments\""), ws, g.byte(':'), ws, json_arguments(tool), ws,
                      g.literal("}\n</tool_call>")});
      case ToolCallFormat::kQwen3Coder: {
        const std::vector<Parameter> parameters = parameters_of(tool);
        std::vector<ExprId> items;
        for (const Parameter& p : parameters) {
          items.push_back(
              g.seq({g.literal("<parameter=" + p.name + ">\n"),
                     xml_value(p, {"</parameter>", "<parameter=", "</function>", "<tool_call>", "</tool_call>"},
                               "\n</parameter>\n")}));
        }
        return g.seq({g.literal("<tool_call>\n<function=" + tool.name + ">\n"),
                      parameter_sequence(g, parameters, items), g.literal("</function>\n</tool_call>")});
      }
      case ToolCallFormat::kGlm45: {
        const std::vector<Parameter> parameters = parameters_of(tool);
        std::vector<ExprId> items;
        const ExprId newline = g.optional(g.literal("\n"));
        for (const Parameter& p : parameters) {
          items.push_back(
              g.seq({g.literal("<arg_key>" + p.name + "</arg_key>"), newline, g.literal("<arg_value>"),
                     xml_value(p, {"</arg_value>", "<tool_call>", "</tool_call>"}, "</arg_value>"), newline}));
        }
        return g.seq({g.literal("<tool_call>" + tool.name), newline, parameter_sequence(g, parameters, items),
                      g.literal("</tool_call>")});
      }
      case ToolCallFormat::kDeepSeekV3:
        return g.seq({special("<｜tool▁call▁begin｜>"), g.literal("function"), special("<｜tool▁sep｜>"),
                      g.literal(tool.name + "\n```json\n"), json_arguments(tool), g.literal("\n```"),
                      special("<｜tool▁call▁end｜>")});
      case ToolCallFormat::kDeepSeekV31:
        return g.seq({special("<｜tool▁call▁begin｜>"), g.literal(tool.name), special("<｜tool▁sep｜>"),
                      json_arguments(tool), special("<｜tool▁call▁end｜>")});
      case ToolCallFormat::kDeepSeekV32: {
        const std::vector<Parameter> parameters = parameters_of(tool);
        std::vector<ExprId> items;
        for (const Parameter& p : parameters) {
          const bool raw = compiler_.is_string_only(*p.schema);
          items.push_back(g.seq(
              {g.literal("<｜DSML｜parameter name=\"" + p.name + "\" string=\"" + (raw ? "true" : "false") + "\">"),
               xml_value(p,
                         {"</｜DSML｜parameter>", "<｜DSML｜invoke", "</｜DSML｜invoke>", "<｜DSML｜function_calls>"},
                         "</｜DSML｜parameter>\n")}));
        }
        return g.seq({g.literal("<｜DSML｜invoke name=\"" + tool.name + "\">\n"),
                      parameter_sequence(g, parameters, items), g.literal("</｜DSML｜invoke>\n")});
      }
    }
    raise(ErrorCode::kInternal, "unknown tool-call format");
  }

  ToolCallFormat format_;
  ToolCallGrammarOptions options_;
  Grammar grammar_;
  JsonSchemaCompiler compiler_;
};

}  // namespace

Grammar tool_call_grammar(ToolCallFormat format, const std::vector<ToolDefinition>& tools,
                          const ToolCallGrammarOptions& options) {
  return ToolCallGrammarBuilder(format, options).build(tools);
}

}  // namespace metrale::grammar
