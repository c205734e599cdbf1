// Tool-call grammars: whatever a constrained walk produces, the parser of the same format reads back
// as calls of the declared tools whose arguments validate against their schemas, with no content.
#include "text/grammar/tool_call_grammar.h"

#include <gtest/gtest.h>

#include <filesystem>

#include "core/error.h"
#include "text/grammar/compiled_grammar.h"
#include "text/grammar/matcher.h"
#include "text/grammar_helpers.h"
#include "text/json_schema_validator.h"
#include "text/tokenizer.h"

namespace metrale::grammar {
namespace {

using Json = nlohmann::ordered_json;
using testing::random_walk;
using testing::SchemaValidator;

// The small test vocabulary, plus DeepSeek's markers as special tokens and the characters they are
// made of, so that every format can be written.
std::shared_ptr<const TokenizerInfo> tool_vocabulary() {
  std::vector<std::string> tokens = {"<eos>"};
  for (int c = 0x20; c < 0x7f; ++c) tokens.emplace_back(1, static_cast<char>(c));
  for (const char* piece : {"\n",
                            "\t",
                            "é",
                            "｜",
                            "▁",
                            "</",
                            "<tool_call>",
                            "</tool_call>",
                            "<function=",
                            "</function>",
                            "<parameter=",
                            "</parameter>",
                            "\n</parameter>\n",
                            "<arg_key>",
                            "</arg_key>",
                            "<arg_value>",
                            "</arg_value>",
                            "{\"",
                            "\":",
                            "\", \"",
                            "\"}",
                            "true",
                            "12",
                            "city",
                            "query",
                            "search",
                            "get_weather",
                            "DSML",
                            " name=\"",
                            "\">",
                            "string=\"true\">",
                            "string=\"false\">"}) {
    tokens.emplace_back(piece);
  }
  std::vector<int32_t> special{0};
  for (const char* marker : {"<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                             "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜end▁of▁sentence｜>"}) {
    special.push_back(static_cast<int32_t>(tokens.size()));
    tokens.emplace_back(marker);
  }
  return TokenizerInfo::from_tokens(tokens, special, {0});
}

std::vector<ToolDefinition> tools() {
  return tool_definitions_from_openai(Json::parse(R"([
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
      "city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 14},
      "unit": {"enum": ["c", "f"]}, "flags": {"type": "object", "properties": {"metric": {"type": "boolean"}}}},
      "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
      "query": {"type": "string", "minLength": 1, "maxLength": 12}, "note": {"type": "string"}}, "required": ["query"]}}}
  ])"));
}

constexpr ToolCallFormat kFormats[] = {ToolCallFormat::kHermes,      ToolCallFormat::kQwen3Coder,
                                       ToolCallFormat::kGlm45,       ToolCallFormat::kDeepSeekV3,
                                       ToolCallFormat::kDeepSeekV31, ToolCallFormat::kDeepSeekV32};

// Walks the grammar and checks what the parser makes of each finished output.
void expect_walks_parse_back(ToolCallFormat format, const ToolCallGrammarOptions& options, size_t min_calls,
                             size_t max_calls) {
  const std::vector<ToolDefinition> declared = tools();
  const auto grammar = compile_grammar(tool_call_grammar(format, declared, options), tool_vocabulary());
  std::mt19937 random(static_cast<uint32_t>(format) * 7 + 1);
  int finished = 0;
  for (int walk = 0; walk < 16; ++walk) {
    GrammarMatcher matcher(grammar);
    bool terminated = false;
    const std::string text = random_walk(matcher, random, 120, /*check_masks=*/walk < 2, &terminated);
    if (::testing::Test::HasFatalFailure()) return;
    if (!terminated) continue;
    ++finished;
    const ToolParseResult parsed = parse_tool_calls(format, declared, text);
    const std::string where = std::string(tool_call_format_name(format)) + ": " + text;
    EXPECT_EQ(parsed.content, "") << where;
    EXPECT_GE(parsed.tool_calls.size(), min_calls) << where;
    EXPECT_LE(parsed.tool_calls.size(), max_calls) << where;
    for (const ToolCall& call : parsed.tool_calls) {
      if (options.function) {
        EXPECT_EQ(call.name, *options.function) << where;
      }
      const ToolDefinition* tool = nullptr;
      for (const ToolDefinition& candidate : declared) {
        if (candidate.name == call.name) tool = &candidate;
      }
      ASSERT_NE(tool, nullptr) << where;
      const Json arguments = Json::parse(call.arguments, nullptr, false);
      ASSERT_FALSE(arguments.is_discarded()) << where;
      EXPECT_EQ(SchemaValidator(tool->parameters).check(arguments), "") << where << "\narguments: " << call.arguments;
    }
  }
  EXPECT_GT(finished, 4) << tool_call_format_name(format);
}

TEST(ToolCallGrammar, EveryFormatParsesBackAsValidCalls) {
  for (ToolCallFormat format : kFormats) {
    expect_walks_parse_back(format, {}, 1, 100);
    if (HasFatalFailure()) return;
  }
}

TEST(ToolCallGrammar, NamedFunctionAndSingleCall) {
  for (ToolCallFormat format : kFormats) {
    ToolCallGrammarOptions named;
    named.function = "search";
    expect_walks_parse_back(format, named, 1, 1);
    ToolCallGrammarOptions single;
    single.parallel = false;
    expect_walks_parse_back(format, single, 1, 1);
    if (HasFatalFailure()) return;
  }
}

// What the chat templates write is inside the grammar (whitespace as the templates put it).
TEST(ToolCallGrammar, AcceptsTheTemplatesMarkup) {
  const std::vector<std::pair<ToolCallFormat, std::string>> outputs = {
      {ToolCallFormat::kHermes,
       "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 3}}\n</tool_call>\n"
       "<tool_call>\n{\"name\": \"search\", \"arguments\": {\"query\": \"x\"}}\n</tool_call>"},
      {ToolCallFormat::kQwen3Coder,
       "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\nCity\n</parameter>\n<parameter=days>\n3\n"
       "</parameter>\n<parameter=flags>\n{\"metric\": true}\n</parameter>\n</function>\n</tool_call>"},
      {ToolCallFormat::kGlm45,
       "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Beijing</arg_value>\n<arg_key>days</arg_key>\n"
       "<arg_value>2</arg_value>\n</tool_call>"},
      {ToolCallFormat::kGlm45, "<tool_call>search<arg_key>query</arg_key><arg_value>q</arg_value></tool_call>"},
      {ToolCallFormat::kDeepSeekV31,
       "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>{\"query\": "
       "\"q\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"},
      {ToolCallFormat::kDeepSeekV3,
       "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>search\n```json\n{\"query\": \"q\"}\n```"
       "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"},
      {ToolCallFormat::kDeepSeekV32,
       "<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"city\" "
       "string=\"true\">Oslo</｜DSML｜parameter>\n<｜DSML｜parameter name=\"days\" "
       "string=\"false\">7</｜DSML｜parameter>\n"
       "</｜DSML｜invoke>\n</｜DSML｜function_calls>"},
  };
  for (const auto& [format, text] : outputs) {
    GrammarMatcher matcher(compile_grammar(tool_call_grammar(format, tools()), tool_vocabulary()));
    EXPECT_TRUE(matcher.accept_string(text) && matcher.can_terminate())
        << tool_call_format_name(format) << ": " << text;
  }
  // Near misses: an undeclared function, a missing required parameter, a value of the wrong type,
  // a string holding the closing markup, text after the call.
  const std::vector<std::pair<ToolCallFormat, std::string>> refused = {
      {ToolCallFormat::kHermes, "<tool_call>\n{\"name\": \"nope\", \"arguments\": {}}\n</tool_call>"},
      {ToolCallFormat::kHermes, "<tool_call>\n{\"name\": \"search\", \"arguments\": {}}\n</tool_call>"},
      {ToolCallFormat::kHermes,
       "<tool_call>\n{\"name\": \"search\", \"arguments\": {\"query\": \"a</tool_call>\"}}\n</tool_call>"},
      {ToolCallFormat::kHermes,
       "<tool_call>\n{\"name\": \"search\", \"arguments\": {\"query\": \"q\"}}\n</tool_call> ok"},
      {ToolCallFormat::kQwen3Coder,
       "<tool_call>\n<function=get_weather>\n<parameter=city>\nX\n</parameter>\n<parameter=days>\n30\n</parameter>\n"
       "</function>\n</tool_call>"},
      {ToolCallFormat::kQwen3Coder,
       "<tool_call>\n<function=search>\n<parameter=query>\na</function>b\n</parameter>\n</function>\n</tool_call>"},
      {ToolCallFormat::kGlm45, "<tool_call>search\n<arg_key>note</arg_key>\n<arg_value>n</arg_value>\n</tool_call>"},
  };
  for (const auto& [format, text] : refused) {
    GrammarMatcher matcher(compile_grammar(tool_call_grammar(format, tools()), tool_vocabulary()));
    EXPECT_FALSE(matcher.accept_string(text) && matcher.can_terminate())
        << tool_call_format_name(format) << ": " << text;
  }
}

TEST(ToolCallGrammar, SpecialMarkersAreAllowedAsTokens) {
  const auto vocabulary = tool_vocabulary();
  GrammarMatcher matcher(compile_grammar(tool_call_grammar(ToolCallFormat::kDeepSeekV31, tools()), vocabulary));
  std::vector<uint32_t> bitmask(static_cast<size_t>(matcher.bitmask_words()));
  matcher.fill_next_token_bitmask(bitmask);
  const int32_t begin = vocabulary->num_tokens() - 6;  // <｜tool▁calls▁begin｜>
  EXPECT_TRUE((bitmask[static_cast<size_t>(begin) >> 5] >> (begin & 31)) & 1);
  EXPECT_TRUE(matcher.accept_token(begin));
  // <｜end▁of▁sentence｜> is special and not named by the grammar: never allowed.
  EXPECT_FALSE(matcher.is_allowed(vocabulary->num_tokens() - 1));
}

TEST(ToolCallGrammar, Errors) {
  EXPECT_THROW(tool_call_grammar(ToolCallFormat::kHermes, {}), Error);
  ToolCallGrammarOptions named;
  named.function = "missing";
  try {
    tool_call_grammar(ToolCallFormat::kHermes, tools(), named);
    FAIL() << "an unknown named function must be refused";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("missing"), std::string::npos) << e.what();
  }
  const auto bad = tool_definitions_from_openai(
      Json::parse(R"([{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                      "properties": {"x": {"not": {}}}}}}])"));
  try {
    tool_call_grammar(ToolCallFormat::kHermes, bad);
    FAIL() << "an unsupported parameter schema must be refused";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kUnsupported);
    EXPECT_NE(std::string(e.what()).find("tool 'f'"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace metrale::grammar

namespace metrale::grammar {
namespace {

// The real Qwen3 vocabulary, where <tool_call> is one added token and whitespace comes in runs: walks
// of the Qwen3 JSON and Qwen3.5 XML grammars still parse back as valid calls.
TEST(ToolCallGrammar, QwenTokenizerWalksParseBack) {
  const std::filesystem::path dir = std::filesystem::path(METRALE_SOURCE_DIR) / "models/default";
  if (!std::filesystem::exists(dir / "tokenizer.json")) GTEST_SKIP() << "models/default/tokenizer.json is missing";
  const Tokenizer tokenizer = Tokenizer::from_dir(dir);
  const auto vocabulary = TokenizerInfo::from_tokenizer(tokenizer, 151936);
  const std::vector<ToolDefinition> declared = tools();
  for (ToolCallFormat format : {ToolCallFormat::kHermes, ToolCallFormat::kQwen3Coder}) {
    const auto grammar = compile_grammar(tool_call_grammar(format, declared), vocabulary);
    // The single <tool_call> token is allowed first.
    GrammarMatcher start(grammar, {*tokenizer.eos_token_id()});
    EXPECT_TRUE(start.is_allowed(*tokenizer.token_to_id("<tool_call>")));
    std::mt19937 random(static_cast<uint32_t>(format) + 41);
    int finished = 0;
    for (int walk = 0; walk < 8; ++walk) {
      GrammarMatcher matcher(grammar, {*tokenizer.eos_token_id()});
      bool terminated = false;
      const std::string text = random_walk(matcher, random, 150, /*check_masks=*/false, &terminated);
      if (!terminated) continue;
      ++finished;
      const ToolParseResult parsed = parse_tool_calls(format, declared, text);
      EXPECT_EQ(parsed.content, "") << text;
      ASSERT_GE(parsed.tool_calls.size(), 1u) << text;
      for (const ToolCall& call : parsed.tool_calls) {
        const ToolDefinition* tool = call.name == "search" ? &declared[1] : &declared[0];
        EXPECT_EQ(SchemaValidator(tool->parameters).check(Json::parse(call.arguments)), "") << text;
      }
    }
    EXPECT_GT(finished, 0) << tool_call_format_name(format);
  }
}

}  // namespace
}  // namespace metrale::grammar
