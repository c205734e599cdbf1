// JSON Schema to grammar: the JSON texts an instance of the schema may be written as. The supported
// subset (docs/structured_outputs.md lists it with examples):
//   type (one or a list); const; enum; anyOf; oneOf (as anyOf); allOf whose branches merge without
//   conflict; $ref to "#", "#/$defs/...", "#/definitions/..." or any JSON pointer into the schema,
//   recursive or not; boolean schemas true;
//   object: properties (written in the schema's order, optional ones may be left out), required,
//   additionalProperties (false, true or a schema; extra keys come after the declared ones and
//   differ from them);
//   array: items, prefixItems (and draft-07 array-form items / additionalItems), minItems, maxItems;
//   string: minLength, maxLength, pattern (pattern.h), format (pattern.h lists them);
//   integer: minimum, maximum, exclusiveMinimum, exclusiveMaximum;
//   number: minimum 0 / exclusiveMinimum below 0 (non-negative numbers) only;
//   nullable: true (OpenAPI);
//   annotations (title, description, default, examples, $schema, $id, $comment, deprecated,
//   readOnly, writeOnly, ...) and unknown keywords are ignored, as JSON Schema says.
// Anything else that constrains values (not, if/then/else, patternProperties, propertyNames,
// uniqueItems: true, contains, multipleOf, minProperties, maxProperties, dependent*, unevaluated*,
// bounds on numbers, pattern together with a length, a false schema) is kUnsupported with a message
// naming the keyword and where it is ("unsupported JSON Schema keyword 'not' at /properties/a").
//
// The text is what a model writes: enum and const values as compact JSON, object keys in the
// schema's order, whitespace between tokens as the options say.
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "text/grammar/char_class.h"
#include "text/grammar/grammar.h"

namespace metrale::grammar {

struct JsonSchemaOptions {
  // Whitespace between JSON tokens: any (space, tab, newline, return), at most max_whitespace
  // characters in a row (-1: unbounded); or none at all.
  bool any_whitespace = true;
  int32_t max_whitespace = -1;
  // additionalProperties unspecified on an object with properties means false (what OpenAI's strict
  // mode requires); when false here, JSON Schema's default (any extra property) applies. prefixItems
  // without items likewise closes the array.
  bool strict = true;
  int32_t max_repetition = 10000;  // bound on minItems/maxItems/minLength/maxLength
  // Text that no string may contain as written (the markup around a tool call, which would end the
  // call early when parsed). Strings whose characters are constrained (pattern, format, lengths)
  // and keys beside declared ones then exclude '<' instead; every markup starts with it.
  std::vector<std::string> forbidden_in_strings;
};

// Builds schema expressions into a grammar; one compiler may serve several schemas (tool calls) and
// shares the "any JSON value" rule among them.
class JsonSchemaCompiler {
 public:
  JsonSchemaCompiler(Grammar& grammar, JsonSchemaOptions options);

  // The root $ref "#" and JSON pointers resolve against (set before compiling its values).
  void set_root(const nlohmann::ordered_json& root);

  // A JSON text matching `schema`; `path` names it in errors ("" for the root).
  ExprId value(const nlohmann::ordered_json& schema, const std::string& path);
  // Any JSON value / any JSON object.
  ExprId any_value();
  ExprId any_object();
  ExprId whitespace();

  // For the XML-like tool-call formats, whose values are written as text: true when `schema` admits
  // only strings, and the expression of such a string's characters as written (no quotes, no
  // escaping) that never contains any of `forbidden` (the markup that would end the value), followed
  // by `suffix` (the closing markup). Constraints on the characters (pattern, format, lengths) keep
  // '<' out instead.
  bool is_string_only(const nlohmann::ordered_json& schema);
  ExprId raw_string(const nlohmann::ordered_json& schema, const std::string& path,
                    const std::vector<std::string_view>& forbidden, std::string_view suffix);

 private:
  ExprId value_at(const nlohmann::ordered_json& schema, const std::string& path);
  ExprId combination(const nlohmann::ordered_json& schema, const nlohmann::ordered_json& members,
                     const std::string& path);
  nlohmann::ordered_json inline_ref(const nlohmann::ordered_json& schema, const std::string& path) const;
  std::vector<std::string> types_of(const nlohmann::ordered_json& schema, const std::string& path) const;
  ExprId typed(const std::string& type, const nlohmann::ordered_json& schema, const std::string& path);
  ExprId object(const nlohmann::ordered_json& schema, const std::string& path);
  ExprId array(const nlohmann::ordered_json& schema, const std::string& path);
  ExprId string(const nlohmann::ordered_json& schema, const std::string& path, StringEncoding encoding);
  ExprId integer(const nlohmann::ordered_json& schema, const std::string& path);
  ExprId number(const nlohmann::ordered_json& schema, const std::string& path);
  ExprId reference(const std::string& ref, const std::string& path);
  ExprId literal_value(const nlohmann::ordered_json& value);
  ExprId key_not_in(const std::vector<std::string>& names);
  ExprId separated(ExprId item);  // ws "," ws item
  ExprId quoted_string();         // an unconstrained JSON string
  ExprId raw_text(const std::vector<std::string_view>& forbidden, std::string_view suffix);
  CharSet constrained_chars() const;
  const nlohmann::ordered_json& resolve(const std::string& ref, const std::string& path) const;
  void check_keywords(const nlohmann::ordered_json& schema, const std::string& path) const;

  Grammar& grammar_;
  JsonSchemaOptions options_;
  const nlohmann::ordered_json* root_ = nullptr;
  RuleId any_rule_ = -1;
  RuleId string_rule_ = -1;                       // with forbidden_in_strings: shared by every string
  std::map<std::string, RuleId> raw_text_rules_;  // unconstrained raw strings, by forbidden markup
  std::map<std::string, RuleId> ref_rules_;       // recursive references, by pointer
  std::vector<std::string> expanding_;            // references being inlined (a repeat means recursion)
  int32_t depth_ = 0;
};

// The grammar of JSON texts matching `schema` (response_format json_schema).
Grammar json_schema_grammar(const nlohmann::ordered_json& schema, const JsonSchemaOptions& options = {});
// The grammar of any JSON object (response_format json_object).
Grammar json_object_grammar(const JsonSchemaOptions& options = {});

}  // namespace metrale::grammar
