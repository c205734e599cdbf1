#include "text/reasoning_parser.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace metrale {
namespace {

struct Split {
  std::string reasoning;
  std::string content;
};

// Feeds the pieces one by one and concatenates every delta.
Split run(ReasoningParser parser, const std::vector<std::string>& pieces) {
  Split split;
  for (const std::string& piece : pieces) {
    const ReasoningDelta delta = parser.feed(piece);
    split.reasoning += delta.reasoning;
    split.content += delta.content;
  }
  const ReasoningDelta last = parser.finish();
  split.reasoning += last.reasoning;
  split.content += last.content;
  return split;
}

// Every way of cutting `text` into two and three pieces gives the same split as one piece.
void expect_split_everywhere(bool starts_in_reasoning, const std::string& text, const Split& expected) {
  for (size_t i = 0; i <= text.size(); ++i) {
    for (size_t j = i; j <= text.size(); ++j) {
      const Split split = run(ReasoningParser(starts_in_reasoning),
                              {text.substr(0, i), text.substr(i, j - i), text.substr(j)});
      ASSERT_EQ(split.reasoning, expected.reasoning) << "cuts at " << i << ", " << j;
      ASSERT_EQ(split.content, expected.content) << "cuts at " << i << ", " << j;
    }
  }
}

TEST(ReasoningParser, SplitsThinkBlockWhateverTheChunking) {
  expect_split_everywhere(false, "<think>\nstep 1\n</think>\n\nThe answer.", {"\nstep 1\n", "\n\nThe answer."});
  expect_split_everywhere(false, "\n <think>a<b</think>c</think>d", {"a<b", "c</think>d"});
}

TEST(ReasoningParser, StartsInReasoningWhenThePromptOpenedTheBlock) {
  expect_split_everywhere(true, "thinking...</think>answer", {"thinking...", "answer"});
  expect_split_everywhere(true, "never closed <", {"never closed <", ""});
}

TEST(ReasoningParser, WithoutTagsEverythingIsContent) {
  expect_split_everywhere(false, "just an answer", {"", "just an answer"});
  expect_split_everywhere(false, "text then <think>x</think>", {"", "text then <think>x</think>"});
  expect_split_everywhere(false, "<thin", {"", "<thin"});
  expect_split_everywhere(false, "  ", {"", "  "});
}

TEST(ReasoningParser, StreamsAsSoonAsTextIsUnambiguous) {
  ReasoningParser parser(true);
  EXPECT_EQ(parser.feed("abc</th").reasoning, "abc");  // "</th" held back
  const ReasoningDelta delta = parser.feed("ink>de");
  EXPECT_EQ(delta.reasoning, "");
  EXPECT_EQ(delta.content, "de");
  EXPECT_EQ(parser.feed("f").content, "f");
}

TEST(ReasoningParser, CustomTags) {
  ReasoningParser parser(false, "[THINK]", "[/THINK]");
  const ReasoningDelta delta = parser.feed("[THINK]r[/THINK]c");
  EXPECT_EQ(delta.reasoning, "r");
  EXPECT_EQ(delta.content, "c");
}

}  // namespace
}  // namespace metrale
