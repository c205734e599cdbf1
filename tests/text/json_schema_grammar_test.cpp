// JSON Schema grammars: accept the instances they should and refuse near misses; masks agree with
// the token-by-token brute force; constrained random walks always produce valid instances.
#include <gtest/gtest.h>

#include <filesystem>
#include <functional>
#include <iostream>

#include "core/error.h"
#include "text/grammar/compiled_grammar.h"
#include "text/grammar/fuzz.h"
#include "text/grammar/json_schema.h"
#include "text/grammar/matcher.h"
#include "text/grammar_helpers.h"
#include "text/json_schema_validator.h"
#include "text/tokenizer.h"

namespace metrale::grammar {
namespace {

using Json = nlohmann::ordered_json;
using testing::expect_mask_matches_brute_force;
using testing::random_walk;
using testing::SchemaValidator;
using testing::small_vocabulary;

std::shared_ptr<const CompiledGrammar> compile(const Json& schema, const JsonSchemaOptions& options = {}) {
  return compile_grammar(json_schema_grammar(schema, options), small_vocabulary());
}

bool accepts(const std::shared_ptr<const CompiledGrammar>& grammar, std::string_view text) {
  GrammarMatcher matcher(grammar);
  return matcher.accept_string(text) && matcher.can_terminate();
}

struct SchemaCase {
  const char* name;
  const char* schema;
  std::vector<const char*> valid;
  std::vector<const char*> invalid;
};

const std::vector<SchemaCase>& cases() {
  static const std::vector<SchemaCase> all = {
      {"flat_object",
       R"({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
           "admin": {"type": "boolean"}}, "required": ["name", "age"]})",
       {R"({"name": "Ann", "age": 30})", R"({"name":"","age":-2,"admin":false})",
        R"({ "name" : "é\n\"x\"" , "age" : 0 })"},
       {R"({"age": 30, "name": "Ann"})", R"({"name": "Ann"})", R"({"name": "Ann", "age": 3.5})",
        R"({"name": "Ann", "age": 01})", R"({"name": "Ann", "age": 3, "x": 1})", R"({"name": "Ann", "age": 3,})",
        R"({"name": "A)"
        "\x01"
        R"(", "age": 3})"}},
      {"nested_arrays_enums",
       R"({"type": "object", "properties": {
           "items": {"type": "array", "items": {"type": "object", "properties": {
              "sku": {"type": "string", "minLength": 2, "maxLength": 4}, "qty": {"type": "integer", "minimum": 1, "maximum": 99},
              "tags": {"type": "array", "items": {"enum": ["red", "green", 3, null]}, "maxItems": 2}},
              "required": ["sku", "qty"]}, "minItems": 1},
           "status": {"enum": ["open", "closed"]}}, "required": ["items", "status"]})",
       {R"({"items": [{"sku": "ab", "qty": 1}], "status": "open"})",
        R"({"items": [{"sku": "abcd", "qty": 99, "tags": ["red", 3]}, {"sku": "日本", "qty": 10, "tags": []}], "status": "closed"})"},
       {R"({"items": [], "status": "open"})", R"({"items": [{"sku": "a", "qty": 1}], "status": "open"})",
        R"({"items": [{"sku": "abcde", "qty": 1}], "status": "open"})",
        R"({"items": [{"sku": "ab", "qty": 100}], "status": "open"})",
        R"({"items": [{"sku": "ab", "qty": 0}], "status": "open"})",
        R"({"items": [{"sku": "ab", "qty": 1, "tags": [1]}], "status": "open"})",
        R"({"items": [{"sku": "ab", "qty": 1, "tags": ["red", "red", "red"]}], "status": "open"})",
        R"({"items": [{"sku": "ab", "qty": 1}], "status": "pending"})"}},
      {"recursive_ref",
       R"({"$ref": "#/$defs/node", "$defs": {"node": {"type": "object", "properties": {
           "value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
           "required": ["value"]}}})",
       {R"({"value": 1})", R"({"value": 1, "children": [{"value": 2, "children": [{"value": 3}]}, {"value": 4}]})"},
       {R"({"value": 1, "children": [{}]})", R"({"value": 1, "children": [{"value": "x"}]})"}},
      {"any_of_and_nullable",
       R"({"anyOf": [{"type": "string", "pattern": "^[a-z]+\\d?$"}, {"type": "number", "minimum": 0}, {"type": "null"}]})",
       {R"("abc")", R"("abc7")", R"(0)", R"(12.5e-3)", R"(null)"},
       {R"("Abc")", R"("abc77")", R"(-1)", R"(true)", R"("")"}},
      {"tuple_and_counts",
       R"({"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer", "exclusiveMinimum": -3, "exclusiveMaximum": 1000}],
           "items": {"type": "boolean"}, "minItems": 2, "maxItems": 4})",
       {R"(["a", -2])", R"(["a", 999, true, false])", R"([ "a" , 0 , true ])"},
       {R"(["a"])", R"(["a", -3])", R"(["a", 1000])", R"(["a", 1, true, true, true])", R"([1, 1])",
        R"(["a", 1, "x"])"}},
      {"additional_properties_schema",
       R"({"type": "object", "properties": {"id": {"type": "integer"}}, "additionalProperties": {"type": "string"}})",
       {R"({})", R"({"id": 1, "a": "x", "b": "y"})", R"({"other": "z"})"},
       {R"({"id": "1"})", R"({"a": 1})", R"({"id": 1, "id": 2})", R"({"a": "x", "id": 1})"}},
      {"formats",
       R"({"type": "object", "properties": {"when": {"type": "string", "format": "date-time"},
           "day": {"type": "string", "format": "date"}, "id": {"type": "string", "format": "uuid"},
           "mail": {"type": "string", "format": "email"}, "ip": {"type": "string", "format": "ipv4"}}})",
       {R"({"when": "2024-02-29T12:30:00Z", "day": "1999-12-31", "id": "123e4567-e89b-12d3-a456-426614174000",
            "mail": "a.b@example.com", "ip": "192.168.0.255"})"},
       {R"({"when": "2024-13-01T00:00:00Z"})", R"({"day": "1999-12-32"})", R"({"id": "123e4567"})",
        R"({"mail": "nobody"})", R"({"ip": "256.1.1.1"})"}},
      {"const_one_of_all_of",
       R"({"oneOf": [{"type": "object", "properties": {"kind": {"const": "a"}, "x": {"type": "integer"}}, "required": ["kind"]},
                     {"type": "object", "properties": {"kind": {"const": "b"}, "y": {"type": "string"}}, "required": ["kind", "y"]}],
           "allOf": [{"description": "merged away"}]})",
       {R"({"kind": "a"})", R"({"kind": "a", "x": 5})", R"({"kind": "b", "y": ""})"},
       {R"({"kind": "b"})", R"({"kind": "c"})", R"({"kind": "a", "y": "s"})"}},
      {"integer_ranges",
       R"({"type": "array", "items": {"type": "integer", "minimum": -105, "maximum": 2047}})",
       {R"([-105, -100, -99, -1, 0, 9, 10, 199, 2000, 2047])"},
       {R"([-106])", R"([2048])", R"([-0])", R"([10000])", R"([007])"}},
      {"json_object_like",
       R"({"type": "object"})",
       {R"({})", R"({"a": [1, {"b": null}], "c": "d", "e": -1.5E+3, "f": true})"},
       {R"([])", R"({"a": })", R"({"a": 1,})", R"("x")"}},
  };
  return all;
}

TEST(JsonSchemaGrammar, AcceptsValidInstancesAndRejectsNearMisses) {
  for (const SchemaCase& c : cases()) {
    const Json schema = Json::parse(c.schema);
    const auto grammar = compile(schema);
    SchemaValidator validator(schema);
    for (const char* text : c.valid) {
      EXPECT_TRUE(accepts(grammar, text)) << c.name << ": " << text;
      EXPECT_EQ(validator.check(Json::parse(text)), "") << c.name << " (the validator): " << text;
      // Pretty-printed the same value is fine too.
      EXPECT_TRUE(accepts(grammar, Json::parse(text).dump(2))) << c.name << ": " << Json::parse(text).dump(2);
    }
    for (const char* text : c.invalid) EXPECT_FALSE(accepts(grammar, text)) << c.name << ": accepted " << text;
  }
}

TEST(JsonSchemaGrammar, MasksMatchBruteForceAndWalksValidate) {
  std::mt19937 random(11);
  for (const SchemaCase& c : cases()) {
    const Json schema = Json::parse(c.schema);
    const auto grammar = compile(schema);
    SchemaValidator validator(schema);
    int finished = 0;
    for (int walk = 0; walk < 12; ++walk) {
      GrammarMatcher matcher(grammar);
      bool terminated = false;
      const std::string text = random_walk(matcher, random, 80, /*check_masks=*/walk < 3, &terminated);
      if (HasFatalFailure()) return;
      if (!terminated) continue;
      ++finished;
      const Json value = Json::parse(text, nullptr, /*allow_exceptions=*/false);
      ASSERT_FALSE(value.is_discarded()) << c.name << ": not JSON: " << text;
      EXPECT_EQ(validator.check(value), "") << c.name << ": " << text;
    }
    EXPECT_GT(finished, 0) << c.name << ": no walk finished";
  }
}

TEST(JsonSchemaGrammar, CompactWhitespaceAndNonStrict) {
  const Json schema = Json::parse(R"({"type": "object", "properties": {"a": {"type": "integer"}}})");
  JsonSchemaOptions compact;
  compact.any_whitespace = false;
  const auto tight = compile(schema, compact);
  EXPECT_TRUE(accepts(tight, R"({"a":1})"));
  EXPECT_FALSE(accepts(tight, R"({"a": 1})"));
  JsonSchemaOptions bounded;
  bounded.max_whitespace = 2;
  const auto some = compile(schema, bounded);
  EXPECT_TRUE(accepts(some, "{ \"a\":  1}"));
  EXPECT_FALSE(accepts(some, "{   \"a\": 1}"));
  JsonSchemaOptions loose;
  loose.strict = false;
  EXPECT_TRUE(accepts(compile(schema, loose), R"({"a": 1, "b": [true]})"));
  EXPECT_FALSE(accepts(compile(schema), R"({"a": 1, "b": [true]})"));
}

TEST(JsonSchemaGrammar, JsonObject) {
  const auto grammar = compile_grammar(json_object_grammar(), small_vocabulary());
  EXPECT_TRUE(accepts(grammar, R"({"k": [1, 2, {"x": "y"}]})"));
  EXPECT_TRUE(accepts(grammar, "{}"));
  EXPECT_FALSE(accepts(grammar, "[1]"));
  EXPECT_FALSE(accepts(grammar, "\"s\""));
  std::mt19937 random(5);
  for (int walk = 0; walk < 10; ++walk) {
    GrammarMatcher matcher(grammar);
    bool terminated = false;
    const std::string text = random_walk(matcher, random, 60, walk < 2, &terminated);
    if (HasFatalFailure()) return;
    if (terminated) {
      const Json value = Json::parse(text, nullptr, false);
      EXPECT_TRUE(value.is_object()) << text;
    }
  }
}

TEST(JsonSchemaGrammar, UnsupportedFeaturesAreNamed) {
  const std::vector<std::pair<const char*, const char*>> refused = {
      {R"({"type": "object", "properties": {"a": {"not": {"type": "string"}}}})", "'not' at /properties/a"},
      {R"({"type": "array", "uniqueItems": true})", "uniqueItems"},
      {R"({"type": "object", "patternProperties": {"^x": {}}})", "patternProperties"},
      {R"({"type": "number", "maximum": 3})", "type number at the root"},
      {R"({"type": "string", "pattern": "(a)\\1"})", "backreferences"},
      {R"({"type": "string", "pattern": "(?=a)b"})", "lookaround"},
      {R"({"type": "string", "format": "color"})", "format 'color'"},
      {R"({"type": "string", "pattern": "a+", "maxLength": 3})", "minLength/maxLength"},
      {R"({"$ref": "https://example.com/schema"})", "remote $ref"},
      {R"({"type": "integer", "minimum": 5, "maximum": 4})", "no integer"},
      {R"({"type": "object", "properties": {"a": false}, "required": ["a"]})", "false schema"},
      {R"({"type": "array", "minItems": 5, "maxItems": 2})", "number of items"},
      {R"({"type": "object", "multipleOf": 2})", "multipleOf"},
  };
  for (const auto& [schema, expected] : refused) {
    try {
      compile(Json::parse(schema));
      ADD_FAILURE() << "accepted " << schema;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kUnsupported) << schema << ": " << e.what();
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << schema << ": " << e.what();
    }
  }
  try {
    compile(Json::parse(R"({"$ref": "#/$defs/missing"})"));
    ADD_FAILURE() << "a dangling $ref";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
  }
}

// The real Qwen3 vocabulary (151k tokens): a long walk stays valid; masks agree with the brute force
// on a few steps (the brute force costs a matcher copy per token, so only a few).
TEST(JsonSchemaGrammar, QwenTokenizerWalks) {
  const std::filesystem::path dir = std::filesystem::path(METRALE_SOURCE_DIR) / "models/default";
  if (!std::filesystem::exists(dir / "tokenizer.json")) GTEST_SKIP() << "models/default/tokenizer.json is missing";
  const Tokenizer tokenizer = Tokenizer::from_dir(dir);
  const auto vocabulary = TokenizerInfo::from_tokenizer(tokenizer, 151936);
  for (const char* name : {"nested_arrays_enums", "recursive_ref", "formats"}) {
    const SchemaCase* c = nullptr;
    for (const SchemaCase& candidate : cases()) {
      if (std::string_view(candidate.name) == name) c = &candidate;
    }
    ASSERT_NE(c, nullptr);
    const Json schema = Json::parse(c->schema);
    const auto grammar = compile_grammar(json_schema_grammar(schema), vocabulary);
    SchemaValidator validator(schema);
    std::mt19937 random(23);
    int finished = 0;
    for (int walk = 0; walk < 6; ++walk) {
      GrammarMatcher matcher(grammar, {*tokenizer.eos_token_id()});
      bool terminated = false;
      const std::string text = random_walk(matcher, random, 120, /*check_masks=*/false, &terminated);
      if (walk == 0) {
        GrammarMatcher fresh(grammar, {*tokenizer.eos_token_id()});
        expect_mask_matches_brute_force(fresh, std::string(name) + " start");
      }
      if (!terminated) {
        std::cerr << name << " walk " << walk << " unfinished: " << text << "\n";
        continue;
      }
      ++finished;
      const Json value = Json::parse(text, nullptr, false);
      ASSERT_FALSE(value.is_discarded()) << name << ": " << text;
      EXPECT_EQ(validator.check(value), "") << name << ": " << text;
    }
    EXPECT_GT(finished, 0) << name;
  }
}

}  // namespace
}  // namespace metrale::grammar

namespace metrale::grammar {
namespace {

// Random schemas stitched from fragments, with random walks, through the fuzzing entry point (which
// aborts on a broken invariant; an exception other than metrale::Error escapes and fails the test).
TEST(JsonSchemaGrammar, FuzzEntryPointOnRandomSchemas) {
  const std::vector<std::string> leaves = {R"({"type": "string"})",
                                           R"({"type": "integer", "minimum": -3, "maximum": 40})",
                                           R"({"type": "number"})",
                                           R"({"enum": ["a", 1, null, {"k": [true]}]})",
                                           R"({"const": "c"})",
                                           R"({"type": "boolean"})",
                                           R"({})",
                                           R"(true)",
                                           R"({"type": "string", "maxLength": 3})",
                                           R"({"type": "string", "pattern": "^[a-c]+x?$"})",
                                           R"({"$ref": "#"})",
                                           R"({"type": ["string", "null"]})",
                                           R"({"type": "string", "format": "date"})",
                                           R"({"not": {}})",
                                           R"({"type": 7})",
                                           R"({"$ref": "#/$defs/d"})",
                                           R"({"$ref": "#/items/99999999999999999999"})",
                                           R"({"minimum": "x"})"};
  std::mt19937 random(99);
  std::function<std::string(int)> schema = [&](int depth) -> std::string {
    const uint32_t pick = random() % (depth > 2 ? 2 : 5);
    if (pick < 2) return leaves[random() % leaves.size()];
    if (pick == 2) {
      return R"({"type": "object", "properties": {"p": )" + schema(depth + 1) + R"(, "q": )" + schema(depth + 1) +
             R"(}, "required": ["p"], "$defs": {"d": )" + leaves[random() % 6] + "}}";
    }
    if (pick == 3) return R"({"type": "array", "items": )" + schema(depth + 1) + R"(, "maxItems": 3})";
    return R"({"anyOf": [)" + schema(depth + 1) + ", " + schema(depth + 1) + "]}";
  };
  for (int round = 0; round < 300; ++round) {
    std::string input = schema(0);
    input.push_back('\0');
    for (int i = 0; i < 60; ++i) input.push_back(static_cast<char>(random()));
    EXPECT_EQ(fuzz_json_schema_grammar(reinterpret_cast<const uint8_t*>(input.data()), input.size()), 0);
  }
}

}  // namespace
}  // namespace metrale::grammar
