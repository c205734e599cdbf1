#include "text/tool_calls/tool_call_parser.h"

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "text/tool_calls/output_parser.h"

namespace metrale {
namespace {

using Json = nlohmann::ordered_json;

std::vector<ToolDefinition> weather_tools() {
  return tool_definitions_from_openai(Json::parse(R"([
    {"type": "function", "function": {"name": "get_weather", "parameters": {
      "type": "object",
      "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "detailed": {"type": "boolean"},
                     "units": {"enum": ["metric", "imperial"]}, "where": {"$ref": "#/$defs/place"},
                     "note": {"type": ["string", "null"]}},
      "$defs": {"place": {"type": "object"}}}}},
    {"type": "function", "function": {"name": "search", "parameters": {
      "type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "number"}}}}}
  ])"));
}

struct Call {
  std::string name;
  std::string arguments;
};

void expect_result(const ToolParseResult& result, std::string_view content, const std::vector<Call>& calls,
                   const std::string& where) {
  EXPECT_EQ(result.content, content) << where;
  ASSERT_EQ(result.tool_calls.size(), calls.size()) << where;
  for (size_t i = 0; i < calls.size(); ++i) {
    EXPECT_EQ(result.tool_calls[i].name, calls[i].name) << where << " call " << i;
    EXPECT_EQ(result.tool_calls[i].arguments, calls[i].arguments) << where << " call " << i;
    EXPECT_TRUE(result.tool_calls[i].id.starts_with("call_")) << where;
    EXPECT_EQ(result.tool_calls[i].id.size(), 29u) << where;
  }
}

ToolParseResult run_pieces(ToolCallFormat format, const std::vector<ToolDefinition>& tools,
                           const std::vector<std::string_view>& pieces, int32_t max_calls = 0) {
  ToolCallParser parser(format, tools, ToolCallParserOptions{.id_seed = 42, .max_calls = max_calls});
  ToolParseResult result;
  int32_t started = 0;
  for (std::string_view piece : pieces) {
    const ToolParseDelta delta = parser.feed(piece);
    // A call's first piece names it, in order; its arguments follow in later pieces.
    for (const ToolCallDelta& call : delta.tool_calls) {
      if (!call.id.empty()) {
        EXPECT_EQ(call.index, started++);
        EXPECT_FALSE(call.name.empty());
        EXPECT_TRUE(call.arguments.empty());
      } else {
        EXPECT_LT(call.index, started);
      }
    }
    merge_tool_parse_delta(result, delta);
  }
  merge_tool_parse_delta(result, parser.finish());
  return result;
}

// The non-streaming result is `content` + `calls`, and so is every way of streaming the text: one
// character at a time, every cut into two and three pieces (three only for short texts), and random
// chunkings.
void expect_parse(ToolCallFormat format, const std::vector<ToolDefinition>& tools, std::string_view text,
                  std::string_view content, const std::vector<Call>& calls, int32_t max_calls = 0) {
  const ToolParseResult whole =
      parse_tool_calls(format, tools, text, ToolCallParserOptions{.id_seed = 42, .max_calls = max_calls});
  expect_result(whole, content, calls, "whole");
  if (::testing::Test::HasFailure()) return;
  const auto same = [&](const ToolParseResult& streamed, const std::string& where) {
    ASSERT_EQ(streamed.content, whole.content) << where;
    ASSERT_EQ(streamed.tool_calls.size(), whole.tool_calls.size()) << where;
    for (size_t i = 0; i < whole.tool_calls.size(); ++i) {
      ASSERT_EQ(streamed.tool_calls[i].id, whole.tool_calls[i].id) << where;
      ASSERT_EQ(streamed.tool_calls[i].name, whole.tool_calls[i].name) << where;
      ASSERT_EQ(streamed.tool_calls[i].arguments, whole.tool_calls[i].arguments) << where;
    }
  };
  std::vector<std::string_view> chars;
  for (size_t i = 0; i < text.size(); ++i) chars.push_back(text.substr(i, 1));
  same(run_pieces(format, tools, chars, max_calls), "one character at a time");
  for (size_t i = 0; i <= text.size(); ++i) {
    if (text.size() <= 160) {
      for (size_t j = i; j <= text.size(); ++j) {
        same(run_pieces(format, tools, {text.substr(0, i), text.substr(i, j - i), text.substr(j)}, max_calls),
             "cuts at " + std::to_string(i) + ", " + std::to_string(j));
        if (::testing::Test::HasFatalFailure()) return;
      }
    } else {
      same(run_pieces(format, tools, {text.substr(0, i), text.substr(i)}, max_calls), "cut at " + std::to_string(i));
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
  std::mt19937 random(7);
  for (int round = 0; round < 200; ++round) {
    std::vector<std::string_view> pieces;
    for (size_t at = 0; at < text.size();) {
      const size_t length = std::min<size_t>(text.size() - at, 1 + random() % 12);
      pieces.push_back(text.substr(at, length));
      at += length;
    }
    same(run_pieces(format, tools, pieces, max_calls), "random chunking " + std::to_string(round));
    if (::testing::Test::HasFatalFailure()) return;
  }
}

// --- Hermes / Qwen3 ---

TEST(ToolCallParser, HermesContentAndCall) {
  expect_parse(
      ToolCallFormat::kHermes, weather_tools(),
      "Let me check.\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 3}}\n"
      "</tool_call>",
      "Let me check.", {{"get_weather", R"({"city":"Paris","days":3})"}});
}

TEST(ToolCallParser, HermesParallelCallsAndTrailingText) {
  expect_parse(ToolCallFormat::kHermes, weather_tools(),
               "<tool_call>\n{\"name\": \"search\", \"arguments\": {\"query\": \"é \\\"x\\\"\"}}\n</tool_call>\n"
               "<tool_call>\n{\"name\": \"get_weather\", \"parameters\": {}}\n</tool_call>\nDone.",
               "Done.", {{"search", R"({"query":"é \"x\""})"}, {"get_weather", "{}"}});
}

TEST(ToolCallParser, HermesArgumentsAsJsonString) {
  expect_parse(ToolCallFormat::kHermes, {}, R"(<tool_call>{"name": "f", "arguments": "{\"a\": [1, 2]}"}</tool_call>)",
               "", {{"f", R"({"a":[1,2]})"}});
}

TEST(ToolCallParser, HermesMalformedCallIsContent) {
  const std::string bad = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": }\n</tool_call>";
  expect_parse(ToolCallFormat::kHermes, weather_tools(), "A " + bad + " B", "A " + bad + " B", {});
  // An unknown function when tools are declared is not a call; without tools any name is.
  const std::string unknown = "<tool_call>{\"name\": \"nope\", \"arguments\": {}}</tool_call>";
  expect_parse(ToolCallFormat::kHermes, weather_tools(), unknown, unknown, {});
  expect_parse(ToolCallFormat::kHermes, {}, unknown, "", {{"nope", "{}"}});
}

TEST(ToolCallParser, HermesUnterminatedCallIsContent) {
  const std::string text = "Sure.\n<tool_call>\n{\"name\": \"search\", \"arguments\": {\"query\": \"x\"}}";
  expect_parse(ToolCallFormat::kHermes, weather_tools(), text, text, {});
}

TEST(ToolCallParser, HermesCallThatNeverClosesBeforeTheNext) {
  // The first call is never closed: it is content, and the second one is still a call.
  const std::string first = "<tool_call>{\"name\": \"search\", \"arguments\": {";
  expect_parse(ToolCallFormat::kHermes, weather_tools(),
               first + "<tool_call>{\"name\": \"search\", \"arguments\": {\"query\": \"q\"}}</tool_call>", first,
               {{"search", R"({"query":"q"})"}});
}

TEST(ToolCallParser, PlainTextAndPartialMarkers) {
  expect_parse(ToolCallFormat::kHermes, weather_tools(), "a < b and <tool_ c <tool_call",
               "a < b and <tool_ c <tool_call", {});
  expect_parse(ToolCallFormat::kHermes, weather_tools(), "  spaced  \n", "  spaced  \n", {});
  expect_parse(ToolCallFormat::kHermes, weather_tools(), "", "", {});
}

// --- Qwen3.5 / Qwen3-Coder XML ---

TEST(ToolCallParser, Qwen3CoderTypedParameters) {
  expect_parse(ToolCallFormat::kQwen3Coder, weather_tools(),
               "I will look.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
               "<parameter=days>\n5\n</parameter>\n<parameter=detailed>\nTrue\n</parameter>\n"
               "<parameter=where>\n{\"lat\": 1.5}\n</parameter>\n<parameter=note>\nnull\n</parameter>\n"
               "</function>\n</tool_call>",
               "I will look.",
               {{"get_weather", R"({"city":"New York","days":5,"detailed":true,"where":{"lat":1.5},"note":null})"}});
}

TEST(ToolCallParser, Qwen3CoderStringsStayStrings) {
  // "123" and a multi-line value are strings when the schema says string; a wrong-typed value falls
  // back to its text.
  expect_parse(
      ToolCallFormat::kQwen3Coder, weather_tools(),
      "<tool_call>\n<function=get_weather>\n<parameter=city>\n123\n</parameter>\n<parameter=days>\nsoon\n"
      "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=search>\n<parameter=query>\nline 1\n"
      "line 2\n\n</parameter>\n<parameter=limit>\n2.5\n</parameter>\n</function>\n</tool_call>",
      "",
      {{"get_weather", R"({"city":"123","days":"soon"})"}, {"search", R"({"query":"line 1\nline 2\n","limit":2.5})"}});
}

TEST(ToolCallParser, Qwen3CoderMissingClosingTagsAreTolerated) {
  expect_parse(ToolCallFormat::kQwen3Coder, weather_tools(),
               "<tool_call>\n<function=search>\n<parameter=query>\nx\n<parameter=limit>\n3\n</tool_call>", "",
               {{"search", R"({"query":"x","limit":3})"}});
}

TEST(ToolCallParser, Qwen3CoderMalformedIsContent) {
  const std::string text = "<tool_call>\n<function=search>\nstray text\n</function>\n</tool_call>";
  expect_parse(ToolCallFormat::kQwen3Coder, weather_tools(), text, text, {});
  const std::string unterminated = "ok <tool_call>\n<function=search>\n<parameter=query>\nx";
  expect_parse(ToolCallFormat::kQwen3Coder, weather_tools(), unterminated, unterminated, {});
}

// --- GLM-4.5 / 4.6 / 4.7 ---

TEST(ToolCallParser, Glm45WithAndWithoutNewlines) {
  expect_parse(
      ToolCallFormat::kGlm45, weather_tools(),
      "Checking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Beijing</arg_value>\n"
      "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>"
      "<tool_call>search<arg_key>query</arg_key><arg_value> two words </arg_value></tool_call>"
      "<tool_call>search</tool_call>",
      "Checking.",
      {{"get_weather", R"({"city":"Beijing","days":2})"}, {"search", R"({"query":" two words "})"}, {"search", "{}"}});
}

TEST(ToolCallParser, Glm45MalformedIsContent) {
  const std::string text = "<tool_call>search\n<arg_key>query</arg_key>\n</tool_call>";
  expect_parse(ToolCallFormat::kGlm45, weather_tools(), text, text, {});
}

// --- DeepSeek ---

TEST(ToolCallParser, DeepSeekV31Calls) {
  expect_parse(ToolCallFormat::kDeepSeekV31, weather_tools(),
               "Looking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Oslo\"}"
               "<｜tool▁call▁end｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>{\"query\": \"x\"}<｜tool▁call▁end｜>"
               "<｜tool▁calls▁end｜>",
               "Looking.", {{"get_weather", R"({"city":"Oslo"})"}, {"search", R"({"query":"x"})"}});
}

TEST(ToolCallParser, DeepSeekV31MalformedAndUnterminated) {
  const std::string empty_section = "<｜tool▁calls▁begin｜><｜tool▁calls▁end｜>";
  expect_parse(ToolCallFormat::kDeepSeekV31, weather_tools(), empty_section, empty_section, {});
  const std::string bad = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>{oops}<｜tool▁call▁end｜>";
  expect_parse(ToolCallFormat::kDeepSeekV31, weather_tools(), bad + "<｜tool▁calls▁end｜>",
               bad + "<｜tool▁calls▁end｜>", {});
  // A good call then a bad one: the bad one is content, the section's markers are spent.
  expect_parse(ToolCallFormat::kDeepSeekV31, weather_tools(),
               "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>{}<｜tool▁call▁end｜>"
               "<｜tool▁call▁begin｜>search<｜tool▁sep｜>[1]<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
               "<｜tool▁call▁begin｜>search<｜tool▁sep｜>[1]<｜tool▁call▁end｜>", {{"search", "{}"}});
  const std::string open = "x<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>{\"q";
  expect_parse(ToolCallFormat::kDeepSeekV31, weather_tools(), open, open, {});
}

TEST(ToolCallParser, DeepSeekV3Fenced) {
  expect_parse(
      ToolCallFormat::kDeepSeekV3, weather_tools(),
      "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>search\n```json\n{\"query\": \"q\"}\n```"
      "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
      "", {{"search", R"({"query":"q"})"}});
}

TEST(ToolCallParser, DeepSeekV32Dsml) {
  expect_parse(ToolCallFormat::kDeepSeekV32, weather_tools(),
               "Let me see.\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
               "<｜DSML｜parameter name=\"city\" string=\"true\">42</｜DSML｜parameter>\n"
               "<｜DSML｜parameter name=\"days\" string=\"false\">7</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
               "<｜DSML｜invoke name=\"search\">\n{\"query\": \"q\"}\n</｜DSML｜invoke>\n</｜DSML｜function_calls>",
               "Let me see.", {{"get_weather", R"({"city":"42","days":7})"}, {"search", R"({"query":"q"})"}});
}

TEST(ToolCallParser, DeepSeekV32Malformed) {
  const std::string text =
      "<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"search\">\n<｜DSML｜parameter name=\"query\" "
      "string=\"maybe\">x</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>";
  expect_parse(ToolCallFormat::kDeepSeekV32, weather_tools(), text, text, {});
}

// --- Reasoning first ---

OutputDelta run_output(OutputParser parser, std::string_view text) {
  OutputDelta all;
  const auto add = [&](OutputDelta delta) {
    all.reasoning += delta.reasoning;
    all.content += delta.content;
    for (ToolCallDelta& call : delta.tool_calls) all.tool_calls.push_back(std::move(call));
  };
  for (size_t i = 0; i < text.size(); i += 3) add(parser.feed(text.substr(i, 3)));
  add(parser.finish());
  return all;
}

TEST(ToolCallParser, CallsAfterReasoningAndInsideReasoning) {
  const std::string call = "<tool_call>\n{\"name\": \"search\", \"arguments\": {\"query\": \"q\"}}\n</tool_call>";
  const OutputDelta after =
      run_output(OutputParser(ReasoningParser(true), ToolCallParser(ToolCallFormat::kHermes, weather_tools())),
                 "I should search.\n</think>\n\n" + call);
  EXPECT_EQ(after.reasoning, "I should search.\n");
  EXPECT_EQ(after.content, "");
  ASSERT_EQ(after.tool_calls.size(), 2u);
  EXPECT_EQ(after.tool_calls[0].name, "search");
  EXPECT_EQ(after.tool_calls[1].arguments, R"({"query":"q"})");

  const OutputDelta inside =
      run_output(OutputParser(ReasoningParser(false), ToolCallParser(ToolCallFormat::kHermes, weather_tools())),
                 "<think>maybe " + call + "</think>No call.");
  EXPECT_EQ(inside.reasoning, "maybe " + call);
  EXPECT_EQ(inside.content, "No call.");
  EXPECT_TRUE(inside.tool_calls.empty());
}

// --- Selection ---

// parallel_tool_calls: false (max_calls 1): the first call that parses is kept; later ones are
// dropped whole, streamed or not; a malformed call is still content, and does not use up the one
// call.
TEST(ToolCallParser, MaxCallsKeepsTheFirstCalls) {
  const auto tools = weather_tools();
  expect_parse(ToolCallFormat::kHermes, tools,
               "<tool_call>\n{\"name\": \"search\", \"arguments\": {\"query\": \"a\"}}\n</tool_call>\n"
               "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {}}\n</tool_call>\nDone.",
               "Done.", {{"search", R"({"query":"a"})"}}, 1);
  expect_parse(ToolCallFormat::kHermes, tools,
               "<tool_call>{oops}</tool_call>\n<tool_call>{\"name\": \"search\", \"arguments\": {}}</tool_call>"
               "<tool_call>{\"name\": \"search\", \"arguments\": {\"query\": \"b\"}}</tool_call>",
               "<tool_call>{oops}</tool_call>", {{"search", "{}"}}, 1);
  expect_parse(ToolCallFormat::kQwen3Coder, tools,
               "<tool_call>\n<function=get_weather>\n<parameter=city>\n123\n</parameter>\n</function>\n</tool_call>\n"
               "<tool_call>\n<function=search>\n<parameter=query>\nx\n</parameter>\n</function>\n</tool_call>",
               "", {{"get_weather", R"({"city":"123"})"}}, 1);
  expect_parse(ToolCallFormat::kGlm45, tools,
               "Checking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Beijing</arg_value>\n"
               "</tool_call><tool_call>search</tool_call><tool_call>search</tool_call>",
               "Checking.", {{"get_weather", R"({"city":"Beijing"})"}, {"search", "{}"}}, 2);
  expect_parse(ToolCallFormat::kDeepSeekV31, tools,
               "Looking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Oslo\"}"
               "<｜tool▁call▁end｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>{\"query\": \"x\"}<｜tool▁call▁end｜>"
               "<｜tool▁calls▁end｜>",
               "Looking.", {{"get_weather", R"({"city":"Oslo"})"}}, 1);
  expect_parse(ToolCallFormat::kDeepSeekV32, tools,
               "<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"search\">\n{\"query\": \"q\"}\n</｜DSML｜invoke>\n"
               "<｜DSML｜invoke name=\"search\">\n{\"query\": \"r\"}\n</｜DSML｜invoke>\n</｜DSML｜function_calls>",
               "", {{"search", R"({"query":"q"})"}}, 1);
  ToolCallParser parser(ToolCallFormat::kHermes, tools, ToolCallParserOptions{.max_calls = 1});
  parser.feed(
      "<tool_call>{\"name\": \"search\", \"arguments\": {}}</tool_call>"
      "<tool_call>{\"name\": \"search\", \"arguments\": {}}</tool_call>");
  parser.finish();
  EXPECT_EQ(parser.num_calls(), 1);
}

TEST(ToolCallParser, FormatNamesRoundTrip) {
  for (std::string_view name : tool_call_format_names()) {
    const std::optional<ToolCallFormat> format = tool_call_format_from_name(name);
    ASSERT_TRUE(format.has_value()) << name;
    EXPECT_EQ(tool_call_format_name(*format), name);
  }
  EXPECT_EQ(tool_call_format_names().size(), 6u);
  EXPECT_EQ(tool_call_format_from_name("qwen3_xml"), ToolCallFormat::kQwen3Coder);
  EXPECT_EQ(tool_call_format_from_name("glm47"), ToolCallFormat::kGlm45);
  EXPECT_FALSE(tool_call_format_from_name("nonsense").has_value());
}

TEST(ToolCallParser, SelectionByModelType) {
  EXPECT_EQ(select_tool_call_format("qwen3", ""), ToolCallFormat::kHermes);
  EXPECT_EQ(select_tool_call_format("qwen3_moe", ""), ToolCallFormat::kHermes);
  EXPECT_EQ(select_tool_call_format("qwen3_5_moe_text", ""), ToolCallFormat::kQwen3Coder);
  EXPECT_EQ(select_tool_call_format("glm4_moe", ""), ToolCallFormat::kGlm45);
  EXPECT_EQ(select_tool_call_format("deepseek_v32", ""), ToolCallFormat::kDeepSeekV32);
  EXPECT_EQ(select_tool_call_format("deepseek_v3", ""), ToolCallFormat::kDeepSeekV31);
  EXPECT_FALSE(select_tool_call_format("llama", "").has_value());
  // The template's markup wins over the model type.
  EXPECT_EQ(select_tool_call_format("qwen3", "... <function=x> <parameter=y> ..."), ToolCallFormat::kQwen3Coder);
}

TEST(ToolCallParser, OpenAiToolsAreValidated) {
  EXPECT_THROW(tool_definitions_from_openai(Json::parse(R"([{"type": "function"}])")), Error);
  EXPECT_THROW(tool_definitions_from_openai(Json::parse(R"([{"type": "function", "function": {"name": 3}}])")), Error);
  EXPECT_THROW(tool_definitions_from_openai(Json::object()), Error);
  const auto tools = tool_definitions_from_openai(Json::parse(R"([{"type": "other"}, {"function": {"name": "f"}}])"));
  ASSERT_EQ(tools.size(), 1u);
  EXPECT_EQ(tools[0].name, "f");
  EXPECT_EQ(tools[0].parameters, Json::object());
}

TEST(ToolCallParser, IdsDependOnSeedAndIndex) {
  const std::string text = "<tool_call>{\"name\": \"f\"}</tool_call><tool_call>{\"name\": \"f\"}</tool_call>";
  const ToolParseResult a = parse_tool_calls(ToolCallFormat::kHermes, {}, text, {.id_seed = 1});
  const ToolParseResult b = parse_tool_calls(ToolCallFormat::kHermes, {}, text, {.id_seed = 2});
  ASSERT_EQ(a.tool_calls.size(), 2u);
  EXPECT_NE(a.tool_calls[0].id, a.tool_calls[1].id);
  EXPECT_NE(a.tool_calls[0].id, b.tool_calls[0].id);
}

TEST(ToolCallParser, FuzzEntryPointRunsOnRandomInputs) {
  // Random mixtures of markup fragments: the entry point aborts if streaming and non-streaming disagree.
  const std::vector<std::string> fragments = {"<tool_call>",
                                              "</tool_call>",
                                              "{\"name\": \"f\", \"arguments\": {\"s\": \"x\"}}",
                                              "<function=f>",
                                              "</function>",
                                              "<parameter=n>",
                                              "\n7\n",
                                              "</parameter>",
                                              "<arg_key>",
                                              "s",
                                              "</arg_key>",
                                              "<arg_value>",
                                              "</arg_value>",
                                              "f",
                                              "<｜tool▁calls▁begin｜>",
                                              "<｜tool▁call▁begin｜>",
                                              "<｜tool▁sep｜>",
                                              "<｜tool▁call▁end｜>",
                                              "<｜tool▁calls▁end｜>",
                                              "<｜DSML｜function_calls>",
                                              "<｜DSML｜invoke",
                                              " name=\"f\">",
                                              "<｜DSML｜parameter name=\"s\" string=\"true\">",
                                              "</｜DSML｜parameter>",
                                              "</｜DSML｜invoke>",
                                              "</｜DSML｜function_calls>",
                                              " ",
                                              "\n",
                                              "text",
                                              "<",
                                              "{",
                                              "}"};
  std::mt19937 random(3);
  for (int round = 0; round < 3000; ++round) {
    std::string input(2, '\0');
    input[0] = static_cast<char>(random());
    input[1] = static_cast<char>(random());
    const int count = 1 + static_cast<int>(random() % 12);
    for (int i = 0; i < count; ++i) input += fragments[random() % fragments.size()];
    EXPECT_EQ(fuzz_tool_call_parser(reinterpret_cast<const uint8_t*>(input.data()), input.size()), 0);
  }
}

}  // namespace
}  // namespace metrale
