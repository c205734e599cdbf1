// The differential test of chat templates: tools/oracles/render_chat.mjs renders every fixture
// template x conversation with @huggingface/jinja and hands the results over in
// METRALE_CHAT_ORACLE_CASES; metrale must render the same bytes. The CTest entry
// text.chat_template_oracle runs the script (tests/text/oracle_tests.cmake); run alone, without the
// variable, this test skips.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/strings.h"
#include "text/chat_template.h"

namespace metrale {
namespace {

// The first differing byte, with some context on both sides.
std::string describe_difference(const std::string& expected, const std::string& actual) {
  size_t at = 0;
  while (at < expected.size() && at < actual.size() && expected[at] == actual[at]) ++at;
  const size_t from = at > 40 ? at - 40 : 0;
  return "first difference at byte " + std::to_string(at) + " (lengths " + std::to_string(expected.size()) + " vs " +
         std::to_string(actual.size()) + ")\n  expected: " + nlohmann::json(expected.substr(from, 120)).dump() +
         "\n  metrale:  " + nlohmann::json(actual.substr(from, 120)).dump();
}

TEST(ChatTemplateOracle, RendersLikeHuggingFaceJinja) {
  const char* cases_path = std::getenv("METRALE_CHAT_ORACLE_CASES");
  if (cases_path == nullptr) GTEST_SKIP() << "run through tools/oracles/render_chat.mjs (ctest -R chat_template_oracle)";
  const auto cases = nlohmann::ordered_json::parse(read_file(cases_path));
  ASSERT_TRUE(cases.is_array());
  ASSERT_GT(cases.size(), 100u);
  const std::filesystem::path templates_dir = std::filesystem::path(METRALE_TEST_DATA_DIR) / "text/chat_templates";
  std::map<std::string, ChatTemplate> templates;
  int compared = 0;
  int raised_as_reference = 0;
  int lenient = 0;
  int mismatches = 0;
  for (const auto& entry : cases) {
    const std::string name = entry.at("template").get<std::string>();
    auto it = templates.find(name);
    if (it == templates.end()) {
      it = templates
               .emplace(name, ChatTemplate(read_file(templates_dir / entry.at("file").get<std::string>()),
                                           entry.at("bos_token").get<std::string>(),
                                           entry.at("eos_token").get<std::string>()))
               .first;
    }
    ChatTemplateInputs inputs;
    inputs.messages = entry.at("messages");
    inputs.tools = entry.at("tools");
    inputs.add_generation_prompt = entry.at("add_generation_prompt").get<bool>();
    inputs.extra = entry.at("kwargs");
    const std::string label = name + " / " + entry.at("conversation").get<std::string>() +
                              " / add_generation_prompt=" + (inputs.add_generation_prompt ? "true" : "false") +
                              " / kwargs=" + entry.at("kwargs").dump();
    std::string rendered;
    std::string error;
    try {
      rendered = it->second.render(inputs);
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << label;
      error = e.what();
    }
    if (entry.contains("expected")) {
      ++compared;
      if (!error.empty()) {
        ++mismatches;
        ADD_FAILURE() << label << ": metrale failed where @huggingface/jinja rendered: " << error;
      } else if (rendered != entry.at("expected").get<std::string>()) {
        ++mismatches;
        ADD_FAILURE() << label << ": " << describe_difference(entry.at("expected").get<std::string>(), rendered);
      }
      continue;
    }
    const std::string reference_error = entry.at("error").get<std::string>();
    if (entry.value("raised", false)) {
      // The template's own raise_exception: metrale must fail with the same message.
      ++raised_as_reference;
      EXPECT_NE(error.find(reference_error), std::string::npos)
          << label << ": expected an error containing \"" << reference_error << "\", got "
          << (error.empty() ? "a rendering" : "\"" + error + "\"");
    } else if (error.empty()) {
      // @huggingface/jinja rejects some things Python Jinja accepts (e.g. `none | string`); metrale
      // follows Python there. Such cases have no reference output to compare.
      ++lenient;
    }
  }
  std::printf("chat template oracle: %d renderings compared (%d differ), %d template errors matched, "
              "%d reference interpreter errors where metrale renders leniently\n",
              compared, mismatches, raised_as_reference, lenient);
}

}  // namespace
}  // namespace metrale
